"""Console sessions: an officer logs in with an officer key and gets a session cookie.

The cookie (`__Host-`: Secure, no Domain, Path=/; HttpOnly; SameSite=Strict; Max-Age the
session's life) holds a random token; Redis holds, under the token's SHA-256 (so a copy of
Redis opens no session), who logged in, the session's CSRF token and its end. Every request
checks the officer's key again (a revoked or expired key ends its sessions within the key
cache's lifetime), and a session never outlives FINSIEVE_CONSOLE_SESSION_S. Sessions live in
Redis, so any gateway's console serves them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import asdict, dataclass

from finsieve.auth import Principal
from finsieve.valkey import Client

from ..keys import KeyStore

SESSION_COOKIE = "__Host-finsieve-session"
LOGIN_COOKIE = "__Host-finsieve-login"  # the login form's CSRF token (double submit)
PREFIX = "{finsieve-console}:session:"
ROLE = "officer"  # the only role the console serves: apps chat, admins manage keys
TOKEN_RE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
MAX_TOKEN = 64


@dataclass(frozen=True)
class Session:
    officer: Principal
    csrf: str
    ends_ms: int

    def csrf_ok(self, sent: str) -> bool:
        return hmac.compare_digest(self.csrf.encode(), sent.encode())


def token_shape_ok(token: str) -> bool:
    return 0 < len(token) <= MAX_TOKEN and set(token) <= TOKEN_RE_CHARS


def _key(token: str) -> str:
    return PREFIX + hashlib.sha256(token.encode()).hexdigest()


def cookie_header(name: str, value: str, max_age: int) -> str:
    """A `__Host-` cookie: Secure, no Domain, Path=/; HttpOnly; SameSite=Strict."""
    return f"{name}={value}; Max-Age={max_age}; Path=/; Secure; HttpOnly; SameSite=Strict"


class Sessions:
    def __init__(self, client: Client, keys: KeyStore, lifetime_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.lifetime_s = lifetime_s

    async def open(self, officer: Principal) -> tuple[str, Session]:
        token = secrets.token_urlsafe(32)
        session = Session(officer, secrets.token_urlsafe(32),
                          int(time.time() * 1000) + self.lifetime_s * 1000)
        body = {"officer": asdict(officer), "csrf": session.csrf, "ends_ms": session.ends_ms}
        await self.redis.set(_key(token), json.dumps(body), ex=self.lifetime_s)
        return token, session

    async def get(self, token: str) -> Session | None:
        """The live session of a cookie's token, its officer's key still valid; None
        otherwise. Raises CheckUnavailable when the key cannot be checked now."""
        if not token_shape_ok(token):
            return None
        raw = await self.redis.get(_key(token))
        if raw is None:
            return None
        try:
            body = json.loads(raw)
            session = Session(Principal(**body["officer"]), str(body["csrf"]), int(body["ends_ms"]))
        except (ValueError, TypeError, KeyError):
            return None  # Redis is untrusted input too
        if session.ends_ms <= time.time() * 1000 or session.officer.role != ROLE:
            return None
        if not await self.keys.check_again(session.officer):
            await self.close(token)
            return None
        return session

    async def close(self, token: str) -> None:
        if token_shape_ok(token):
            await self.redis.delete(_key(token))

