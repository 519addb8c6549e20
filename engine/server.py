"""The Engine gRPC service: one long-lived stream per gateway in front of the engine loop.

A gateway's stream carries every request of that gateway, so nothing one request does may
end it: a frame that does not parse is refused for the request it names (the stream's
frames arrive as bytes and are parsed here, not by gRPC, which would end the call), and an
exception while preparing a request fails that request alone.

Each stream tells its gateway the engine's load (EngineLoad) whenever it changed, so that
gateways send each request to the least loaded engine. On shutdown the engine drains: its
load says so (gateways stop sending), a request that still arrives is refused UNAVAILABLE
(its gateway runs it elsewhere), and those in flight finish before the streams close.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field

import grpc
import structlog
from google.protobuf.message import DecodeError

from finsieve import supervise, tls
from finsieve.auth import GATEWAY_ROLE, Principal, Unauthenticated, bearer
from finsieve.config import Settings
from finsieve.errors import RequestError, error_event, invalid
from finsieve.policy.reload import PolicyHolder
from finsieve.v1 import chat_pb2, engine_pb2, engine_pb2_grpc

from . import events
from .engine import LLMEngine
from .sequence import Finish

log = structlog.get_logger(__name__)

# How soon an idle stream tells its gateway that the rules were reloaded or the load changed.
STATUS_POLL_S = 0.2
DRAINING_MESSAGE = "the engine is shutting down; the request was not started"
RETRY_AFTER_MS = 1000


@dataclass
class _Preparing:
    """A request between its frame and its submission to the engine."""

    task: asyncio.Task = field(init=False)  # done once submitted (or answered here)
    cancelled: bool = False  # its cancel came first: it ends without being submitted


class Doorbell:
    """Hands steps to one asyncio loop from any thread, waking it once for every step handed
    over before it runs: the engine delivers to each gateway stream in a row, and each
    wakeup writes to the loop's self-pipe, after which its thread competes with the engine
    loop's for the GIL (a wakeup per stream and step was ~2% of the loop at 128 streams)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, engine_pb2.EngineStep]] = []

    def put(self, queue: asyncio.Queue, step: engine_pb2.EngineStep) -> None:
        with self._lock:
            self._pending.append((queue, step))
            if len(self._pending) > 1:
                return  # a wakeup is on its way
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: no later step may wait for a wakeup lost here
            with self._lock:
                self._pending.clear()
            raise

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, step in pending:
            queue.put_nowait(step)


class StreamSink:
    """Hands one gateway stream's events from the engine thread to its asyncio loop."""

    def __init__(self, doorbell: Doorbell) -> None:
        self._doorbell = doorbell
        self.steps: asyncio.Queue[engine_pb2.EngineStep] = asyncio.Queue()
        self.closed = False  # the stream ended: nothing more is submitted for it

    def deliver(self, step: engine_pb2.EngineStep) -> None:
        self._doorbell.put(self.steps, step)

    def deliver_event(self, event: chat_pb2.ChatServerMessage) -> None:
        """One event of the server's own (an answer to a request the engine never saw)."""
        self.deliver(engine_pb2.EngineStep(events=[event]))


class GatewayGate:
    """An engine's check of its callers, which must be gateways: the engine keeps no audit
    trail, knows no tenant and applies no limits, so anything else that reaches it is past
    all of them. Without mTLS: the engine secret as a bearer token. With mTLS
    (--tls-client-ca): a certificate carrying a name on FINSIEVE_ENGINE_ALLOWED_PEERS and,
    unless FINSIEVE_ENGINE_REQUIRE_SECRET=false, the secret as well. Every other certificate
    of the same CA (in a bank it also signs the apps') is refused and logged."""

    def __init__(self, secret: bytes, peers: tls.PeerAllowList | None = None,
                 require_secret: bool = True) -> None:
        self._secret = secret
        self._peers = peers
        self._require_secret = require_secret or peers is None

    @classmethod
    def of(cls, settings: Settings, secret: bytes, apart: bool) -> GatewayGate:
        """apart: the engine serves its own listener (role engine), under the process's TLS
        settings; else it is in the gateway's process, on loopback, the secret alone."""
        return cls(secret, tls.engine_peers(settings) if apart else None,
                   settings.engine_require_secret)

    async def __call__(self, metadata: Mapping[str, str],
                       auth_context: Mapping[str, Iterable[bytes]]) -> Principal:
        name = _allowed_peer(self._peers, auth_context) if self._peers is not None else ""
        token = bearer(metadata)
        if token is not None:  # a secret that is sent must match, even where not required
            if not hmac.compare_digest(token.encode(), self._secret):
                raise Unauthenticated("wrong engine secret")
        elif self._require_secret:
            raise Unauthenticated("no engine secret")
        return Principal("gateway", "", GATEWAY_ROLE, name=name)


def _allowed_peer(peers: tls.PeerAllowList, auth_context: Mapping[str, Iterable[bytes]]) -> str:
    """The allowed name the caller's certificate carries; else logged and Unauthenticated,
    before the secret is looked at: a certificate of the CA that is not a gateway's is worth
    an operator's attention, whatever else the call carries."""
    peer = tls.PeerCertificate.of(auth_context)
    name = peers.match(peer) if peer is not None else None
    if name is None:
        log.warning("engine refused a client certificate not on the allow-list",
                    setting=tls.ALLOWED_PEERS_ENV, **(peer.log_fields() if peer else {}))
        raise Unauthenticated(f"client certificate not on {tls.ALLOWED_PEERS_ENV}")
    return name


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: LLMEngine, rules: PolicyHolder | None = None) -> None:
        self.engine = engine
        self.rules = rules  # for the reload counts the gateway turns into admin audit events
        self._doorbell: Doorbell | None = None  # of the loop that serves the streams (one)
        self.draining = False  # shutting down: new requests are refused
        self._preparing = 0  # requests of every stream between their frame and the scheduler

    def load(self) -> tuple[int, int]:
        """Requests running, and waiting (queued or being prepared). len() of the engine
        thread's list and deque is safe to read from here."""
        scheduler = self.engine.scheduler
        return len(scheduler.running), len(scheduler.waiting) + self._preparing

    async def drain(self, deadline_s: float) -> int:
        """Refuse new requests and wait up to deadline_s for those in flight; returns how
        many are left."""
        self.draining = True
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while self._left() and loop.time() < end:
            await asyncio.sleep(0.05)
        return self._left()

    def _left(self) -> int:
        return sum(self.load()) + self.engine.handed_over()

    async def Generate(
        self,
        request_iterator: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[engine_pb2.EngineStep]:
        loop = asyncio.get_running_loop()
        if self._doorbell is None or self._doorbell.loop is not loop:
            self._doorbell = Doorbell(loop)
        sink = StreamSink(self._doorbell)
        reader = asyncio.create_task(self._read(request_iterator, sink))
        reader.add_done_callback(supervise.log_failure)  # never an unseen exception
        sent: engine_pb2.EngineStatus | None = None
        # The load last sent (-1: none yet). Compared field by field: this runs for every
        # step of every stream, and builds nothing unless the load changed.
        sent_running = sent_waiting = -1
        sent_draining = False
        max_batch = self.engine.max_batch
        try:
            while True:
                try:
                    step = await asyncio.wait_for(sink.steps.get(), STATUS_POLL_S)
                except TimeoutError:
                    step = engine_pb2.EngineStep()
                status = self._status()
                if status != sent:  # first step, or the rules were reloaded
                    step.status.CopyFrom(status)
                    sent = status
                running, waiting = self.load()
                if running != sent_running or waiting != sent_waiting or self.draining != sent_draining:
                    load = step.load
                    load.running, load.waiting, load.max_batch = running, waiting, max_batch
                    load.draining = sent_draining = self.draining
                    sent_running, sent_waiting = running, waiting
                if step.events or step.HasField("status") or step.HasField("load"):
                    yield step
        finally:
            sink.closed = True  # before the cancel: a preparation finishing now submits nothing
            reader.cancel()
            self.engine.cancel(sink)  # the gateway is gone: free all of its sequences

    async def _read(self, frames: AsyncIterator[bytes], sink: StreamSink) -> None:
        """Requests are prepared concurrently (tokenizing and the input rules take
        milliseconds; one after another, a burst on one gateway stream waited for each in
        turn), at most `max_waiting` at once per stream; frames are read in order, so a
        cancel that overtakes the preparation of its request ends that request there."""
        preparing: dict[str, _Preparing] = {}
        room = asyncio.Semaphore(self.engine.scheduler.max_waiting)
        try:
            async for frame in frames:
                try:
                    msg = chat_pb2.ChatClientMessage.FromString(frame)
                except DecodeError as e:
                    _refuse_bad_frame(frame, sink, e)
                    continue
                kind = msg.WhichOneof("msg")
                if kind == "cancel":
                    pending = preparing.get(msg.cancel.request_id)
                    if pending is not None and not pending.task.done():
                        pending.cancelled = True
                    else:
                        self.engine.cancel(sink, msg.cancel.request_id)
                elif kind == "request":
                    request_id = msg.request.request_id
                    if self.draining:
                        sink.deliver_event(error_event(request_id, grpc.StatusCode.UNAVAILABLE,
                                                       DRAINING_MESSAGE, retry_after_ms=RETRY_AFTER_MS))
                        continue
                    if request_id in preparing:
                        sink.deliver_event(invalid("request_id", "a request with this id is in flight")
                                           .to_event(request_id))
                        continue
                    await room.acquire()
                    pending = preparing[request_id] = _Preparing()
                    self._preparing += 1
                    pending.task = asyncio.create_task(self._prepare(msg.request, sink, pending))

                    def prepared(_: asyncio.Task, request_id: str = request_id) -> None:
                        del preparing[request_id]
                        self._preparing -= 1
                        room.release()

                    pending.task.add_done_callback(prepared)
            # The gateway closed its side: the requests it sent are still answered.
            await asyncio.gather(*(p.task for p in list(preparing.values())))
        except BaseException:
            for pending in list(preparing.values()):  # the stream is gone: submit nothing more
                pending.task.cancel()
            raise

    async def _prepare(self, request: chat_pb2.ChatRequest, sink: StreamSink,
                       pending: _Preparing) -> None:
        loop = asyncio.get_running_loop()
        try:
            seq = await loop.run_in_executor(None, self.engine.prepare, request, sink)
        except RequestError as e:
            sink.deliver_event(e.to_event(request.request_id))
            return
        except Exception:
            log.exception("preparing a request failed", request_id=request.request_id)
            sink.deliver_event(error_event(request.request_id, grpc.StatusCode.INTERNAL,
                                           "the engine could not prepare this request"))
            return
        if sink.closed:
            return
        if pending.cancelled:  # cancelled before it reached the engine: it ends here
            seq.finish_reason = Finish.CANCELLED
            sink.deliver_event(events.finished(seq))
            return
        self.engine.submit(seq)

    def _status(self) -> engine_pb2.EngineStatus:
        return engine_pb2.EngineStatus(model=self.engine.model_name,
                                       policy_version=self.engine.policy().version)

    async def Info(
        self, request: engine_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineInfo:
        e = self.engine
        return engine_pb2.EngineInfo(
            model=e.model_name,
            policy_version=e.policy().version,
            max_context=e.max_context,
            max_batch=e.max_batch,
            device=str(e.device),
            pack_loads=self.rules.loads if self.rules else 0,
            pack_rejections=self.rules.rejections if self.rules else 0,
            last_rejection=self.rules.last_rejection if self.rules else "",
        )


def _refuse_bad_frame(frame: bytes, sink: StreamSink, error: DecodeError) -> None:
    """Refuse the request a malformed frame names, if it names one; the stream goes on."""
    try:
        head = engine_pb2.FrameHead.FromString(frame)
        request_id = head.request.request_id.decode() if head.WhichOneof("msg") == "request" else ""
    except (DecodeError, UnicodeDecodeError):
        request_id = ""
    log.warning("a frame from the gateway does not parse", request_id=request_id, error=str(error))
    if request_id:
        sink.deliver_event(error_event(request_id, grpc.StatusCode.INVALID_ARGUMENT,
                                       f"the request does not parse: {error}"))


def add_to_server(service: EngineService, server: grpc.aio.Server) -> None:
    """Like the generated registration, except that Generate receives its frames as bytes."""
    handlers = {
        "Generate": grpc.stream_stream_rpc_method_handler(
            service.Generate, request_deserializer=None,
            response_serializer=engine_pb2.EngineStep.SerializeToString),
        "Info": grpc.unary_unary_rpc_method_handler(
            service.Info, request_deserializer=engine_pb2.InfoRequest.FromString,
            response_serializer=engine_pb2.EngineInfo.SerializeToString),
    }
    name = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
