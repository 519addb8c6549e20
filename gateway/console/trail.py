"""Reading the trail for the console: newest first, through the trail's own indexes, every
page bounded in rows, bytes and time.

`AuditLog.query` pages oldest first (what an export wants); a console reads the newest
first. A page walks one index, or several merged (the review queue reads the index of each
action), backwards in time, `BATCH` entries a round trip, and resumes at `Back`: entries
older than (time, seq) of the last one it looked at, so a page costs O(log n) in the index
however deep it is. A page cut short by its time bound says so and where to go on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as redis

from gateway.audit import AuditLog, Filters, index_key, parse, record_key, sealed_ok

BATCH = 500  # index entries, and records, per round trip
# A record of this type is the conversation a row stands for: the final record of a
# request (a cache hit's one record included).
REQUEST = "request"
# The raw bytes of every request record hold this (canonical JSON: sorted keys, no spaces;
# inside a string the quotes would be escaped): records without it are not parsed.
REQUEST_MARK = b'"type":"request"'

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
    """One sorted-set index read backwards from `until` (or a cursor) down to `since`."""

    def __init__(self, client: redis.Redis, key: str, since: int, until: int,
                 after: Back | None) -> None:
        self.client, self.key, self.since = client, key, since
        self.top = after.score if after else until  # inclusive
        self.skip = 0  # entries at `top` already read
        self.after = after
        self.buf: deque[tuple[int, int]] = deque()
        self.done = False

    async def peek(self) -> tuple[int, int] | None:
        while not self.buf and not self.done:
            await self._fill()
        return self.buf[0] if self.buf else None

    async def _fill(self) -> None:
        entries = cast("list[tuple[bytes, float]]", await self.client.zrevrangebyscore(
            self.key, self.top, self.since, start=self.skip, num=BATCH, withscores=True))
        self.done = len(entries) < BATCH
        for member, raw_score in entries:
            score = int(raw_score)
            if score == self.top:
                self.skip += 1
            else:
                self.top, self.skip = score, 1
            if not member.isdigit():
                continue
            entry = (score, int(member))
            if self.after is None or entry < (self.after.score, self.after.seq):
                self.buf.append(entry)


async def newest(client: redis.Redis, keys: list[str], since: int, until: int,
                 after: Back | None = None) -> AsyncIterator[tuple[int, int]]:
    """(time, seq) of every entry of the indexes, newest first, each seq once."""
    indexes = [_Index(client, k, since, until, after) for k in keys]
    last: tuple[int, int] | None = None
    while True:
        best: _Index | None = None
        best_entry: tuple[int, int] | None = None
        for index in indexes:
            entry = await index.peek()
            if entry is not None and (best_entry is None or entry > best_entry):
                best, best_entry = index, entry
        if best is None or best_entry is None:
            return
        best.buf.popleft()
        if best_entry != last:  # one record in two indexes: adjacent, as its (time, seq) is one
            yield best_entry
            last = best_entry


@dataclass
class Page:
    records: list[dict[str, Any]] = field(default_factory=list)
    more: Back | None = None  # where the next page starts; None: nothing older
    stopped: bool = False  # cut short by the time or byte bound, not by the row count
    examined: int = 0


Want = Callable[[dict[str, Any]], bool]


async def read_page(log: AuditLog, keys: list[str], filters: Filters, limit: int,
                    after: Back | None, deadline: float, max_bytes: int,
                    want: Want | None = None, mark: bytes | None = REQUEST_MARK) -> Page:
    """Up to `limit` records of the indexes that the filters accept and `want` wants,
    newest first. Records whose raw bytes lack `mark` are skipped unparsed."""
    until = filters.until_ms or int(time.time() * 1000)
    page, size = Page(), 0
    chunk: list[tuple[int, int]] = []
    entries = newest(log.redis, keys, filters.since_ms, until, after)

    async def take() -> bool:
        """Read the chunk's records; True when the page is full."""
        nonlocal size
        raws = cast("list[bytes | None]", await log.redis.mget([record_key(s) for _, s in chunk]))
        for (score, seq), raw in zip(chunk, raws, strict=True):
            page.examined += 1
            page.more = Back(score, seq)
            if raw is None or (mark is not None and mark not in raw):
                continue
            rec = parse(raw)
            if rec is None or rec.get("seq") != seq or not filters.accepts(rec) \
                    or (want is not None and not want(rec)):
                continue
            page.records.append(rec)
            size += len(raw)
            if len(page.records) >= limit or size >= max_bytes:
                page.stopped = size >= max_bytes and len(page.records) < limit
                return True
        return False

    async for entry in entries:
        chunk.append(entry)
        if len(chunk) < BATCH:
            continue
        if await take():
            return page
        chunk = []
        if time.monotonic() > deadline:
            page.stopped = True
            return page
    if chunk and await take():
        return page
    page.more = None  # the index is exhausted
    return page


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
    wanted = [s for s in seqs if s]
    found: dict[int, dict[str, Any]] = {}
    for start in range(0, len(wanted), BATCH):
        part = wanted[start:start + BATCH]
        raws = cast("list[bytes | None]", await log.redis.mget([record_key(s) for s in part]))
        for seq, raw in zip(part, raws, strict=True):
            rec = parse(raw)
            if rec is not None and rec.get("seq") == seq and sealed_ok(log.key, rec):
                found[seq] = rec
    return [found.get(s) for s in seqs]


async def all_of(log: AuditLog, field_name: str, value: str, limit: int) -> list[dict[str, Any]]:
    """Every sealed record of one index, oldest first, at most `limit` (the newest ones)."""
    members = cast("list[bytes]", await log.redis.zrange(index_key(field_name, value), -limit, -1))
    seqs = [int(m) for m in members if m.isdigit()]
    out: list[dict[str, Any]] = []
    for start in range(0, len(seqs), BATCH):
        part = seqs[start:start + BATCH]
        raws = cast("list[bytes | None]", await log.redis.mget([record_key(s) for s in part]))
        for seq, raw in zip(part, raws, strict=True):
            rec = parse(raw)
            if rec is not None and rec.get("seq") == seq and sealed_ok(log.key, rec):
                out.append(rec)
    return out
