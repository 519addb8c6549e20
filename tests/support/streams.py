"""Clients of a real server's Chat stream: a well-behaved one, a raw-bytes one, and readers
of the events they get."""

from __future__ import annotations

import asyncio

import grpc

from finsieve.v1 import chat_pb2

from support.servers import dev_key


class ChatStream:
    """A real client stream on which a test sends requests and cancels and reads events.
    It authenticates with `key`, by default the server's development app key."""

    def __init__(self, target: str, key: str | None = None, credentials=None) -> None:
        from finsieve.app.client import Credentials
        from finsieve.v1 import chat_pb2_grpc

        credentials = credentials or Credentials(dev_key(target) if key is None else key)
        self._channel = credentials.channel(target)
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._call = chat_pb2_grpc.GatewayStub(self._channel).Chat(self._requests())
        self.events: list = []  # every event received, in order
        self._counted = 0  # events until_done has accounted for

    async def _requests(self):
        while (msg := await self._outbox.get()) is not None:
            yield msg

    async def __aenter__(self) -> ChatStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._call.cancel()
        await self._channel.close()

    def send(self, request) -> None:
        from finsieve.v1 import chat_pb2

        self._outbox.put_nowait(chat_pb2.ChatClientMessage(request=request))

    def cancel(self, request_id: str) -> None:
        from finsieve.v1 import chat_pb2

        self._outbox.put_nowait(
            chat_pb2.ChatClientMessage(cancel=chat_pb2.Cancel(request_id=request_id))
        )

    def close_writes(self) -> None:
        self._outbox.put_nowait(None)

    async def next(self, timeout: float = 120):
        event = await asyncio.wait_for(self._call.read(), timeout)
        self.events.append(event)
        return event

    async def until_done(self, *request_ids: str, timeout: float = 300) -> dict[str, list]:
        """Read until every named request has its terminal event; events per request."""
        from finsieve.app.client import is_terminal

        # Terminal events the test read itself since the last until_done count too.
        waiting = set(request_ids) - {e.request_id for e in self.events[self._counted:]
                                      if is_terminal(e)}
        while waiting:
            event = await self.next(timeout)
            if is_terminal(event):
                waiting.discard(event.request_id)
        self._counted = len(self.events)
        return {rid: [e for e in self.events if e.request_id == rid] for rid in request_ids}


def run_requests(target: str, requests: list, cancel: str = "") -> dict:
    """Send requests on one stream (cancel one after its first delta); events per request."""
    async def go():
        async with ChatStream(target) as s:
            for r in requests:
                s.send(r)
            if cancel:
                while not any(e.request_id == cancel and e.WhichOneof("event") == "delta"
                              for e in s.events):
                    await s.next()
                s.cancel(cancel)
            return await s.until_done(*(r.request_id for r in requests))
    return asyncio.run(go())


def tagged(request_id: str, question: str, **kw):
    """A request from tenant bank-a's mobile app, user alice."""
    from finsieve.app.client import chat_request

    req = chat_request(request_id, question, **kw)
    req.metadata.update({"tenant": "bank-a", "app": "mobile", "user": "alice"})
    return req



def text_of(events: list) -> str:
    return "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")


def kinds(events: list) -> list[str]:
    return [e.WhichOneof("event") for e in events]



class RawStream:
    """A Chat call that sends raw bytes, as a hostile client can (authenticated with the
    server's development app key unless another key is given)."""

    def __init__(self, target: str, options: list | None = None, timeout: float | None = None,
                 key: str | None = None) -> None:
        from finsieve.app.client import Credentials

        self.channel = Credentials(dev_key(target) if key is None else key).channel(target, options)
        self._frames: asyncio.Queue[bytes | None] = asyncio.Queue()
        chat = self.channel.stream_stream("/finsieve.v1.Gateway/Chat", request_serializer=lambda b: b,
                                          response_deserializer=chat_pb2.ChatServerMessage.FromString)
        self.call = chat(self._send(), timeout=timeout)

    async def _send(self):
        while (frame := await self._frames.get()) is not None:
            yield frame

    def close_writes(self) -> None:
        self._frames.put_nowait(None)

    def send(self, frame: bytes | chat_pb2.ChatRequest) -> None:
        if isinstance(frame, chat_pb2.ChatRequest):
            frame = chat_pb2.ChatClientMessage(request=frame).SerializeToString()
        self._frames.put_nowait(frame)

    async def terminals(self, n: int, timeout: float = 300) -> list[chat_pb2.ChatServerMessage]:
        out = []
        while len(out) < n:
            e = await asyncio.wait_for(self.call.read(), timeout)
            assert e is not grpc.aio.EOF, out
            if e.WhichOneof("event") in ("finished", "error"):
                out.append(e)
        return out

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()
