"""On a Redis Cluster a script or transaction may touch keys of one hash slot only. Every
key that a script or transaction of finsieve touches together is derived here, as the code
builds it, and must share the slot of its group: the audit chain (records, head, time and
field indexes, restored copies, checkpoint, the guard), a tenant's limit buckets and stream
leases, the API keys and their index. (The cache's commands take one key each.)"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as redis
from redis.crc import key_slot

from gateway import keys as api_keys
from gateway import limits
from gateway.audit import CHECKPOINT, HEAD, TIME, AuditLog, index_key, index_values, record_key, restored_key
from gateway.limits import Limiter, TenantLimits

KEY = b"test-audit-key-of-at-least-32-bytes!"


def slots(keys: list[str]) -> set[int]:
    return {key_slot(k.encode()) for k in keys}


class KeysOfAppends(AuditLog):
    """The keys each append passes to the append script (Redis itself is not asked)."""

    def __init__(self) -> None:
        super().__init__(redis.Redis(), KEY)  # never connects
        self.calls: list[list[str]] = []

    async def head(self):
        from gateway.audit import Head
        return Head(len(self.calls), "f" * 64, "")

    async def _run_append(self, keys: list[str], args: list[Any]) -> tuple[int, Any]:
        self.calls.append(keys)
        return 1, None


def test_every_key_an_audit_append_touches_is_on_the_chain_s_slot():
    full = {"tenant": "bank-a", "user": "u-7", "request_id": "r-1", "finish_reason": "STOP",
            "audit_id": "41", "interventions": [{"rule_id": "pan", "action": "redact"},
                                               {"rule_id": "iban", "action": "block"}],
            "match_hashes": ["ab" * 16, "cd" * 16]}
    log = KeysOfAppends()

    async def go():
        await log.append("request", full, ids={"user": "u-7", "request_id": "r-1"})
        log.guard = (1, "0" * 40)  # a DurableAuditLog's: its newest acknowledged record
        carried = {**full, "seq": 1, "hmac": "e" * 64, "type": "request"}
        await log.append("restored", {"restored": carried})
        await log.append("admin", {"event": "key_created", "tenant": "bank-a"})

    asyncio.run(go())
    assert len(log.calls) == 3 and all(len(keys) >= 4 for keys in log.calls)
    chain = key_slot(HEAD.encode())
    for keys in log.calls:
        assert slots(keys) == {chain}, keys
    # What verify, trim and recovery touch with them: by seq, by field, by restored copy.
    wrapper = {"type": "restored", "restored": {**full, "seq": 9, "hmac": "a" * 64}}
    derived = [CHECKPOINT, TIME, restored_key(9, "a" * 64), *(record_key(s) for s in (1, 10**15)),
               *(index_key(f, v) for f, v in index_values(wrapper))]
    assert ("restored", f"9:{'a' * 64}") in index_values(wrapper)
    assert slots(derived) == {chain}


class KeysOfLimits(Limiter):
    def __init__(self) -> None:
        super().__init__(redis.Redis(), TenantLimits(5.0, 1000, 3), {})
        self.calls: list[list[str]] = []

    async def _overrides(self, tenant: str) -> dict[str, float | int]:
        return {}

    async def _run(self, script, keys: list[str], args: list[Any], ok: int = 0) -> int:
        self.calls.append(keys)
        return ok


def test_a_tenant_s_buckets_and_stream_leases_share_its_slot():
    for tenant in ("a", "bank-a.prod_1", "Z" * 64):
        limiter = KeysOfLimits()

        async def go(limiter=limiter, tenant=tenant):
            await limiter.admit(tenant)
            await limiter.charge(tenant, 10)
            await limiter.open_stream(tenant, "stream-1")

        asyncio.run(go())
        touched = [k for keys in limiter.calls for k in keys]
        assert len(limiter.calls) == 3 and len(touched) == 4  # rps+tpm, tpm, streams
        assert slots([*touched, limits._key(tenant, "set")]) == {key_slot(touched[0].encode())}


def test_an_api_key_entry_shares_the_slot_of_the_key_index():
    assert slots([api_keys.INDEX, api_keys.record_key("0123456789abcdef")]) == {
        key_slot(api_keys.INDEX.encode())}
