"""Reading the trail for the console: newest first, through the trail's own indexes, every
page bounded in rows, bytes and time.

`AuditLog.query` pages oldest first (what an export wants); a console reads the newest
first. A page walks one index, or several merged (the review queue reads the index of each
action), backwards in time, `BATCH` entries and their records a round trip (a script:
Python packs no key and receives no record the page skips), and resumes at `Back`: entries
older than (time, seq) of the last one it looked at, so a page costs O(log n) in the index
however deep it is. A page cut short by its time bound says so and where to go on.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from gateway.audit import INDEXED, TAG, AuditLog, Filters, index_key, parse, record_key, sealed_ok

BATCH = 500  # index entries, and records, per round trip
# A record of this type is the conversation a row stands for: the final record of a
# request (a cache hit's one record included).
REQUEST = "request"
# The raw bytes of every request record hold this (canonical JSON: sorted keys, no spaces;
# inside a string the quotes would be escaped): records without it are not parsed.
REQUEST_MARK = b'"type":"request"'

# A stored record's own HMAC member (see `sealed_bytes`).
HMAC_MEMBER = re.compile(rb'"hmac":"([0-9a-f]{64})",')

# Entries of one index, newest first, with their records: KEYS[1] the index; ARGV the top
# score, the lowest, how many entries at the top to skip, how many to read, the records' key
# prefix, and a byte string a record must hold to be sent ("": any). A flat array of member,
# score and record ("" when gone or without the mark): the keys of the records share the
# index's hash tag, so on a Redis Cluster they live on its node.
FETCH = """
local entries = redis.call('ZREVRANGEBYSCORE', KEYS[1], ARGV[1], ARGV[2], 'WITHSCORES',
                           'LIMIT', ARGV[3], ARGV[4])
local out = {}
for i = 1, #entries, 2 do
  local seq = tonumber(entries[i])
  local raw = seq and redis.call('GET', ARGV[5] .. string.format('%d', seq)) or false
  if not raw or (ARGV[6] ~= '' and not string.find(raw, ARGV[6], 1, true)) then raw = '' end
  out[#out + 1] = entries[i]
  out[#out + 1] = entries[i + 1]
  out[#out + 1] = raw
end
return out
"""
Entry = tuple[int, int, bytes]  # (time, seq, stored bytes)

# The newest entry of each index named (KEYS), "" for an empty one: one round trip for the
# review status of a whole page.
_NEWEST = """
local out = {}
for i = 1, #KEYS do
  local top = redis.call('ZREVRANGE', KEYS[i], 0, 0)
  out[i] = top[1] or ''
end
return out
"""


@dataclass(frozen=True)
class Back:
    """Where a newest-first page resumes: entries older than (score, seq)."""

    score: int
    seq: int

    def token(self) -> str:
        return f"{self.score}.{self.seq}"

    @classmethod
    def parse(cls, token: str) -> Back | None:
        parts = token.split(".")
        if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) < 20 for p in parts):
            return None
        return cls(int(parts[0]), int(parts[1]))


class _Index:
    """One sorted-set index read backwards from `until` (or a cursor) down to `since`, its
    records fetched with it (FETCH: one round trip per BATCH entries). The next batch is
    asked for as soon as one arrives, so Redis reads it while this process parses."""

    def __init__(self, log: AuditLog, key: str, since: int, until: int, after: Back | None,
                 mark: bytes | None) -> None:
        self.fetch = log.redis.register_script(FETCH)
        self.key, self.since, self.mark = key, since, mark or b""
        self.top = after.score if after else until  # inclusive
        self.skip = 0  # entries at `top` already read
        self.after = (after.score, after.seq) if after else None
        self.buf: deque[Entry] = deque()
        self.done = False
        self.next: asyncio.Task[list[bytes]] | None = None

    async def peek(self) -> Entry | None:
        while not self.buf and not self.done:
            flat = await (self.next or self._ask())
            self.next = None
            self._take(flat)
            if not self.done:
                self.next = asyncio.ensure_future(self._ask())
        return self.buf[0] if self.buf else None

    def close(self) -> None:
        """Drop the batch asked for ahead (read, its failure too: nobody waits for it)."""
        if self.next is not None:
            self.next.cancel()
            if self.next.done() and not self.next.cancelled():
                self.next.exception()

    async def _ask(self) -> list[bytes]:
        return cast("list[bytes]", await self.fetch(
            keys=[self.key], args=[self.top, self.since, self.skip, BATCH, f"{TAG}:rec:", self.mark]))

    def _take(self, flat: list[bytes]) -> None:
        self.done = len(flat) < 3 * BATCH
        for i in range(0, len(flat), 3):
            member, score = flat[i], int(float(flat[i + 1]))
            if score == self.top:
                self.skip += 1
            else:
                self.top, self.skip = score, 1
            if member.isdigit() and (self.after is None or (score, int(member)) < self.after):
                self.buf.append((score, int(member), flat[i + 2]))


async def newest(log: AuditLog, keys: list[str], since: int, until: int, after: Back | None = None,
                 mark: bytes | None = None) -> AsyncGenerator[Entry, None]:
    """(time, seq, stored bytes) of every entry of the indexes, newest first, each seq once;
    the bytes are b"" for a record that is gone or lacks `mark`."""
    indexes = [_Index(log, k, since, until, after, mark) for k in keys]
    try:
        if len(indexes) == 1:  # one index: its entries in its own order
            (index,) = indexes
            while await index.peek() is not None:
                while index.buf:
                    yield index.buf.popleft()
            return
        last = -1
        while True:
            best: _Index | None = None
            best_entry: Entry | None = None
            for index in indexes:
                entry = await index.peek()
                if entry is not None and (best_entry is None or entry[:2] > best_entry[:2]):
                    best, best_entry = index, entry
            if best is None or best_entry is None:
                return
            best.buf.popleft()
            if best_entry[1] != last:  # one record in two indexes: adjacent (one time, one seq)
                yield best_entry
                last = best_entry[1]
    finally:
        for index in indexes:
            index.close()


@dataclass
class Page:
    records: list[dict[str, Any]] = field(default_factory=list)
    more: Back | None = None  # where the next page starts; None: nothing older
    stopped: bool = False  # cut short by the time or byte bound, not by the row count
    examined: int = 0
    sealed: dict[int, bool] = field(default_factory=dict)  # seq: its stored bytes' HMAC matches
    size: int = 0  # stored bytes of its records


def sealed_bytes(key: bytes, raw: bytes) -> bool:
    """A request record's seal, checked on its stored bytes without parsing them again: the
    trail stores a record as its canonical JSON with the HMAC member added (`audit.stored`),
    so the bytes less that member are the bytes the HMAC covers. The first member named
    hmac is the record's own: keys are sorted, and none before it (app, audit_id,
    cache_hit, delivered, error, finish_reason) holds a key a client chose. Bytes stored any
    other way fail the check; it never passes a record whose HMAC does not match."""
    found = HMAC_MEMBER.search(raw)
    if found is None:
        return False
    mac = hmac.new(key, raw[:found.start()] + raw[found.end():], hashlib.sha256).hexdigest()
    return hmac.compare_digest(mac.encode(), found.group(1))


Want = Callable[[dict[str, Any]], bool]


def load(raw: bytes) -> dict[str, Any] | None:
    """A stored record, parsed by orjson (a page may hold 10,000: it parses them in a third
    of the time); what orjson refuses and the standard parser takes (an integer past 64
    bits, NaN) is parsed as `audit.parse` does, so a page shows what `audit show` shows."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return parse(raw)
    return value if isinstance(value, dict) else None


async def read_page(log: AuditLog, keys: list[str], filters: Filters, limit: int,
                    after: Back | None, deadline: float, max_bytes: int,
                    want: Want | None = None, mark: bytes | None = REQUEST_MARK) -> Page:
    """Up to `limit` records of the indexes that the filters accept and `want` wants,
    newest first. Records whose stored bytes lack `mark` are skipped in Redis, unsent."""
    until = filters.until_ms or int(time.time() * 1000)
    page = Page()
    # The index read holds one filter's records; the others are checked on each record.
    check = any(getattr(filters, f) for f in INDEXED)
    async with aclosing(newest(log, keys, filters.since_ms, until, after, mark)) as entries:
        async for score, seq, raw in entries:
            if _add(page, log.key, filters, check, want, score, seq, raw) and (
                    len(page.records) >= limit or page.size >= max_bytes):
                page.stopped = page.size >= max_bytes and len(page.records) < limit
                return page
            if page.examined % BATCH == 0 and time.monotonic() > deadline:
                page.stopped = True
                return page
    page.more = None  # the indexes are exhausted
    return page


def _add(page: Page, key: bytes, filters: Filters, check: bool, want: Want | None,
               score: int, seq: int, raw: bytes) -> bool:
    """Look at one entry; True if its record joins the page."""
    page.examined += 1
    page.more = Back(score, seq)
    rec = load(raw) if raw else None
    if rec is None or rec.get("seq") != seq or (check and not filters.accepts(rec)) \
            or (want is not None and not want(rec)):
        return False
    page.records.append(rec)
    page.sealed[seq] = sealed_bytes(key, raw)
    page.size += len(raw)
    return True


def is_request(rec: dict[str, Any]) -> bool:
    return rec.get("type") == REQUEST


def audit_id_of(rec: dict[str, Any]) -> int:
    """The audit id a conversation is known by: its request_started record's seq (a cache
    hit has one record, its own)."""
    value = rec.get("audit_id")
    return value if isinstance(value, int) and value > 0 else int(rec["seq"])


async def newest_of(log: AuditLog, field_name: str, values: list[str]) -> list[dict[str, Any] | None]:
    """For each value, the newest record of the index `field_name:value` (sealed), or None."""
    if not values:
        return []
    script = log.redis.register_script(_NEWEST)
    tops = cast("list[bytes]", await script(keys=[index_key(field_name, v) for v in values]))
    seqs = [int(t) if t.isdigit() else 0 for t in tops]
    found = await _sealed(log, [s for s in seqs if s])
    return [found.get(s) for s in seqs]


async def all_of(log: AuditLog, field_name: str, value: str, limit: int) -> list[dict[str, Any]]:
    """Every sealed record of one index, oldest first, at most `limit` (the newest ones)."""
    members = cast("list[bytes]", await log.redis.zrange(index_key(field_name, value), -limit, -1))
    found = await _sealed(log, [int(m) for m in members if m.isdigit()])
    return list(found.values())


async def _sealed(log: AuditLog, seqs: list[int]) -> dict[int, dict[str, Any]]:
    """The records of these seqs that are whole and sealed with the trail's key, by seq, in
    the order given; BATCH a read."""
    found: dict[int, dict[str, Any]] = {}
    for start in range(0, len(seqs), BATCH):
        part = seqs[start:start + BATCH]
        raws = cast("list[bytes | None]", await log.redis.mget([record_key(s) for s in part]))
        for seq, raw in zip(part, raws, strict=True):
            rec = parse(raw)
            if rec is not None and rec.get("seq") == seq and sealed_ok(log.key, rec):
                found[seq] = rec
    return found
