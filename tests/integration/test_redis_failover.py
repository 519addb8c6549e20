"""A Redis primary killed (kill -9) after it acknowledged audit records its replicas never
got, a replica promoted, another writer appending on the rewound chain first: the writer
that acknowledged them restores them from its spool, and `verify` passes with its anchor.
Real valkey-server processes: a Sentinel set (1 primary, 2 replicas, 3 sentinels) in the
default suite, a Cluster (3 primaries, 3 replicas) under the chaos marker.
tests/integration/test_chaos_redis.py does the same through a real gateway with clients."""

from __future__ import annotations

import asyncio
import time

import pytest

from finsieve.valkey import connect
from gateway.anchors import AnchorWriter
from gateway.audit import HEAD, AuditError, AuditLog, parse, record_key, restored_key
from gateway.audit_recovery import DurableAuditLog
from gateway.audit_verify import verify
from gateway.keys import KeyStore
from gateway.limits import LIMIT_ERRORS, Limiter, TenantLimits
from gateway.spool import Spool

from support.topologies import Cluster, SentinelSet, stall_replicas, wait_replicated

KEY = b"test-audit-key-of-at-least-32-bytes!"


async def until_appended(log: AuditLog, body: dict, timeout: float = 30) -> int:
    """Append once the trail takes writes again (each failed try is the fail-closed refusal)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await log.append("request", body, deadline_s=2)
        except AuditError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("topology", ["sentinel", pytest.param("cluster", marks=pytest.mark.chaos)])
def test_a_failover_loses_no_acknowledged_record(tmp_path, topology):
    with (SentinelSet(tmp_path / "redis") if topology == "sentinel" else Cluster(tmp_path / "redis")) as topo:
        def primary():
            return topo.primary() if isinstance(topo, SentinelSet) else topo.primary_for(HEAD)

        async def go():
            client = await connect(topo.url(), timeout=1)
            other_client = await connect(topo.url(), timeout=1)
            log = DurableAuditLog(client, KEY, Spool(tmp_path / "spool", 1000, 1 << 20, 60), "gateway")
            other = AuditLog(other_client, KEY)  # another gateway, on the same chain
            anchors = AnchorWriter(tmp_path / "anchors", "gateway", KEY)
            try:
                for i in range(5):
                    await log.append("request", {"request_id": f"before-{i}"})
                old = primary()
                wait_replicated(old)
                replicas = topo.data_replicas(old) if isinstance(topo, SentinelSet) else topo.replicas_of(old)
                stall_replicas(old, replicas)  # what is acknowledged now reaches no replica
                acked = [await log.append("request", {"request_id": f"acked-{i}"}) for i in range(3)]
                acked_records = [parse(await client.get(record_key(s))) for s in acked]
                anchors.write(*log.last)
                old.kill()
                for r in replicas:
                    r.thaw()
                if isinstance(topo, SentinelSet):
                    topo.wait_promoted(old)
                else:
                    topo.wait_promoted(old, HEAD)
                other_seq = await until_appended(other, {"request_id": "other"})
                lost = await verify(log, anchor_dir=anchors.path.parent)
                after = await until_appended(log, {"request_id": "after"})
                verdict = await verify(log, anchor_dir=anchors.path.parent)
                carried = [await client.zrange(restored_key(r["seq"], r["hmac"]), 0, -1)
                           for r in acked_records]
                return acked, other_seq, lost, after, verdict, carried, await other_users(log)
            finally:
                await log.aclose()
                await client.aclose()
                await other_client.aclose()

        acked, other_seq, lost, after, verdict, carried, others = asyncio.run(go())
    assert acked == [6, 7, 8]
    assert other_seq == 6  # the promoted replica had records 1-5 only: the three were lost
    assert not lost.ok and "records 7 to 8 are missing: the chain was cut after record 6" in lost.reason
    assert after == 10 and verdict.ok and verdict.restored == 3, verdict
    assert [len(c) for c in carried] == [1, 1, 1]  # each acknowledged record is carried once
    assert others == {"trimmed_two_or_more": True, "verify_after_trim": True, "admitted": 0, "stream": 0,
                      "limit_errors": 0, "key_found": True}


async def other_users(log: AuditLog) -> dict:
    """Retention (a script and a transaction), tenant limits (a two-key script, a lease) and
    API keys (a transaction) on the same topology: each touches keys of one slot only."""
    client = log.redis
    third = parse(await client.get(record_key(3)))
    trimmed = await log.trim(third["ts_ms"])  # records 1 and 2 at least are older
    errors = LIMIT_ERRORS._value.get()
    limiter = Limiter(client, TenantLimits(5.0, 1000, 3), {})
    admitted, stream = await limiter.admit("bank-a"), await limiter.open_stream("bank-a", "s-1")
    await limiter.charge("bank-a", 10)
    keys = KeyStore(client, b"k" * 32)
    _, info = await keys.create("bank-a", "app", "failover test", 0)
    return {"trimmed_two_or_more": trimmed >= 2, "verify_after_trim": (await verify(log)).ok,
            "admitted": admitted, "stream": stream, "limit_errors": LIMIT_ERRORS._value.get() - errors,
            "key_found": (await keys.get(info.key_id)) == info}
