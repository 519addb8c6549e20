"""The prompt-hash response cache: deterministic answers replayed from Redis.

The key covers everything that decides the answer: tenant, model, policy version, the
exact messages, every sampling parameter, seed and max tokens. Only greedy requests and
seeded ones are cacheable. An entry is stored under the model and policy version of its
own `Started` event, and looked up under those an engine announces for new requests.

Redis is not trusted: an entry is HMAC-signed (a key derived from the audit key) over its
own Redis key, model, policy version, expiry, the sequence number of the audit record of
the answer, and the events. On a lookup an entry that is too large, unsigned, corrupt,
moved from another key, of another model or version, past its expiry, whose audit record
is missing or altered, or whose text matches an output rule in force, is deleted, counted
(`finsieve_cache_rejected_total{reason}`), logged, and the request served uncached. Redis
trouble never fails a request: it is served uncached.

An answer is stored after the client has its last event (its audit record first). A repeat
of it that reaches this gateway meanwhile waits for that store (at most `store_wait_s`)
instead of missing: without the wait, a client that asks again as soon as it has the answer
missed whenever the record and the entry took longer to write than its request took to
arrive (1 in 10 on loopback; always with a Redis a few milliseconds away). Why an answer was
not stored is counted (`finsieve_cache_stores_total{result}`) and logged at debug level.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

# cast: connect()'s clients return bytes (decode_responses off); redis-py types replies bytes | str.
from typing import Any, cast

import redis.asyncio as redis
import structlog
from google.protobuf.message import DecodeError
from prometheus_client import Counter, Gauge

from finsieve.policy.matcher import scan_text
from finsieve.policy.pack import Pack
from finsieve.v1 import chat_pb2, engine_pb2
from finsieve.valkey import ERRORS, Client

from .audit import AuditLog, derive_key, now_ms, sealed_ok

log = structlog.get_logger(__name__)

LOOKUPS = Counter("finsieve_cache_lookups", "Response cache lookups", ["result"])
REJECTED = Counter("finsieve_cache_rejected", "Cache entries deleted on lookup", ["reason"])
STORES = Counter("finsieve_cache_stores", "Answers of cacheable requests: stored, or why not",
                 ["result"])
STORE_WAITS = Counter("finsieve_cache_store_waits",
                      "Lookups that waited for the same answer's entry being stored", ["outcome"])
WAITING = Gauge("finsieve_cache_store_waiting", "Lookups waiting now for an entry being stored")
PREFIX = "finsieve:cache:"
_MAC_LEN = 64  # hex SHA-256


def cacheable(req: chat_pb2.ChatRequest) -> bool:
    """Greedy or seeded: the same request gives the same answer."""
    return req.params.temperature == 0 or req.params.HasField("seed")


def cache_key(tenant: str, model: str, policy_version: str, req: chat_pb2.ChatRequest) -> str | None:
    """The key of a deterministic request; None when sampling makes it unrepeatable."""
    if not cacheable(req):
        return None
    p = req.params
    canon = {
        "tenant": tenant, "model": model, "policy_version": policy_version,
        "messages": [[m.role, m.content] for m in req.messages],
        "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
        "top_k": p.top_k, "seed": p.seed if p.HasField("seed") else None, "stop": list(p.stop),
    }
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return PREFIX + hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class CachedAnswer:
    events: list[chat_pb2.ChatServerMessage]
    record: dict[str, Any]  # the audit record of the answer replayed


class _Rejected(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def lookup_skipped(reason: str) -> None:
    """A request served uncached without a lookup: no engine announced yet, or the
    gateway's rules are not the version the engine announced (fail closed)."""
    LOOKUPS.labels(f"skipped_{reason}").inc()
    log.debug("cache not looked up", reason=reason)


def not_stored(reason: str) -> None:
    """An answer that will not be cached, and why (counted; logged at debug level)."""
    STORES.labels(reason).inc()
    log.debug("answer not cached", reason=reason)


class ResponseCache:
    def __init__(self, client: Client, audit: AuditLog, ttl_s: int, max_bytes: int,
                 store_wait_s: float = 0.5) -> None:
        self.redis = client
        self.audit = audit
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.store_wait_s = store_wait_s
        self._key = derive_key(audit.key, "cache")
        # Keys whose answer is being stored, with how many stores of it are under way: one
        # entry per request completing, so bounded by the requests in flight.
        self._storing: dict[str, tuple[asyncio.Event, int]] = {}

    @asynccontextmanager
    async def storing(self, key: str) -> AsyncIterator[None]:
        """Around an answer's audit record and store: lookups of `key` wait for it. Entered
        before the caller's first await, so no request that arrives after the answer's last
        event can look up before it."""
        done, count = self._storing.get(key, (asyncio.Event(), 0))
        self._storing[key] = (done, count + 1)
        try:
            yield
        finally:
            done, count = self._storing[key]
            if count > 1:
                self._storing[key] = (done, count - 1)
            else:
                del self._storing[key]
                done.set()

    async def _await_store(self, key: str) -> None:
        pending = self._storing.get(key)
        if pending is None or self.store_wait_s <= 0:
            return
        try:
            with WAITING.track_inprogress():
                await asyncio.wait_for(pending[0].wait(), self.store_wait_s)
            STORE_WAITS.labels("stored").inc()
        except TimeoutError:
            STORE_WAITS.labels("timeout").inc()
            log.info("cache lookup did not wait longer for the same answer's store",
                     wait_s=self.store_wait_s, entry=key.removeprefix(PREFIX)[:16])

    async def get(self, key: str, model: str, policy_version: str,
                  rules: Pack | None) -> CachedAnswer | None:
        """The verified entry, or None (a miss, Redis trouble, or a rejected entry)."""
        await self._await_store(key)
        try:
            # At most max_bytes + 1 bytes: a planted giant value is never read whole.
            raw = cast(bytes, await self.redis.getrange(key, 0, self.max_bytes))
        except redis.ResponseError:
            await self._reject(key, "corrupt")  # not a string at all
            return None
        except ERRORS as e:
            LOOKUPS.labels("error").inc()
            log.warning("cache lookup failed; serving uncached", error=type(e).__name__)
            return None
        if not raw:
            LOOKUPS.labels("miss").inc()
            return None
        try:
            events, seq = self._open(key, raw, model, policy_version)
            record = await self.audit.get(seq)
            if record is None or not sealed_ok(self.audit.key, record) or record.get("type") != "request" \
                    or (record.get("model"), record.get("policy_version")) != (model, policy_version):
                raise _Rejected("audit_record")
            if rules is not None and scan_text(rules.output, _text(events)):
                raise _Rejected("rules")
        except _Rejected as e:
            await self._reject(key, e.reason)
            return None
        except ERRORS as e:
            LOOKUPS.labels("error").inc()
            log.warning("cache lookup failed; serving uncached", error=type(e).__name__)
            return None
        LOOKUPS.labels("hit").inc()
        return CachedAnswer(events, record)

    def _open(self, key: str, raw: bytes, model: str, policy_version: str
              ) -> tuple[list[chat_pb2.ChatServerMessage], int]:
        if len(raw) > self.max_bytes:
            raise _Rejected("oversize")
        mac, body = raw[:_MAC_LEN], raw[_MAC_LEN:]
        if not hmac.compare_digest(mac, hmac.new(self._key, body, hashlib.sha256).hexdigest().encode()):
            raise _Rejected("signature")
        try:
            entry = json.loads(body)
            events = list(engine_pb2.EngineStep.FromString(base64.b64decode(entry["events"])).events)
            seq, expires = int(entry["audit_seq"]), int(entry["expires_ms"])
            started, finished = events[0].started, events[-1]
            fields = (entry["key"], entry["model"], entry["policy_version"])
        except (ValueError, KeyError, TypeError, IndexError, DecodeError):
            raise _Rejected("corrupt") from None
        if events[0].WhichOneof("event") != "started" or finished.WhichOneof("event") != "finished":
            raise _Rejected("corrupt")
        if fields[0] != key:
            raise _Rejected("moved")
        if (fields[1], fields[2]) != (model, policy_version) or (
                started.model, started.policy_version) != (model, policy_version):
            raise _Rejected("version")
        if expires < now_ms():
            raise _Rejected("expired")
        return events, seq

    async def _reject(self, key: str, reason: str) -> None:
        LOOKUPS.labels("rejected").inc()
        REJECTED.labels(reason).inc()
        log.warning("cache entry rejected and deleted; serving uncached", reason=reason,
                    entry=key.removeprefix(PREFIX)[:16])
        try:
            await self.redis.delete(key)
        except ERRORS as e:
            log.warning("cache entry not deleted", error=type(e).__name__)

    async def put(self, key: str, events: list[chat_pb2.ChatServerMessage], audit_seq: int) -> None:
        """Store an answer; its Started event says the model and version it was made under."""
        started = events[0].started
        entry = {
            "key": key, "model": started.model, "policy_version": started.policy_version,
            "expires_ms": now_ms() + 1000 * self.ttl_s, "audit_seq": audit_seq,
            "events": base64.b64encode(engine_pb2.EngineStep(events=events).SerializeToString()).decode(),
        }
        body = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()
        blob = hmac.new(self._key, body, hashlib.sha256).hexdigest().encode() + body
        if len(blob) > self.max_bytes:
            not_stored("oversize")  # FINSIEVE_CACHE_MAX_BYTES
            return
        try:
            await self.redis.set(key, blob, ex=self.ttl_s)
        except ERRORS as e:
            STORES.labels("error").inc()
            log.warning("cache store failed", error=type(e).__name__)
            return
        STORES.labels("stored").inc()


def _text(events: list[chat_pb2.ChatServerMessage]) -> str:
    return "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")
