"""The gateway's side of the Engine contract: one long-lived stream per engine."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import grpc
import structlog

from finsieve.errors import RequestError
from finsieve.grpc_server import CHANNEL_OPTIONS
from finsieve.v1 import chat_pb2, engine_pb2, engine_pb2_grpc

log = structlog.get_logger(__name__)

EventHandler = Callable[[chat_pb2.ChatServerMessage], None]
TERMINAL = ("finished", "error")

# Come back quickly after an engine restarts instead of gRPC's default backoff (minutes).
_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class EngineClient:
    def __init__(self, address: str, connect_timeout: float = 3.0) -> None:
        self.address = address
        self._connect_timeout = connect_timeout
        self._channel = grpc.aio.insecure_channel(address, options=_OPTIONS)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._handlers: dict[str, EventHandler] = {}
        self._connect_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()  # grpc.aio allows one write at a time
        # What a request submitted now would run under, as the engine last said on its stream.
        self.status: engine_pb2.EngineStatus | None = None

    @property
    def in_flight(self) -> int:
        return len(self._handlers)

    async def submit(self, request: chat_pb2.ChatRequest, handler: EventHandler) -> None:
        """Send a request; its events go to handler until a terminal one. Raises RequestError."""
        call = await self._stream()
        self._handlers[request.request_id] = handler
        try:
            async with self._write_lock:
                await call.write(chat_pb2.ChatClientMessage(request=request))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            self._handlers.pop(request.request_id, None)
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
        try:
            return await self._stub.Info(engine_pb2.InfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return None

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        await self._channel.close()

    async def _stream(self) -> grpc.aio.StreamStreamCall:
        async with self._connect_lock:
            if self._call is not None and not self._call.done():
                return self._call
            try:
                await asyncio.wait_for(self._channel.channel_ready(), self._connect_timeout)
            except TimeoutError:
                raise self._unavailable(
                    f"it is unreachable (no connection within {self._connect_timeout:g} s)"
                ) from None
            self._call = self._stub.Generate()
            self._reader = asyncio.create_task(self._read(self._call))
            return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
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
                    handler(event)
        except grpc.aio.AioRpcError as e:
            reason = f"lost the stream to it ({_status(e)})"
        except asyncio.CancelledError:
            reason = "the gateway closed the stream"
        finally:
            if self._call is call:
                self._call = None
                self.status = None
            lost, self._handlers = self._handlers, {}
            if lost:
                log.warning("engine stream lost", engine=self.address, requests=len(lost))
            err = self._unavailable(reason)
            for request_id, handler in lost.items():
                handler(err.to_event(request_id))

    def _unavailable(self, what: str) -> RequestError:
        return RequestError(grpc.StatusCode.UNAVAILABLE, f"engine {self.address}: {what}")


class EnginePool:
    """Spreads requests over engines: the least loaded first, the next on failure."""

    def __init__(self, addresses: list[str]) -> None:
        self.clients = [EngineClient(a) for a in addresses]
        self._ids = itertools.count()

    def new_id(self) -> str:
        return f"r{next(self._ids)}"

    async def submit(self, request: chat_pb2.ChatRequest, handler: EventHandler) -> EngineClient:
        errors = []
        for client in sorted(self.clients, key=lambda c: c.in_flight):
            try:
                await client.submit(request, handler)
                return client
            except RequestError as e:
                errors.append(e.message)
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "no engine available: " + "; ".join(errors))

    def status(self) -> engine_pb2.EngineStatus | None:
        """What a request submitted now would run under, as the engine it would go to last
        said on its stream (None before that engine's stream is open)."""
        return min(self.clients, key=lambda c: c.in_flight).status

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))


def _status(e: Exception) -> str:
    return e.code().name if isinstance(e, grpc.aio.AioRpcError) else type(e).__name__

