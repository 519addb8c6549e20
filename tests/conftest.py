"""Shared fixtures: real servers (subprocesses on loopback), the real default model."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from finsieve.app.client import chat_request, wait_ready
from finsieve.policy.pack import Pack
from finsieve.policy.schema import PackError
from finsieve.policy.sources import PackLimits
from finsieve.v1 import chat_pb2, engine_pb2, engine_pb2_grpc

# torch's CPU threads (OpenMP) spin at each of a step's hundreds of barriers by default. On
# this suite's 2-core machines a thread that spins keeps a core from the one it waits for
# whenever anything else runs: the client, a server's gateway threads, another server, a CI
# neighbour. One busy process beside the in-process engine made a decode step 3.6x slower
# (10 tokens: 1.16 s -> 4.18 s), 0.2 -> 2.0 s a token beside a neighbour's test run; waiting
# passively, 1.3 s idle and 1.9 s beside the busy process. Set before torch is imported,
# here and in every server the tests start (they inherit the environment); the same
# threads compute the same results either way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
# The converted default model is prepared once by `make setup` and shared by all tests.
MODEL_STATE = REPO / ".finsieve"
# Per-tenant limits of the session server, for the tenants test_identity.py makes keys for.
SESSION_LIMITS = "tenants:\n  t-tokens:\n    tokens_per_min: 10\n"


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

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def key(self, role: str) -> str:
        return dev_key(self.target, role)

    def valkey_port(self) -> int:
        return next(json.loads(line)["port"] for line in self.log().splitlines()
                    if '"embedded valkey started"' in line)

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
                 ready: bool = True, credentials=None) -> Server:
    """`finsieve serve` on free ports; waits for health (over TLS with `credentials`)."""
    port, audit_port = free_port(), free_port()
    log_path = tmp / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "finsieve.app.cli", "serve", "--port", str(port),
           "--audit-port", str(audit_port), "--state-dir", str(tmp / "state"), *args]
    full_env = {**os.environ, "FINSIEVE_LOG_FORMAT": "json", **(env or {})}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = Server(proc, f"127.0.0.1:{port}", f"127.0.0.1:{audit_port}", log_path, tmp / "state")
    _STATE_DIRS[server.target] = _STATE_DIRS[server.audit_target] = server.state
    if ready and not asyncio.run(wait_ready(server.target, 120, credentials)):
        server.stop(signal.SIGKILL)
        raise RuntimeError(f"server did not come up:\n{server.log()}")
    return server


@pytest.fixture
def valkey(tmp_path: Path):
    """A real valkey-server of its own (appendfsync always), for one test."""
    from finsieve.valkey import EmbeddedValkey

    server = EmbeddedValkey(tmp_path / "valkey", appendfsync="always")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from engine.loader import default_model_dir

    return default_model_dir(MODEL_STATE)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    """One full server (gateway + engine + embedded Valkey) for the session."""
    tmp = tmp_path_factory.mktemp("server")
    (tmp / "limits.yaml").write_text(SESSION_LIMITS)
    srv = start_server(tmp, "--model", str(default_model_dir), "--metrics-port", str(free_port()),
                       "--limits-file", str(tmp / "limits.yaml"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def engine(default_model_dir: Path):
    """The same model in-process, for non-streamed reference decodes."""
    import torch

    from engine.engine import EngineLimits, LLMEngine
    from engine.loader import load_model

    device = torch.device("cpu")
    model = load_model(str(default_model_dir), MODEL_STATE, device)
    return LLMEngine(model, EngineLimits(max_batch=8, max_context=2048, default_max_tokens=256), device)


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1, a client certificate for Bank A's mobile
    app, and one from a CA the server does not trust."""
    d = tmp_path_factory.mktemp("certs")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    def new_key_and(*args: str) -> list[str]:
        return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", *args]

    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", *new_key_and("-keyout", f"{ca}.key", "-out", f"{ca}.pem"),
                "-days", "2", "-subj", f"/CN={ca}")
    for name, subject, san, ca in [
            ("server", "/CN=localhost", "DNS:localhost,IP:127.0.0.1", "ca"),
            ("client", "/O=Bank A/CN=mobile-app", "URI:spiffe://bank-a/mobile", "ca"),
            ("stranger", "/O=Bank A/CN=mobile-app", "URI:spiffe://bank-a/mobile", "other-ca")]:
        openssl("req", *new_key_and("-keyout", f"{name}.key", "-out", f"{name}.csr"),
                "-subj", subject)
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return d


def pids_named(name: str) -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
            if state == "Z":  # exited, waiting to be reaped by its parent
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


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


def text_of(events: list) -> str:
    return "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")


def kinds(events: list) -> list[str]:
    return [e.WhichOneof("event") for e in events]


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

# Small enough that tests reach every bound cheaply; see the README's table for each.
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
}


@dataclass
class TightServer:
    server: Server
    rules: Path  # its rules directory: tests write packs here
    metrics_url: str

    @property
    def target(self) -> str:
        return self.server.target

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


@pytest.fixture(scope="session")
def tight_server(tmp_path_factory: pytest.TempPathFactory,
                 default_model_dir: Path) -> Iterator[TightServer]:
    tmp = tmp_path_factory.mktemp("tight")
    rules = tmp / "rules"
    rules.mkdir()
    (rules / "canary.yaml").write_text(CANARY)
    metrics = free_port()
    secret = tmp / "engine.secret"  # its engine's secret: tests call the engine as a gateway
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    srv = start_server(tmp, "--model", str(default_model_dir), "--rules", str(rules),
                       "--luts", str(tmp / "luts"), "--metrics-port", str(metrics),
                       env={**TIGHT_ENV, "FINSIEVE_ENGINE_SECRET_FILE": str(secret)})
    yield TightServer(srv, rules, f"http://127.0.0.1:{metrics}/metrics")
    srv.stop()


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


def wait_for(condition, timeout: float = 30.0, every: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(every)
    return False


TIGHT_LIMITS = PackLimits(max_bytes=int(TIGHT_ENV["FINSIEVE_RULES_MAX_BYTES"]))


def apply(tight_server: TightServer, change) -> engine_pb2.EngineInfo:
    """Change the running server's rules directory and wait until its engine shows the outcome
    the same loader gives here: the new version in force, or one more rejection."""
    return reload(tight_server, change)[0]


def reload(tight_server: TightServer, change,
           before: engine_pb2.EngineInfo | None = None) -> tuple[engine_pb2.EngineInfo, str | None]:
    """apply(), given the engine's Info from before the change if the caller has it; also
    returns the version the loader here gives the directory (None: it rejects it)."""
    before = before or tight_server.engine_info()
    change()
    try:
        expected = Pack.load(tight_server.rules, TIGHT_LIMITS).version
    except PackError:
        expected = None

    def seen() -> bool:
        info = tight_server.engine_info()
        if expected is None:
            return info.pack_rejections > before.pack_rejections
        return info.policy_version == expected

    # Polled often: the outcome is there ~30 ms after the change (the watcher's 20 ms step,
    # then the compile), and the fuzzer waits for a thousand of them.
    assert wait_for(seen, 60, every=0.005)
    return tight_server.engine_info(), expected


def canary_halts(tight_server) -> bool:
    """The input rule in canary.yaml is in force: a message containing it is not decoded."""
    async def go():
        async with ChatStream(tight_server.target) as s:
            s.send(chat_request("canary", "say: canary phrase", max_tokens=2))
            return (await s.until_done("canary"))["canary"]

    events = asyncio.run(go())
    return (events[-1].finished.finish_reason == chat_pb2.FINISH_REASON_CONTENT_FILTER
            and any(e.policy_event.rule_id == "canary" for e in events))
