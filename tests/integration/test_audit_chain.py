"""The audit chain against someone with write access to Redis but not the audit key:
every tampering is reported by `verify` at the exact record, index entry or anchor.
A real Valkey; appends from other processes where the number of writers matters."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio as redis

from finsieve.valkey import valkey_binary
from gateway.anchors import Anchoring, AnchorWriter, read_anchor
from gateway.audit import (
    HEAD,
    TIME,
    AuditError,
    AuditLog,
    Filters,
    index_key,
    index_values,
    parse,
    record_key,
)
from gateway.audit_verify import verify

from support.servers import free_port

KEY = b"test-audit-key-of-at-least-32-bytes!"


def run(valkey, fn, **kw):
    async def go():
        client = redis.Redis(port=valkey.port, password=valkey.password)
        try:
            return await fn(AuditLog(client, KEY, **kw), client)
        finally:
            await client.aclose()
    return asyncio.run(go())


async def fill(log: AuditLog, n: int) -> None:
    start = (await log.head()).seq
    for i in range(start, start + n):
        await log.append("request", {"request_id": f"r{i}", "user": f"u{i % 3}"})


async def delete(client: redis.Redis, *seqs: int) -> None:
    """Delete records and their index entries, as someone cleaning up behind them would."""
    for seq in seqs:
        rec = parse(await client.get(record_key(seq)))
        await client.delete(record_key(seq))
        await client.zrem(TIME, seq)
        for field, value in index_values(rec or {}):
            await client.zrem(index_key(field, value), seq)


async def rewound(log: AuditLog, client: redis.Redis) -> dict:
    """Ten records, an anchor of the newest; returns the genuine head as it was at record 8."""
    await fill(log, 8)
    head_at_8 = await client.hgetall(HEAD)
    await fill(log, 2)
    return head_at_8


async def delete_newest_and_rewind_head(log, client, anchors):
    head_at_8 = await rewound(log, client)
    anchors.write(*log.last)
    await delete(client, 9, 10)
    await client.hset(HEAD, mapping=head_at_8)


async def rewind_head_only(log, client, anchors):
    head_at_8 = await rewound(log, client)
    await client.hset(HEAD, mapping=head_at_8)


async def truncate_tail(log, client, anchors):
    await fill(log, 10)
    await delete(client, 9, 10)


async def delete_oldest(log, client, anchors):
    await fill(log, 10)
    await delete(client, 1, 2, 3)


async def delete_oldest_segment_after_a_trim(log, client, anchors):
    await fill(log, 5)
    await asyncio.sleep(0.01)  # records 6.. are strictly younger than 1..5
    await fill(log, 5)
    assert await log.trim(parse(await client.get(record_key(6)))["ts_ms"]) == 5
    await delete(client, 6, 7)


async def delete_an_index(log, client, anchors):
    await fill(log, 10)
    await client.delete(index_key("user", "u1"))  # u1's: records 2, 5, 8


async def add_an_index_entry(log, client, anchors):
    await fill(log, 10)
    ts = parse(await client.get(record_key(3)))["ts_ms"]
    await client.zadd(index_key("user", "u1"), {"3": ts})  # record 3 is u2's


async def alter_the_head_signature(log, client, anchors):
    await fill(log, 10)
    await client.hset(HEAD, "sig", "0" * 64)


async def forge_an_anchor(log, client, anchors):
    await fill(log, 10)
    anchors.write(*log.last)
    line = json.loads(anchors.path.read_text().splitlines()[-1])
    line["seq"] = 9
    with anchors.path.open("a") as f:
        f.write(json.dumps(line) + "\n")


@pytest.mark.parametrize(("tamper", "seq", "reason"), [
    (delete_newest_and_rewind_head, 9, "records 9 to 10 are missing: the chain was cut after record 8"),
    (rewind_head_only, 9, "record 9 lies beyond the chain head"),
    (truncate_tail, 9, "record 9 is missing"),
    (delete_oldest, 1, "record 1 is missing"),
    (delete_oldest_segment_after_a_trim, 6, "record 6 is missing"),
    (delete_an_index, 2, "record 2 is missing from the index idx:user:u1"),
    (add_an_index_entry, 3, "the index idx:user:u1 lists record 3, which does not belong to it"),
    (alter_the_head_signature, 10, "the chain head was altered"),
    (forge_an_anchor, 0, "gateway.jsonl: anchor not signed with this audit key"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_verify_reports_each_tampering_at_the_exact_record(valkey, tmp_path, tamper, seq, reason):
    anchors = AnchorWriter(tmp_path / "anchors", "gateway", KEY)

    async def go(log, client):
        await tamper(log, client, anchors)
        return await verify(log, anchor_dir=anchors.path.parent)

    verdict = run(valkey, go)
    assert not verdict.ok
    assert reason in verdict.reason
    assert verdict.first_bad_seq == seq, verdict


def test_an_intact_chain_reaches_its_newest_anchor_and_anchors_from_elsewhere(valkey, tmp_path):
    anchors = AnchorWriter(tmp_path / "anchors", "gateway", KEY)

    async def go(log, client):
        await fill(log, 5)
        anchors.write(*log.last)
        shipped = read_anchor(KEY, json.loads(anchors.path.read_text()), "worm")
        await fill(log, 5)
        ok = await verify(log, anchors=[shipped], anchor_dir=anchors.path.parent)
        # An anchor of another chain (say, before Redis was replaced by a rebuilt copy).
        other = dataclasses.replace(shipped, record_hmac="f" * 64)
        bad = await verify(log, anchors=[other], anchor_dir=anchors.path.parent)
        return ok, bad

    ok, bad = run(valkey, go)
    assert ok.ok and ok.checked == 10 and ok.anchor.seq == 5
    assert not bad.ok and bad.first_bad_seq == 5 and "is not the record the anchor written by" in bad.reason


def test_an_append_never_overwrites_a_record_after_the_head_was_rewound(valkey):
    async def go(log, client):
        head_at_8 = await rewound(log, client)
        await client.hset(HEAD, mapping=head_at_8)
        before = await client.get(record_key(9))
        with pytest.raises(AuditError, match="record 9 already exists"):
            await log.append("request", {"request_id": "after"}, deadline_s=1)
        return before, await client.get(record_key(9))

    before, after = run(valkey, go)
    assert before == after


def test_two_gateways_with_skewed_clocks_trim_without_breaking_the_chain(valkey):
    """Gateway A's clock is a minute ahead of B's. Trimming by time alone would delete B's
    records written after A's and keep A's: a hole in the chain."""
    script = (
        "import asyncio, sys, time, redis.asyncio as r\n"
        "from gateway.audit import AuditLog\n"
        "async def main():\n"
        f"    log = AuditLog(r.Redis(port={valkey.port}, password={valkey.password!r}), {KEY!r},\n"
        "                   clock_ms=lambda: int(time.time() * 1000) + int(sys.argv[2]))\n"
        "    for i in range(5):\n"
        "        await log.append('request', {'request_id': sys.argv[1] + str(i)})\n"
        "asyncio.run(main())\n"
    )
    hour = 3_600_000
    for name, offset in (("old", -hour), ("a", 60_000), ("b", 0), ("a", 60_000)):
        subprocess.run([sys.executable, "-c", script, name, str(offset)], check=True, timeout=60)

    async def go(log, client):
        b_last = parse(await client.get(record_key(15)))
        cutoff = b_last["ts_ms"] + 1  # B's records are older than this; A's are not
        trimmed = await log.trim(cutoff)
        kept = sorted(int(s) for s in await client.zrange(TIME, 0, -1))
        return trimmed, await verify(log), kept, cutoff, [parse(await client.get(record_key(s)))
                                                           for s in kept]

    trimmed, verdict, kept, cutoff, records = run(valkey, go)
    assert trimmed == 5  # the records from an hour ago, up to A's first
    assert verdict.ok and verdict.checked == 15
    assert kept == list(range(6, 21))
    assert any(r["ts_ms"] < cutoff for r in records)  # B's records stay rather than leave a hole


def test_an_append_waits_for_replicas_when_asked(valkey, tmp_path):
    port = free_port()
    replica = subprocess.Popen(
        [str(valkey_binary()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--dir", str(tmp_path), "--replicaof", "127.0.0.1", str(valkey.port),
         "--masterauth", valkey.password],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def replicas(client: redis.Redis, want: int) -> None:
        for _ in range(600):
            info = await client.info("replication")
            if sum(info.get(f"slave{i}", {}).get("state") == "online" for i in range(want + 1)) == want:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"never {want} replicas")

    async def go(log, client):
        await client.config_set("repl-diskless-sync-delay", 0)
        await replicas(client, 1)
        patient = AuditLog(client, KEY, wait_replicas=1, wait_timeout_ms=30_000)
        seq = await patient.append("request", {"request_id": "replicated"})
        replica.kill()
        replica.wait()
        await replicas(client, 0)
        with pytest.raises(AuditError, match="reached 0 of 1 replicas within 200 ms"):
            await log.append("request", {"request_id": "alone"})
        # WAITAOF: the primary's own fsync is enough when no replica is asked for ...
        fsynced = AuditLog(client, KEY, waitaof_local=True, wait_timeout_ms=200)
        assert await fsynced.append("request", {"request_id": "fsynced"}) == 3
        # ... and an append that no replica fsynced in time is refused, as with WAIT.
        with pytest.raises(AuditError, match="not fsynced within 200 ms: the primary did, 0 of 1 "
                                             "replicas did"):
            await AuditLog(client, KEY, waitaof_local=True, wait_replicas=1,
                           wait_timeout_ms=200).append("request", {"request_id": "alone"})
        return seq

    try:
        assert run(valkey, go, wait_replicas=1, wait_timeout_ms=200) == 1
    finally:
        replica.kill()
        replica.wait()


def test_anchors_are_written_while_records_are_appended_and_at_stop(valkey, tmp_path):
    writer = AnchorWriter(tmp_path / "anchors", "gateway", KEY)

    async def go(log, client):
        anchoring = Anchoring(log, writer, 0.05)
        anchoring.start()
        deadline = time.monotonic() + 60
        while not writer.path.exists() and time.monotonic() < deadline:
            await log.append("request", {"request_id": "x"})
            await asyncio.sleep(0.01)
        await log.append("request", {"request_id": "last"})
        await anchoring.stop()
        return log.last

    last = run(valkey, go)
    anchors = [read_anchor(KEY, json.loads(line), "file") for line in writer.path.read_text().splitlines()]
    assert len(anchors) >= 2
    assert [a.seq for a in anchors] == sorted(a.seq for a in anchors)
    assert (anchors[-1].seq, anchors[-1].record_hmac) == last
    assert stat.S_IMODE(os.stat(writer.path).st_mode) == 0o600


def test_query_and_export_pages_are_bounded_by_bytes(valkey):
    async def go(log, client):
        for i in range(30):
            await log.append("request", {"request_id": f"r{i}", "delivered": "x" * 1000})
        first, cursor = await log.query(Filters(), limit=100, max_bytes=5000)
        second, _ = await log.query(Filters(), limit=100, cursor=cursor, max_bytes=5000)
        pages = [page async for page in log.export(Filters(), page=100, max_bytes=5000)]
        return first, second, pages

    first, second, pages = run(valkey, go)
    assert 1 < len(first) < 30 and second[0]["seq"] == len(first) + 1
    assert [r["seq"] for page in pages for r in page] == list(range(1, 31))
    assert all(sum(len(json.dumps(r)) for r in page) <= 5000 * 1.1 for page in pages)


def test_garbage_in_redis_is_reported_not_raised(valkey):
    async def go(log, client):
        await fill(log, 3)
        await client.set(record_key(2), b"\xff not json")
        await client.set(index_key("user", "u2"), "not a sorted set")
        return await verify(log), await log.query(Filters(), limit=10)

    verdict, (records, _) = run(valkey, go)
    assert not verdict.ok and verdict.first_bad_seq == 2 and "not a JSON record" in verdict.reason
    assert [r["seq"] for r in records] == [1, 3]


def test_retention_needs_a_verified_chain(valkey, tmp_path: Path):
    async def go(log, client):
        await fill(log, 6)
        rec = parse(await client.get(record_key(2)))
        rec["user"] = "someone-else"
        await client.set(record_key(2), json.dumps(rec))
        with pytest.raises(AuditError, match="not trimming: record 2 does not verify"):
            await log.trim(int(time.time() * 1000) + 60_000)
        return await client.exists(record_key(1))

    assert run(valkey, go) == 1  # nothing was deleted behind a checkpoint


def test_pages_never_skip_or_repeat_records_of_the_same_millisecond(valkey):
    async def go(log, client):
        for i in range(250):
            await log.append("request", {"request_id": f"r{i}"})
        seen, cursor = [], None
        while True:
            page, cursor = await log.query(Filters(since_ms=0, until_ms=2000), limit=7, cursor=cursor)
            seen += [r["seq"] for r in page]
            if cursor is None:
                return seen

    seen = run(valkey, go, clock_ms=lambda: 1000)  # every record in one millisecond
    assert sorted(seen) == list(range(1, 251)) and len(seen) == 250


def test_records_of_one_millisecond_come_back_in_sequence_order(valkey):
    """A sorted set orders the members of one score as strings: with plain numbers, record
    10 came before record 9 (seen as a flaky export test when appends shared a millisecond)."""
    async def go(log, client):
        await fill(log, 12)
        records, _ = await log.query(Filters(), limit=100)
        by_user, _ = await log.query(Filters(user="u0"), limit=100)
        verified = await verify(log)
        return [r["seq"] for r in records], [r["seq"] for r in by_user], verified

    seqs, by_user, verified = run(valkey, go, clock_ms=lambda: 1_700_000_000_000)
    assert seqs == list(range(1, 13))
    assert by_user == [1, 4, 7, 10]
    assert verified.ok, verified.reason
