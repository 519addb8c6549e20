"""The gateway's one request pipeline, behind both of its doors (gRPC `Chat` in server.py, the
OpenAI-compatible HTTP endpoint in openai_api/): admission, authorization, validation,
the response cache, the audit trail, engine submission, relay, moves and completion.

A door opens a `Session` for its client (a gRPC Chat stream, or one HTTP request): its
caller, its connection, an outbox of events and its requests in flight by the client's id.
The door hands requests to `start`, sends what the outbox holds, and `close`s the session
when its client is gone; the pipeline knows nothing of the wire.

Each request gets an internal id for the engine, and its events are mapped back. On SIGTERM
the gateway drains: new requests are refused, requests in flight may finish until the
deadline, then sessions end.

What one client can cost is bounded (docs/operations.md, "Limits and bounds"): requests in
flight per session and per connection, events waiting for it (the door ends a client that
stops reading), cancels (only the first for a live request reaches the engine). When a
session closes for any reason (the client left, its deadline passed, it was ended), every
request still on it is cancelled at the engine and audited as CANCELLED.

A request whose engine is lost (its stream broke, or the engine refused it UNAVAILABLE, as
one shutting down does) before any delta or policy event reached the client runs again on
another engine, at most MAX_MOVES times, each move a `request_moved` audit record; the rest
end UNAVAILABLE with a retry hint.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from prometheus_client import Counter

from finsieve import supervise
from finsieve.auth import (
    CHECK_UNAVAILABLE_MESSAGE,
    UNAUTHENTICATED_MESSAGE,
    CheckUnavailable,
    Principal,
)
from finsieve.errors import RequestError, error_event, invalid
from finsieve.policy.reload import PolicyHolder
from finsieve.v1 import chat_pb2

from .audit import AuditError, AuditLog
from .cache import CachedAnswer, ResponseCache, cache_key, lookup_skipped, not_stored
from .engines import TERMINAL, EngineClient, EnginePool, EventHandler
from .identity import ClientAuthenticator
from .limits import Limiter
from .outbox import Outbox
from .rules import GatewayPolicy
from .trace import Trace
from .validation import Limits, validate

log = structlog.get_logger(__name__)

CANCELS = Counter("finsieve_gateway_cancels", "Cancels from clients: forwarded to the engine, or "
                  "dropped (unknown, finished or already cancelled)", ["outcome"])
RETRY_AFTER_MS = 1000  # hint with RESOURCE_EXHAUSTED
_CLIENT_KEY = re.compile(r"\[(?!\d+\])[^\]]*\]?")  # a bracketed field part that is no index
AUDIT_SERIAL_S = 10.0  # after a failed audit write, records are written before engines start
MAX_MOVES = 2  # times one request is run again on another engine after its engine was lost
STREAMS_ENDED = Counter("finsieve_streams_ended", "Streams the gateway ended: gRPC Chat streams "
                        "(slow_reader, overflow), HTTP answers (http_slow_reader, http_overflow)",
                        ["reason"])
MOVES = Counter("finsieve_gateway_requests_moved", "Requests run again on another engine after "
                "theirs was lost before anything reached the client")
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


@dataclass(frozen=True)
class Bounds:
    """Per-client bounds (Settings: max_in_flight_per_stream, …)."""

    max_in_flight_per_stream: int = 64
    max_in_flight_per_connection: int = 256
    outbox_max_events: int = 1024
    slow_reader_grace_s: float = 30.0


@dataclass(eq=False)
class _InFlight:
    internal_id: str
    engine: EngineClient | None = None  # set once the engine accepted it
    cancelled: bool = False  # a cancel was asked for (sent once the engine has it)
    done: bool = False  # its terminal event was delivered: anything after it is dropped
    # The engine's events while the request is being submitted and its request_started
    # (or request_moved) record written (None: relayed as they come): nothing reaches the
    # client before that record is in the trail. One Redis write long (its socket timeout at
    # most), so one answer's events at most.
    held: list[chat_pb2.ChatServerMessage] | None = None
    output: bool = False  # a delta or policy event reached the client: it can no longer move
    tried: list[str] = field(default_factory=list)  # the engines it was sent to, in order


@dataclass(eq=False)
class Session:
    """One client's channel to the pipeline (a Chat stream, an HTTP request): its caller,
    connection, outbox, and requests in flight by client id."""

    id: str  # names its tenant stream lease in Redis
    caller: Principal
    peer: str  # the client's connection: requests in flight are bounded per connection
    out: Outbox
    in_flight: dict[str, _InFlight] = field(default_factory=dict)
    reading_done: bool = False
    closed: bool = False

    def close_if_idle(self, draining: bool) -> None:
        if (self.reading_done or draining) and not self.in_flight:
            self.out.put(None)


class GatewayCore:
    def __init__(self, engines: EnginePool, limits: Limits, audit: AuditLog | None = None,
                 cache: ResponseCache | None = None, audit_fail_open: bool = False,
                 rules: PolicyHolder[GatewayPolicy] | None = None,
                 bounds: Bounds | None = None, auth: ClientAuthenticator | None = None,
                 limiter: Limiter | None = None) -> None:
        self.engines = engines
        self.limits = limits
        self.audit = audit
        self.cache = cache
        self.rules = rules  # the gateway's own copy: cache replay check, masking in the trail
        self.audit_fail_open = audit_fail_open
        self.bounds = bounds or Bounds()
        self.auth = auth
        self.limiter = limiter
        self._instance = secrets.token_hex(6)  # names this gateway's stream leases in Redis
        self._session_count = itertools.count()
        self.draining = False
        self._sessions: set[Session] = set()
        self._per_peer: dict[str, int] = {}  # requests in flight per client connection
        self._background: set[asyncio.Task[None]] = set()  # audit appends, cache stores, cancels
        self._audit_serial_until = 0.0  # see _record_and_submit

    # -- sessions: what a door calls -----------------------------------------------------

    def open(self, who: Principal, peer: str) -> Session:
        """A session for a client; `close` it in a finally, whatever happens."""
        session = Session(f"{self._instance}:{next(self._session_count)}", who, peer,
                          Outbox(self.bounds.outbox_max_events))
        self._sessions.add(session)
        return session

    async def hold_stream(self, session: Session) -> None:
        """Take one of the tenant's concurrent-stream slots for the session (released by
        `close`); RequestError RESOURCE_EXHAUSTED, with a retry hint, when none is free."""
        if self.limiter is not None and (
                wait := await self.limiter.open_stream(session.caller.tenant, session.id)):
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               "the tenant's limit of concurrent streams is reached",
                               retry_after_ms=wait)

    def close(self, session: Session) -> None:
        """The session is over: its requests still in flight are cancelled at the engine
        (and audited CANCELLED), its slot is released. No await: this also runs when the
        door's task was cancelled (client gone, deadline)."""
        session.closed = True
        session.out.close()
        self._sessions.discard(session)
        if self.limiter is not None:
            self._in_background(self.limiter.close_stream(session.id))
        if session.in_flight:
            self._in_background(self._cancel_all(list(session.in_flight.values())))

    async def cancel(self, session: Session, client_id: str) -> None:
        flight = session.in_flight.get(client_id)
        if flight is None or flight.cancelled:  # unknown, finished or already cancelled
            CANCELS.labels("dropped").inc()
            return
        flight.cancelled = True
        CANCELS.labels("forwarded").inc()
        if flight.engine is not None:  # else _submit sends it once the engine has the request
            await flight.engine.cancel(flight.internal_id)

    async def _cancel_all(self, flights: list[_InFlight]) -> None:
        for flight in flights:
            if not flight.cancelled:
                flight.cancelled = True
                if flight.engine is not None:
                    await flight.engine.cancel(flight.internal_id)

    def _admit(self, req: chat_pb2.ChatRequest, session: Session) -> None:
        """Raise RequestError unless this request may start now."""
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down; retry elsewhere")
        validate(req, self.limits)
        if req.request_id in session.in_flight:
            raise invalid("request_id", "a request with this id is already in flight on this stream")
        b = self.bounds
        if len(session.in_flight) >= b.max_in_flight_per_stream:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{b.max_in_flight_per_stream} requests are already in flight on this "
                               "stream (FINSIEVE_MAX_IN_FLIGHT_PER_STREAM)", retry_after_ms=RETRY_AFTER_MS)
        if self._per_peer.get(session.peer, 0) >= b.max_in_flight_per_connection:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{b.max_in_flight_per_connection} requests are already in flight on "
                               "this connection (FINSIEVE_MAX_IN_FLIGHT_PER_CONNECTION)",
                               retry_after_ms=RETRY_AFTER_MS)

    async def start(self, req: chat_pb2.ChatRequest, session: Session) -> None:
        """Admit, authorize and submit one request: its events, an error included, go to the
        session's outbox. Returns once the request is on an engine (or answered)."""
        try:
            self._admit(req, session)
        except RequestError as e:
            session.out.put(e.to_event(req.request_id))
            return
        # The connection's slot is taken before the await, so that its other streams cannot
        # slip past the bound meanwhile.
        self._per_peer[session.peer] = self._per_peer.get(session.peer, 0) + 1
        try:
            await self._authorize(session.caller)
        except asyncio.CancelledError:  # the session ended meanwhile
            self._release(session.peer)
            raise
        except Exception as e:  # refused, or failed: this request only, and its slot back
            self._release(session.peer)
            if not isinstance(e, RequestError):
                log.exception("authorizing a request failed")
                e = RequestError(grpc.StatusCode.INTERNAL, "the gateway failed this request")
            session.out.put(e.to_event(req.request_id))
            return
        flight = _InFlight(self.engines.new_id())
        session.in_flight[req.request_id] = flight
        # Shielded: if the session ends meanwhile, the submission still completes (and is then
        # cancelled), so no request is left generating for nobody.
        await asyncio.shield(self._submit(req, session, flight))

    async def _submit(self, req: chat_pb2.ChatRequest, session: Session, flight: _InFlight) -> None:
        client_id = req.request_id
        policy = self.rules.current if self.rules else None
        trace = Trace(req, session.caller, policy.sensitive if policy else None)

        def deliver(event: chat_pb2.ChatServerMessage) -> None:
            if flight.done:
                return
            event.request_id = client_id
            if event.HasField("delta"):
                flight.output = True
            elif event.HasField("policy_event"):
                flight.output = True
                event.policy_event.suppressed = ""  # for the audit trail, never for the client
            if event.HasField("finished") and trace.audit_id:
                event.finished.audit_id = str(trace.audit_id)
            session.out.put(event)
            if event.WhichOneof("event") in TERMINAL:
                flight.done = True
                if session.in_flight.get(client_id) is flight:
                    del session.in_flight[client_id]
                self._release(session.peer)
                _log_outcome(event, trace.started)
                session.close_if_idle(self.draining)

        def relay(event: chat_pb2.ChatServerMessage) -> None:
            if flight.done:
                return
            trace.observe(event)
            deliver(event)
            trace.events.append(event)
            if event.WhichOneof("event") in TERMINAL:
                self._in_background(self._complete(trace))
                if self.limiter is not None and event.HasField("finished"):
                    self._in_background(self.limiter.charge(
                        session.caller.tenant, event.finished.usage.completion_tokens))

        def from_engine(event: chat_pb2.ChatServerMessage) -> None:
            """The engine's events: held while the request is being submitted and recorded
            (and, after a refusal, until its error is relayed); a request the engine lost
            before anything reached the client runs again elsewhere."""
            if flight.done:
                return
            if flight.held is not None:
                flight.held.append(event)
            elif self._may_move(event, flight):
                self._in_background(self._move(internal, from_engine, relay, trace, flight, session,
                                               event))
            elif not (len(flight.tried) > 1 and event.HasField("started")
                      and (event.started.model, event.started.policy_version)
                      == (trace.model, trace.policy_version)):  # moved: the client has this one
                relay(event)

        try:
            hit = await self._lookup(req, trace, policy)
            if hit is not None:
                await self._audit_hit(trace, hit)
                for event in hit.events:
                    deliver(event)
                return
            if flight.cancelled or session.closed:  # gone before it reached an engine
                relay(chat_pb2.ChatServerMessage(finished=chat_pb2.Finished(
                    finish_reason=chat_pb2.FINISH_REASON_CANCELLED)))
                return
            internal = chat_pb2.ChatRequest()
            internal.CopyFrom(req)
            internal.DiscardUnknownFields()  # only what the contract names reaches an engine
            internal.request_id = flight.internal_id
            await self._record_and_submit(internal, from_engine, trace, flight, session)
        except RequestError as e:
            relay(e.to_event(client_id))
        except Exception:  # fail this request, never the session
            log.exception("request failed in the gateway")
            relay(error_event(client_id, grpc.StatusCode.INTERNAL, "the gateway failed this request"))

    async def _record_and_submit(self, internal: chat_pb2.ChatRequest, from_engine: EventHandler,
                                 trace: Trace, flight: _InFlight, session: Session) -> None:
        """The request_started record, and the request on an engine. While the trail is
        healthy, both at once (masking the prompt and the round trip to Redis were ~1.5 ms
        of a stream's first token on an H200 host): the engine's events are held until the
        record is in, and a refusal (fail closed) cancels the engine's request and drops
        what it made. For AUDIT_SERIAL_S after a failed write, the record first: a trail
        that is down must not cost the engines the work of the requests it refuses."""
        flight.held = []
        try:
            if time.monotonic() < self._audit_serial_until:
                trace.audit_id = await self._audit("request_started", trace.started_record,
                                                   trace.ids())
                await self._submit_to_engine(internal, from_engine, flight, session)
            else:
                recording = asyncio.ensure_future(
                    self._audit("request_started", trace.started_record, trace.ids()))
                try:
                    await self._submit_to_engine(internal, from_engine, flight, session)
                finally:  # shielded: a record half-written when cancelled would be neither in nor out
                    trace.audit_id = await asyncio.shield(recording)
        except BaseException:  # what the engine sends stays held, and is dropped: never streamed
            await self._cancel_all([flight])  # once: not again after a client's cancel
            raise
        self._release_held(flight, from_engine)

    async def _submit_to_engine(self, internal: chat_pb2.ChatRequest, from_engine: EventHandler,
                                flight: _InFlight, session: Session) -> None:
        flight.engine = await self.engines.submit(internal, from_engine, avoid=flight.tried)
        flight.tried.append(flight.engine.address)
        if flight.cancelled or session.closed:  # asked for while it was being submitted
            flight.cancelled = True
            await flight.engine.cancel(flight.internal_id)

    def _release_held(self, flight: _InFlight, from_engine: EventHandler) -> None:
        """Relay what the engine sent while its events were held; if it lost the request
        meanwhile, none of it reached the client: dropped, and the request moves."""
        held, flight.held = flight.held or [], None
        if held and self._may_move(held[-1], flight):
            held = held[-1:]
        for event in held:
            from_engine(event)

    def _may_move(self, event: chat_pb2.ChatServerMessage, flight: _InFlight) -> bool:
        """Its engine lost it, nothing of it reached the client, and it has moves left."""
        return (event.HasField("error") and event.error.code == _UNAVAILABLE and not flight.output
                and not flight.done and flight.engine is not None
                and len(flight.tried) <= MAX_MOVES)

    async def _move(self, internal: chat_pb2.ChatRequest, from_engine: EventHandler,
                    relay: EventHandler, trace: Trace, flight: _InFlight, session: Session,
                    lost: chat_pb2.ChatServerMessage) -> None:
        """Run the request on another engine, and record the move (as a request's first
        record: its events are held until the record is in; a refusal fails it). A client
        that cancelled or left meanwhile has its request end CANCELLED here. Nothing that
        goes wrong leaves the client without a terminal event."""
        old, flight.engine = flight.engine, None  # a cancel meanwhile is sent to the new one
        assert old is not None  # _may_move checked it
        if flight.cancelled or session.closed:
            relay(chat_pb2.ChatServerMessage(finished=chat_pb2.Finished(
                finish_reason=chat_pb2.FINISH_REASON_CANCELLED)))
            return
        flight.held = []
        try:
            try:
                await self._submit_to_engine(internal, from_engine, flight, session)
            except RequestError:  # no engine takes it: the client hears of the engine it lost
                relay(lost)
                return
            assert flight.engine is not None
            new = flight.engine.address
            MOVES.inc()
            log.info("request moved to another engine", from_engine=old.address, to_engine=new,
                     moves=len(flight.tried) - 1)
            trace.moved_from.append(old.address)
            await self._audit("request_moved", lambda: {
                "tenant": trace.caller.tenant, "key_id": trace.caller.key_id,
                "audit_id": trace.audit_id, "from_engine": old.address, "to_engine": new,
                "reason": lost.error.message, "moves": len(flight.tried) - 1}, trace.ids())
        except Exception as e:  # what the new engine sends stays held, and is dropped
            await self._cancel_all([flight])
            if not isinstance(e, RequestError):
                log.exception("moving a request failed")
                e = RequestError(grpc.StatusCode.INTERNAL, "the gateway failed this request")
            relay(e.to_event(""))
            return
        self._release_held(flight, from_engine)

    def _release(self, peer: str) -> None:
        left = self._per_peer.get(peer, 0) - 1
        if left > 0:
            self._per_peer[peer] = left
        else:
            self._per_peer.pop(peer, None)

    async def _authorize(self, who: Principal) -> None:
        """A stream's key is checked again for each request (revocation, expiry), then the
        tenant's request and token rates."""
        try:
            if self.auth is not None and not await self.auth.still_valid(who):
                log.warning("request refused: the stream's key was revoked or expired",
                            key_id=who.key_id, tenant=who.tenant)
                raise RequestError(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        except CheckUnavailable:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, CHECK_UNAVAILABLE_MESSAGE) from None
        if self.limiter is not None and (wait := await self.limiter.admit(who.tenant)):
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               "the tenant's request or token rate limit is reached",
                               retry_after_ms=wait)

    async def _lookup(self, req: chat_pb2.ChatRequest, trace: Trace,
                      policy: GatewayPolicy | None) -> CachedAnswer | None:
        """A verified cached answer under the model and policy version an engine announced for
        new requests; none while this gateway's own rules are another version (fail closed)."""
        status = self.engines.status()
        version = policy.version if policy else "none"
        if self.cache is None:
            return None
        if status is None or status.policy_version != version:
            lookup_skipped("no_engine" if status is None else "policy_version")
            return None
        key = cache_key(trace.identity()["tenant"], status.model, version, req)
        if key is None:
            return None
        return await self.cache.get(key, status.model, version, policy.pack if policy else None)

    async def _audit_hit(self, trace: Trace, hit: CachedAnswer) -> None:
        """A hit's one record goes in before its first byte is replayed: it names the record
        of the answer it replays and carries that record's interventions."""
        replay = Trace(trace.request, trace.caller, trace.sensitive, started=trace.started,
                       cache_hit=True)
        for event in hit.events:
            if event.HasField("started"):
                event.started.cache_hit = True
            replay.observe(event)
        trace.audit_id = await self._audit("request", lambda: replay.final_record(hit.record),
                                           trace.ids())

    async def _audit(self, kind: str, build: Callable[[], dict[str, Any]],
                     ids: dict[str, str]) -> int:
        """Append a record (built off the event loop: masking scans every message) before
        anything is streamed; fail closed by default. Returns its seq (0: not written).
        `ids`: the request's user and request ids as sent (indexed by keyed hash)."""
        if self.audit is None:
            return 0
        try:
            return await self.audit.append(kind, await asyncio.to_thread(build), ids=ids)
        except AuditError as e:
            self._audit_serial_until = time.monotonic() + AUDIT_SERIAL_S
            log.error("audit trail unavailable", error=str(e), fail_open=self.audit_fail_open)
            if not self.audit_fail_open:
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   "the audit trail is unavailable; the request was refused") from None
            return 0

    async def _complete(self, trace: Trace) -> None:
        """After the terminal event: the full audit record, then the cache entry (stored
        under the model and version of the answer's own Started event). A lookup of the
        same key meanwhile waits for the entry: marked before the first await."""
        key = self._store_key(trace)
        async with self.cache.storing(key) if key and self.cache else contextlib.nullcontext():
            seq = 0
            if self.audit is not None:
                try:
                    seq = await self.audit.append("request", await asyncio.to_thread(trace.final_record),
                                                  ids=trace.ids())
                except AuditError as e:
                    log.error("audit record lost", error=str(e))
            if key is not None and self.cache is not None:
                if seq:
                    await self.cache.put(key, trace.events, seq)
                else:
                    not_stored("no_audit_record")  # a hit must name its answer's record

    def _store_key(self, trace: Trace) -> str | None:
        """The key this answer is cached under; None, counted with why, when it is not."""
        if self.cache is None:
            return None
        t = trace.terminal
        if t is None or t.WhichOneof("event") != "finished":
            not_stored("error")
        elif t.finished.finish_reason == chat_pb2.FINISH_REASON_CANCELLED:
            not_stored("cancelled")  # a partial answer; e.g. a client that stopped reading
        elif (key := cache_key(trace.identity()["tenant"], trace.model, trace.policy_version,
                               trace.request)) is None:
            not_stored("not_deterministic")  # sampled without a seed
        else:
            return key
        return None

    def _in_background(self, coro) -> None:
        task = asyncio.create_task(coro)
        task.add_done_callback(supervise.log_failure)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def in_flight(self) -> int:
        return sum(len(s.in_flight) for s in self._sessions)

    async def drain(self, deadline_s: float) -> None:
        """Refuse new requests; wait up to deadline_s for those in flight; end idle sessions."""
        self.draining = True
        for s in self._sessions:
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
        # `metadata[KEY]` names a client's key, which may hold anything: logged as `metadata[…]`.
        log.info("request failed", code=event.error.code,
                 field=_CLIENT_KEY.sub("[…]", event.error.field))
    else:
        f = event.finished
        log.info(
            "request finished",
            # By name; a newer engine's reason unknown here stays a number.
            finish_reason=(chat_pb2.FinishReason.Name(f.finish_reason)
                           if f.finish_reason in chat_pb2.FinishReason.values() else f.finish_reason),
            prompt_tokens=f.usage.prompt_tokens,
            completion_tokens=f.usage.completion_tokens,
            seconds=round(time.monotonic() - started, 3),
        )
