"""A small client of the Gateway: open a Chat stream, send requests, read events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from finsieve.grpc_server import CHANNEL_OPTIONS
from finsieve.v1 import chat_pb2, chat_pb2_grpc


def chat_request(
    request_id: str,
    question: str,
    *,
    max_tokens: int = 0,
    temperature: float = 0.0,
    seed: int | None = None,
    stop: Iterable[str] = (),
) -> chat_pb2.ChatRequest:
    params = chat_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, stop=list(stop)
    )
    if seed is not None:
        params.seed = seed
    return chat_pb2.ChatRequest(
        request_id=request_id,
        messages=[chat_pb2.Message(role="user", content=question)],
        params=params,
    )


async def wait_ready(target: str, timeout: float) -> bool:
    """Wait until the server's health check says SERVING; False after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while loop.time() < deadline:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    return False


def is_terminal(event: chat_pb2.ChatServerMessage) -> bool:
    return event.WhichOneof("event") in ("finished", "error")


async def stream_one(
    target: str, request: chat_pb2.ChatRequest, timeout: float | None = None
) -> AsyncIterator[chat_pb2.ChatServerMessage]:
    """Send one request on a fresh stream; yield its events up to the terminal one."""
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = chat_pb2_grpc.GatewayStub(channel)
        outbox: asyncio.Queue[chat_pb2.ChatClientMessage | None] = asyncio.Queue()
        outbox.put_nowait(chat_pb2.ChatClientMessage(request=request))

        async def requests() -> AsyncIterator[chat_pb2.ChatClientMessage]:
            while (msg := await outbox.get()) is not None:
                yield msg

        call = stub.Chat(requests(), timeout=timeout)
        try:
            async for event in call:
                yield event
                if is_terminal(event):
                    break
        finally:
            outbox.put_nowait(None)
            call.cancel()
