"""Privileged calls leave a trace first: every admin action and officer read is an audit
record (who, what, when; never a key). No record, no action: these calls fail closed.

Admin events that no caller waits for (rule packs loaded or rejected by an engine, start and
stop, retention trims) cannot be refused after the fact: `AdminTrail` keeps them, in order,
in a bounded backlog and writes them until each lands; health is NOT_SERVING while any
waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog
from prometheus_client import Gauge

from finsieve import supervise
from finsieve.auth import Principal

from .audit import AuditError, AuditLog

log = structlog.get_logger(__name__)

BACKLOG = Gauge("finsieve_admin_backlog", "Admin audit records waiting to be written (rule "
                "packs loaded or rejected, start, stop): above 0 the trail refuses them")

Health = Callable[[bool], Awaitable[None]]
WRITE_BACKOFF = supervise.Backoff(0.1, 5.0)  # a trail back up is written to within 5 s
# At shutdown, after the drain: how long what waits may take to land (then it is logged as
# lost), so that a trail that is down does not hold the process past its grace period.
FLUSH_AT_SHUTDOWN_S = 5.0


def stamped(kind: str, who: Principal, body: dict[str, Any]) -> dict[str, Any]:
    """`body` naming who acted; an access record is also indexed by its reader (`kind`
    read), so the console finds every officer's reads."""
    by: dict[str, Any] = {"by": who.key_id, "by_tenant": who.tenant, "by_role": who.role}
    if kind == "access":
        by |= {"kind": "read", "reader": who.key_id}
    return {**by, **body}


async def record(audit: AuditLog, context: grpc.aio.ServicerContext, kind: str, who: Principal,
                 body: dict[str, Any]) -> int:
    """Append an `admin` or `access` record naming the caller; abort UNAVAILABLE if it
    cannot be written. `tenant` in body is the tenant acted on (indexed for queries)."""
    try:
        return await audit.append(kind, stamped(kind, who, body))
    except AuditError as e:
        log.error("audit trail unavailable; privileged call refused", action=body.get("event"),
                  error=str(e))
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            "the audit trail is unavailable; nothing was done")
        raise  # not reached: abort raises


class AdminTrail:
    """Admin records written in order by one supervised task, each retried (with backoff)
    until it lands. At most `max_backlog` wait; when that many do, `record` waits for room,
    so its caller (the rule-pack watcher) stops until the trail takes records again: nothing
    is dropped and memory stays bounded (the engines keep counting their loads meanwhile).
    Health (`watch`) is NOT_SERVING from the first failed write until the backlog is
    written. Call start() once a loop runs."""

    def __init__(self, audit: AuditLog, max_backlog: int,
                 backoff: supervise.Backoff = WRITE_BACKOFF) -> None:
        self._audit = audit
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(max_backlog)
        self._head: dict[str, Any] | None = None  # being written: out of the queue, not lost
        self._backoff = backoff
        self._serving = True
        self._health: Health | None = None
        self._task: asyncio.Task[None] | None = None
        BACKLOG.set(0)

    @property
    def pending(self) -> int:
        return self._queue.qsize() + (self._head is not None)

    def start(self) -> None:
        if self._task is None:
            self._task = supervise.start("admin-trail", self._run)

    async def watch(self, health: Health | None) -> None:
        """Report the trail's state to `health` from now on (None: stop reporting, as at
        shutdown, when health is NOT_SERVING for good)."""
        self._health = health
        if health is not None and not self._serving:
            await health(False)

    async def record(self, body: dict[str, Any]) -> None:
        """Queue one admin record, stamped with when it happened (it may land later)."""
        body = {**body, "occurred_ms": int(time.time() * 1000)}
        if self._queue.full():
            log.error("admin audit backlog full; waiting until the audit trail takes records",
                      backlog=self.pending, action=body.get("event"))
        await self._queue.put(body)
        BACKLOG.set(self.pending)

    async def close(self, timeout: float = FLUSH_AT_SHUTDOWN_S) -> None:
        """Write what waits, for at most `timeout` seconds, then stop; what is left is logged."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.pending and self._task is not None and loop.time() < end:
            await asyncio.sleep(0.05)
        if self._task is not None:
            self._task.cancel()
        if self.pending:
            log.error("admin audit records lost at shutdown: the audit trail did not take them",
                      records=self.pending)

    async def _run(self) -> None:
        while True:
            if self._head is None:
                self._head = await self._queue.get()
            await self._write(self._head)
            self._head = None
            BACKLOG.set(self.pending)
            if not self.pending:
                await self._set_serving(True)

    async def _write(self, body: dict[str, Any]) -> None:
        failures = 0
        while True:
            try:
                await self._audit.append("admin", body)
                return
            except AuditError as e:
                failures += 1
                delay = self._backoff.delay(failures)
                log.error("admin audit record not written yet; retrying", action=body.get("event"),
                          backlog=self.pending, failures=failures, retry_in_s=delay, error=str(e))
                await self._set_serving(False)
                await asyncio.sleep(delay)

    async def _set_serving(self, serving: bool) -> None:
        if serving == self._serving:
            return
        self._serving = serving
        if serving:
            log.info("admin audit backlog written; serving again")
        else:
            log.error("admin events cannot be recorded; health is NOT_SERVING until they are",
                      backlog=self.pending)
        if self._health is not None:
            await self._health(serving)
