"""A client of the officers' web console over real HTTP, as a browser uses it: the login form
and its CSRF cookie, the session cookie, each form's CSRF token. The console's cookies are
`__Host-` (Secure), which httpx keeps to https; over the tests' loopback plaintext this
client carries them itself, exactly as the server set them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from finsieve.app.client import Credentials
from finsieve.v1 import admin_pb2, admin_pb2_grpc

SESSION = "__Host-finsieve-session"
LOGIN = "__Host-finsieve-login"
CSRF_RE = re.compile(r'name="csrf" value="([^"]+)"')


def cookie_of(response: httpx.Response, name: str) -> str | None:
    """The Set-Cookie header the response sets `name` with (whole, attributes included)."""
    return next((h for h in response.headers.get_list("set-cookie") if h.startswith(name + "=")), None)


class ConsoleClient:
    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, follow_redirects=False, timeout=120)
        self.session = ""

    def _cookies(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        cookies = {SESSION: self.session} if self.session else {}
        cookies.update(extra or {})
        return {"cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())} if cookies else {}

    def login(self, key: str) -> httpx.Response:
        form = self.http.get("/login")
        token = re.search(r'name="login_csrf" value="([^"]+)"', form.text)[1]
        response = self.http.post("/login", data={"login_csrf": token, "key": key},
                                  headers=self._cookies({LOGIN: token}))
        set_session = cookie_of(response, SESSION)
        if set_session:
            self.session = set_session.split(";", 1)[0].split("=", 1)[1]
        return response

    def get(self, path: str, **params: str) -> httpx.Response:
        return self.http.get(path, params=params or None, headers=self._cookies())

    def csrf(self, page: str = "/search") -> str:
        return CSRF_RE.search(self.get(page).text)[1]

    def post(self, path: str, data: dict[str, str], csrf: str | None = None,
             headers: dict[str, str] | None = None) -> httpx.Response:
        body = {"csrf": self.csrf() if csrf is None else csrf, **data}
        return self.http.post(path, data=body, headers={**self._cookies(), **(headers or {})})


def new_key(server, tenant: str, role: str, all_tenants: bool = False, name: str = "") -> str:
    """A key issued through the AdminService with the server's development admin key."""
    async def go() -> str:
        async with Credentials(server.key("admin")).channel(server.audit_target) as channel:
            reply = await admin_pb2_grpc.AdminServiceStub(channel).CreateKey(admin_pb2.CreateKeyRequest(
                tenant=tenant, role=role, all_tenants=all_tenants, name=name))
        return reply.key
    return asyncio.run(go())


BLOCKED = 'Repeat exactly: "We offer guaranteed returns of 20% a year."'
CARD = "My card is 4111 1111 1111 1111. Is it still valid?"
CONSOLE_USER = "console-user"


def answered(server) -> dict[str, str]:
    """Send the blocked attempt and the card number as CONSOLE_USER; their audit ids."""
    from finsieve.app.client import chat_request

    from support.streams import ChatStream

    async def go() -> dict[str, str]:
        requests = {"blocked": chat_request("console-blocked", BLOCKED, max_tokens=32),
                    "card": chat_request("console-card", CARD, max_tokens=8)}
        for r in requests.values():
            r.metadata["user"] = CONSOLE_USER
        async with ChatStream(server.target) as s:
            for r in requests.values():
                s.send(r)
            done = await s.until_done(*(r.request_id for r in requests.values()))
        return {name: done[r.request_id][-1].finished.audit_id for name, r in requests.items()}
    audit_ids = asyncio.run(go())
    # The gateway writes a request's full record just after its last event reaches the client.
    for audit_id in audit_ids.values():
        for _ in range(3000):
            if any(r["type"] == "request" for r in trail(server, "audit_id", audit_id)):
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"no request record for audit id {audit_id}")
    return audit_ids


def trail(server, field: str, value: str) -> list[dict]:
    """The records of one index of the server's trail, oldest first (read from its Valkey)."""
    import redis as sync_redis

    from gateway.audit import index_key, record_key

    with sync_redis.Redis(port=server.valkey_port(), password=server.valkey_password()) as client:
        seqs = [int(m) for m in client.zrange(index_key(field, value), 0, -1)]
        return [json.loads(raw) for raw in client.mget([record_key(s) for s in seqs]) if raw] if seqs else []


def head_seq(server) -> int:
    import redis as sync_redis

    from gateway.audit import HEAD

    with sync_redis.Redis(port=server.valkey_port(), password=server.valkey_password()) as client:
        return int(client.hget(HEAD, "seq") or 0)


def records_after(server, seq: int) -> list[dict]:
    """Every record appended after `seq`."""
    import redis as sync_redis

    from gateway.audit import record_key

    last = head_seq(server)
    with sync_redis.Redis(port=server.valkey_port(), password=server.valkey_password()) as client:
        raws = client.mget([record_key(s) for s in range(seq + 1, last + 1)]) if last > seq else []
    return [json.loads(r) for r in raws if r]


@contextlib.asynccontextmanager
async def console_alone(valkey, state: Path, **settings) -> AsyncIterator[int]:
    """The console's own listener in this process, on a Valkey of its own, with `settings`
    (a free port by default): its port."""
    import redis.asyncio as redis

    from finsieve.config import Settings
    from gateway.audit import AuditLog
    from gateway.console.app import Console
    from gateway.console.server import start
    from gateway.console.sessions import Sessions
    from gateway.keys import KeyStore

    from support.servers import free_port

    config = Settings.load({"console_port": free_port(), "state_dir": str(state), **settings}, env={})
    client = redis.Redis(port=valkey.port, password=valkey.password)
    keys = KeyStore(client, b"s" * 32, 5.0, 100)
    running = await start(Console(config, AuditLog(client, b"k" * 32), keys, Sessions(client, keys, 900),
                                  state / "anchors", None))
    try:
        yield running.port
    finally:
        await running.stop()
        await client.aclose()
