"""The gRPC door: the public Gateway service's Chat streams, on the pipeline in core.py.

Each Chat stream is one session of the core, multiplexing many requests by the client's
request_id. A client that stops reading is ended after a grace period, or when more events
wait for it than its outbox holds; when a stream ends for any reason, every request still on
it is cancelled at the engine and audited as CANCELLED (core.GatewayCore.close).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog

from finsieve import supervise
from finsieve.auth import caller
from finsieve.errors import RequestError, error_event, invalid, retry_status
from finsieve.v1 import chat_pb2, chat_pb2_grpc

from .core import STREAMS_ENDED, GatewayCore, Session
from .frames import BadFrame

log = structlog.get_logger(__name__)


class GatewayService(chat_pb2_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def Chat(
        self,
        request_iterator: AsyncIterator[chat_pb2.ChatClientMessage | BadFrame],
        context: grpc.aio.ServicerContext,
    ) -> None:
        stream = self.core.open(caller(), context.peer())
        reader: asyncio.Task[None] | None = None
        try:
            try:
                await self.core.hold_stream(stream)
            except RequestError as e:
                await context.abort_with_status(retry_status(e.code, e.message, e.retry_after_ms))
            reader = asyncio.create_task(self._read(request_iterator, stream))
            reader.add_done_callback(supervise.log_failure)  # never an unseen exception
            await self._write(stream, context)
        finally:
            # No await here: this also runs when the call was cancelled (client gone, deadline).
            if reader is not None:
                reader.cancel()
            self.core.close(stream)

    async def _write(self, stream: Session, context: grpc.aio.ServicerContext) -> None:
        """Send the outbox until the stream's end. A write blocks while the client does not
        read (gRPC flow control): past the grace period, or when the outbox overflows, the
        stream is ended."""
        grace = self.core.bounds.slow_reader_grace_s
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(None) as timer:
                stream.out.on_overflow = lambda: timer.reschedule(loop.time())
                while True:
                    batch = await stream.out.take()
                    for msg in batch:
                        if msg is None:
                            return
                        timer.reschedule(loop.time() + grace)
                        await context.write(msg)
                    timer.reschedule(None)
        except TimeoutError:
            if stream.out.overflowed:
                await self._end(context, "overflow", f"more than {stream.out.max_events} events "
                                "waited for this client: it reads too slowly")
            await self._end(context, "slow_reader", f"the client read nothing for {grace:g} s")

    async def _end(self, context: grpc.aio.ServicerContext, reason: str, message: str) -> None:
        STREAMS_ENDED.labels(reason).inc()
        log.warning("chat stream ended", reason=reason)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    async def _read(
        self, requests: AsyncIterator[chat_pb2.ChatClientMessage | BadFrame], stream: Session
    ) -> None:
        try:
            async for msg in requests:
                await stream.out.room()  # backpressure: gRPC flow control then slows the client
                if isinstance(msg, BadFrame):
                    stream.out.put(error_event(msg.request_id, grpc.StatusCode.INVALID_ARGUMENT,
                                               f"{msg.field or 'frame'}: {msg.reason}", msg.field))
                elif msg.WhichOneof("msg") == "cancel":
                    await self.core.cancel(stream, msg.cancel.request_id)
                elif msg.WhichOneof("msg") == "request":
                    await self.core.start(msg.request, stream)
                else:
                    stream.out.put(invalid("msg", "a message carries a request or a cancel").to_event(""))
        except grpc.aio.AioRpcError:
            pass  # the client went away; Chat's finally cancels its requests
        stream.reading_done = True
        stream.close_if_idle(self.core.draining)
