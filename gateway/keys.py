"""API keys: issued once, stored only as keyed hashes in Redis, verified with a short cache.

A key reads `fsk_<id>_<secret>`. Redis holds, per id, HMAC-SHA256(server key, whole key)
and the key's tenant, role, name, creation, expiry, revocation and all-tenants grant; the
server key lives in a 0600 file (FINSIEVE_KEYS_SECRET_FILE), so a copy of Redis yields no
usable key and cannot be brute-forced offline. Verified keys are cached for
FINSIEVE_KEY_CACHE_S, so a request costs no Redis round trip in the common case and a
revocation takes effect on every gateway within that time. Redis contents are checked like
any input: a malformed entry authenticates nobody.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass

# cast: connect()'s clients return bytes (decode_responses off); redis-py types replies bytes | str.
from typing import cast

import structlog
from redis.typing import EncodableT

from finsieve.auth import ROLES, CheckUnavailable, Principal, Unauthenticated
from finsieve.valkey import ERRORS, Client

log = structlog.get_logger(__name__)

PREFIX = "fsk"
TAG = "{finsieve-keys}"
INDEX = f"{TAG}:index"  # sorted set of key ids by creation time
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
KEY_RE = re.compile(r"^fsk_([0-9a-f]{16})_([0-9a-f]{64})$")
KEY_ID_RE = re.compile(r"^[0-9a-f]{16}$")
MAX_NAME = 128
MAX_EXPIRY_S = 10 * 365 * 86400
STALE_IF_ERROR_S = 60.0  # how long a verified key outlives its cache entry while Redis is down


def record_key(key_id: str) -> str:
    return f"{TAG}:key:{key_id}"


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    tenant: str
    role: str
    name: str
    created_ms: int
    expires_ms: int  # 0: never
    all_tenants: bool
    revoked_ms: int  # 0: not revoked
    created_by: str

    def usable(self, now_ms: int) -> str:
        """Why the key cannot be used now ("" when it can)."""
        if self.revoked_ms:
            return "revoked"
        if self.expires_ms and now_ms >= self.expires_ms:
            return "expired"
        return ""

    def principal(self, credential: str) -> Principal:
        return Principal(self.key_id, self.tenant, self.role, self.all_tenants, self.name,
                         credential)


def new_key_problem(tenant: str, role: str, name: str, expires_in_s: int,
                    all_tenants: bool) -> tuple[str, str] | None:
    """(field, what is wrong) for a key that cannot be issued as asked; None when it can."""
    if not TENANT_RE.match(tenant):
        return "tenant", "1-64 letters, digits, '.', '_' or '-'"
    if role not in ROLES:
        return "role", f"one of {', '.join(ROLES)}"
    if len(name) > MAX_NAME or any(unicodedata.category(c)[0] == "C" for c in name):
        return "name", f"at most {MAX_NAME} printable characters"
    if not 0 <= expires_in_s <= MAX_EXPIRY_S:
        return "expires_in_s", f"0 (never) to {MAX_EXPIRY_S} seconds"
    if all_tenants and role == "app":
        return "all_tenants", "only officer and admin keys may have it"
    return None


def _parse(key_id: str, fields: dict[bytes, bytes]) -> tuple[KeyInfo, str] | None:
    """A stored entry as (KeyInfo, hash), or None when any part of it is not well formed."""
    try:
        f = {k.decode(): v.decode() for k, v in fields.items()}
        info = KeyInfo(key_id, f["tenant"], f["role"], f.get("name", ""), int(f["created_ms"]),
                       int(f.get("expires_ms", "0")), f.get("all_tenants", "0") == "1",
                       int(f.get("revoked_ms", "0")), f.get("created_by", ""))
        digest = f["hash"]
    except (KeyError, ValueError, UnicodeDecodeError):
        return None
    if (info.role not in ROLES or not TENANT_RE.match(info.tenant)
            or not re.fullmatch(r"[0-9a-f]{64}", digest)):
        return None
    return info, digest


class KeyStore:
    def __init__(self, client: Client, hash_key: bytes, cache_s: float = 5.0,
                 cache_max: int = 10000) -> None:
        self.redis = client
        self._hash_key = hash_key
        self._cache_s = cache_s
        self._cache_max = cache_max
        # keyed hash of a presented key -> (its entry, when it was read from Redis)
        self._cache: OrderedDict[str, tuple[KeyInfo, float]] = OrderedDict()

    def digest(self, key: str) -> str:
        return hmac.new(self._hash_key, key.encode(), hashlib.sha256).hexdigest()

    # -- issuing --------------------------------------------------------------------------

    async def create(self, tenant: str, role: str, name: str = "", expires_ms: int = 0,
                     all_tenants: bool = False, created_by: str = "") -> tuple[str, KeyInfo]:
        """A new key (returned once, never stored) and its entry. Callers validate inputs."""
        while True:
            key_id, secret = secrets.token_hex(8), secrets.token_hex(32)
            key = f"{PREFIX}_{key_id}_{secret}"
            info = KeyInfo(key_id, tenant, role, name, int(time.time() * 1000), expires_ms,
                           all_tenants, 0, created_by)
            fields: dict[EncodableT, EncodableT] = {  # a Redis hash
                "hash": self.digest(key), "tenant": tenant, "role": role, "name": name,
                "created_ms": info.created_ms, "expires_ms": expires_ms,
                "all_tenants": int(all_tenants), "revoked_ms": 0, "created_by": created_by}
            if await self.redis.hsetnx(record_key(key_id), "hash", fields["hash"]):
                break  # a fresh id (a collision of 64 random bits is not expected, but cheap)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(record_key(key_id), mapping=fields)
            pipe.zadd(INDEX, {key_id: info.created_ms})
            await pipe.execute()
        return key, info

    async def revoke(self, key_id: str) -> KeyInfo | None:
        info = await self.get(key_id)
        if info is None or info.revoked_ms:
            return info
        now = int(time.time() * 1000)
        await self.redis.hset(record_key(key_id), "revoked_ms", now)
        for digest, (cached, _) in list(self._cache.items()):
            if cached.key_id == key_id:
                del self._cache[digest]
        return KeyInfo(**{**info.__dict__, "revoked_ms": now})

    # -- reading --------------------------------------------------------------------------

    async def get(self, key_id: str) -> KeyInfo | None:
        if not KEY_ID_RE.match(key_id):
            return None
        parsed = _parse(key_id, cast("dict[bytes, bytes]", await self.redis.hgetall(record_key(key_id))))
        return parsed[0] if parsed else None

    async def list(self, tenant: str = "", include_revoked: bool = False, offset: int = 0,
                   limit: int = 100) -> tuple[list[KeyInfo], int | None]:
        """Entries oldest first, filtered; and the offset of the next page (None: last)."""
        out: list[KeyInfo] = []
        pos = offset
        while True:
            ids = cast("list[bytes]", await self.redis.zrange(INDEX, pos, pos + max(limit, 200) - 1))
            if not ids:
                return out, None
            names = [raw.decode(errors="replace") for raw in ids]
            async with self.redis.pipeline(transaction=False) as pipe:
                for key_id in names:
                    pipe.hgetall(record_key(key_id))
                entries = await pipe.execute()
            for k, (key_id, fields) in enumerate(zip(names, entries, strict=True)):
                parsed = _parse(key_id, fields) if KEY_ID_RE.match(key_id) else None
                info = parsed[0] if parsed else None
                if (info is not None and (not tenant or info.tenant == tenant)
                        and (include_revoked or not info.revoked_ms)):
                    out.append(info)
                    if len(out) == limit:
                        return out, pos + k + 1
            pos += len(ids)

    # -- verifying ------------------------------------------------------------------------

    async def verify(self, key: str) -> Principal:
        """The principal a presented key stands for. Raises Unauthenticated (reason for logs)."""
        match = KEY_RE.match(key)
        if match is None:
            raise Unauthenticated("not a finsieve key")
        return await self._check(match[1], self.digest(key))

    async def check_again(self, principal: Principal) -> bool:
        """Whether the principal's key is still valid (not revoked or expired since).
        Raises CheckUnavailable when that cannot be known."""
        try:
            await self._check(principal.key_id, principal.credential)
        except Unauthenticated:
            return False
        return True

    async def _check(self, key_id: str, digest: str) -> Principal:
        info = await self._entry(key_id, digest)
        if why := info.usable(int(time.time() * 1000)):
            raise Unauthenticated(f"key {key_id} is {why}")
        return info.principal(digest)

    async def _entry(self, key_id: str, digest: str) -> KeyInfo:
        """The entry of a presented key: cached, or read from Redis and compared."""
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and now - cached[1] < self._cache_s:
            return cached[0]
        try:
            parsed = _parse(key_id, cast("dict[bytes, bytes]", await self.redis.hgetall(record_key(key_id))))
        except ERRORS as e:
            # Nothing can be revoked while Redis is down: a key verified a moment ago stays
            # good for a while (not refreshed); an unknown one cannot be checked.
            if cached is not None and now - cached[1] < STALE_IF_ERROR_S:
                return cached[0]
            raise CheckUnavailable(f"key store unreachable ({type(e).__name__})") from None
        if parsed is None:
            self._cache.pop(digest, None)
            raise Unauthenticated(f"unknown or malformed key {key_id}")
        info, stored = parsed
        if not hmac.compare_digest(stored, digest):
            raise Unauthenticated(f"wrong secret for key {key_id}")
        self._cache[digest] = (info, now)
        self._cache.move_to_end(digest)
        while len(self._cache) > self._cache_max:
            self._cache.popitem(last=False)
        return info
