"""The Starlette application of the HTTP door: each request is one session of the gateway's
pipeline (gateway/core.py), so keys, roles, tenants, limits, validation ranges, the cache,
the audit trail and the engines are exactly gRPC Chat's.

A streamed answer's status is decided by its first event: an error that comes before any
answer (a limit, a full engine queue, an audit trail that refuses) is an HTTP status; once
the stream has begun, an error is an SSE `error` object. A client that disconnects has its
request cancelled at the engine: the disconnect ends the response's task, and the session's
close cancels what is in flight. No exception text reaches a client (`internal_error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from finsieve.auth import (
    CHECK_UNAVAILABLE_MESSAGE,
    DENIED_MESSAGE,
    UNAUTHENTICATED_MESSAGE,
    Authenticate,
    CheckUnavailable,
    Principal,
    Unauthenticated,
)
from finsieve.errors import RequestError
from finsieve.v1 import chat_pb2

from ..core import STREAMS_ENDED, GatewayCore, Session
from .errors import ApiError, from_event
from .mapping import Answer, Call, error_chunk, parse, to_call

log = structlog.get_logger(__name__)

KEEPALIVE = b": keepalive\n\n"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # nginx: do not buffer


@dataclass(frozen=True)
class HttpBounds:
    """What one HTTP request may cost (Settings: http_max_body_bytes, …)."""

    max_body_bytes: int = 2 << 20
    read_timeout_s: float = 30.0
    sse_keepalive_s: float = 15.0


class _Gone(Exception):
    """The client disconnected: nobody reads an answer."""


class OpenAIDoor:
    def __init__(self, core: GatewayCore, authenticate: Authenticate,
                 bounds: HttpBounds | None = None) -> None:
        self.core = core
        self.authenticate = authenticate
        self.bounds = bounds or HttpBounds()

    def app(self) -> _Quiet:
        return _Quiet(Starlette(
            routes=[Route("/v1/chat/completions", self.completions, methods=["POST"]),
                    Route("/v1/models", self.models, methods=["GET"])],
            exception_handlers={HTTPException: http_error, Exception: internal_error}))

    async def models(self, request: Request) -> Response:
        try:
            await self._caller(request)
        except ApiError as e:
            return error_response(e)
        status = self.core.engines.status()
        models = [] if status is None else [
            {"id": status.model, "object": "model", "created": 0, "owned_by": "finsieve"}]
        return _json({"object": "list", "data": models})

    async def completions(self, request: Request) -> Response:
        try:
            who = await self._caller(request)
            body = parse(await self._body(request))
            status = self.core.engines.status()
            call = to_call(body, f"chatcmpl-{secrets.token_hex(12)}",
                           status.model if status is not None else None)
        except ApiError as e:
            log.info("http request refused", status=e.status, param=_head(e.param))
            return error_response(e)
        except _Gone:
            return Response(status_code=400)  # read by nobody
        return await self._answer(call, who, request)

    async def _caller(self, request: Request) -> Principal:
        """The credential decides tenant and role, as on gRPC: an API key (`Authorization:
        Bearer`); only the app role may chat. Refusals say no more than gRPC's."""
        peer = _peer(request)
        try:
            who = await self.authenticate({"authorization": request.headers.get("authorization", "")}, {})
        except Unauthenticated as e:
            log.info("authentication failed", reason=str(e), peer=peer)
            raise ApiError(401, UNAUTHENTICATED_MESSAGE) from None
        except CheckUnavailable as e:
            log.warning("credentials cannot be checked", reason=str(e))
            raise ApiError(503, CHECK_UNAVAILABLE_MESSAGE) from None
        if who.role != "app":
            log.info("permission denied", key_id=who.key_id, role=who.role, peer=peer)
            raise ApiError(403, DENIED_MESSAGE)
        return who

    async def _body(self, request: Request) -> bytes:
        """The body, counted as it arrives (413 past the bound, whatever Content-Length
        said), within the read timeout (408)."""
        limit = self.bounds.max_body_bytes
        too_big = ApiError(413, f"the request body is larger than {limit} bytes "
                           "(FINSIEVE_HTTP_MAX_BODY_BYTES)")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.bounds.read_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within "
                           f"{self.bounds.read_timeout_s:g} s (FINSIEVE_HTTP_READ_TIMEOUT_S)") from None
        except ClientDisconnect:
            raise _Gone from None
        return b"".join(chunks)

    async def _answer(self, call: Call, who: Principal, request: Request) -> Response:
        session = self.core.open(who, _peer(request))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        streaming = False
        try:
            try:
                await self.core.hold_stream(session)
            except RequestError as e:
                raise from_event(e.to_event("").error, call.rename) from None
            await self.core.start(call.request, session)
            session.reading_done = True  # one request per HTTP request
            answer = Answer(call, call.request.request_id)
            if not call.stream:
                while answer.finished is None:
                    for event in await self._next(session, gone, None) or ():
                        if event is not None:
                            answer.add(event)
                return Response(answer.completion(), media_type="application/json")
            # The first events decide the status: an error before the answer is an HTTP one.
            first = await self._taken(session, answer, gone, self.bounds.sse_keepalive_s)
            streaming = True
            return EventStream(self._sse(session, answer, first), SSE_HEADERS,
                               lambda: self.core.close(session))
        except ApiError as e:
            return error_response(e)
        except _Gone:
            return Response(status_code=400)  # read by nobody
        finally:
            gone.cancel()
            if not streaming:
                self.core.close(session)

    async def _taken(self, session: Session, answer: Answer, gone: asyncio.Future[None],
                     timeout: float) -> list[bytes]:
        """The chunks of the events waiting now, or arriving within `timeout` (ApiError for
        an error among them)."""
        chunks = []
        for event in await self._next(session, gone, timeout) or ():
            if event is not None:
                answer.add(event)
                chunks.append(answer.chunk(event))
        return chunks

    @staticmethod
    async def _next(session: Session, gone: asyncio.Future[None],
                    timeout: float | None) -> list[chat_pb2.ChatServerMessage | None] | None:
        """The session's next events; None when `timeout` passed first; _Gone when the
        client left first."""
        take = asyncio.ensure_future(session.out.take())
        either: list[asyncio.Future[Any]] = [take, gone]
        done, _ = await asyncio.wait(either, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if take in done:
            return take.result()
        take.cancel()  # nothing is taken from the outbox until take() returns
        if gone.done():
            raise _Gone
        return None

    async def _sse(self, session: Session, answer: Answer, first: list[bytes]
                   ) -> AsyncGenerator[bytes, None]:
        """The answer's chunks, several events to a write when they wait together; an SSE
        comment while nothing comes (queued, a long prefill). The response closes the
        session, however it ends."""
        if first:
            yield b"".join(first)
        while answer.finished is None:
            try:
                async with asyncio.timeout(self.bounds.sse_keepalive_s):
                    batch = await session.out.take()
            except TimeoutError:
                yield KEEPALIVE
                continue
            if session.out.overflowed:  # more events waited than a client may leave unread
                STREAMS_ENDED.labels("http_overflow").inc()
                log.warning("http stream ended", reason="overflow")
                return
            out: list[bytes] = []
            for event in batch:
                if event is None:  # the session's end: after the answer's last event
                    break
                try:
                    answer.add(event)
                except ApiError as e:
                    yield b"".join([*out, error_chunk(e)])
                    return
                out.append(answer.chunk(event))
            yield b"".join(out)
            if None in batch:
                return


class EventStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends, at once: a disconnect
    cancels it mid-write, or before its generator even started. No await in on_close."""

    def __init__(self, body: AsyncGenerator[bytes, None], headers: dict[str, str],
                 on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._body = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

    async def stream_response(self, send: Send) -> None:
        async with contextlib.aclosing(self._body):
            await super().stream_response(send)


class _Quiet:
    """Outermost: Starlette answers an unexpected exception through `internal_error` (logged
    there with an id), then raises it again for the server to log; here it stops."""

    def __init__(self, app: Starlette) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(Exception):
            await self.app(scope, receive, send)


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> Response:
    h = {**e.headers(), **(headers or {})}
    if e.status == 401:
        h["www-authenticate"] = "Bearer"
    if e.status in (408, 413):  # the rest of the body is not read: the connection cannot go on
        h["connection"] = "close"
    return Response(e.body(), status_code=e.status, headers=h, media_type="application/json")


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such path, method not allowed), in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = "no such endpoint: this server serves POST /v1/chat/completions and GET /v1/models"
    elif exc.status_code == 405:
        message = "method not allowed"
    else:
        message = "the request was refused"
    return error_response(ApiError(exc.status_code, message), dict(exc.headers or {}))


async def internal_error(request: Request, exc: Exception) -> Response:
    """An exception nothing else answered: 500 "internal error (id …)", the id in the log
    line with the traceback, as HideErrors does for gRPC."""
    error_id = secrets.token_hex(4)
    log.error("http request failed: unexpected error", method=request.method, error_id=error_id,
              error_type=type(exc).__name__, exc_info=(type(exc), exc, exc.__traceback__))
    return error_response(ApiError(
        500, f"internal error (id {error_id}); the operator can look it up in the log"))


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _peer(request: Request) -> str:
    client = request.client
    return f"http:{client.host}:{client.port}" if client else "http:unknown"


def _head(param: str | None) -> str | None:
    """A parameter's name for the log: never a client's metadata key or index contents."""
    return param.split("[", 1)[0].split(".", 1)[0] if param else None


def _json(obj: object) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")
