"""The audit trail: hash-chained records in Redis that compliance officers query and verify.

Every record carries `prev`, the HMAC of the record before it, and `hmac`, the HMAC of its
own canonical bytes (prev included). A changed field breaks that record's HMAC; a deleted,
reordered or inserted record breaks a link. Appends from several gateways never fork the
chain: a Lua script appends only if the head is still the one the record was sealed
against, and the gateway re-seals and retries otherwise. All keys share one hash tag, so
on a Redis Cluster the chain lives on one slot.

Trimming (retention) deletes the oldest records and writes a signed checkpoint holding the
last trimmed record's HMAC, so verification still links across the gap.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as redis
from prometheus_client import Histogram

TAG = "{finsieve-audit}"
HEAD = f"{TAG}:head"
TIME = f"{TAG}:time"
CHECKPOINT = f"{TAG}:checkpoint"
INDEXED = ("tenant", "user", "rule_id", "action", "finish_reason", "request_id")

APPEND_SECONDS = Histogram("finsieve_audit_append_seconds", "Audit record appends",
                           buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5))

_APPEND = """
local head = redis.call('HMGET', KEYS[1], 'seq', 'hmac')
local seq = tonumber(head[1]) or 0
if (head[2] or '') ~= ARGV[1] or seq + 1 ~= tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[3], ARGV[3])
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'hmac', ARGV[4])
for i = 2, #KEYS do
  if i ~= 3 then redis.call('ZADD', KEYS[i], ARGV[5], ARGV[2]) end
end
return 1
"""


class AuditError(RuntimeError):
    """The audit trail could not be written (Redis down, or contention that did not clear)."""


def record_key(seq: int) -> str:
    return f"{TAG}:rec:{seq}"


def index_key(field: str, value: str) -> str:
    return f"{TAG}:idx:{field}:{value}"


def canonical(record: dict[str, Any]) -> bytes:
    """The bytes an HMAC covers: sorted keys, no spaces, UTF-8, without the hmac itself."""
    body = {k: v for k, v in record.items() if k != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def seal(key: bytes, record: dict[str, Any]) -> str:
    return hmac.new(key, canonical(record), hashlib.sha256).hexdigest()


def index_values(record: dict[str, Any]) -> list[tuple[str, str]]:
    values = [(f, str(record[f])) for f in ("tenant", "user", "finish_reason", "request_id")
              if record.get(f)]
    for i in record.get("interventions", []):
        values += [(f, i[f]) for f in ("rule_id", "action") if i.get(f)]  # proto JSON omits ""
    return sorted(set(values))


@dataclass(frozen=True)
class Filters:
    since_ms: int = 0
    until_ms: int = 0  # 0: now
    tenant: str = ""
    user: str = ""
    rule_id: str = ""
    action: str = ""
    finish_reason: str = ""
    request_id: str = ""

    def index(self) -> str:
        """The most selective index the filters allow."""
        for field in ("request_id", "rule_id", "user", "action", "finish_reason", "tenant"):
            if getattr(self, field):
                return index_key(field, getattr(self, field))
        return TIME

    def accepts(self, record: dict[str, Any]) -> bool:
        have = set(index_values(record))
        return all(not getattr(self, f) or (f, getattr(self, f)) in have for f in INDEXED)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    checked: int
    first_bad_seq: int = 0
    reason: str = ""


class AuditLog:
    def __init__(self, client: redis.Redis, key: bytes) -> None:
        self.redis = client
        self.key = key
        self._append = client.register_script(_APPEND)
        # Appends of one process queue here instead of racing for the head; only appends
        # from other gateway processes can make the compare-and-set retry.
        self._lock = asyncio.Lock()

    # -- writing ------------------------------------------------------------------------

    async def append(self, kind: str, body: dict[str, Any], deadline_s: float = 10.0) -> int:
        """Seal and append one record; returns its sequence number. Raises AuditError."""
        async with self._lock:
            with APPEND_SECONDS.time():
                return await self._append_unlocked(kind, body, deadline_s)

    async def _append_unlocked(self, kind: str, body: dict[str, Any], deadline_s: float) -> int:
        deadline = time.monotonic() + deadline_s
        try:
            for attempt in itertools.count():
                seq, prev = await self._head()
                now = int(time.time() * 1000)
                record = {"seq": seq + 1, "prev": prev, "type": kind, "ts_ms": now, **body}
                record["hmac"] = seal(self.key, record)
                keys = [HEAD, TIME, record_key(seq + 1),
                        *(index_key(f, v) for f, v in index_values(record))]
                args = [prev, seq + 1, json.dumps(record, ensure_ascii=False), record["hmac"], now]
                if await self._append(keys=keys, args=args):
                    return seq + 1
                if time.monotonic() > deadline:
                    break
                # Another gateway appended first: back off with jitter, so none starves.
                await asyncio.sleep(random.uniform(0, min(0.05, 0.0005 * 2**attempt)))
        except (redis.RedisError, OSError) as e:
            raise AuditError(f"audit append failed: {type(e).__name__}: {e}") from None
        raise AuditError("audit append failed: the chain head kept moving (contention)")

    async def _head(self) -> tuple[int, str]:
        seq, mac = await self.redis.hmget(HEAD, "seq", "hmac")
        return int(seq or 0), (mac or b"").decode()

    # -- reading ------------------------------------------------------------------------

    async def get(self, seq: int) -> dict[str, Any] | None:
        raw = await self.redis.get(record_key(seq))
        return json.loads(raw) if raw else None

    async def query(self, f: Filters, limit: int = 50, offset: int = 0
                    ) -> tuple[list[dict[str, Any]], int | None]:
        """Records matching the filters, oldest first; and the offset of the next page."""
        until = f.until_ms or int(time.time() * 1000)
        out: list[dict[str, Any]] = []
        pos = offset  # entries of the index consumed so far
        while True:
            seqs = await self.redis.zrangebyscore(f.index(), f.since_ms, until,
                                                  start=pos, num=max(limit, 200))
            if not seqs:
                return out, None
            for k, raw in enumerate(await self.redis.mget([record_key(int(s)) for s in seqs])):
                if raw and f.accepts(rec := json.loads(raw)):
                    out.append(rec)
                    if len(out) == limit:
                        return out, pos + k + 1
            pos += len(seqs)

    async def export(self, f: Filters) -> AsyncIterator[dict[str, Any]]:
        offset: int | None = 0
        while offset is not None:
            page, offset = await self.query(f, 500, offset)
            for rec in page:
                yield rec

    # -- verifying ------------------------------------------------------------------------

    async def verify(self, since_ms: int = 0, until_ms: int = 0) -> Verdict:
        """Check every record in a time range: its HMAC, its link to the one before, its place."""
        until = until_ms or int(time.time() * 1000)
        seqs = sorted(int(s) for s in await self.redis.zrangebyscore(TIME, since_ms, until))
        head_seq, head_mac = await self._head()
        if not seqs:
            return Verdict(True, 0)
        prev_mac = await self._mac_before(seqs[0])
        expected = seqs[0]
        checked = 0
        for start in range(0, len(seqs), 500):
            chunk = seqs[start : start + 500]
            raws = await self.redis.mget([record_key(s) for s in chunk])
            for seq, raw in zip(chunk, raws, strict=True):
                if seq != expected:
                    return Verdict(False, checked, expected, f"record {expected} is missing")
                if raw is None:
                    return Verdict(False, checked, seq, f"record {seq} is missing")
                rec = json.loads(raw)
                if rec.get("seq") != seq:
                    return Verdict(False, checked, seq,
                                   f"record {seq} holds record {rec.get('seq')}: moved or swapped")
                if not hmac.compare_digest(rec.get("hmac", ""), seal(self.key, rec)):
                    return Verdict(False, checked, seq, f"record {seq} was altered: its HMAC does not match")
                if prev_mac is not None and rec.get("prev") != prev_mac:
                    return Verdict(False, checked, seq,
                                   f"record {seq} does not link to record {seq - 1}: inserted, "
                                   "deleted or reordered")
                prev_mac, expected = rec["hmac"], seq + 1
                checked += 1
        if until_ms == 0 and expected - 1 == head_seq and prev_mac != head_mac:
            return Verdict(False, checked, head_seq, "the chain head does not match the last record")
        if until_ms == 0 and expected - 1 < head_seq:
            return Verdict(False, checked, expected, f"record {expected} is missing from the time index")
        return Verdict(True, checked)

    async def _mac_before(self, seq: int) -> str | None:
        """HMAC the first record of a range must link to (None: cannot be known, not checked)."""
        if seq == 1:
            return ""
        before = await self.get(seq - 1)
        if before is not None:
            return before.get("hmac")
        cp = await self.redis.get(CHECKPOINT)
        if cp:
            checkpoint = json.loads(cp)
            if checkpoint.get("through") == seq - 1 and hmac.compare_digest(
                    checkpoint.get("hmac", ""), seal(self.key, checkpoint)):
                return checkpoint["last_hmac"]
        return None

    # -- retention ------------------------------------------------------------------------

    async def trim(self, before_ms: int) -> int:
        """Delete records older than before_ms behind a signed checkpoint; returns how many."""
        seqs = sorted(int(s) for s in await self.redis.zrangebyscore(TIME, 0, before_ms - 1))
        if not seqs:
            return 0
        last = await self.get(seqs[-1])
        if last is None:
            raise AuditError(f"cannot trim: record {seqs[-1]} is missing")
        checkpoint = {"through": seqs[-1], "last_hmac": last["hmac"], "ts_ms": int(time.time() * 1000)}
        checkpoint["hmac"] = seal(self.key, checkpoint)
        await self.redis.set(CHECKPOINT, json.dumps(checkpoint))
        for start in range(0, len(seqs), 1000):
            chunk = seqs[start : start + 1000]
            records = await self.redis.mget([record_key(s) for s in chunk])
            async with self.redis.pipeline(transaction=False) as pipe:
                for seq, raw in zip(chunk, records, strict=True):
                    pipe.delete(record_key(seq))
                    pipe.zrem(TIME, seq)
                    for field, value in index_values(json.loads(raw)) if raw else []:
                        pipe.zrem(index_key(field, value), seq)
                await pipe.execute()
        return len(seqs)
