"""A rules file truncated mid-write while clients stream through the server (`make
test-chaos`): a rule author's editor, or a hand-made ConfigMap change, leaves half a file in
the rules directory for a few seconds. Every request is answered under the pack in force,
the half file is refused naming its file and line (and the refusal is an admin record),
the completed file comes in force with no restart, and the trail verifies with every
audit id the clients were given in it."""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter

import pytest

from finsieve.secretfiles import read_secret
from finsieve.valkey import connect
from gateway.audit import AuditLog, parse

from support.chaos import Clients, cli, trail, unrecorded
from support.paths import REPO
from support.processes import wait_for
from support.servers import start_server

pytestmark = pytest.mark.chaos

HOUSE = """\
rules:
  - id: house-no-crypto
    description: This bank does not discuss crypto-assets with retail clients.
    kind: literal
    patterns: [bitcoin, cryptocurrency]
    action: block
"""
CUT = "kind: lit"  # the writer stopped inside a value: line 4 names an unknown kind


REJECTED = "rule pack rejected; the previous one stays in force"


def test_a_rules_file_truncated_mid_write(tmp_path, default_model_dir):
    rules = tmp_path / "rules"
    rules.mkdir()
    for pack in (REPO / "rules").glob("*.yaml"):
        shutil.copy(pack, rules / pack.name)
    server = start_server(tmp_path, "--model", str(default_model_dir), "--rules", str(rules),
                          env={"FINSIEVE_CACHE_TTL_S": "0", "FINSIEVE_TENANT_REQUESTS_PER_S": "0",
                               "FINSIEVE_TENANT_TOKENS_PER_MIN": "0"})
    try:
        loaded_at_start = len(server.records("rule pack loaded"))
        with Clients(server.target, server.key("app")) as clients:
            assert wait_for(lambda: clients.ok_since(0) >= 3, 120, 0.1), clients.outcomes
            head = HOUSE[:HOUSE.index(CUT) + len(CUT)]
            with (rules / "house.yaml").open("w") as f:  # half written, not closed
                f.write(head)
                f.flush()
                assert wait_for(lambda: len(server.records(REJECTED)) >= 1, 60, 0.1)
                answered = len(clients.outcomes)
                # Still answered, under the pack in force, while the half file is there.
                assert wait_for(lambda: clients.ok_since(0) >= answered + 3, 120, 0.1)
                f.write(HOUSE[len(head):])
            # Both watchers (the engine's and the gateway's) take the completed file.
            assert wait_for(lambda: len(server.records("rule pack loaded"))
                            >= loaded_at_start + 2, 60, 0.1)
            answered = len(clients.outcomes)
            assert wait_for(lambda: clients.ok_since(0) >= answered + 3, 120, 0.1)
        assert Counter(o.status for o in clients.outcomes) == {"OK": len(clients.outcomes)}

        url = f"redis://:{server.valkey_password()}@127.0.0.1:{server.valkey_port()}/0"
        key = read_secret(server.state / "audit.key", "FINSIEVE_AUDIT_KEY_FILE")
        assert not unrecorded(clients.outcomes, trail(url, key))
        admin = _admin_records(url, key)
        rejected = [r for r in admin if r.get("event") == "rule_pack_rejected"]
        assert rejected and f"{rules / 'house.yaml'}:4:" in rejected[-1]["reason"], rejected
        assert any(r.get("event") == "rule_pack_loaded" for r in admin)
        verified = cli("audit", "verify", "--target", server.audit_target, key=server.key("officer"))
        assert verified.returncode == 0 and "audit trail intact" in verified.stdout, verified.stderr
    finally:
        server.stop()


def _admin_records(url: str, key: bytes) -> list[dict]:
    async def go() -> list[dict]:
        client = await connect(url)
        try:
            log = AuditLog(client, key)
            return [rec async for _, raw in log.records(1, (await log.head()).seq)
                    if (rec := parse(raw) or {}).get("type") == "admin"]
        finally:
            await client.aclose()
    return asyncio.run(go())
