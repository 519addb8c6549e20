"""The Engine gRPC service: one long-lived stream per gateway in front of the engine loop.

A gateway's stream carries every request of that gateway, so nothing one request does may
end it: a frame that does not parse is refused for the request it names (the stream's
frames arrive as bytes and are parsed here, not by gRPC, which would end the call), and an
exception while preparing a request fails that request alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog
from google.protobuf.message import DecodeError

from finsieve.errors import RequestError, error_event
from finsieve.policy.reload import PolicyHolder
from finsieve.v1 import chat_pb2, engine_pb2, engine_pb2_grpc

from .engine import LLMEngine

log = structlog.get_logger(__name__)

# How soon an idle stream tells its gateway that the rules were reloaded.
STATUS_POLL_S = 0.2


class StreamSink:
    """Hands one gateway stream's events from the engine thread to its asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.steps: asyncio.Queue[engine_pb2.EngineStep] = asyncio.Queue()

    def deliver(self, events: list[chat_pb2.ChatServerMessage]) -> None:
        step = engine_pb2.EngineStep(events=events)
        self._loop.call_soon_threadsafe(self.steps.put_nowait, step)


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: LLMEngine, rules: PolicyHolder | None = None) -> None:
        self.engine = engine
        self.rules = rules  # for the reload counts the gateway turns into admin audit events

    async def Generate(
        self,
        request_iterator: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[engine_pb2.EngineStep]:
        sink = StreamSink(asyncio.get_running_loop())
        reader = asyncio.create_task(self._read(request_iterator, sink))
        sent: engine_pb2.EngineStatus | None = None
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
                if step.events or step.HasField("status"):
                    yield step
        finally:
            reader.cancel()
            self.engine.cancel(sink)  # the gateway is gone: free all of its sequences

    async def _read(self, frames: AsyncIterator[bytes], sink: StreamSink) -> None:
        loop = asyncio.get_running_loop()
        # One message at a time, so a cancel is never overtaken by the request it cancels.
        async for frame in frames:
            try:
                msg = chat_pb2.ChatClientMessage.FromString(frame)
            except DecodeError as e:
                _refuse_bad_frame(frame, sink, e)
                continue
            if msg.WhichOneof("msg") == "cancel":
                self.engine.cancel(sink, msg.cancel.request_id)
                continue
            if msg.WhichOneof("msg") != "request":
                continue
            try:
                seq = await loop.run_in_executor(None, self.engine.prepare, msg.request, sink)
            except RequestError as e:
                sink.deliver([e.to_event(msg.request.request_id)])
                continue
            except Exception:
                log.exception("preparing a request failed", request_id=msg.request.request_id)
                sink.deliver([error_event(msg.request.request_id, grpc.StatusCode.INTERNAL,
                                          "the engine could not prepare this request")])
                continue
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
        sink.deliver([error_event(request_id, grpc.StatusCode.INVALID_ARGUMENT,
                                  f"the request does not parse: {error}")])


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
