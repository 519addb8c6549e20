"""Engines and gateways as separate processes on loopback, clients that keep every event, and
the checks a chaos test ends with: the audit trail verifies, and every request a client saw
end has its records in it (each audit_id a client received names its request_started)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from finsieve.app.client import wait_ready
from finsieve.v1 import chat_pb2

from support.processes import wait_for
from support.servers import Server, free_port, start_server
from support.streams import ChatStream, text_of

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]

# Short keepalive, so that a stopped engine is found within seconds; every request reaches an
# engine (no cache, no tenant rates); each audit record is fsynced before it is acknowledged.
ENV = {
    "FINSIEVE_ENGINE_KEEPALIVE_TIME_S": "1",
    "FINSIEVE_ENGINE_KEEPALIVE_TIMEOUT_S": "1",
    "FINSIEVE_ENGINE_CONNECT_TIMEOUT_S": "2",
    "FINSIEVE_CACHE_TTL_S": "0",
    "FINSIEVE_TENANT_REQUESTS_PER_S": "0",
    "FINSIEVE_TENANT_TOKENS_PER_MIN": "0",
    "FINSIEVE_APPENDFSYNC": "always",
    "FINSIEVE_DRAIN_SECONDS": "60",
}


@dataclass
class Fleet:
    """The processes of one test, each stopped at the end (a stopped one continued first)."""

    tmp: Path
    model: Path
    env: dict[str, str] = field(default_factory=dict)
    servers: list[Server] = field(default_factory=list)

    @classmethod
    def new(cls, tmp: Path, model: Path, **env: str) -> Fleet:
        secret = tmp / "engine.secret"  # shared by the gateways and the engines
        secret.write_text(os.urandom(32).hex())
        secret.chmod(0o600)
        return cls(tmp, model, {**ENV, "FINSIEVE_ENGINE_SECRET_FILE": str(secret), **env})

    def engines(self, count: int, *args: str, ports: list[int] | None = None) -> list[Server]:
        """`count` engines (their metrics served), started together; each Server's target is
        its engine address and `metrics` its metrics URL."""
        ports = ports or [free_port() for _ in range(count)]
        started = []
        for port in ports:
            directory = self.tmp / f"engine-{port}-{len(self.servers)}"
            directory.mkdir()
            metrics = free_port()
            server = start_server(directory, "--role", "engine", "--engine-port", str(port),
                                  "--model", str(self.model), "--no-rules", "--metrics-port",
                                  str(metrics), *args, env=self.env, ready=False)
            server.target = f"127.0.0.1:{port}"
            server.metrics = f"http://127.0.0.1:{metrics}/metrics"
            self.servers.append(server)
            started.append(server)

        async def ready() -> list[bool]:
            return await asyncio.gather(*(wait_ready(s.target, 180) for s in started))

        assert all(asyncio.run(ready())), "\n".join(s.log()[-3000:] for s in started)
        return started

    def gateway(self, *args: str, directory: Path | None = None) -> Server:
        directory = directory or self.tmp / f"gateway-{len(self.servers)}"
        directory.mkdir(exist_ok=True)
        server = start_server(directory, "--role", "gateway", "--no-rules", *args, env=self.env)
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for server in self.servers:
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGCONT)
                try:
                    server.stop(timeout=90)
                except subprocess.TimeoutExpired:
                    server.stop(signal.SIGKILL)


def generated_tokens(engine: Server) -> float:
    """The engine's finsieve_generated_tokens_total (0 when it cannot be read)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(engine.metrics, timeout=5).read().decode()
    except OSError:
        return 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "finsieve_generated_tokens_total":
                return sample.value
    return 0.0


def log_lines(server: Server, event: str) -> list[dict]:
    """The server's JSON log lines whose event is `event`."""
    return server.records(event)


# -- clients ------------------------------------------------------------------------------------


def request(request_id: str, max_tokens: int) -> chat_pb2.ChatRequest:
    """A request whose answer goes on past max_tokens (the default model's, greedy)."""
    from finsieve.app.client import chat_request

    return chat_request(request_id, "Describe the bond market in detail.", max_tokens=max_tokens)


def terminal(events: list) -> chat_pb2.ChatServerMessage:
    return events[-1]


def delivered_before_end(events: list) -> bool:
    return any(e.WhichOneof("event") in ("delta", "policy_event") for e in events[:-1])


def check_outcome(events: list) -> str:
    """"finished", or "unavailable" for an UNAVAILABLE with a retry hint; any other end fails."""
    end = terminal(events)
    if end.WhichOneof("event") == "finished":
        assert end.finished.audit_id and text_of(events), events
        return "finished"
    assert end.WhichOneof("event") == "error", events
    assert end.error.code == UNAVAILABLE and end.error.retry_after_ms > 0, end
    return "unavailable"


async def streaming(stream: ChatStream, count: int) -> set[str]:
    """Read until `count` requests have delivered text; their ids."""
    seen: set[str] = set()
    while len(seen) < count:
        e = await stream.next(180)
        assert e.WhichOneof("event") not in ("finished", "error"), \
            f"a request ended before {count} were streaming: {e}"
        if e.WhichOneof("event") == "delta":
            seen.add(e.request_id)
    return seen


def ask(target: str, request_id: str, max_tokens: int = 4) -> list:
    async def go() -> list:
        async with ChatStream(target) as s:
            s.send(request(request_id, max_tokens))
            return (await s.until_done(request_id, timeout=180))[request_id]
    return asyncio.run(go())


# -- the audit trail ----------------------------------------------------------------------------


def audit(gateway: Server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "finsieve.app.cli", "audit", *args, "--target",
                           gateway.audit_target, "--state-dir", str(gateway.state)],
                          capture_output=True, text=True, timeout=120)


def check_trail(gateway: Server, outcomes: dict[str, list]) -> list[dict]:
    """`audit verify` passes; every request the clients saw end has its final record, and
    each audit_id they received names the request_started record of that request. Returns
    the trail."""
    def trail() -> list[dict]:
        out = audit(gateway, "export", "--since", "1h")
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]

    def final_records_in() -> bool:  # written after the client has the terminal event
        have = {r.get("request_id") for r in trail() if r["type"] == "request"}
        return set(outcomes) <= have

    assert wait_for(final_records_in, 60, 0.5)
    verified = audit(gateway, "verify")
    assert verified.returncode == 0 and "intact" in verified.stdout, verified.stdout + verified.stderr
    records = trail()
    by_seq = {r["seq"]: r for r in records}
    for request_id, events in outcomes.items():
        (final,) = [r for r in records if r["type"] == "request" and r["request_id"] == request_id]
        end = terminal(events)
        if end.WhichOneof("event") == "finished":
            started = by_seq[int(end.finished.audit_id)]
            assert (started["type"], started["request_id"]) == ("request_started", request_id)
            assert final["audit_id"] == started["seq"] and final["delivered"] == text_of(events)
        else:
            assert final["finish_reason"] == "ERROR" and final["error"]["code"] == end.error.code
    return records


def moves(records: list[dict]) -> list[dict]:
    return [r for r in records if r["type"] == "request_moved"]
