"""The prompt-hash response cache: deterministic answers replayed from Redis.

The key covers everything that decides the answer: tenant, model, policy version, the
exact messages, every sampling parameter, seed and max tokens. Only greedy requests and
seeded ones are cacheable. A new policy version is a new key, so an answer made under
other rules is never served. Redis trouble never fails a request: it is served uncached.
"""

from __future__ import annotations

import hashlib
import json

import redis.asyncio as redis
import structlog
from prometheus_client import Counter

from finsieve.v1 import chat_pb2, engine_pb2

log = structlog.get_logger(__name__)

LOOKUPS = Counter("finsieve_cache_lookups", "Response cache lookups", ["result"])
PREFIX = "finsieve:cache:"


def cache_key(tenant: str, model: str, policy_version: str, req: chat_pb2.ChatRequest) -> str | None:
    """The key of a deterministic request; None when sampling makes it unrepeatable."""
    p = req.params
    if p.temperature != 0 and not p.HasField("seed"):
        return None
    canon = {
        "tenant": tenant, "model": model, "policy_version": policy_version,
        "messages": [[m.role, m.content] for m in req.messages],
        "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
        "top_k": p.top_k, "seed": p.seed if p.HasField("seed") else None, "stop": list(p.stop),
    }
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return PREFIX + hashlib.sha256(blob.encode()).hexdigest()


class ResponseCache:
    def __init__(self, client: redis.Redis, ttl_s: int, max_bytes: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes

    async def get(self, key: str) -> list[chat_pb2.ChatServerMessage] | None:
        try:
            raw = await self.redis.get(key)
        except (redis.RedisError, OSError) as e:
            LOOKUPS.labels("error").inc()
            log.warning("cache lookup failed; serving uncached", error=type(e).__name__)
            return None
        LOOKUPS.labels("hit" if raw else "miss").inc()
        return list(engine_pb2.EngineStep.FromString(raw).events) if raw else None

    async def put(self, key: str, events: list[chat_pb2.ChatServerMessage]) -> None:
        blob = engine_pb2.EngineStep(events=events).SerializeToString()
        if len(blob) > self.max_bytes:
            return
        try:
            await self.redis.set(key, blob, ex=self.ttl_s)
        except (redis.RedisError, OSError) as e:
            log.warning("cache store failed", error=type(e).__name__)
