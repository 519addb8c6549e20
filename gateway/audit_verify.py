"""`audit verify`: walk the chain and report the first record, link, anchor or index entry
that is not what was written.

Checked, in order of sequence number: that the head is signed; that the first record links
to the genesis or to the signed retention checkpoint; for every record its HMAC, its link
to the one before, its presence in the time index and in each field index it belongs to;
that the chain reaches the newest anchor and agrees with every anchor given; that nothing
lies beyond the head, neither a record nor an index entry. A full verify (no time range)
also finds index entries that belong to no record: an order-independent keyed sum of every
entry is compared with the sum the records call for, and only when they differ are the
index entries matched to records one by one. Memory stays bounded: records are read FETCH
at a time, indexes scanned in chunks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

# cast: connect()'s clients return bytes (decode_responses off); redis-py types replies bytes | str.
from typing import Any, cast

from .anchors import Anchor, newest
from .audit import (
    FETCH,
    INDEX_PREFIX,
    TAG,
    TIME,
    AuditError,
    AuditLog,
    derive_key,
    head_sig,
    index_key,
    index_member,
    index_values,
    now_ms,
    parse,
    record_key,
    restored_key,
    sealed_ok,
)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    checked: int
    first_bad_seq: int = 0
    reason: str = ""
    anchor: Anchor | None = None  # the newest anchor the chain was checked against
    restored: int = 0  # records of type `restored` walked (audit_recovery.py)


class Broken(Exception):
    def __init__(self, seq: int, reason: str) -> None:
        super().__init__(reason)
        self.seq, self.reason = seq, reason


# KEYS: indexes; ARGV: (seq, time) for each. The first index (1-based) that lacks its record
# (0), holds it at another time (1) or is not a sorted set (2); {0, 0} when all hold theirs.
# One round trip for a whole chunk of records instead of one per entry.
_CHECK_INDEXES = """
for i = 1, #KEYS do
  local score = redis.pcall('ZSCORE', KEYS[i], ARGV[2 * i - 1])
  if not score then  -- an entry written before members were zero-padded
    score = redis.pcall('ZSCORE', KEYS[i], tostring(tonumber(ARGV[2 * i - 1])))
  end
  if type(score) == 'table' and score.err then return {i, 2} end
  if not score then return {i, 0} end
  if tonumber(score) ~= tonumber(ARGV[2 * i]) then return {i, 1} end
end
return {0, 0}
"""
SMALL_INDEX = 100  # entries of an index read whole in a pipeline with others


def _index_name(key: str) -> str:
    return key.removeprefix(TAG + ":")


class _Walk:
    """One verification; the state it carries is a few numbers, whatever the chain length."""

    def __init__(self, log: AuditLog, anchors: list[Anchor]) -> None:
        self.log = log
        self.anchors: dict[int, list[Anchor]] = {}
        for a in anchors:
            self.anchors.setdefault(a.seq, []).append(a)
        self.checked = 0
        self.restored = 0
        self._sum_key = derive_key(log.key, "index-sum")
        self._check = log.redis.register_script(_CHECK_INDEXES)
        self.expected_sum = 0  # of every index entry the records walked call for

    def entry_hash(self, key: str, seq: int, score: float) -> int:
        h = hashlib.blake2b(f"{key}\0{seq}\0{score:.0f}".encode(), key=self._sum_key, digest_size=8)
        return int.from_bytes(h.digest())

    async def records(self, lo: int, hi: int, prev: str, head_seq: int, latest: Anchor | None) -> str:
        """Check records lo..hi; returns the HMAC of the last. Raises Broken at the first fault."""
        chunk: list[dict[str, Any]] = []
        async for seq, raw in self.log.records(lo, hi):
            rec = parse(raw)
            fault = self._fault(seq, raw, rec, prev, head_seq, latest)
            if fault is not None:
                await self._indexes(chunk)
                raise Broken(seq, fault)
            assert rec is not None
            chunk.append(rec)
            prev = rec["hmac"]
            if len(chunk) == FETCH:
                await self._indexes(chunk)
                chunk = []
        await self._indexes(chunk)
        return prev

    def _fault(self, seq: int, raw: bytes | None, rec: dict[str, Any] | None, prev: str,
               head_seq: int, latest: Anchor | None) -> str | None:
        if raw is None:
            if latest is not None and head_seq < seq <= latest.seq:
                return (f"records {seq} to {latest.seq} are missing: the chain was cut after "
                        f"record {seq - 1}, but {_written(latest)} shows record {latest.seq}")
            return f"record {seq} is missing"
        if rec is None:
            return f"record {seq} was altered: it is not a JSON record"
        if rec.get("seq") != seq:
            return f"record {seq} holds record {rec.get('seq')}: moved or swapped"
        if not sealed_ok(self.log.key, rec):
            return f"record {seq} was altered: its HMAC does not match"
        if rec.get("prev") != prev:
            return (f"record {seq} does not link to record {seq - 1}: inserted, deleted or "
                    "reordered")
        if rec.get("type") == "restored" and not _carries_sealed(self.log.key, rec):
            return f"record {seq} restores a record whose HMAC does not match"
        for anchor in self.anchors.get(seq, []):
            if anchor.record_hmac != rec["hmac"]:
                return f"record {seq} is not the record {_written(anchor)} shows"
        return None

    async def _indexes(self, records: list[dict[str, Any]]) -> None:
        """Every record is in the time index and in each field index it belongs to (each is
        sealed, and the writer's seal covers its ts_ms)."""
        expected = [(key, rec["seq"], rec["ts_ms"])
                    for rec in records
                    for key in (TIME, *(index_key(f, v) for f, v in index_values(rec)))]
        if not expected:
            return
        fault, how = await self._check(keys=[k for k, _, _ in expected],
                                       args=[v for _, seq, ts in expected
                                             for v in (index_member(seq), ts)])
        if fault:
            key, seq, _ = expected[fault - 1]
            raise Broken(seq, (f"record {seq} is missing from the index {_index_name(key)}",
                               f"the index {_index_name(key)} holds record {seq} at another time",
                               f"record {seq}'s index {_index_name(key)} is not an index (wrong type)"
                               )[how])
        for key, seq, ts in expected:
            self.expected_sum = (self.expected_sum + self.entry_hash(key, seq, ts)) % 2**64
        self.checked += len(records)
        self.restored += sum(1 for rec in records if rec.get("type") == "restored")

    async def extra_entries(self, first: int, hi: int) -> None:
        """Index entries that no record calls for (entries of records newer than hi are
        skipped: they were appended during the walk)."""
        actual, below, beyond = 0, None, None
        async for key, seq, score in self._entries():
            if seq is not None and seq > hi:
                beyond = (seq, key) if beyond is None else max(beyond, (seq, key))
                continue
            if seq is None or seq < first:
                below = (seq or 0, key) if below is None else min(below, (seq or 0, key))
                continue
            actual = (actual + self.entry_hash(key, seq, score)) % 2**64
        if below is not None:
            raise Broken(below[0], f"the index {_index_name(below[1])} lists record {below[0]}, "
                                   "which is not in the chain")
        await self._beyond_head(beyond)
        if actual != self.expected_sum:
            await self._find_extra(first, hi)

    async def _beyond_head(self, newest: tuple[int, str] | None) -> None:
        """The newest entry past the walk's end must name a record appended since: the head
        is read after the scan, and an append writes its record, the head and its index
        entries at once, so an entry past the head then was never a record's."""
        if newest is None:
            return
        head = await self.log.head()
        if newest[0] > head.seq:
            raise Broken(newest[0], f"the index {_index_name(newest[1])} lists record "
                                    f"{newest[0]}, beyond the chain head (record {head.seq})")

    async def _entries(self):
        keys = [TIME]
        async for key in self.log.redis.scan_iter(match=f"{INDEX_PREFIX}*", count=1000):
            keys.append(key.decode(errors="replace"))
            if len(keys) < FETCH:
                continue
            async for entry in self._members(keys):
                yield entry
            keys = []
        async for entry in self._members(keys):
            yield entry

    async def _members(self, keys: list[str]):
        """Every (key, seq, score) of these indexes: small ones (most: one per request id)
        read in one pipelined round trip, large ones scanned in chunks."""
        r = self.log.redis
        async with r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.zcard(key)
            sizes = await pipe.execute(raise_on_error=False)
        for key, size in zip(keys, sizes, strict=True):
            if isinstance(size, Exception):
                raise Broken(0, f"{_index_name(key)} is not an index (wrong type)")
        small = [k for k, size in zip(keys, sizes, strict=True) if size <= SMALL_INDEX]
        async with r.pipeline(transaction=False) as pipe:
            for key in small:
                pipe.zrange(key, 0, -1, withscores=True)
            read = await pipe.execute()
        for key, entries in zip(small, read, strict=True):
            for member, score in entries:
                yield key, int(member) if member.isdigit() else None, score
        for key, size in zip(keys, sizes, strict=True):
            if size > SMALL_INDEX:
                async for member, score in r.zscan_iter(key, count=1000):
                    yield key, int(member) if member.isdigit() else None, score

    async def _find_extra(self, first: int, hi: int) -> None:
        """The entry with the lowest sequence number that its record does not call for."""
        worst: tuple[int, str] | None = None
        batch: list[tuple[str, int, float]] = []

        async def check() -> None:
            nonlocal worst
            raws = await self.log.redis.mget([record_key(seq) for _, seq, _ in batch])
            for (key, seq, score), raw in zip(batch, raws, strict=True):
                rec = parse(raw) or {}
                belongs = key == TIME or any(index_key(f, v) == key for f, v in index_values(rec))
                if not belongs or rec.get("ts_ms") != score:
                    worst = min(worst or (seq, key), (seq, key))
            batch.clear()

        async for key, seq, score in self._entries():
            if seq is not None and first <= seq <= hi:
                batch.append((key, seq, score))
                if len(batch) == FETCH:
                    await check()
        if batch:
            await check()
        if worst is not None:
            raise Broken(worst[0], f"the index {_index_name(worst[1])} lists record {worst[0]}, "
                                   "which does not belong to it")


def _carries_sealed(key: bytes, rec: dict[str, Any]) -> bool:
    """A `restored` record carries one record, sealed with the same key."""
    inner = rec.get("restored")
    return isinstance(inner, dict) and isinstance(inner.get("seq"), int) and sealed_ok(key, inner)


async def _restored_copies(log: AuditLog, anchors: list[Anchor]) -> dict[Anchor, int]:
    """The anchors whose record a `restored` record carries (it was lost from Redis and
    appended again: audit_recovery.py), with the seq of that restored record."""
    found: dict[Anchor, int] = {}
    for start in range(0, len(anchors), FETCH):
        chunk = anchors[start:start + FETCH]
        async with log.redis.pipeline(transaction=False) as pipe:
            for a in chunk:
                pipe.zrange(restored_key(a.seq, a.record_hmac), 0, 0)
            firsts = await pipe.execute()
        for a, first in zip(chunk, firsts, strict=True):
            if first and first[0].isdigit():
                found[a] = int(first[0])
    return found


async def _check_restored(log: AuditLog, copies: dict[Anchor, int], head_seq: int) -> None:
    """Each anchor satisfied by a restored copy: that copy is a sealed `restored` record of
    the chain, carrying a record with the anchor's seq and HMAC whose own HMAC verifies."""
    for anchor, seq in sorted(copies.items(), key=lambda item: item[0].seq):
        rec = await log.get(seq)
        inner = (rec or {}).get("restored")
        if not (rec is not None and seq <= head_seq and rec.get("seq") == seq
                and rec.get("type") == "restored" and sealed_ok(log.key, rec)
                and _carries_sealed(log.key, rec) and isinstance(inner, dict)
                and inner.get("seq") == anchor.seq and inner.get("hmac") == anchor.record_hmac):
            raise Broken(anchor.seq, f"record {anchor.seq} is not the record {_written(anchor)} "
                                     f"shows, and its restored copy (record {seq}) does not verify")


def _written(anchor: Anchor) -> str:
    import datetime as dt

    when = dt.datetime.fromtimestamp(anchor.ts_ms / 1000, dt.UTC).isoformat(timespec="seconds")
    return f"the anchor written by {anchor.writer} at {when}" + (
        f" ({anchor.source})" if anchor.source else "")


async def verify(log: AuditLog, since_ms: int = 0, until_ms: int = 0,
                 anchors: list[Anchor] | None = None, anchor_dir: Path | None = None) -> Verdict:
    """Verify the whole chain (no time range), or the records written in a time range and
    the link into it. `anchors` are officer-supplied (e.g. from write-once storage); the
    newest anchor in `anchor_dir` is always checked."""
    given = list(anchors or [])
    local, problems = newest(anchor_dir, log.key) if anchor_dir else (None, [])
    if local is not None:
        given.append(local)
    newest_anchor = max(given, key=lambda a: a.seq, default=None)
    # An anchor of a record that a failover lost, and that its writer restored inside a
    # `restored` record, is checked against that copy instead of the chain's record there.
    copies = await _restored_copies(log, given)
    in_chain = [a for a in given if a not in copies]
    walk = _Walk(log, in_chain)
    newest_in_chain = max(in_chain, key=lambda a: a.seq, default=None)
    try:
        if problems:
            raise Broken(0, problems[0])
        head = await log.head()
        if head.seq < 0 or (head.seq > 0 and head.sig != head_sig(log.key, head.seq, head.hmac)):
            raise Broken(max(head.seq, 0), "the chain head was altered: its signature does not match")
        try:
            cp = await log.checkpoint()
        except AuditError as e:
            raise Broken(0, str(e)) from None
        first = cp.through + 1 if cp else 1
        last = max(head.seq, newest_in_chain.seq if newest_in_chain else 0)
        full = since_ms == 0 and until_ms == 0
        lo, hi = first, last
        if not full:
            members = cast("list[bytes]", await log.redis.zrangebyscore(TIME, since_ms, until_ms or now_ms()))
            seqs = [int(s) for s in members if s.isdigit()]
            if not seqs:
                return Verdict(True, 0, anchor=newest_anchor)
            if max(seqs) > head.seq and max(seqs) > (now := await log.head()).seq:
                # Read again: a record appended since the first read is no fault.
                raise Broken(max(seqs), f"the index {_index_name(TIME)} lists record {max(seqs)}, "
                                        f"beyond the chain head (record {now.seq})")
            lo, hi = max(first, min(seqs)), max(seqs) if until_ms else last
        prev = await _link_into(log, lo, first, cp.last_hmac if cp else "")
        tail = await walk.records(lo, hi, prev, head.seq, newest_in_chain)
        if hi == last:
            if head.seq != hi:
                raise Broken(head.seq + 1, f"the chain head says record {head.seq} is the newest, "
                                           f"but the chain reaches record {hi}: it was rewound")
            if head.seq and head.hmac != tail:
                raise Broken(head.seq, "the chain head does not match the last record")
            # Read the head again: a record appended during the walk is past the head that
            # was read first, not past the head now; a rewound head stays behind it.
            if await log.redis.exists(record_key(hi + 1)) and (await log.head()).seq <= hi:
                raise Broken(hi + 1, f"record {hi + 1} lies beyond the chain head: inserted, "
                                           "or the head was rewound")
        if full:
            await walk.extra_entries(first, hi)
        await _check_restored(log, copies, max(head.seq, hi))
    except Broken as b:
        return Verdict(False, walk.checked, b.seq, b.reason, newest_anchor, walk.restored)
    return Verdict(True, walk.checked, anchor=newest_anchor, restored=walk.restored)


async def _link_into(log: AuditLog, lo: int, first: int, genesis: str) -> str:
    """The HMAC record lo must link to: the genesis or checkpoint's, or record lo-1's."""
    if lo <= first:
        return genesis
    before = await log.get(lo - 1)
    if before is None:
        raise Broken(lo - 1, f"record {lo - 1} is missing")
    if before.get("seq") != lo - 1 or not sealed_ok(log.key, before):
        raise Broken(lo - 1, f"record {lo - 1} was altered: its HMAC does not match")
    return before["hmac"]
