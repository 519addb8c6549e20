"""The audit trail: hash-chained records in Redis that compliance officers query and verify.

Every record carries its sequence number `seq`, `prev` (the HMAC of the record before it)
and `hmac` (the HMAC of its own canonical bytes, seq and prev included). A changed field
breaks that record's HMAC; a deleted, reordered or inserted record breaks a link. The
chain head (newest seq and HMAC) is signed, and each writer anchors it outside Redis
(`anchors.py`), so deleting the newest records and rewinding the head is detected too.

Appends from several gateways never fork the chain: a Lua script appends only if the head
is still the one the record was sealed against (and never over an existing record), and
the gateway re-seals and retries otherwise. All keys share one hash tag, so on a Redis
Cluster the chain lives on one slot.

A client chooses its user and request ids, and either may hold a card number: a record
stores them masked like any text (`trace.py`), and the indexes name them by their keyed
hash (`id_hash`, in the record's `id_hashes`), never by the value, so no key name holds
one; officers' queries by user or request id are hashed the same way. Records written
before `id_hashes` existed stay indexed by the value they hold.

Retention deletes the oldest records by sequence number, up to the first record younger
than the period, behind a signed checkpoint: the gateways' clocks never decide which
records go, so skew between them cannot leave a hole.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

# cast: connect()'s clients return bytes (decode_responses off); redis-py types replies bytes | str.
from typing import Any, cast

from prometheus_client import Histogram

from finsieve.valkey import ERRORS, Client, SlotPrimary

TAG = "{finsieve-audit}"
HEAD = f"{TAG}:head"
TIME = f"{TAG}:time"
CHECKPOINT = f"{TAG}:checkpoint"
INDEX_PREFIX = f"{TAG}:idx:"
INDEXED = ("tenant", "user", "rule_id", "action", "finish_reason", "request_id", "audit_id", "match")
HASHED_IDS = ("user", "request_id")  # chosen by clients: indexed by their keyed hash
# Indexed fields that no record written before the officers' console holds, so a chain
# written before verifies unchanged: `kind` (review, hold, rules, read), `subject` (the
# audit id a review is about), `reader` (the key of an access record).
LATER_INDEXED = ("kind", "subject", "reader")
FETCH = 100  # records per Redis round trip when reading

APPEND_SECONDS = Histogram("finsieve_audit_append_seconds", "Audit record appends",
                           buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5))

# KEYS: head, the new record, the guard (the record this writer acknowledged last), then the
# time index and the record's field indexes. ARGV: the head's HMAC it was sealed against,
# seq, the record, its HMAC, ts_ms, head signature, index member, and the SHA-1 of the
# guard's stored bytes ('': no guard). Refuses when the guard is not what this writer
# stored (-2: a failover lost it), when the head moved (0) or when the record already
# exists (-1: the head was rewound; never overwrite).
_APPEND = """
if ARGV[8] ~= '' and redis.sha1hex(redis.call('GET', KEYS[3]) or '') ~= ARGV[8] then return -2 end
local head = redis.call('HMGET', KEYS[1], 'seq', 'hmac')
local seq = tonumber(head[1]) or 0
if (head[2] or '') ~= ARGV[1] or seq + 1 ~= tonumber(ARGV[2]) then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'hmac', ARGV[4], 'sig', ARGV[6])
for i = 4, #KEYS do redis.call('ZADD', KEYS[i], ARGV[5], ARGV[7]) end
return 1
"""

# A checkpoint only moves forward, whichever gateway trims first.
_CHECKPOINT = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, old = pcall(cjson.decode, cur)
  if not ok or type(old) ~= 'table' or not tonumber(old['through']) then return -1 end
  if tonumber(old['through']) >= tonumber(ARGV[1]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""


class AuditError(RuntimeError):
    """The audit trail could not be written (Redis down, contention, a rewound head)."""


class GuardLost(AuditError):
    """The record this writer acknowledged last is no longer in Redis as it was written."""


def record_key(seq: int) -> str:
    return f"{TAG}:rec:{seq}"


def index_key(field: str, value: str) -> str:
    return f"{INDEX_PREFIX}{field}:{value}"


def restored_key(seq: int, mac: str) -> str:
    """The index of the `restored` records that carry the record (seq, mac)."""
    return index_key("restored", f"{seq}:{mac}")


def derive_key(key: bytes, purpose: str) -> bytes:
    """A key for one purpose (head, anchors, checkpoints, cache, value hashes) from the
    audit key, so no MAC made for one purpose is valid for another."""
    return hmac.new(key, f"finsieve/{purpose}/v1".encode(), hashlib.sha256).digest()


def id_hash(key: bytes, field: str, value: str) -> str:
    """The keyed hash a client-chosen id is indexed and queried by (key: the audit key).
    Exact (a user id is not a card number to canonicalize), one per field."""
    return hmac.new(derive_key(key, "index"), f"{field}\0{value}".encode(),
                    hashlib.sha256).hexdigest()[:32]


def canonical(record: dict[str, Any], without: str = "hmac") -> bytes:
    """The bytes a MAC covers: sorted keys, no spaces, UTF-8, without the MAC itself."""
    body = {k: v for k, v in record.items() if k != without}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def seal(key: bytes, record: dict[str, Any], without: str = "hmac") -> str:
    return hmac.new(key, canonical(record, without), hashlib.sha256).hexdigest()


def sealed_ok(key: bytes, record: dict[str, Any], field: str = "hmac") -> bool:
    mac = record.get(field)
    return isinstance(mac, str) and hmac.compare_digest(mac, seal(key, record, field))


def head_sig(key: bytes, seq: int, mac: str) -> str:
    return hmac.new(derive_key(key, "head"), f"{seq}:{mac}".encode(), hashlib.sha256).hexdigest()


def stored(record: dict[str, Any]) -> str:
    """How a record is stored and exported: its canonical JSON with the HMAC."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def index_values(record: dict[str, Any]) -> list[tuple[str, str]]:
    """The (field, value) indexes a record belongs to. A `restored` record (one lost from
    Redis and appended again inside a new record) is in those of the record it carries,
    and in the index of that record's seq and HMAC."""
    inner = record.get("restored")
    if record.get("type") == "restored" and isinstance(inner, dict) and inner.get("type") != "restored":
        return sorted({*index_values(inner), ("restored", f"{inner.get('seq')}:{inner.get('hmac')}")})
    hashed = record.get("id_hashes")
    hashed = hashed if isinstance(hashed, dict) else {}
    values = [(f, str(hashed[f]) if f in HASHED_IDS and f in hashed else str(record[f]))
              for f in ("tenant", "user", "finish_reason", "request_id", "audit_id")
              if record.get(f)]
    for i in record.get("interventions") or []:
        if isinstance(i, dict):  # proto JSON omits an empty rule_id
            values += [(f, str(i[f])) for f in ("rule_id", "action") if i.get(f)]
    values += [("match", str(h)) for h in record.get("match_hashes") or []]
    values += [(f, str(record[f])) for f in LATER_INDEXED if record.get(f)]
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
    audit_id: str = ""
    match: str = ""  # the keyed hash of a value (never the value)

    def index(self) -> str:
        """The most selective index the filters allow."""
        for field in ("audit_id", "request_id", "match", "rule_id", "user", "action",
                      "finish_reason", "tenant"):
            if getattr(self, field):
                return index_key(field, getattr(self, field))
        return TIME

    def accepts(self, record: dict[str, Any]) -> bool:
        have = set(index_values(record))
        return all(not getattr(self, f) or (f, getattr(self, f)) in have for f in INDEXED)


@dataclass(frozen=True)
class Cursor:
    """Where a page of a query starts in its index: at time `score`, past the first `skip`
    entries of that millisecond; `until` is fixed by the first page."""

    score: int
    skip: int
    until: int

    def past(self, score: int) -> Cursor:
        """The cursor just past an entry at `score` read from here."""
        return Cursor(score, self.skip + 1 if score == self.score else 1, self.until)

    def token(self) -> str:
        return f"{self.score}.{self.skip}.{self.until}"

    @classmethod
    def parse(cls, token: str) -> Cursor | None:
        parts = token.split(".")
        if len(parts) != 3 or not all(p.isdigit() and len(p) < 20 for p in parts):
            return None
        return cls(*map(int, parts))


@dataclass(frozen=True)
class Head:
    seq: int
    hmac: str
    sig: str


@dataclass(frozen=True)
class Checkpoint:
    """Records up to `through` were deleted; the first kept one links to `last_hmac`."""

    through: int
    last_hmac: str
    ts_ms: int


def now_ms() -> int:
    return int(time.time() * 1000)


class AuditLog:
    def __init__(self, client: Client, key: bytes, *, wait_replicas: int = 0,
                 waitaof_local: bool = False, wait_timeout_ms: int = 1000,
                 clock_ms: Callable[[], int] = now_ms) -> None:
        self.redis = client
        self.key = key
        self.wait_replicas = wait_replicas
        self.waitaof_local = waitaof_local
        self.wait_timeout_ms = wait_timeout_ms
        self.clock_ms = clock_ms  # only the records' ts_ms; never which records are trimmed
        self._checkpoint_key = derive_key(key, "checkpoint")
        self._append = client.register_script(_APPEND)
        self._set_checkpoint = client.register_script(_CHECKPOINT)
        self._primary = SlotPrimary(client)  # the node that takes the chain's writes
        # Appends of one process queue here instead of racing for the head; only appends
        # from other gateway processes can make the compare-and-set retry.
        self._lock = asyncio.Lock()
        self.last: tuple[int, str] | None = None  # newest (seq, hmac) this process appended
        # (seq, SHA-1 of its stored bytes) of a record every append first checks is still in
        # Redis as written (None: no check); see DurableAuditLog.
        self.guard: tuple[int, str] | None = None

    # -- writing ------------------------------------------------------------------------

    async def append(self, kind: str, body: dict[str, Any], deadline_s: float = 10.0,
                     ids: dict[str, str] | None = None) -> int:
        """Seal and append one record; returns its sequence number. Raises AuditError,
        within about deadline_s (waiting for the appends before it included).
        `ids`: client-chosen ids as sent (HASHED_IDS), which body holds masked: indexed by
        their keyed hash."""
        if ids:
            body = {**body, "id_hashes": {f: id_hash(self.key, f, v) for f, v in sorted(ids.items())
                                          if f in HASHED_IDS and v}}
        deadline = time.monotonic() + deadline_s
        async with self.locked(deadline_s):
            with APPEND_SECONDS.time():
                record = await self._append_record(kind, body, deadline)
            self.last = (record["seq"], record["hmac"])
            return record["seq"]

    @asynccontextmanager
    async def locked(self, timeout_s: float) -> AsyncIterator[None]:
        """This process's appends, one at a time; AuditError if the lock is not had within
        timeout_s (a recovery holds it while it re-appends lost records)."""
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout_s)
        except TimeoutError:
            raise AuditError(f"audit append refused: the trail was busy for {timeout_s:g} s "
                             "(restoring records lost from Redis, or Redis slow)") from None
        try:
            yield
        finally:
            self._lock.release()

    async def _append_record(self, kind: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Append one record (the lock held); the subclass adds what acknowledging it takes."""
        return await self._append_unlocked(kind, body, deadline)

    async def _append_unlocked(self, kind: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        try:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                for attempt in itertools.count():
                    head = await self.head()
                    if head.seq < 0:
                        raise AuditError("audit append refused: the chain head is not readable; run "
                                         "`finsieve audit verify`")
                    record = {**body, "seq": head.seq + 1, "prev": head.hmac, "type": kind,
                              "ts_ms": self.clock_ms()}
                    record["hmac"] = seal(self.key, record)
                    if await self._store(record) == 1:
                        return record
                    if time.monotonic() > deadline:
                        break
                    # Another gateway appended first: back off with jitter, so none starves.
                    await asyncio.sleep(random.uniform(0, min(0.05, 0.0005 * 2**attempt)))
        except TimeoutError:
            raise AuditError("audit append failed: Redis did not answer in time") from None
        except ERRORS as e:
            raise AuditError(f"audit append failed: {type(e).__name__}: {e}") from None
        raise AuditError("audit append failed: the chain head kept moving (contention)")

    async def _store(self, record: dict[str, Any]) -> int:
        """Write a sealed record if the head is still the one it links to: 1 once it is
        acknowledged as the settings ask, 0 if the head moved. Raises GuardLost, and
        AuditError when the record exists already or was not acknowledged in time."""
        seq, mac = record["seq"], record["hmac"]
        guard_seq, guard_sha = self.guard or (seq, "")
        keys = [HEAD, record_key(seq), record_key(guard_seq), TIME,
                *(index_key(f, v) for f, v in index_values(record))]
        args = [record["prev"], seq, stored(record), mac, record["ts_ms"],
                head_sig(self.key, seq, mac), index_member(seq), guard_sha]
        done, acks = await self._run_append(keys, args)
        if done == -2:
            raise GuardLost(f"audit record {guard_seq}, acknowledged by this process, is no longer "
                            "in Redis as written (a failover lost it?)")
        if done == -1:
            if await self.redis.get(record_key(seq)) == args[2].encode():
                # redis-py sent the script again after a connection failed: the first landed.
                raise AuditError(f"audit record {seq} was written, but its reply was lost with "
                                 "the connection: not acknowledged")
            raise AuditError(f"audit append refused: record {seq} already exists, so the "
                             "chain head was rewound; run `finsieve audit verify`")
        if done == 1 and not self._acknowledged(acks):
            raise AuditError(f"audit record {seq} {self._acks_said(acks)}")
        return done

    async def _run_append(self, keys: list[str], args: list[Any]) -> tuple[int, Any]:
        """The append script's answer, and what WAIT or WAITAOF answered after it. Both go
        on one connection to the node that took the write (a pipeline; on a Cluster, to the
        slot's primary: SlotPrimary). Without either, one round trip, as a pipeline holding
        a script asks Redis whether it has the script first."""
        writer = self._primary.for_key(HEAD)
        if not self.wait_replicas and not self.waitaof_local:
            return await self._append(keys=keys, args=args, client=writer), None
        async with writer.pipeline(transaction=False) as pipe:
            await self._append(keys=keys, args=args, client=pipe)
            if self.waitaof_local:
                pipe.waitaof(1, self.wait_replicas, self.wait_timeout_ms)
            else:
                pipe.wait(self.wait_replicas, self.wait_timeout_ms)
            done, acks = await pipe.execute()
        return done, acks

    def _acknowledged(self, acks: Any) -> bool:
        if self.waitaof_local:  # [1 if the primary fsynced its AOF, replicas that fsynced]
            return int(acks[0]) >= 1 and int(acks[1]) >= self.wait_replicas
        return acks is None or int(acks) >= self.wait_replicas

    def _acks_said(self, acks: Any) -> str:
        if self.waitaof_local:
            return (f"was not fsynced within {self.wait_timeout_ms} ms: the primary "
                    f"{'did' if int(acks[0]) else 'did not'}, {int(acks[1])} of "
                    f"{self.wait_replicas} replicas did (FINSIEVE_AUDIT_WAITAOF_LOCAL, "
                    "FINSIEVE_AUDIT_WAIT_REPLICAS)")
        return (f"reached {int(acks)} of {self.wait_replicas} replicas within "
                f"{self.wait_timeout_ms} ms (FINSIEVE_AUDIT_WAIT_REPLICAS)")

    async def aclose(self) -> None:
        """Close the connections of its own (a Cluster's pinned primaries); not the client's."""
        await self._primary.aclose()

    async def head(self) -> Head:
        seq, mac, sig = cast("list[bytes | None]", await self.redis.hmget(HEAD, "seq", "hmac", "sig"))
        try:
            number = int(seq or 0)
        except ValueError:
            number = -1  # not a number: nothing links to it, verify reports it
        return Head(number, (mac or b"").decode(errors="replace"), (sig or b"").decode(errors="replace"))

    # -- reading ------------------------------------------------------------------------

    async def get(self, seq: int) -> dict[str, Any] | None:
        raw = await self.redis.get(record_key(seq))
        return parse(raw)

    async def query(self, f: Filters, limit: int = 50, cursor: Cursor | None = None,
                    max_bytes: int = 4 << 20) -> tuple[list[dict[str, Any]], Cursor | None]:
        """Records matching the filters, oldest first, at most `limit` of them and about
        `max_bytes` (always at least one); and where the next page starts (None: done).
        Each page costs O(log n) in the index, however deep into it the page is."""
        cur = cursor or Cursor(f.since_ms, 0, f.until_ms or now_ms())
        out: list[dict[str, Any]] = []
        size = 0
        while True:
            entries = cast("list[tuple[bytes, float]]", await self.redis.zrangebyscore(
                f.index(), cur.score, cur.until, start=cur.skip, num=FETCH, withscores=True))
            if not entries:
                return out, None
            raws = cast("list[bytes | None]", await self.redis.mget(
                [record_key(int(m)) if m.isdigit() else "-" for m, _ in entries]))
            for (_, score), raw in zip(entries, raws, strict=True):
                after = cur.past(int(score))
                rec = parse(raw)
                if raw is not None and rec is not None and f.accepts(rec):  # parse(None) is None
                    if out and size + len(raw) > max_bytes:
                        return out, cur
                    out.append(rec)
                    size += len(raw)
                cur = after
                if len(out) == limit:
                    return out, cur

    async def export(self, f: Filters, page: int = 500, max_bytes: int = 4 << 20
                     ) -> AsyncIterator[list[dict[str, Any]]]:
        """Every matching record, in pages bounded by count and bytes."""
        cursor: Cursor | None = None
        while True:
            records, cursor = await self.query(f, page, cursor, max_bytes)
            if records:
                yield records
            if cursor is None:
                return

    async def records(self, first: int, last: int) -> AsyncIterator[tuple[int, bytes | None]]:
        """(seq, stored bytes or None) for every seq from first to last, FETCH at a time."""
        for start in range(first, last + 1, FETCH):
            chunk = list(range(start, min(start + FETCH, last + 1)))
            raws = cast("list[bytes | None]", await self.redis.mget([record_key(s) for s in chunk]))
            for item in zip(chunk, raws, strict=True):
                yield item

    # -- retention ------------------------------------------------------------------------

    async def checkpoint(self) -> Checkpoint | None:
        """The signed retention checkpoint, None if nothing was ever trimmed.
        Raises AuditError if it is there but not signed with this key."""
        raw = await self.redis.get(CHECKPOINT)
        if raw is None:
            return None
        cp = parse(raw)
        if cp is None or not sealed_ok(self._checkpoint_key, cp, "sig") or not isinstance(
                cp.get("through"), int) or not isinstance(cp.get("last_hmac"), str):
            raise AuditError("the retention checkpoint was altered: its signature does not match")
        return Checkpoint(cp["through"], cp["last_hmac"], cp.get("ts_ms", 0))

    async def trim(self, before_ms: int) -> int:
        """Delete the oldest records, by sequence, up to the first one written at or after
        before_ms, behind a signed checkpoint; returns how many. The records trimmed are
        verified first: a broken chain is never hidden behind a checkpoint."""
        cp = await self.checkpoint()
        first = cp.through + 1 if cp else 1
        prev = cp.last_hmac if cp else ""
        cut = first
        async for seq, raw in self.records(first, (await self.head()).seq):
            rec = parse(raw)
            if rec is None or rec.get("seq") != seq or rec.get("prev") != prev \
                    or not sealed_ok(self.key, rec):
                raise AuditError(f"not trimming: record {seq} does not verify "
                                 "(run `finsieve audit verify`)")
            if not isinstance(rec.get("ts_ms"), int) or rec["ts_ms"] >= before_ms:
                break
            prev, cut = rec["hmac"], seq + 1
        if cut == first:
            return 0
        checkpoint = {"type": "checkpoint", "through": cut - 1, "last_hmac": prev,
                      "ts_ms": self.clock_ms()}
        checkpoint["sig"] = seal(self._checkpoint_key, checkpoint, "sig")
        if await self._set_checkpoint(keys=[CHECKPOINT], args=[cut - 1, stored(checkpoint)]) == -1:
            raise AuditError("not trimming: the retention checkpoint is not readable")
        for start in range(first, cut, FETCH):
            chunk = list(range(start, min(start + FETCH, cut)))
            raws = cast("list[bytes | None]", await self.redis.mget([record_key(s) for s in chunk]))
            async with self.redis.pipeline(transaction=True) as pipe:
                for seq, raw in zip(chunk, raws, strict=True):
                    pipe.delete(record_key(seq))
                    pipe.zrem(TIME, index_member(seq), seq)
                    for field, value in index_values(parse(raw) or {}):
                        pipe.zrem(index_key(field, value), index_member(seq), seq)
                await pipe.execute()
        return cut - first


def index_member(seq: int) -> str:
    """A record's member in the indexes: zero-padded, because a sorted set orders the
    records of one millisecond by member, as strings ("10" before "9"); plain numbers,
    written before, are still read and checked."""
    return f"{seq:020d}"


def parse(raw: bytes | str | None) -> dict[str, Any] | None:
    """A stored record, or None when it is absent or not a JSON object (Redis is untrusted)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None
