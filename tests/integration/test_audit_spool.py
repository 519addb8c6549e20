"""Acknowledged audit records that Redis lost, restored from the writer's spool: as written
where they still link to the head, inside `restored` records where the chain moved on; a
spool that was tampered with injects nothing. A real Valkey; the loss is made as a failover
makes it: the newest records and their index entries gone, the head rewound to the record
before them (test_redis_failover.py kills a real primary)."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as redis

from gateway.anchors import AnchorWriter
from gateway.audit import (
    HEAD,
    TIME,
    AuditLog,
    Filters,
    head_sig,
    index_key,
    index_values,
    parse,
    record_key,
    restored_key,
    seal,
    stored,
)
from gateway.audit_recovery import DurableAuditLog
from gateway.audit_verify import verify
from gateway.spool import Spool

KEY = b"test-audit-key-of-at-least-32-bytes!"


def durable(client: redis.Redis, tmp_path, name: str = "gateway") -> DurableAuditLog:
    return DurableAuditLog(client, KEY, Spool(tmp_path / "spool" / name, 1000, 1 << 20, 60), name)


async def lose_newest(client: redis.Redis, keep: int) -> None:
    """What a failover to a replica that had records 1..keep does: the rest, their index
    entries and the head that named them are gone."""
    head = int((await client.hget(HEAD, "seq")) or 0)
    for seq in range(keep + 1, head + 1):
        rec = parse(await client.get(record_key(seq)))
        await client.delete(record_key(seq))
        await client.zrem(TIME, f"{seq:020d}")
        for field, value in index_values(rec or {}):
            await client.zrem(index_key(field, value), f"{seq:020d}")
    kept = parse(await client.get(record_key(keep)))
    await client.hset(HEAD, mapping={"seq": keep, "hmac": kept["hmac"],
                                     "sig": head_sig(KEY, keep, kept["hmac"])})


def run(valkey, fn):
    async def go():
        client = redis.Redis(port=valkey.port, password=valkey.password)
        try:
            return await fn(client)
        finally:
            await client.aclose()
    return asyncio.run(go())


def test_records_lost_at_the_head_are_restored_as_written(valkey, tmp_path):
    anchors = AnchorWriter(tmp_path / "anchors", "gateway", KEY)

    async def go(client):
        log = durable(client, tmp_path)
        acked = [await log.append("request", {"request_id": f"r{i}"}) for i in range(5)]
        written = {s: await client.get(record_key(s)) for s in acked}
        anchors.write(*log.last)
        await lose_newest(client, 3)
        lost = await verify(log, anchor_dir=anchors.path.parent)
        after = await log.append("request", {"request_id": "after"})
        return acked, written, lost, after, await verify(log, anchor_dir=anchors.path.parent), \
            {s: await client.get(record_key(s)) for s in acked}

    acked, written, lost, after, verdict, now = run(valkey, go)
    assert acked == [1, 2, 3, 4, 5]
    assert not lost.ok and "records 4 to 5 are missing" in lost.reason
    assert now == written  # the same bytes: same seq, same HMAC, so anchors still match
    assert after == 6 and verdict.ok and verdict.checked == 6 and verdict.restored == 0


def test_records_lost_under_another_writers_records_are_restored_inside_new_ones(valkey, tmp_path):
    """Another gateway appended on the rewound head before this one noticed: the lost records
    come back inside `restored` records, and verify accepts the anchor that names them."""
    anchors = AnchorWriter(tmp_path / "anchors", "gateway", KEY)

    async def go(client):
        log = durable(client, tmp_path)
        for i in range(5):
            await log.append("request", {"request_id": f"r{i}", "user": "u"})
        lost = {s: parse(await client.get(record_key(s))) for s in (4, 5)}
        anchors.write(*log.last)
        await lose_newest(client, 3)
        other = AuditLog(client, KEY)
        await other.append("request", {"request_id": "other"})  # seq 4, another record
        before = await verify(log, anchor_dir=anchors.path.parent)
        restored = await log.check()
        verdict = await verify(log, anchor_dir=anchors.path.parent)
        wrappers = [parse(await client.get(record_key(s))) for s in (5, 6)]
        by_user = await log.query(Filters(user="u"))
        return lost, before, restored, verdict, wrappers, by_user[0]

    lost, before, restored, verdict, wrappers, by_user = run(valkey, go)
    assert not before.ok and before.first_bad_seq == 5
    assert restored == 2
    assert verdict.ok and verdict.restored == 2 and verdict.anchor.seq == 5, verdict
    assert [w["type"] for w in wrappers] == ["restored", "restored"]
    assert [w["restored"] for w in wrappers] == [lost[4], lost[5]]  # carried as they were
    # Queries find a restored record by what the record it carries is indexed under.
    assert [r["seq"] for r in by_user] == [1, 2, 3, 5, 6]


def test_a_restarted_or_idle_writer_restores_what_it_acknowledged_before(valkey, tmp_path):
    """The guard comes from the spool after a restart; a check restores without an append."""
    async def go(client):
        first = durable(client, tmp_path)
        for i in range(4):
            await first.append("request", {"request_id": f"r{i}"})
        first.spool.close()
        await lose_newest(client, 2)
        again = durable(client, tmp_path)  # the same spool, as after a restart
        return again.last, await again.check(), await verify(again)

    last, restored, verdict = run(valkey, go)
    assert last[0] == 4 and restored == 2 and verdict.ok and verdict.checked == 4


def test_a_tampered_spool_injects_no_record(valkey, tmp_path):
    """Someone who can write the spool but lacks the audit key: a genuine line altered and a
    forged one are skipped (counted); the genuine lost records come back, nothing else."""
    async def go(client):
        log = durable(client, tmp_path)
        for i in range(4):
            await log.append("request", {"request_id": f"r{i}"})
        log.spool.close()
        segment = next((tmp_path / "spool" / "gateway").glob("*.jsonl"))
        lines = segment.read_bytes().splitlines()
        altered = {**json.loads(lines[2]), "request_id": "altered"}
        forged = {**json.loads(lines[3]), "seq": 5, "prev": json.loads(lines[3])["hmac"],
                  "request_id": "forged"}
        forged["hmac"] = seal(b"not-the-audit-key-but-32-bytes-long!", forged)
        segment.write_bytes(b"\n".join([*lines[:2], stored(altered).encode(), lines[3],
                                        stored(forged).encode()]) + b"\n")
        await lose_newest(client, 1)
        restarted = durable(client, tmp_path)  # its guard: the newest line that verifies
        restored = await restarted.check()
        return restored, restarted.last, await verify(restarted), \
            [parse(await client.get(record_key(s))) for s in (1, 2, 3, 4)]

    restored, last, verdict, records = run(valkey, go)
    assert restored == 2 and verdict.ok and verdict.checked == 3 and verdict.restored == 1
    # Record 2 as written; record 4 (it linked to the lost record 3) inside record 3; record
    # 3 itself is gone with the spool line that was altered.
    assert [r and r.get("request_id") for r in records] == ["r0", "r1", None, None]
    assert records[2]["type"] == "restored" and records[2]["restored"]["request_id"] == "r3"
    assert last[0] == 3


def test_a_full_spool_drops_only_records_a_check_found_in_redis(valkey, tmp_path):
    """At its bound, the spool makes room from records the guard shows are in Redis (even
    younger than keep_s), and the append is acknowledged; nothing unchecked is dropped."""
    from gateway.spool import DROPPED_EARLY

    async def go(client):
        log = DurableAuditLog(client, KEY, Spool(tmp_path / "spool", 8, 1 << 20, 3600), "gateway")
        dropped = DROPPED_EARLY._value.get()
        seqs = [await log.append("request", {"request_id": f"r{i}"}) for i in range(12)]
        kept = [json.loads(line)["seq"] for path, size in log.spool.snapshot()
                for line in Spool.read(path, size)]
        return seqs, kept, DROPPED_EARLY._value.get() - dropped

    seqs, kept, dropped = run(valkey, go)
    assert seqs == list(range(1, 13))
    assert kept == list(range(5, 13)) and dropped == 4  # whole segments of one record each


def test_a_planted_restored_index_entry_does_not_stop_a_restore(valkey, tmp_path):
    """Someone who can write Redis claims a lost record is already carried by a `restored`
    record (an index entry naming another record): the claim is checked, the record restored."""
    async def go(client):
        log = durable(client, tmp_path)
        for i in range(4):
            await log.append("request", {"request_id": f"r{i}"})
        lost = parse(await client.get(record_key(4)))
        await lose_newest(client, 3)
        await client.zadd(restored_key(4, lost["hmac"]), {f"{2:020d}": 1})
        return await log.check(), await client.get(record_key(4)), lost

    restored, raw, lost = run(valkey, go)
    assert restored == 1 and parse(raw) == lost
