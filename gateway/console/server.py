"""The console's listener: uvicorn on the officers' process's own event loop, on
FINSIEVE_AUDIT_HOST:FINSIEVE_CONSOLE_PORT, with the certificates every other listener serves
(and a client certificate required when FINSIEVE_TLS_CLIENT_CA is set). Plaintext only on
loopback: `tls.check_transport` refuses a non-loopback FINSIEVE_AUDIT_HOST without TLS.

Each connection is bounded as the OpenAI door's are (gateway/http_bounds.py): a request's
head within FINSIEVE_HTTP_READ_TIMEOUT_S, a socket that takes no byte for
FINSIEVE_SLOW_READER_GRACE_S dropped.

The process's signal handling stays its own: uvicorn's `serve()` would take SIGTERM over,
so the server is started, run and shut down through its parts.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from dataclasses import dataclass, field

import uvicorn

from finsieve import supervise
from finsieve.errors import ConfigError

from ..http_bounds import BoundedH11, ListenerBounds, bounded, route_uvicorn_logs
from .app import Console, build

KEEP_ALIVE_S = 5
SHUTDOWN_S = 5.0
MAX_HEADER_BYTES = 64 << 10


@dataclass
class RunningConsole:
    server: uvicorn.Server
    sock: socket.socket
    task: asyncio.Task[None]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)  # work it needs (the rules archive)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self.task, SHUTDOWN_S)
        except TimeoutError:
            self.task.cancel()
        await asyncio.wait_for(self.server.shutdown([self.sock]), SHUTDOWN_S)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host.strip("[]"), port), family=family)
    except OSError as e:
        raise ConfigError(f"FINSIEVE_CONSOLE_PORT {port} on {host}: cannot listen: "
                          f"{e.strerror or e}") from None
    sock.setblocking(False)
    return sock


async def start(console: Console) -> RunningConsole:
    s = console.settings
    sock = _listen(s.audit_host, s.console_port)
    bounds = ListenerBounds(MAX_HEADER_BYTES, s.audit_max_calls, s.http_read_timeout_s,
                            s.slow_reader_grace_s, KEEP_ALIVE_S)
    config = uvicorn.Config(
        build(console), http=bounded(BoundedH11, bounds), ws="none", lifespan="off",
        log_config=None, access_log=False, server_header=False,
        proxy_headers=False, limit_concurrency=s.audit_max_calls, timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        ssl_certfile=s.tls_cert or None, ssl_keyfile=s.tls_key or None,
        ssl_ca_certs=s.tls_client_ca or None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if s.tls_client_ca else ssl.CERT_NONE)
    config.load()
    route_uvicorn_logs()
    if config.ssl is not None:
        config.ssl.minimum_version = ssl.TLSVersion.TLSv1_2
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    return RunningConsole(server, sock, supervise.start("console", server.main_loop))
