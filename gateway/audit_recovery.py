"""Acknowledged audit records that a Redis failover lost, appended again from the spool.

Redis replicates asynchronously: a primary that dies takes with it the writes its replicas
had not received, acknowledged or not (WAIT and WAITAOF narrow that window: a record is
acknowledged only once replicas have it; they cannot close it for a record whose WAIT
timed out, which is refused yet may survive). So a DurableAuditLog acknowledges a record
only once it is also in the local spool (spool.py), and keeps the newest record it
acknowledged as its guard: every append's script first checks that the guard is still in
Redis as written, and while no append runs a periodic check does the same. When it is
not, the process recovers, holding its append lock (appends wait for it, bounded):

- every spooled record whose HMAC verifies, above the retention checkpoint, is looked up:
  it is there as written (same seq and HMAC), or a `restored` record carries it, or it is
  missing;
- a missing record whose `prev` is the head's HMAC (it is the next seq) is appended again
  as it was, same seq and HMAC, so the anchors that name it still match;
- any other (another gateway appended on the rewound head meanwhile) is appended inside a
  new record of type `restored`, sealed into the chain; `audit verify` accepts an anchor
  that names the record it carries, and reports how many records were restored.

A spool line is not trusted: one whose HMAC does not verify is skipped and counted, so a
spool file cannot inject a record; only whoever holds the audit key can seal one.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time
from pathlib import Path

# cast: connect()'s clients return bytes (decode_responses off); redis-py types replies bytes | str.
from typing import Any, cast

import structlog
from prometheus_client import Counter

from finsieve import supervise
from finsieve.config import Settings
from finsieve.valkey import ERRORS, Client

from .audit import (
    FETCH,
    AuditError,
    AuditLog,
    GuardLost,
    parse,
    record_key,
    restored_key,
    sealed_ok,
    stored,
)
from .spool import Spool, SpoolFull

log = structlog.get_logger(__name__)

RECOVERIES = Counter("finsieve_audit_recoveries",
                     "Checks that found acknowledged audit records missing from Redis, by result",
                     ["result"])
RESTORED = Counter("finsieve_audit_restored",
                   "Audit records appended again from the spool: as_written (same seq and HMAC) or "
                   "inside a `restored` record", ["how"])
REJECTED = Counter("finsieve_audit_spool_rejected",
                   "Spool lines skipped because their record's HMAC does not verify")

CHECK_TIMEOUT_S = 60.0  # a periodic check, recovery included


def guard_of(line: bytes) -> str:
    """What the append script compares a stored record with (Lua's redis.sha1hex)."""
    return hashlib.sha1(line).hexdigest()


class DurableAuditLog(AuditLog):
    """An AuditLog whose acknowledged records survive a failover (see the module's doc)."""

    def __init__(self, client: Client, key: bytes, spool: Spool, writer: str, **kw: Any) -> None:
        super().__init__(client, key, **kw)
        self.spool = spool
        self.writer = writer  # named in the records it restores
        # A recovery that failed part way (Redis failed again): until one completes, every
        # append and check runs it first (the guard then names a restored record, which
        # would not show what is still missing).
        self.unfinished = False
        # The first guard: the newest record acknowledged before a restart (the newest line
        # that verifies, read from the end).
        for path, size in reversed(spool.snapshot()):
            for line in reversed(Spool.read(path, size)):
                for rec, _ in self._verified([line]):
                    self.guard = (rec["seq"], guard_of(line))
                    self.last = (rec["seq"], rec["hmac"])
                    return

    # -- acknowledging --------------------------------------------------------------------

    async def _append_record(self, kind: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        if self.unfinished:
            await self._recover(deadline)
        try:
            record = await self._append_unlocked(kind, body, deadline)
        except GuardLost:
            await self._recover(deadline)
            record = await self._append_unlocked(kind, body, deadline)
        await self._acknowledge(record)
        return record

    async def _acknowledge(self, record: dict[str, Any]) -> None:
        """Spool the record (fsynced), make it the guard and the newest to anchor. Raises
        AuditError."""
        line = stored(record).encode()
        try:
            try:
                await asyncio.to_thread(self.spool.write, line)
            except SpoolFull:  # the records spooled before the guard may go, if it holds
                started = self.spool.clock()
                if await self._guard_holds():
                    await asyncio.to_thread(self.spool.confirmed, started)
                await asyncio.to_thread(self.spool.write, line)
        except ERRORS as e:  # SpoolFull and the spool's other OSErrors included
            raise AuditError(f"audit record {record['seq']} not acknowledged: the spool "
                             f"({self.spool.directory}) refused it: {type(e).__name__}: {e}") from None
        self.guard = (record["seq"], guard_of(line))
        self.last = (record["seq"], record["hmac"])

    # -- checking -------------------------------------------------------------------------

    async def check(self, timeout_s: float = CHECK_TIMEOUT_S) -> int:
        """Whether the newest record this process acknowledged is still in Redis as written;
        if not, restore what is missing. Returns how many records were restored. Raises
        AuditError (Redis unreachable, or a recovery that did not finish in time)."""
        deadline = time.monotonic() + timeout_s
        async with self.locked(timeout_s):
            return await self._check_unlocked(deadline)

    async def _check_unlocked(self, deadline: float) -> int:
        started = self.spool.clock()
        try:
            restored = 0 if await self._guard_holds() else await self._recover(deadline)
        except ERRORS as e:
            raise AuditError(f"audit check failed: {type(e).__name__}: {e}") from None
        await asyncio.to_thread(self.spool.confirmed, started)
        return restored

    async def _guard_holds(self) -> bool:
        if self.unfinished:
            return False
        if self.guard is None:
            return True
        seq, digest = self.guard
        raw = cast("bytes | None", await self.redis.get(record_key(seq)))
        if raw is not None and guard_of(raw) == digest:
            return True
        checkpoint = await self.checkpoint()
        if checkpoint is not None and seq <= checkpoint.through:  # trimmed by retention
            self.guard = None
            return True
        return False

    # -- recovering -----------------------------------------------------------------------

    async def _recover(self, deadline: float) -> int:
        """Append again every spooled record that Redis lost (the lock held)."""
        log.error("audit records this process acknowledged are missing from Redis (a failover?); "
                  "restoring them from the spool", guard_seq=self.guard[0] if self.guard else None)
        self.guard = None  # what it guarded is being restored: appends must not check it
        self.unfinished = True
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                checkpoint = await self.checkpoint()
                through = checkpoint.through if checkpoint else 0
                done: set[tuple[int, str]] = set()
                for path, size in self.spool.snapshot():
                    records = await asyncio.to_thread(self._carried, Spool.read(path, size))
                    for start in range(0, len(records), FETCH):
                        await self._restore_missing(records[start:start + FETCH], through, done,
                                                    deadline)
        except TimeoutError:
            RECOVERIES.labels("failed").inc()
            raise AuditError("restoring lost audit records did not finish in time; the next "
                             "check goes on") from None
        except AuditError as e:
            RECOVERIES.labels("failed").inc()
            raise AuditError(f"restoring lost audit records failed: {e}") from None
        except ERRORS as e:
            RECOVERIES.labels("failed").inc()
            raise AuditError(f"restoring lost audit records failed: {type(e).__name__}: {e}") from None
        self.unfinished = False
        RECOVERIES.labels("done").inc()
        log.warning("audit records restored from the spool", restored=len(done))
        return len(done)

    def _verified(self, lines: list[bytes]) -> list[tuple[dict[str, Any], bytes]]:
        """The spool lines whose record's HMAC verifies (the rest counted and logged)."""
        out = []
        for line in lines:
            rec = parse(line)
            if rec is None or not sealed_ok(self.key, rec) or not isinstance(rec.get("seq"), int):
                REJECTED.inc()
                log.error("audit spool line rejected: its HMAC does not verify",
                          spool=str(self.spool.directory))
                continue
            out.append((rec, line))
        return out

    def _carried(self, lines: list[bytes]) -> list[dict[str, Any]]:
        """The records the spool lines stand for: a `restored` record stands for the one it
        carries (itself restored again if lost again; never nested)."""
        out = []
        for rec, _ in self._verified(lines):
            inner = rec.get("restored")
            if rec.get("type") == "restored":
                if not (isinstance(inner, dict) and sealed_ok(self.key, inner)
                        and isinstance(inner.get("seq"), int)):
                    continue
                rec = inner
            out.append(rec)
        return out

    async def _restore_missing(self, chunk: list[dict[str, Any]], through: int,
                               done: set[tuple[int, str]], deadline: float) -> None:
        todo = [r for r in chunk if r["seq"] > through and (r["seq"], r["hmac"]) not in done]
        if not todo:
            return
        raws = await self.redis.mget([record_key(r["seq"]) for r in todo])
        missing = [r for r, raw in zip(todo, raws, strict=True)
                   if (parse(raw) or {}).get("hmac") != r["hmac"]]
        for r in missing:
            if not await self._carried_in_redis(r):
                await self._restore(r, deadline)
                done.add((r["seq"], r["hmac"]))

    async def _carried_in_redis(self, record: dict[str, Any]) -> bool:
        """Whether a sealed `restored` record in Redis carries `record` (its index entry is
        checked, not trusted: a planted one must not stop a restore)."""
        members = cast("list[bytes]", await self.redis.zrange(
            restored_key(record["seq"], record["hmac"]), 0, 9))
        for member in members:
            wrapper = parse(await self.redis.get(record_key(int(member)))) if member.isdigit() else None
            inner = (wrapper or {}).get("restored")
            if wrapper is not None and wrapper.get("type") == "restored" \
                    and sealed_ok(self.key, wrapper) and isinstance(inner, dict) \
                    and (inner.get("seq"), inner.get("hmac")) == (record["seq"], record["hmac"]):
                return True
        return False

    async def _restore(self, record: dict[str, Any], deadline: float) -> None:
        """As written where it links to the head; otherwise inside a `restored` record."""
        head = await self.head()
        if record["seq"] == head.seq + 1 and record.get("prev") == head.hmac \
                and await self._store(record) == 1:
            await self._acknowledge(record)
            RESTORED.labels("as_written").inc()
            log.warning("audit record restored as written", seq=record["seq"])
            return
        wrapper = await self._append_unlocked("restored", {
            "restored": record, "by": self.writer,
            "reason": "lost from Redis after it was acknowledged (a failover); appended again "
                      "from the spool"}, deadline)
        await self._acknowledge(wrapper)
        RESTORED.labels("inside").inc()
        log.warning("audit record restored inside a new record", seq=record["seq"],
                    restored_as=wrapper["seq"])


class Checking:
    """Checks a DurableAuditLog at start and every `interval_s` (supervised): a gateway
    that appends nothing still finds, and restores, what a failover lost. Nothing to do for
    an AuditLog without a spool."""

    def __init__(self, audit: AuditLog, interval_s: float) -> None:
        self.audit, self.interval_s = audit, interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        audit = self.audit
        if isinstance(audit, DurableAuditLog):
            self._task = supervise.start("audit-check", lambda: self._run(audit))

    async def _run(self, audit: DurableAuditLog) -> None:
        while True:
            try:
                await audit.check()
            except AuditError as e:
                log.warning("audit check failed; trying again", error=str(e),
                            every_s=self.interval_s)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if isinstance(self.audit, DurableAuditLog):
            self.audit.spool.close()


def audit_log(settings: Settings, client: Client, key: bytes, name: str) -> AuditLog:
    """The audit log of one process (`name`: gateway, officers) as the settings ask: with a
    spool in <state dir>/audit-spool/<name> unless FINSIEVE_AUDIT_SPOOL_MAX_RECORDS is 0."""
    kw: dict[str, Any] = {"wait_replicas": settings.audit_wait_replicas,
                          "waitaof_local": settings.audit_waitaof_local,
                          "wait_timeout_ms": settings.audit_wait_timeout_ms}
    if not settings.audit_spool_max_records:
        return AuditLog(client, key, **kw)
    spool = Spool(spool_dir(settings) / name, settings.audit_spool_max_records,
                  settings.audit_spool_max_bytes, settings.audit_spool_keep_s)
    return DurableAuditLog(client, key, spool, f"{socket.gethostname()}/{name}", **kw)


def spool_dir(settings: Settings) -> Path:
    return settings.state_path / "audit-spool"
