"""The HTTP door's server: uvicorn (h11) on the gateway's own event loop, bounded.

uvicorn parses HTTP; what it leaves open is bounded here, in a subclass of its h11
protocol: a connection must send a request's head within the read timeout (uvicorn waits
for ever once a byte came), a connection whose socket takes no byte for the write timeout
is dropped (uvicorn waits for a reader for ever), and uvicorn's refusals of malformed HTTP
are in OpenAI's error shape. A head over the bound (h11 bounds only one still incomplete)
and connections beyond the bound are refused in that shape too (`_Limited`, in place of
uvicorn's plain-text `limit_concurrency`). The gateway's signal handlers, not uvicorn's,
decide when the server stops; uvicorn's log lines go to the structured log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import h11
import structlog
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from finsieve.errors import ConfigError

from ..core import STREAMS_ENDED
from .app import error_response
from .errors import ApiError

log = structlog.get_logger(__name__)

GRACEFUL_STOP_S = 1.0  # after the gateway's drain, what is left of the responses


@dataclass(frozen=True)
class ListenerBounds:
    max_header_bytes: int = 16384
    max_connections: int = 1000
    read_timeout_s: float = 30.0  # a request's line and headers
    write_timeout_s: float = 30.0  # a socket that takes no byte
    keepalive_s: float = 5.0  # an idle keep-alive connection


class _BoundedH11(H11Protocol):
    BOUNDS = ListenerBounds()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stalled: asyncio.TimerHandle | None = None
        self._head: asyncio.TimerHandle | None = None  # waiting for a request's whole head
        self._head_after: object = None  # the request cycle before the awaited head

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def on_response_complete(self) -> None:
        self._await_head()  # first: a pipelined head already received is taken just below
        super().on_response_complete()

    def handle_events(self) -> None:
        super().handle_events()
        if self._head is not None and self.cycle is not self._head_after:  # a head came
            self._head.cancel()
            self._head = None

    def _await_head(self) -> None:
        """A request's line and headers must arrive within the read timeout: uvicorn's own
        keep-alive timer stops at the first byte, so a head sent a byte at a time would hold
        the connection for ever."""
        if self._head is not None:
            self._head.cancel()
        self._head_after = self.cycle
        self._head = self.loop.call_later(self.BOUNDS.read_timeout_s, self._no_head)

    def _no_head(self) -> None:
        self._head = None
        if not self.transport.is_closing():
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.BOUNDS.write_timeout_s, self._drop)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def connection_lost(self, exc: Exception | None) -> None:
        self._unstall()
        if self._head is not None:
            self._head.cancel()
            self._head = None
        super().connection_lost(exc)

    def _unstall(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _drop(self) -> None:
        """The client read nothing for the write timeout: the connection is aborted (close
        would wait for ever to flush), which ends its response and cancels its request."""
        self._stalled = None
        STREAMS_ENDED.labels("http_slow_reader").inc()
        log.warning("http connection dropped", reason="slow_reader",
                    seconds=self.BOUNDS.write_timeout_s)
        self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to HTTP that h11 cannot parse, in OpenAI's shape: 431 for a head
        over the bound, 400 otherwise; the connection is closed."""
        if len(self.conn.trailing_data[0]) > self.BOUNDS.max_header_bytes:
            error = _too_large_head(self.BOUNDS.max_header_bytes)
        else:
            error = ApiError(400, "malformed HTTP request")
        body = error.body()
        for event in (h11.Response(status_code=error.status, headers=[
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()


class _Limited:
    """Open connections and requests beyond the bound get 503 (uvicorn's limit_concurrency,
    in OpenAI's shape); a request line and headers over the bound 431 (h11 bounds only a
    head still incomplete: one that arrives whole in a read passes it). Either closes the
    connection."""

    def __init__(self, app: ASGIApp, bounds: ListenerBounds) -> None:
        self.app = app
        self.bounds = bounds
        self.state: ServerState | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (error := self._refusal(scope)) is not None:
            await error_response(error, {"connection": "close"})(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> ApiError | None:
        s, b = self.state, self.bounds
        if s is not None and (len(s.connections) > b.max_connections
                              or len(s.tasks) > b.max_connections):
            return ApiError(503, f"more than {b.max_connections} connections are open "
                            "(FINSIEVE_HTTP_MAX_CONNECTIONS); retry later", retry_after_ms=1000)
        head = len(scope["raw_path"]) + len(scope["query_string"]) + sum(
            len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > b.max_header_bytes:
            return _too_large_head(b.max_header_bytes)
        return None


def _too_large_head(limit: int) -> ApiError:
    return ApiError(431, f"the request line and headers exceed {limit} bytes "
                    "(FINSIEVE_HTTP_MAX_HEADER_BYTES)")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the gateway's own handlers decide when to stop (then stop() is called)


class HttpListener:
    """Serve an ASGI app on host:port (TLS with `context`) until stop()."""

    def __init__(self, app: ASGIApp, host: str, port: int, context: ssl.SSLContext | None,
                 bounds: ListenerBounds) -> None:
        self.host, self.port = host, port
        self._limited = _Limited(app, bounds)
        protocol = type("BoundedH11", (_BoundedH11,), {"BOUNDS": bounds})
        self._config = uvicorn.Config(
            self._limited, http=protocol, ws="none", lifespan="off", interface="asgi3",
            log_config=None, access_log=False, proxy_headers=False, server_header=False,
            h11_max_incomplete_event_size=bounds.max_header_bytes,
            timeout_keep_alive=max(1, round(bounds.keepalive_s)),
            timeout_graceful_shutdown=round(GRACEFUL_STOP_S), backlog=2048)
        self._config.load()
        self._config.ssl = context  # the gateway's context (finsieve.tls), not uvicorn's own
        self._socket: socket.socket | None = None
        self._server: _Server | None = None
        _route_uvicorn_logs()

    def bind(self) -> int:
        """Listen now (a taken port stops start-up here, naming the setting); the port."""
        self._socket = self._bind()
        self.port = self._socket.getsockname()[1]
        return self.port

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            return socket.create_server((self.host.strip("[]"), self.port), family=family,
                                        backlog=2048)
        except OSError as e:
            raise ConfigError(f"--http-port {self.port} (--http-host {self.host}): cannot listen: "
                              f"{e.strerror or e}") from None

    async def serve(self) -> None:
        """Run by supervise: serve until stop(); a run after a failure listens again."""
        sock, self._socket = self._socket or self._bind(), None
        self._server = _Server(self._config)
        self._limited.state = self._server.server_state
        await self._server.serve(sockets=[sock])

    def stop(self) -> None:
        """Stop accepting; what is left of the responses gets GRACEFUL_STOP_S (the gateway
        drained its requests before)."""
        if self._server is not None:
            self._server.should_exit = True


class _ToStructlog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        log.log(record.levelno, "http server", message=record.getMessage())


def _route_uvicorn_logs() -> None:
    """uvicorn logs through the standard library: its warnings and errors (its own texts,
    never a request's content) become structured lines."""
    logger = logging.getLogger("uvicorn")
    if not any(isinstance(h, _ToStructlog) for h in logger.handlers):
        logger.addHandler(_ToStructlog())
        logger.setLevel(logging.WARNING)
        logger.propagate = False
