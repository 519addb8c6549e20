"""The public Gateway service: validates chat requests and relays them to engines.

Each Chat stream multiplexes many requests by the client's request_id. The gateway gives
each one an internal id for the engine and maps events back. On SIGTERM it drains: new
requests are refused, requests in flight may finish until the deadline, then streams end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from finsieve.errors import RequestError, invalid
from finsieve.policy.reload import PolicyHolder
from finsieve.v1 import chat_pb2, chat_pb2_grpc

from .audit import AuditError, AuditLog
from .cache import CachedAnswer, ResponseCache, cache_key
from .engines import TERMINAL, EngineClient, EnginePool
from .outbox import Outbox
from .rules import GatewayPolicy
from .trace import Trace
from .validation import Limits, validate

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class _InFlight:
    internal_id: str
    engine: EngineClient | None = None  # set once the engine accepted it


@dataclass(eq=False)
class _Stream:
    """One client's Chat stream: its outbox and its requests in flight by client id."""

    out: Outbox = field(default_factory=Outbox)
    in_flight: dict[str, _InFlight] = field(default_factory=dict)
    reading_done: bool = False

    def close_if_idle(self, draining: bool) -> None:
        if (self.reading_done or draining) and not self.in_flight:
            self.out.put(None)


class GatewayService(chat_pb2_grpc.GatewayServicer):
    def __init__(self, engines: EnginePool, limits: Limits, audit: AuditLog | None = None,
                 cache: ResponseCache | None = None, audit_fail_open: bool = False,
                 rules: PolicyHolder[GatewayPolicy] | None = None) -> None:
        self.engines = engines
        self.limits = limits
        self.audit = audit
        self.cache = cache
        self.rules = rules  # the gateway's own copy: cache replay check, masking in the trail
        self.audit_fail_open = audit_fail_open
        self.draining = False
        self._streams: set[_Stream] = set()
        self._background: set[asyncio.Task[None]] = set()  # audit appends, cache stores

    async def Chat(
        self,
        request_iterator: AsyncIterator[chat_pb2.ChatClientMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[chat_pb2.ChatServerMessage]:
        stream = _Stream()
        self._streams.add(stream)
        reader = asyncio.create_task(self._read(request_iterator, stream))
        try:
            while True:
                for msg in await stream.out.take():
                    if msg is None:
                        return
                    yield msg
        finally:
            reader.cancel()
            self._streams.discard(stream)
            for flight in stream.in_flight.values():
                if flight.engine is not None:
                    await flight.engine.cancel(flight.internal_id)

    async def _read(
        self, requests: AsyncIterator[chat_pb2.ChatClientMessage], stream: _Stream
    ) -> None:
        try:
            async for msg in requests:
                if msg.WhichOneof("msg") == "cancel":
                    flight = stream.in_flight.get(msg.cancel.request_id)
                    if flight is not None and flight.engine is not None:
                        await flight.engine.cancel(flight.internal_id)
                elif msg.WhichOneof("msg") == "request":
                    await self._start(msg.request, stream)
        except grpc.aio.AioRpcError:
            pass  # the client went away; Chat's finally cancels its requests
        stream.reading_done = True
        stream.close_if_idle(self.draining)

    async def _start(self, req: chat_pb2.ChatRequest, stream: _Stream) -> None:
        client_id = req.request_id
        try:
            if self.draining:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down; retry elsewhere"
                )
            validate(req, self.limits)
            if client_id in stream.in_flight:
                raise invalid("request_id", "a request with this id is already in flight on this stream")
        except RequestError as e:
            stream.out.put(e.to_event(client_id))
            return
        flight = _InFlight(self.engines.new_id())
        stream.in_flight[client_id] = flight
        policy = self.rules.current if self.rules else None
        trace = Trace(req, policy.sensitive if policy else None)

        def deliver(event: chat_pb2.ChatServerMessage) -> None:
            event.request_id = client_id
            if event.HasField("policy_event"):
                event.policy_event.suppressed = ""  # for the audit trail, never for the client
            if event.HasField("finished") and trace.audit_id:
                event.finished.audit_id = str(trace.audit_id)
            stream.out.put(event)
            if event.WhichOneof("event") in TERMINAL:
                stream.in_flight.pop(client_id, None)
                _log_outcome(event, trace.started)
                stream.close_if_idle(self.draining)

        def relay(event: chat_pb2.ChatServerMessage) -> None:
            trace.observe(event)
            deliver(event)
            trace.events.append(event)
            if event.WhichOneof("event") in TERMINAL:
                self._in_background(self._complete(trace))

        try:
            hit = await self._lookup(req, trace, policy)
            if hit is not None:
                await self._audit_hit(trace, hit)
                for event in hit.events:
                    deliver(event)
                return
            trace.audit_id = await self._audit("request_started", trace.started_record)
            internal = chat_pb2.ChatRequest()
            internal.CopyFrom(req)
            internal.request_id = flight.internal_id
            flight.engine = await self.engines.submit(internal, relay)
        except RequestError as e:
            relay(e.to_event(client_id))

    async def _lookup(self, req: chat_pb2.ChatRequest, trace: Trace,
                      policy: GatewayPolicy | None) -> CachedAnswer | None:
        """A verified cached answer under the model and policy version an engine announced for
        new requests; none while this gateway's own rules are another version (fail closed)."""
        status = self.engines.status()
        version = policy.version if policy else "none"
        if self.cache is None or status is None or status.policy_version != version:
            return None
        key = cache_key(trace.identity()["tenant"], status.model, version, req)
        if key is None:
            return None
        return await self.cache.get(key, status.model, version, policy.pack if policy else None)

    async def _audit_hit(self, trace: Trace, hit: CachedAnswer) -> None:
        """A hit's one record goes in before its first byte is replayed: it names the record
        of the answer it replays and carries that record's interventions."""
        replay = Trace(trace.request, trace.sensitive, started=trace.started, cache_hit=True)
        for event in hit.events:
            if event.HasField("started"):
                event.started.cache_hit = True
            replay.observe(event)
        trace.audit_id = await self._audit("request", lambda: replay.final_record(hit.record))

    async def _audit(self, kind: str, build: Callable[[], dict[str, Any]]) -> int:
        """Append a record (built off the event loop: masking scans every message) before
        anything is streamed; fail closed by default. Returns its seq (0: not written)."""
        if self.audit is None:
            return 0
        try:
            return await self.audit.append(kind, await asyncio.to_thread(build))
        except AuditError as e:
            log.error("audit trail unavailable", error=str(e), fail_open=self.audit_fail_open)
            if not self.audit_fail_open:
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   "the audit trail is unavailable; the request was refused") from None
            return 0

    async def _complete(self, trace: Trace) -> None:
        """After the terminal event: the full audit record, then the cache entry (stored
        under the model and version of the answer's own Started event)."""
        seq = 0
        if self.audit is not None:
            try:
                seq = await self.audit.append("request", await asyncio.to_thread(trace.final_record))
            except AuditError as e:
                log.error("audit record lost", error=str(e))
        t = trace.terminal
        if (seq and self.cache is not None and t is not None and t.WhichOneof("event") == "finished"
                and t.finished.finish_reason != chat_pb2.FINISH_REASON_CANCELLED):
            key = cache_key(trace.identity()["tenant"], trace.model, trace.policy_version, trace.request)
            if key is not None:
                await self.cache.put(key, trace.events, seq)

    def _in_background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def in_flight(self) -> int:
        return sum(len(s.in_flight) for s in self._streams)

    async def drain(self, deadline_s: float) -> None:
        """Refuse new requests; wait up to deadline_s for those in flight; end idle streams."""
        self.draining = True
        for s in self._streams:
            s.close_if_idle(True)
        end = time.monotonic() + deadline_s
        while self.in_flight() and time.monotonic() < end:
            await asyncio.sleep(0.05)
        left = self.in_flight()
        if self._background:  # audit records of what just finished
            await asyncio.wait(list(self._background), timeout=max(1.0, end - time.monotonic()))
        log.info("drained", unfinished=left)


def _log_outcome(event: chat_pb2.ChatServerMessage, started: float) -> None:
    # Outcomes only: prompts and answers belong to the audit trail, never to logs.
    if event.WhichOneof("event") == "error":
        log.info("request failed", code=event.error.code, field=event.error.field)
    else:
        f = event.finished
        log.info(
            "request finished",
            finish_reason=chat_pb2.FinishReason.Name(f.finish_reason),
            prompt_tokens=f.usage.prompt_tokens,
            completion_tokens=f.usage.completion_tokens,
            seconds=round(time.monotonic() - started, 3),
        )
