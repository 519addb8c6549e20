"""Clients that keep streaming through a gateway while a test breaks what is under it, and
the checks that follow: what statuses they got, whether every audit id they were given is
in the trail, and `finsieve audit verify`.

    with Clients(server.target, app_key) as clients:   # a thread of their own
        ...break something, wait, heal...
    outcomes = clients.outcomes
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import grpc

from finsieve.app.client import chat_request
from finsieve.valkey import connect
from gateway.audit import AuditLog, parse

from support.streams import ChatStream

# What a client may get while Redis fails: its answer, or UNAVAILABLE (the trail cannot be
# written, so the request is refused: fail closed; or the key store cannot be read).
CLEAR = {"OK", "UNAVAILABLE"}


@dataclass(frozen=True)
class Outcome:
    request_id: str
    status: str  # "OK", a gRPC status name, or TIMEOUT
    audit_id: int  # Finished.audit_id (0: none)
    message: str
    at: float  # time.monotonic() when it ended


class Clients:
    """`count` clients, each sending one short request after another on its own Chat stream
    (a new stream when one ends), until stopped; at most `limit` requests each, each bounded
    by `timeout` seconds."""

    def __init__(self, target: str, key: str, count: int = 3, max_tokens: int = 3,
                 limit: int = 400, timeout: float = 60) -> None:
        self.target, self.key, self.count = target, key, count
        self.max_tokens, self.limit, self.timeout = max_tokens, limit, timeout
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Clients:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2 * self.timeout)

    def ok_since(self, t: float) -> int:
        return sum(1 for o in self.outcomes if o.status == "OK" and o.at > t)

    async def _run(self) -> None:
        await asyncio.gather(*(self._client(n) for n in range(self.count)))

    async def _client(self, n: int) -> None:
        sent = 0
        while not self._stop.is_set() and sent < self.limit:
            try:
                async with ChatStream(self.target, self.key) as stream:
                    while not self._stop.is_set() and sent < self.limit:
                        rid = f"c{n}-{sent}"
                        sent += 1
                        stream.send(chat_request(rid, f"Say a colour ({rid}).", max_tokens=self.max_tokens))
                        last = (await stream.until_done(rid, timeout=self.timeout))[rid][-1]
                        self.outcomes.append(_outcome(rid, last))
                        if last.WhichOneof("event") == "error":  # as a client should: back off
                            await asyncio.sleep(max(0.2, last.error.retry_after_ms / 1000))
            except grpc.aio.AioRpcError as e:  # the stream itself ended
                self.outcomes.append(Outcome(f"c{n}-stream", e.code().name, 0, e.details() or "",
                                             time.monotonic()))
                await asyncio.sleep(0.2)
            except TimeoutError:
                self.outcomes.append(Outcome(f"c{n}-{sent - 1}", "TIMEOUT", 0, "", time.monotonic()))


def _outcome(rid: str, last) -> Outcome:
    if last.WhichOneof("event") == "finished":
        return Outcome(rid, "OK", int(last.finished.audit_id or 0), "", time.monotonic())
    return Outcome(rid, grpc.StatusCode(_code(last.error.code)).name, 0, last.error.message,
                   time.monotonic())


def _code(number: int) -> tuple:
    return next(c.value for c in grpc.StatusCode if c.value[0] == number)


def trail(url: str, key: bytes) -> dict[int, list[dict]]:
    """Every request_started record of the chain by seq, those carried by `restored` records
    (lost by a failover, appended again) under their own seq."""
    async def go() -> dict[int, list[dict]]:
        client = await connect(url, timeout=3)
        try:
            log = AuditLog(client, key)
            found: dict[int, list[dict]] = {}
            async for _, raw in log.records(1, (await log.head()).seq):
                rec = parse(raw) or {}
                inner = rec.get("restored") if rec.get("type") == "restored" else rec
                if isinstance(inner, dict) and inner.get("type") == "request_started":
                    found.setdefault(inner["seq"], []).append(inner)
            return found
        finally:
            await client.aclose()
    return asyncio.run(go())


def unrecorded(outcomes: list[Outcome], records: dict[int, list]) -> list[Outcome]:
    """The answers whose audit id names no request_started record of that request."""
    return [o for o in outcomes if o.status == "OK" and not any(
        r.get("request_id") == o.request_id for r in records.get(o.audit_id, []))]


def cli(*args: str, key: str, prefix: tuple[str, ...] = (),
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`finsieve <args>` with an API key (FINSIEVE_API_KEY), optionally inside a namespace."""
    return subprocess.run([*prefix, sys.executable, "-m", "finsieve.app.cli", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "FINSIEVE_API_KEY": key})


def make_key(url: str, state: str, role: str, *extra: str) -> str:
    """A key made with `keys create --direct` on FINSIEVE_REDIS_URL (no admin key exists)."""
    made = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "keys", "create", "--direct",
                           "--tenant", "chaos", "--role", role, "--state-dir", state, *extra],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FINSIEVE_REDIS_URL": url})
    assert made.returncode == 0, made.stderr
    return made.stdout.splitlines()[0]
