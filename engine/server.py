"""The Engine gRPC service: one long-lived stream per gateway in front of the engine loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from finsieve.errors import RequestError
from finsieve.policy.reload import PolicyHolder
from finsieve.v1 import chat_pb2, engine_pb2, engine_pb2_grpc

from .engine import LLMEngine

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
        request_iterator: AsyncIterator[chat_pb2.ChatClientMessage],
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

    async def _read(
        self, requests: AsyncIterator[chat_pb2.ChatClientMessage], sink: StreamSink
    ) -> None:
        loop = asyncio.get_running_loop()
        # One message at a time, so a cancel is never overtaken by the request it cancels.
        async for msg in requests:
            if msg.WhichOneof("msg") == "cancel":
                self.engine.cancel(sink, msg.cancel.request_id)
                continue
            try:
                seq = await loop.run_in_executor(None, self.engine.prepare, msg.request, sink)
            except RequestError as e:
                sink.deliver([e.to_event(msg.request.request_id)])
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
