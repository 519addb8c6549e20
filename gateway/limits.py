"""Per-tenant limits shared by every gateway: requests/s, generated tokens/min, open streams.

Rates are token buckets in Redis, updated by one Lua script with Redis' own clock, so
several gateways draw from the same buckets and their clocks do not matter. Requests/s
allows a burst of one second's worth. Generated tokens are charged when a request
finishes; a tenant whose bucket is empty (in debt) gets no new request until it refills,
so it can overshoot by at most the requests it already has in flight. Open Chat streams
are leases in a sorted set, renewed while the stream lives, so a gateway that dies frees
its tenants' slots within STREAM_LEASE_MS.

Limits come from FINSIEVE_TENANT_* (defaults), FINSIEVE_LIMITS_FILE (per tenant), and
the AdminService (per tenant, in Redis, overriding the file). Redis trouble does not fail a
request: limits are a fairness control, not a compliance decision, so they fail open
(logged and counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, fields, replace
from pathlib import Path

# cast: connect()'s clients return bytes (decode_responses off); redis-py types replies bytes | str.
from typing import Any, cast

import structlog
from prometheus_client import Counter

from finsieve.config import Settings, load_yaml_file
from finsieve.errors import ConfigError
from finsieve.valkey import ERRORS, Client

from .keys import TENANT_RE

log = structlog.get_logger(__name__)

REFUSED = Counter("finsieve_rate_limited", "Refused by a per-tenant limit: requests (per second "
                  "or tokens per minute) or concurrent_streams", ["limit"])
LIMIT_ERRORS = Counter("finsieve_rate_limit_errors", "Limit checks skipped because Redis failed")

STREAM_LEASE_MS = 30_000
STREAM_RETRY_MS = 1_000  # a hint only: when a stream ends is not known
BOUNDS = {"requests_per_s": 1e6, "tokens_per_min": 1e12, "concurrent_streams": 1e6}

# ARGV holds (rate per ms, capacity, cost, need) per bucket. All buckets or none are drawn.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state, wait = {}, 0
for i = 1, #KEYS do
  local rate, cap = tonumber(ARGV[4*i-3]), tonumber(ARGV[4*i-2])
  local cost, need = tonumber(ARGV[4*i-1]), tonumber(ARGV[4*i])
  local b = redis.call('HMGET', KEYS[i], 't', 'at')
  local tokens, at = tonumber(b[1]), tonumber(b[2])
  if tokens == nil or at == nil or tokens ~= tokens or at ~= at then tokens, at = cap, now end
  if now > at then tokens = tokens + (now - at) * rate end
  tokens = math.max(-cap, math.min(cap, tokens))
  if tokens < need then wait = math.max(wait, math.ceil((need - tokens) / rate)) end
  state[i] = {math.max(-cap, tokens - cost), rate, cap}
end
if wait > 0 then return math.max(1, wait) end
for i = 1, #KEYS do
  local s = state[i]
  -- 10 significant digits, exponent always written: exact enough, and never a run of 13-19
  -- digits a PAN scanner flags (%g writes 0.002016666667: 13)
  redis.call('HSET', KEYS[i], 't', string.format('%.9e', s[1]), 'at', tostring(now))
  redis.call('PEXPIRE', KEYS[i], math.ceil(2 * s[3] / s[2]) + 1000)
end
return 0
"""

# ARGV: limit (-1: renew, never refuse), lease ms, member. 1: holds a slot; 0: refused.
_LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local limit = tonumber(ARGV[1])
if limit >= 0 and not redis.call('ZSCORE', KEYS[1], ARGV[3])
   and redis.call('ZCARD', KEYS[1]) >= limit then return 0 end
if limit < 0 then  -- a renewal: only a lease that is still held (never a closed stream's)
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[3])
else
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
end
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
return 1
"""


@dataclass(frozen=True)
class TenantLimits:
    """0 means unlimited."""

    requests_per_s: float = 0.0
    tokens_per_min: int = 0
    concurrent_streams: int = 0


FIELDS = tuple(f.name for f in fields(TenantLimits))


def checked(name: str, value: Any) -> float | int:
    """A limit's value, or ValueError saying what is wrong with it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("expected a number")
    if not (math.isfinite(value) and 0 <= value <= BOUNDS[name]):
        raise ValueError(f"expected 0 (unlimited) to {BOUNDS[name]:g}")
    if name != "requests_per_s":
        if value != int(value):
            raise ValueError("expected a whole number")
        return int(value)
    return float(value)


def _key(tenant: str, what: str) -> str:
    return f"{{finsieve-limits:{tenant}}}:{what}"


def load_limits_file(path: Path, setting: str = "FINSIEVE_LIMITS_FILE") -> dict[str, dict[str, Any]]:
    """`tenants: {name: {requests_per_s: .., tokens_per_min: .., concurrent_streams: ..}}`."""
    where = f"{setting} {path}"
    doc = load_yaml_file(path, setting)
    tenants = doc.get("tenants") if isinstance(doc, dict) else None
    if not isinstance(tenants, dict) or set(doc) != {"tenants"}:
        raise ConfigError(f"{where}: expected one mapping `tenants:` of tenant -> limits")
    table: dict[str, dict[str, Any]] = {}
    for tenant, values in tenants.items():
        if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
            raise ConfigError(f"{where}: tenants.{tenant}: not a tenant name "
                              "(1-64 letters, digits, '.', '_' or '-')")
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: tenants.{tenant}: expected a mapping of limits")
        table[tenant] = {}
        for name, value in values.items():
            if name not in FIELDS:
                raise ConfigError(f"{where}: tenants.{tenant}.{name}: unknown limit "
                                  f"(one of {', '.join(FIELDS)})")
            try:
                table[tenant][name] = checked(name, value)
            except ValueError as e:
                raise ConfigError(f"{where}: tenants.{tenant}.{name}: {e}") from None
    return table


class Limiter:
    def __init__(self, client: Client, defaults: TenantLimits,
                 per_tenant: dict[str, dict[str, Any]], cache_s: float = 5.0,
                 cache_max: int = 10000) -> None:
        self.redis = client
        self.defaults = defaults
        self.per_tenant = per_tenant
        self._cache_s = cache_s
        self._cache_max = cache_max
        self._cache: OrderedDict[str, tuple[TenantLimits, float]] = OrderedDict()
        self._take = client.register_script(_TAKE)
        self._lease = client.register_script(_LEASE)
        self._streams: dict[str, str] = {}  # lease member -> tenant, renewed while open

    # -- configuration ----------------------------------------------------------------------

    async def limits(self, tenant: str) -> TenantLimits:
        """In force for a tenant: the admin API's values over the file's over the defaults."""
        cached = self._cache.get(tenant)
        if cached is not None and time.monotonic() - cached[1] < self._cache_s:
            return cached[0]
        merged = {**self.per_tenant.get(tenant, {}), **await self._overrides(tenant)}
        limits = replace(self.defaults, **merged)
        self._cache[tenant] = (limits, time.monotonic())
        self._cache.move_to_end(tenant)
        while len(self._cache) > self._cache_max:
            self._cache.popitem(last=False)
        return limits

    async def set_overrides(self, tenant: str, values: dict[str, float | int]) -> TenantLimits:
        """Store per-tenant values (already checked); other gateways see them within cache_s."""
        await self.redis.hset(_key(tenant, "set"), mapping={k: repr(v) for k, v in values.items()})
        self._cache.pop(tenant, None)
        return await self.limits(tenant)

    async def _overrides(self, tenant: str) -> dict[str, float | int]:
        try:
            raw = cast("dict[bytes, bytes]", await self.redis.hgetall(_key(tenant, "set")))
        except ERRORS:
            return {}
        out: dict[str, float | int] = {}
        for k, v in raw.items():
            name = k.decode(errors="replace")
            try:  # Redis contents are input like any other: a bad value is ignored, and said
                out[name] = checked(name, float(v))
            except (KeyError, ValueError):
                log.warning("ignoring a malformed tenant limit in redis", tenant=tenant, limit=name)
        return out

    # -- checks -----------------------------------------------------------------------------

    async def admit(self, tenant: str) -> int:
        """Take one request from the tenant's buckets: 0, or milliseconds to wait."""
        limits = await self.limits(tenant)
        keys, args = [], []
        if limits.requests_per_s:
            keys.append(_key(tenant, "rps"))
            args += [limits.requests_per_s / 1000, max(1.0, limits.requests_per_s), 1, 1]
        if limits.tokens_per_min:  # only checked here: a bucket in debt admits nothing
            keys.append(_key(tenant, "tpm"))
            args += [limits.tokens_per_min / 60000, limits.tokens_per_min, 0, 1]
        if not keys:
            return 0
        wait = await self._run(self._take, keys, args)
        if wait:
            REFUSED.labels("requests").inc()
        return wait

    async def charge(self, tenant: str, tokens: int) -> None:
        """Debit generated tokens after a request (the bucket may go into debt)."""
        limits = await self.limits(tenant)
        if limits.tokens_per_min and tokens > 0:
            await self._run(self._take, [_key(tenant, "tpm")],
                            [limits.tokens_per_min / 60000, limits.tokens_per_min, tokens,
                             -1e300])  # no need: always drawn

    async def open_stream(self, tenant: str, stream_id: str) -> int:
        """Hold one of the tenant's stream slots: 0, or milliseconds to wait before retrying."""
        limits = await self.limits(tenant)
        if not limits.concurrent_streams:
            return 0
        self._streams[stream_id] = tenant  # known first: a stream that ends meanwhile frees it
        if not await self._run(self._lease, [_key(tenant, "streams")],
                               [limits.concurrent_streams, STREAM_LEASE_MS, stream_id], ok=1):
            self._streams.pop(stream_id, None)
            REFUSED.labels("concurrent_streams").inc()
            return STREAM_RETRY_MS
        return 0

    async def close_stream(self, stream_id: str) -> None:
        tenant = self._streams.pop(stream_id, None)
        if tenant is not None:
            with contextlib.suppress(*ERRORS):  # else the lease runs out
                await self.redis.zrem(_key(tenant, "streams"), stream_id)

    async def renew_leases(self) -> None:
        """Run for the gateway's life: keep the leases of open streams from running out."""
        while True:
            await asyncio.sleep(STREAM_LEASE_MS / 3000)
            for stream_id, tenant in list(self._streams.items()):
                await self._run(self._lease, [_key(tenant, "streams")],
                                [-1, STREAM_LEASE_MS, stream_id])

    async def _run(self, script, keys: list[str], args: list[Any], ok: int = 0) -> int:
        try:
            return int(await script(keys=keys, args=[repr(a) if isinstance(a, float) else a
                                                     for a in args]))
        except ERRORS as e:
            LIMIT_ERRORS.inc()
            log.warning("tenant limit not checked: redis failed", error=type(e).__name__)
            return ok


def tenant_limiter(settings: Settings, client: Client) -> Limiter:
    """The limiter the settings describe (defaults, then the limits file's tenants)."""
    return Limiter(client, TenantLimits(settings.tenant_requests_per_s,
                                        settings.tenant_tokens_per_min,
                                        settings.tenant_concurrent_streams),
                   load_limits_file(Path(settings.limits_file)) if settings.limits_file else {},
                   settings.key_cache_s, settings.key_cache_max)
