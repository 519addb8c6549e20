"""Real servers for the tests: `finsieve serve` subprocesses on free loopback ports, and the
settings of the two the session shares (the session server and the tight one)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from finsieve.app.client import wait_ready
from finsieve.v1 import engine_pb2, engine_pb2_grpc

# Per-tenant limits of the session server, for the tenants test_identity.py and
# test_openai_http.py make keys for.
SESSION_LIMITS = ("tenants:\n  t-tokens:\n    tokens_per_min: 10\n"
                  "  t-http-flood:\n    requests_per_s: 0.01\n")


_JSON = json.JSONDecoder()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Where each started server keeps its state, by its targets: clients find its development keys.
_STATE_DIRS: dict[str, Path] = {}


def state_of(target: str) -> Path:
    """The state directory of the server listening at `target`."""
    return _STATE_DIRS[target]


def dev_key(target: str, role: str = "app") -> str:
    """The development key of `role` that the server at `target` wrote on start."""
    return (state_of(target) / "keys" / f"{role}.key").read_text().strip()



@dataclass
class Server:
    process: subprocess.Popen[bytes]
    target: str
    audit_target: str
    log_path: Path
    state: Path
    metrics: str = ""  # its Prometheus endpoint, where the test asked for one
    console_url: str = ""  # the officers' web console, when started with one
    http: str = ""  # the base URL of its OpenAI-compatible endpoint, where it serves one

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def records(self, event: str) -> list[dict]:
        """Its JSON log records whose event is `event`. The gateway and its officers' child
        share the log file, and a line once held two records (CI, 2026-12-06; not
        reproduced): every object of a line is read."""
        found = []
        for line in self.log().splitlines():
            at = line.find("{")
            while 0 <= at < len(line):
                try:
                    record, end = _JSON.raw_decode(line, at)
                except ValueError:
                    break
                if isinstance(record, dict) and record.get("event") == event:
                    found.append(record)
                at = line.find("{", end)
        return found

    def key(self, role: str) -> str:
        return dev_key(self.target, role)

    def valkey_port(self) -> int:
        return self.records("embedded valkey started")[0]["port"]

    def valkey_password(self) -> str:
        """From the embedded Valkey's 0600 config file: what an operator on the machine can
        read."""
        conf = (self.state / "valkey" / "valkey.conf").read_text()
        return re.search(r"^requirepass (\S+)$", conf, re.M)[1]

    def valkey(self):
        """An asyncio client of the server's embedded Valkey."""
        import redis.asyncio as redis

        return redis.Redis(port=self.valkey_port(), password=self.valkey_password())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


def start_server(tmp: Path, *args: str, env: dict[str, str] | None = None,
                 ready: bool = True, credentials=None, console: bool = False) -> Server:
    """`finsieve serve` on free ports; waits for health (over TLS with `credentials`).
    `console`: with the officers' web console on a port of its own."""
    port, audit_port = free_port(), free_port()
    log_path = tmp / f"serve-{port}.log"
    console_args = ["--console-port", str(free_port())] if console else []
    cmd = [sys.executable, "-m", "finsieve.app.cli", "serve", "--port", str(port),
           "--audit-port", str(audit_port), "--state-dir", str(tmp / "state"), *console_args, *args]
    full_env = {**os.environ, "FINSIEVE_LOG_FORMAT": "json", **(env or {})}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = Server(proc, f"127.0.0.1:{port}", f"127.0.0.1:{audit_port}", log_path, tmp / "state",
                    console_url=f"http://127.0.0.1:{console_args[1]}" if console else "")
    if "--http-port" in args:
        scheme = "https" if "--tls-cert" in args else "http"
        server.http = f"{scheme}://127.0.0.1:{args[args.index('--http-port') + 1]}/v1"
    _STATE_DIRS[server.target] = _STATE_DIRS[server.audit_target] = server.state
    if ready and not asyncio.run(wait_ready(server.target, 120, credentials)):
        server.stop(signal.SIGKILL)
        raise RuntimeError(f"server did not come up:\n{server.log()}")
    return server



def start_engine(tmp: Path, *args: str, port: int = 0, env: dict[str, str] | None = None) -> Server:
    """`finsieve serve --role engine` on `port` (a free one by default); waits for its health.
    The Server's target is the engine's address."""
    port = port or free_port()
    server = start_server(tmp, "--role", "engine", "--engine-port", str(port), *args, env=env,
                          ready=False)
    server = dataclasses.replace(server, target=f"127.0.0.1:{port}")
    if not asyncio.run(wait_ready(server.target, 120)):
        server.stop(signal.SIGKILL)
        raise RuntimeError(f"engine did not come up:\n{server.log()}")
    return server


def wait_cached(server: Server, events: list, request, tenant: str = "default") -> None:
    """Wait until the server's embedded Valkey holds the answer's cache entry: the gateway
    stores it after the client has the answer. The tenant is the caller's (the development
    keys' by default), never the request's metadata."""
    import redis

    from gateway.cache import cache_key

    started = events[0].started
    key = cache_key(tenant, started.model, started.policy_version, request)
    with redis.Redis(port=server.valkey_port(), password=server.valkey_password()) as client:
        for _ in range(1000):
            if client.exists(key):
                return
            time.sleep(0.01)
    raise AssertionError("the answer was never cached")



# -- a server with small bounds, for hostile clients and rule packs ----------------------

CANARY = """\
rules:
  - id: canary
    description: an input rule that proves which pack is in force
    kind: literal
    patterns: [canary phrase]
    scope: input
    action: halt
"""

# Small enough that tests reach every bound cheaply; each is in docs/configuration.md.
TIGHT_ENV = {
    "FINSIEVE_MAX_INPUT_BYTES": "16384",
    "FINSIEVE_MAX_MESSAGES": "16",
    "FINSIEVE_MAX_MESSAGE_BYTES": "131072",
    "FINSIEVE_MAX_IN_FLIGHT_PER_STREAM": "4",
    "FINSIEVE_MAX_IN_FLIGHT_PER_CONNECTION": "6",
    "FINSIEVE_MAX_STREAMS": "24",
    "FINSIEVE_OUTBOX_MAX_EVENTS": "64",
    "FINSIEVE_SLOW_READER_GRACE_S": "2",
    "FINSIEVE_RULES_DEBOUNCE_MS": "20",
    "FINSIEVE_RULES_MAX_BYTES": "1048576",
    "FINSIEVE_CACHE_TTL_S": "0",  # every request reaches the engine
    # The fuzzers send hundreds of requests a second: no tenant rate here (test_identity.py
    # tests tenants' limits).
    "FINSIEVE_TENANT_REQUESTS_PER_S": "0",
    "FINSIEVE_TENANT_TOKENS_PER_MIN": "0",
    # The HTTP door's bounds (test_openai_http.py).
    "FINSIEVE_HTTP_MAX_BODY_BYTES": "65536",
    "FINSIEVE_HTTP_MAX_HEADER_BYTES": "8192",
    "FINSIEVE_HTTP_READ_TIMEOUT_S": "2",
    "FINSIEVE_HTTP_SSE_KEEPALIVE_S": "1",
}


@dataclass
class TightServer:
    server: Server
    rules: Path  # its rules directory: tests write packs here
    metrics_url: str

    @property
    def target(self) -> str:
        return self.server.target

    @property
    def http(self) -> str:
        return self.server.http

    @functools.cached_property
    def engine_target(self) -> str:
        import json

        for line in self.server.log().splitlines():
            if '"engine serving"' in line:
                return json.loads(line)["address"]
        raise AssertionError("no engine address in the log")

    @functools.cached_property
    def _engine(self) -> engine_pb2_grpc.EngineStub:
        return engine_pb2_grpc.EngineStub(grpc.insecure_channel(self.engine_target))

    def engine_info(self) -> engine_pb2.EngineInfo:
        """The engine's Info, called as a gateway does: with the engine secret."""
        secret = self.engine_secret_file.read_text().strip()
        return self._engine.Info(engine_pb2.InfoRequest(), timeout=30,
                                 metadata=(("authorization", f"Bearer {secret}"),))

    @property
    def engine_secret_file(self) -> Path:
        return self.server.state.parent / "engine.secret"

    def metric(self, name: str, **labels: str) -> float:
        """A counter's value from the server's Prometheus endpoint (0 if not yet counted)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0
