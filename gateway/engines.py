"""The gateway's side of the Engine contract: one long-lived stream per engine.

Each engine is kept connected by its own background task: it opens the stream, reads it
until it breaks, and reconnects. An engine that cannot be reached, or whose stream broke, is
marked down once (one log line) and probed in the background; a request never waits for a
down engine, and requests never wait for each other to connect. Only before an engine's
first connection attempt has finished may a request wait for it, and only when no engine
is up yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog

from finsieve import supervise
from finsieve.errors import RequestError
from finsieve.v1 import chat_pb2, engine_pb2, engine_pb2_grpc
from finsieve.wire import ENGINE_MESSAGE_BYTES

log = structlog.get_logger(__name__)

EventHandler = Callable[[chat_pb2.ChatServerMessage], None]
TERMINAL = ("finished", "error")
RETRY_AFTER_MS = 1000  # hint to a client when no engine is up
RECONNECT_PAUSE_S = 0.5  # after a stream broke on a connection that still looks fine


@dataclass(frozen=True)
class EngineCredentials:
    """How a gateway proves itself to engines: the shared secret, over TLS when configured."""

    secret: bytes = b""
    tls: grpc.ChannelCredentials | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.secret.decode()}"),) if self.secret else ()


class EngineClient:
    def __init__(self, address: str, connect_timeout: float = 3.0,
                 options: list[tuple[str, int]] | None = None,
                 credentials: EngineCredentials | None = None) -> None:
        self.address = address
        self._connect_timeout = connect_timeout
        credentials = credentials or EngineCredentials()
        self._metadata = credentials.metadata
        self._channel = (grpc.aio.secure_channel(address, credentials.tls, options=options)
                         if credentials.tls is not None
                         else grpc.aio.insecure_channel(address, options=options))
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._handlers: dict[str, EventHandler] = {}
        self._write_lock = asyncio.Lock()  # grpc.aio allows one write at a time
        self._task: asyncio.Task[None] | None = None
        self.probed = asyncio.Event()  # the first connection attempt has an outcome
        self.down = False  # marked down (logged once), until the next connection
        self.down_reason = "not connected yet"
        # What a request submitted now would run under, as the engine last said on its stream.
        self.status: engine_pb2.EngineStatus | None = None

    @property
    def up(self) -> bool:
        return self._call is not None

    @property
    def in_flight(self) -> int:
        return len(self._handlers)

    def start(self) -> None:
        if self._task is None:
            self._task = supervise.start(f"engine-stream {self.address}", self._keep_connected)

    async def submit(self, request: chat_pb2.ChatRequest, handler: EventHandler) -> None:
        """Send a request; its events go to handler until a terminal one. Raises RequestError."""
        call = self._call
        if call is None:
            raise self._unavailable(self.down_reason)
        message = chat_pb2.ChatClientMessage(request=request)
        if message.ByteSize() > ENGINE_MESSAGE_BYTES:  # cannot happen with valid settings
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               "the request is too large to forward to an engine", "messages")
        self._handlers[request.request_id] = handler
        try:
            async with self._write_lock:
                await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            if self._handlers.pop(request.request_id, None) is None:
                return  # the stream's end already failed this request: one terminal event only
            raise self._unavailable(f"the stream to it broke ({_status(e)})") from None

    async def cancel(self, request_id: str) -> None:
        call = self._call
        if call is None or request_id not in self._handlers:
            return
        try:
            async with self._write_lock:
                await call.write(chat_pb2.ChatClientMessage(cancel=chat_pb2.Cancel(request_id=request_id)))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the stream is gone; _read fails the request

    async def info(self, timeout: float = 2.0) -> engine_pb2.EngineInfo | None:
        if not self.up:
            return None
        try:
            return await self._stub.Info(engine_pb2.InfoRequest(), timeout=timeout,
                                         metadata=self._metadata)
        except grpc.aio.AioRpcError:
            return None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._call is not None:
            self._call.cancel()
        await self._channel.close()

    async def _keep_connected(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._until_ready(loop)
            call = self._stub.Generate(metadata=self._metadata)
            self._call, self.down = call, False
            self.probed.set()
            log.info("engine up", engine=self.address)
            self._mark_down(await self._read(call))
            await asyncio.sleep(RECONNECT_PAUSE_S)

    async def _until_ready(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait for a connection, marking the engine down as soon as it refuses one or does
        not answer within the connect timeout (gRPC keeps retrying with backoff meanwhile)."""
        ready, failed = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE
        deadline = loop.time() + self._connect_timeout
        state = self._channel.get_state(try_to_connect=True)
        while state != ready:
            if state == failed:
                self._mark_down("it is unreachable (it refused or dropped the connection)")
            elif loop.time() >= deadline:
                self._mark_down(f"it is unreachable (no connection within {self._connect_timeout:g} s)")
            wait = None if self.down else deadline - loop.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._channel.wait_for_state_change(state), wait)
            state = self._channel.get_state(try_to_connect=True)

    def _mark_down(self, reason: str) -> None:
        self.down_reason = reason
        self.probed.set()
        if not self.down:  # once per outage
            self.down = True
            log.warning("engine marked down; probing it in the background", engine=self.address,
                        reason=reason)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> str:
        """Relay the stream's events until it ends; fail what was in flight; say why it ended."""
        reason = "the engine closed the stream"
        try:
            async for step in call:
                if step.HasField("status"):
                    self.status = step.status
                for event in step.events:
                    handler = self._handlers.get(event.request_id)
                    if handler is None:
                        continue
                    if event.WhichOneof("event") in TERMINAL:
                        del self._handlers[event.request_id]
                    try:
                        handler(event)
                    except Exception:  # one request's fault never ends the shared stream
                        log.exception("relaying an engine event failed", engine=self.address)
        except grpc.aio.AioRpcError as e:
            reason = f"lost the stream to it ({_status(e)})"
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                log.error("engine refused this gateway's credential: the engine secret "
                          "differs, or this gateway's certificate (--tls-cert) carries no name "
                          "on the engine's FINSIEVE_ENGINE_ALLOWED_PEERS", engine=self.address)
        except asyncio.CancelledError:
            reason = "the gateway closed the stream"
            raise
        finally:  # nothing is left waiting
            self._call = None
            self.status = None
            lost, self._handlers = self._handlers, {}
            if lost:
                log.warning("engine stream lost", engine=self.address, requests=len(lost))
            err = self._unavailable(reason)
            for request_id, handler in lost.items():
                try:
                    handler(err.to_event(request_id))
                except Exception:  # the others are still failed, and the engine reconnects
                    log.exception("failing a request of a lost engine stream failed",
                                  engine=self.address)
        return reason

    def _unavailable(self, what: str) -> RequestError:
        return RequestError(grpc.StatusCode.UNAVAILABLE, f"engine {self.address}: {what}",
                            retry_after_ms=RETRY_AFTER_MS)


class EnginePool:
    """Spreads requests over the engines that are up: the least loaded first, the next on
    failure. Call start() once a loop runs."""

    def __init__(self, addresses: list[str], connect_timeout: float = 3.0,
                 options: list[tuple[str, int]] | None = None,
                 credentials: EngineCredentials | None = None) -> None:
        self.clients = [EngineClient(a, connect_timeout, options, credentials) for a in addresses]
        self._connect_timeout = connect_timeout
        self._ids = itertools.count()

    def start(self) -> None:
        for c in self.clients:
            c.start()

    def new_id(self) -> str:
        return f"r{next(self._ids)}"

    async def submit(self, request: chat_pb2.ChatRequest, handler: EventHandler) -> EngineClient:
        self.start()
        await self._first_probes()
        errors = []
        for client in sorted(self.clients, key=lambda c: (not c.up, c.in_flight)):
            try:
                await client.submit(request, handler)
                return client
            except RequestError as e:
                errors.append(e.message)
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "no engine available: " + "; ".join(errors),
                           retry_after_ms=RETRY_AFTER_MS)

    def status(self) -> engine_pb2.EngineStatus | None:
        """What a request submitted now would run under, as the engine it would go to last
        said on its stream (None before an engine's stream is open)."""
        up = [c for c in self.clients if c.up]
        return min(up, key=lambda c: c.in_flight).status if up else None

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    async def _first_probes(self) -> None:
        """Right after start-up, with no engine up yet: wait (all requests together, at most
        the connect timeout) until one is up or every first attempt has an outcome."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout
        while not any(c.up for c in self.clients) and loop.time() < deadline:
            waiting = [asyncio.ensure_future(c.probed.wait())
                       for c in self.clients if not c.probed.is_set()]
            if not waiting:
                return
            _, pending = await asyncio.wait(waiting, timeout=deadline - loop.time(),
                                            return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()


def _status(e: Exception) -> str:
    return e.code().name if isinstance(e, grpc.aio.AioRpcError) else type(e).__name__
