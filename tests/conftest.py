"""Shared fixtures: real servers (subprocesses on loopback), the real default model."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from finsieve.client import wait_ready

REPO = Path(__file__).resolve().parents[1]
# The converted default model is prepared once by `make setup` and shared by all tests.
MODEL_STATE = REPO / ".finsieve"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    target: str
    audit_target: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


def start_server(tmp: Path, *args: str, env: dict[str, str] | None = None,
                 ready: bool = True) -> Server:
    port, audit_port = free_port(), free_port()
    log_path = tmp / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "finsieve.cli", "serve", "--port", str(port),
           "--audit-port", str(audit_port), "--state-dir", str(tmp / "state"), *args]
    full_env = {**os.environ, "FINSIEVE_LOG_FORMAT": "json", **(env or {})}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = Server(proc, f"127.0.0.1:{port}", f"127.0.0.1:{audit_port}", log_path)
    if ready and not asyncio.run(wait_ready(server.target, 120)):
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
    from finsieve.engine.loader import default_model_dir

    return default_model_dir(MODEL_STATE)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    """One full server (gateway + engine + embedded Valkey) for the session."""
    srv = start_server(tmp_path_factory.mktemp("server"), "--model", str(default_model_dir),
                       "--metrics-port", str(free_port()))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def engine(default_model_dir: Path):
    """The same model in-process, for non-streamed reference decodes."""
    import torch

    from finsieve.engine.engine import EngineLimits, LLMEngine
    from finsieve.engine.loader import load_model

    device = torch.device("cpu")
    model = load_model(str(default_model_dir), MODEL_STATE, device)
    return LLMEngine(model, EngineLimits(max_batch=8, max_context=2048, default_max_tokens=256), device)


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
    """A real client stream on which a test sends requests and cancels and reads events."""

    def __init__(self, target: str) -> None:
        import grpc

        from finsieve.grpc_server import CHANNEL_OPTIONS
        from finsieve.v1 import chat_pb2_grpc

        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._call = chat_pb2_grpc.GatewayStub(self._channel).Chat(self._requests())
        self.events: list = []  # every event received, in order

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
        from finsieve.client import is_terminal

        waiting = set(request_ids)
        while waiting:
            event = await self.next(timeout)
            if is_terminal(event):
                waiting.discard(event.request_id)
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
    from finsieve.client import chat_request

    req = chat_request(request_id, question, **kw)
    req.metadata.update({"tenant": "bank-a", "app": "mobile", "user": "alice"})
    return req


def wait_cached(server: Server, events: list, request) -> None:
    """Wait until the server's embedded Valkey holds the answer's cache entry: the gateway
    stores it after the client has the answer."""
    import json

    import redis

    from finsieve.gateway.cache import cache_key

    port = next(json.loads(line)["port"] for line in server.log().splitlines()
                if '"embedded valkey started"' in line)
    started = events[0].started
    key = cache_key(request.metadata.get("tenant", ""), started.model, started.policy_version, request)
    with redis.Redis(port=port) as client:
        for _ in range(1000):
            if client.exists(key):
                return
            time.sleep(0.01)
    raise AssertionError("the answer was never cached")


def text_of(events: list) -> str:
    return "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")


def kinds(events: list) -> list[str]:
    return [e.WhichOneof("event") for e in events]
