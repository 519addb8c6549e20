"""The HTTP door's server: uvicorn (h11) on the gateway's own event loop, bounded.

uvicorn parses HTTP and bounds a request's line and headers (h11's incomplete-event
limit); what it leaves open is bounded here, in a subclass of its h11 protocol: a
connection must send a request's head within the read timeout (uvicorn waits for ever), a
connection whose socket takes no byte for the write timeout is dropped (uvicorn waits for a
reader for ever), and its own refusals of malformed HTTP are in OpenAI's error shape. Open
connections beyond the bound get a 503 in that shape too (`_Limited`, in place of uvicorn's
plain-text `limit_concurrency`). The gateway's signal handlers, not uvicorn's, decide when
the server stops; uvicorn's log lines go to the structured log.
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

from .app import HTTP_ENDED, error_response
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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # The keep-alive timer, which a request's complete head clears (uvicorn arms it only
        # after a response): a connection that sends no full head in time is closed.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.BOUNDS.read_timeout_s, self.timeout_keep_alive_handler)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.BOUNDS.write_timeout_s, self._drop)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def connection_lost(self, exc: Exception | None) -> None:
        self._unstall()
        super().connection_lost(exc)

    def _unstall(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _drop(self) -> None:
        """The client read nothing for the write timeout: the connection is aborted (close
        would wait for ever to flush), which ends its response and cancels its request."""
        self._stalled = None
        HTTP_ENDED.labels("slow_reader").inc()
        log.warning("http connection dropped", reason="slow_reader",
                    seconds=self.BOUNDS.write_timeout_s)
        self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to HTTP that h11 cannot parse, in OpenAI's shape: 431 for a head
        over the bound, 400 otherwise; the connection is closed."""
        if len(self.conn.trailing_data[0]) > self.BOUNDS.max_header_bytes:
            status, error = 431, ApiError(431, f"the request line and headers exceed "
                                          f"{self.BOUNDS.max_header_bytes} bytes "
                                          "(FINSIEVE_HTTP_MAX_HEADER_BYTES)")
        else:
            status, error = 400, ApiError(400, "malformed HTTP request")
        body = error.body()
        for event in (h11.Response(status_code=status, headers=[
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()


class _Limited:
    """Open connections and requests beyond the bound get 503 and their connection closes
    (uvicorn's limit_concurrency, in OpenAI's shape)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.state: ServerState | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        s = self.state
        if scope["type"] == "http" and s is not None and (
                len(s.connections) > self.limit or len(s.tasks) > self.limit):
            response = error_response(ApiError(
                503, f"more than {self.limit} connections are open (FINSIEVE_HTTP_MAX_CONNECTIONS); "
                "retry later", retry_after_ms=1000), {"connection": "close"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the gateway's own handlers decide when to stop (then stop() is called)


class HttpListener:
    """Serve an ASGI app on host:port (TLS with `context`) until stop()."""

    def __init__(self, app: ASGIApp, host: str, port: int, context: ssl.SSLContext | None,
                 bounds: ListenerBounds) -> None:
        self.host, self.port = host, port
        self.tls = context is not None
        self._limited = _Limited(app, bounds.max_connections)
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
