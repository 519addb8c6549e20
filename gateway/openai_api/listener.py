"""The HTTP door's server: uvicorn (h11) on the gateway's own event loop, bounded.

uvicorn parses HTTP; what it leaves open is bounded (gateway/http_bounds.py: a request's
head within the read timeout, a socket that takes no byte dropped after the write
timeout), and uvicorn's refusals of malformed HTTP are in OpenAI's error shape. A head
over the bound (h11 bounds only one still incomplete) and connections beyond the bound are
refused in that shape too (`_Limited`, in place of uvicorn's plain-text
`limit_concurrency`). The gateway's signal handlers, not uvicorn's, decide when the server
stops; uvicorn's log lines go to the structured log.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Iterator

import h11
import structlog
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.server import ServerState

from finsieve.errors import ConfigError

from ..core import STREAMS_ENDED
from ..http_bounds import BoundedH11, ListenerBounds, bounded, route_uvicorn_logs
from .app import error_response
from .errors import ApiError

log = structlog.get_logger(__name__)

GRACEFUL_STOP_S = 1.0  # after the gateway's drain, what is left of the responses


class _OpenAIH11(BoundedH11):
    """The bounds' drops counted with the streams ended; uvicorn's refusals of malformed
    HTTP in OpenAI's shape."""

    def dropped(self) -> None:
        STREAMS_ENDED.labels("http_slow_reader").inc()
        super().dropped()

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
        self._config = uvicorn.Config(
            self._limited, http=bounded(_OpenAIH11, bounds), ws="none", lifespan="off", interface="asgi3",
            log_config=None, access_log=False, proxy_headers=False, server_header=False,
            h11_max_incomplete_event_size=bounds.max_header_bytes,
            timeout_keep_alive=max(1, round(bounds.keepalive_s)),
            timeout_graceful_shutdown=round(GRACEFUL_STOP_S), backlog=2048)
        self._config.load()
        self._config.ssl = context  # the gateway's context (finsieve.tls), not uvicorn's own
        self._socket: socket.socket | None = None
        self._server: _Server | None = None
        route_uvicorn_logs()

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
