"""What an officer types is checked against its field's domain, and no value typed can put a
card number into the trail: not in an access record, not in an index key name, not in the
AOF (issue #42, red-team review of finding 1: F2, F9). A real officers' service (a gateway
whose engine is down: no model needed), its embedded Valkey, the officers' real CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from finsieve.app.client import Credentials
from finsieve.v1 import audit_pb2, audit_pb2_grpc
from gateway.sensitive import value_hash

from support.pan_scan import card_numbers, leaks
from support.servers import Server, free_port, start_server

CARD = "4111 1111 1111 1111"


@pytest.fixture(scope="module")
def officers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("officers"), "--role", "gateway", "--engine",
                       f"127.0.0.1:{free_port()}")
    yield srv
    srv.stop()


def _cli(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "finsieve.app.cli", "audit", *args, "--target",
                           server.audit_target, "--state-dir", str(server.state)],
                          capture_output=True, text=True, timeout=60)


def _stored_leaks(server: Server) -> dict[str, list[str]]:
    async def go() -> dict[str, list[str]]:
        client = server.valkey()
        try:
            return await leaks(client)
        finally:
            await client.aclose()
    return asyncio.run(go())


def _access_records(server: Server) -> list[dict]:
    out = _cli(server, "query", "--since", "1h", "--limit", "1000", "--format", "jsonl")
    assert out.returncode == 0, out.stderr
    return [r for r in map(json.loads, out.stdout.splitlines()) if r["type"] == "access"]


def test_values_an_officer_types_never_put_a_card_number_in_valkey(officers):
    for args in (["query", "--tenant", CARD], ["query", "--rule", CARD],
                 ["query", "--tenant", "4111111111111111"], ["query", "--rule", "4111111111111111"],
                 ["query", "--tenant", "4111_1111_1111_1111"], ["show", "4111111111111111"],
                 ["query", "--match", CARD], ["query", "--user", CARD],
                 ["query", "--request-id", CARD]):
        out = _cli(officers, *args)
        assert "Traceback" not in out.stderr, (args, out.stderr)
    assert _stored_leaks(officers) == {}
    records = _access_records(officers)
    assert not [r for r in records if card_numbers(json.dumps(r))]
    # A typed value that could be a card number is recorded by its keyed hash: --match finds
    # who looked for it.
    found = _cli(officers, "query", "--match", CARD, "--format", "jsonl")
    probes = [r for r in map(json.loads, found.stdout.splitlines()) if r["type"] == "access"]
    assert {r["event"] for r in probes} >= {"audit_query", "audit_get"}
    assert any(r["filters"]["tenant"].startswith("[hash:") for r in probes if r["event"] == "audit_query")


def test_each_filter_is_checked_against_its_domain(officers):
    for args, field in ((["--tenant", CARD], "tenant"), (["--rule", CARD], "rule_id"),
                        (["--rule", "Card Number"], "rule_id"), (["--action", "steal"], "action"),
                        (["--finish-reason", "4111111111111111"], "finish_reason")):
        out = _cli(officers, "query", *args)
        assert out.returncode == 1 and f"INVALID_ARGUMENT: {field}: " in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr
    # What the domains hold still passes.
    for args in (["--tenant", "bank-a"], ["--rule", "payment-card-number"], ["--action", "redact"],
                 ["--finish-reason", "content_filter"]):
        out = _cli(officers, "query", *args)
        assert out.returncode == 0, (args, out.stderr)


def test_a_seq_out_of_range_is_a_field_error_not_a_traceback(officers):
    for seq in ("99999999999999999999999", "9007199254740992", "0"):
        out = _cli(officers, "show", seq)
        assert out.returncode == 2 and "argument AUDIT_ID|SEQ: not an audit id" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_reading_an_index_creates_no_key(officers):
    async def keys() -> set[str]:
        client = officers.valkey()
        try:
            return {k.decode() async for k in client.scan_iter(match="{finsieve-audit}:idx:*")}
        finally:
            await client.aclose()

    before = asyncio.run(keys())
    assert _cli(officers, "query", "--rule", "no-such-rule-42", "--action", "halt").returncode == 0
    assert _cli(officers, "show", "777777").returncode == 1  # NOT_FOUND
    made = asyncio.run(keys()) - before
    # Only the access records' own indexes (their type, tenant, time) are new.
    assert not [k for k in made if "no-such-rule-42" in k or "777777" in k or ":action:" in k], made
    assert value_hash(b"k", CARD) == value_hash(b"k", "4111111111111111")  # one value, one hash


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_an_audit_id_padded_with_zeros_is_a_field_error(officers):
    """Only the first 20 characters were range-checked: zeros in front let a card number
    through into an index key's name."""
    async def query(audit_id: str) -> grpc.StatusCode:
        async with Credentials(officers.key("officer")).channel(officers.audit_target) as ch:
            try:
                await audit_pb2_grpc.AuditServiceStub(ch).Query(audit_pb2.AuditQuery(audit_id=audit_id))
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

    for padded in ("0" * 19 + "1" + CARD.replace(" ", ""), "01"):
        assert asyncio.run(query(padded)) == grpc.StatusCode.INVALID_ARGUMENT, padded
    assert asyncio.run(query("1")) == grpc.StatusCode.OK
