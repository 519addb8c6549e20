"""Where a gateway's engines come from (gateway/discovery.py) and which one a request goes to
(gateway/engines.py): the file's format and its errors, the settings, the DNS name resolved
for real (localhost), the bound, and the ranking by reported load."""

from __future__ import annotations

import asyncio

import pytest

from finsieve.config import Settings, engine_address
from finsieve.errors import ConfigError
from finsieve.tls import check_transport
from gateway.discovery import Discovery, Sources, read_engines_file
from gateway.engines import EnginePool


def test_an_engines_file_lists_addresses_with_comments_and_names_the_line_at_fault(tmp_path):
    listed = tmp_path / "engines"
    listed.write_text("# engines of zone a\n\n127.0.0.1:50052\n  [::1]:50052  # v6\n"
                      "127.0.0.1:50052\nlocalhost:7\n")
    assert read_engines_file(listed, plaintext_ok=False) == ["127.0.0.1:50052", "[::1]:50052",
                                                             "localhost:7"]
    for line, why in [("node-1", "expected host:port"), ("node-1:0", "the port must be"),
                      ("::1:50052", "in brackets"), ("http://node-1:80", "expected host:port")]:
        listed.write_text(f"127.0.0.1:50052\n{line}\n")
        with pytest.raises(ConfigError, match=f"^{listed}:2: .*{why}"):
            read_engines_file(listed, plaintext_ok=True)
    listed.write_text("10.0.0.7:50052\n")  # a remote engine needs TLS (or --allow-insecure)
    with pytest.raises(ConfigError, match=f"^{listed}:1: 10.0.0.7:50052: refusing plaintext"):
        read_engines_file(listed, plaintext_ok=False)
    assert read_engines_file(listed, plaintext_ok=True) == ["10.0.0.7:50052"]
    with pytest.raises(ConfigError, match="cannot read"):
        read_engines_file(tmp_path / "absent", plaintext_ok=True)


def test_the_settings_take_engines_from_a_file_or_a_dns_name_and_name_a_bad_one():
    for env in ({"FINSIEVE_ENGINES_FILE": "/etc/finsieve/engines"},
                {"FINSIEVE_ENGINE_DNS": "localhost:50052"}):
        assert Settings.load(env={"FINSIEVE_ROLE": "gateway", **env}).role == "gateway"
    with pytest.raises(ConfigError, match="--engine, --engines-file or --engine-dns"):
        Settings.load(env={"FINSIEVE_ROLE": "gateway"})
    with pytest.raises(ConfigError, match=r"^--engine-dns 'engines\.svc': expected host:port"):
        Settings.load({"role": "gateway", "engine_dns": "engines.svc"})
    with pytest.raises(ConfigError, match="more than FINSIEVE_MAX_ENGINES"):
        Settings.load({"role": "gateway", "engines": ["localhost:1", "localhost:2"]},
                      env={"FINSIEVE_MAX_ENGINES": "1"})
    with pytest.raises(ConfigError, match="FINSIEVE_ENGINE_KEEPALIVE_TIME_S: at least 1"):
        Settings.load(env={"FINSIEVE_ENGINE_KEEPALIVE_TIME_S": "0.5"})
    remote = Settings.load({"role": "gateway", "engine_dns": "engines.bank.svc:50052"})
    with pytest.raises(ConfigError, match=r"^--engine-dns engines\.bank\.svc:50052: refusing plaintext"):
        check_transport(remote)
    check_transport(remote.replace(allow_insecure=True))
    assert engine_address(" [::1]:50052 ") == "[::1]:50052"


def test_a_file_that_would_pass_the_bound_stops_start_up(tmp_path):
    listed = tmp_path / "engines"
    listed.write_text("127.0.0.1:1\n127.0.0.1:2\n")
    bound = rf"^{listed}: 3 engines \(with --engine\), more than FINSIEVE_MAX_ENGINES \(2\)$"
    with pytest.raises(ConfigError, match=bound):
        Discovery(Sources(static=("127.0.0.1:3",), file=listed, max_engines=2)).load()


def test_a_dns_name_gives_its_addresses_and_a_failed_resolution_keeps_them():
    async def resolved(sources: Sources, then: Sources | None = None) -> list[str]:
        pool = EnginePool([])
        discovery = Discovery(sources)
        try:
            await discovery.start(pool)
            if then is not None:
                discovery.sources = then
                await discovery._resolve()  # the next round
            return sorted(c.address for c in pool.clients)
        finally:
            await discovery.stop()
            await pool.close()

    name = Sources(static=("127.0.0.1:9",), dns="localhost:50052")
    found = asyncio.run(resolved(name))
    assert "127.0.0.1:50052" in found and "127.0.0.1:9" in found
    failing = Sources(static=("127.0.0.1:9",), dns="name.invalid:50052")
    assert asyncio.run(resolved(name, then=failing)) == found  # the previous engines stay
    bounded = Sources(static=("127.0.0.1:9",), dns="localhost:50052", max_engines=1)
    assert asyncio.run(resolved(bounded)) == ["127.0.0.1:9"]  # past the bound: refused


def test_a_request_goes_to_the_engine_least_full_by_its_report():
    """Reported running + waiting, plus what this gateway sent since, over the engine's KV
    slots; an engine shutting down, or in `avoid`, gets nothing."""
    async def run() -> list[str]:
        pool = EnginePool(["big:1", "small:1", "silent:1", "draining:1", "avoided:1"])
        clients = {c.address: c for c in pool.clients}
        clients["big:1"].load = (60, 128, False)  # (60 + 1) / 128
        clients["small:1"].load = (1, 8, False)  # (1 + 1) / 8
        clients["silent:1"].load = None  # no report yet: its in-flight count + 1, over one slot
        clients["draining:1"].load = (0, 128, True)
        clients["avoided:1"].load = (0, 128, False)
        ranked = [c.address for c in pool._ranked(avoid={"avoided:1"})]
        await pool.close()
        return ranked

    assert asyncio.run(run()) == ["small:1", "big:1", "silent:1"]


def test_an_engine_removed_is_drained_then_closed_and_one_added_joins(tmp_path):
    async def run() -> tuple[list[str], list[str]]:
        pool = EnginePool(["127.0.0.1:1"], drain_s=5)
        pool.update({"127.0.0.1:2": ""})
        during = [c.address for c in pool.clients]
        await asyncio.sleep(0.2)  # nothing in flight: closed at once
        closed = [a for a in ("127.0.0.1:1",) if a not in pool._draining]
        await pool.close()
        return during, closed

    during, closed = asyncio.run(run())
    assert during == ["127.0.0.1:2"] and closed == ["127.0.0.1:1"]
