"""Audit and cache benchmark: append rate and latency by fsync policy, cache hit vs miss TTFT,
query latency on 1,000,000 records.

    .venv/bin/python bench/bench_audit.py [--records 1000000]

Real embedded Valkey servers on loopback (one per fsync policy, run in the same process
one after the other), a real finsieve server for the TTFT comparison. Prints tables and
writes bench/results/audit.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as redis

from finsieve.client import Credentials, chat_request, dev_key_path, stream_one, wait_ready
from finsieve.gateway.audit import TIME, AuditLog, Filters, index_key, record_key
from finsieve.valkey import EmbeddedValkey

REPO = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def appends(port: int, password: str, n: int, writers: int) -> dict:
    clients = [redis.Redis(port=port, password=password) for _ in range(writers)]
    logs = [AuditLog(c, b"bench-key") for c in clients]
    latencies: list[float] = []

    async def writer(log: AuditLog, count: int) -> None:
        for i in range(count):
            start = time.perf_counter()
            await log.append("request", {"request_id": f"b{i}", "user": "u", "delivered": "x" * 400})
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(writer(log, n // writers) for log in logs))
    wall = time.perf_counter() - start
    ok = (await logs[0].verify()).ok
    for c in clients:
        await c.aclose()
    return {"writers": writers, "appends": len(latencies), "per_s": len(latencies) / wall,
            "p50_ms": 1000 * pct(latencies, 0.5), "p99_ms": 1000 * pct(latencies, 0.99),
            "chain_ok": ok}


async def bulk_load(port: int, password: str, n: int, rule_share: float = 0.01) -> None:
    """Records with indexes as the gateway writes them (not chained: only queries are timed)."""
    client = redis.Redis(port=port, password=password)
    rng = random.Random(0)
    now = int(time.time() * 1000) - n
    for start in range(0, n, 10_000):
        async with client.pipeline(transaction=False) as pipe:
            for seq in range(start + 1, min(n, start + 10_000) + 1):
                ts = now + seq
                user = f"user{rng.randrange(10_000)}"
                rule = "card" if rng.random() < rule_share else ""
                rec = {"seq": seq, "ts_ms": ts, "type": "request", "user": user,
                       "request_id": f"r{seq}", "delivered": "x" * 200,
                       "interventions": [{"rule_id": rule, "action": "redact"}] if rule else []}
                pipe.set(record_key(seq), json.dumps(rec))
                pipe.zadd(TIME, {seq: ts})
                pipe.zadd(index_key("user", user), {seq: ts})
                if rule:
                    pipe.zadd(index_key("rule_id", rule), {seq: ts})
            await pipe.execute()
    await client.aclose()


async def query_latency(port: int, password: str) -> dict:
    client = redis.Redis(port=port, password=password)
    log = AuditLog(client, b"bench-key")
    out = {}
    for name, f in (("by rule", Filters(rule_id="card")), ("by user", Filters(user="user42")),
                    ("by time", Filters(since_ms=0))):
        times = []
        for _ in range(20):
            start = time.perf_counter()
            page, _ = await log.query(f, limit=50)
            times.append(time.perf_counter() - start)
        out[name] = {"median_ms": 1000 * statistics.median(times), "p99_ms": 1000 * max(times),
                     "records": len(page)}
    await client.aclose()
    return out


async def ttft(target: str, credentials: Credentials, prompts: list[str]) -> dict:
    async def first_delta(i: int, prompt: str) -> tuple[float, bool]:
        # Read to the end: a stream cancelled after its first delta is never cached.
        start = time.perf_counter()
        hit, first = False, float("nan")
        async for e in stream_one(target, chat_request(f"t{i}", prompt, max_tokens=32),
                                  credentials=credentials):
            if e.WhichOneof("event") == "started":
                hit = e.started.cache_hit
            if e.WhichOneof("event") == "delta" and e.delta.text and first != first:
                first = time.perf_counter() - start
        return first, hit

    miss = [await first_delta(i, p) for i, p in enumerate(prompts)]
    hit = [await first_delta(i, p) for i, p in enumerate(prompts)]
    assert not any(h for _, h in miss) and all(h for _, h in hit)
    return {"miss_ms": 1000 * statistics.median(t for t, _ in miss),
            "hit_ms": 1000 * statistics.median(t for t, _ in hit)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--appends", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "audit.json")
    args = ap.parse_args()
    result: dict = {"appends": []}

    for policy in ("everysec", "always"):
        with tempfile.TemporaryDirectory() as tmp:
            server = EmbeddedValkey(Path(tmp), appendfsync=policy)
            server.start()
            try:
                for writers in (1, 8):
                    row = asyncio.run(appends(server.port, server.password, args.appends, writers))
                    result["appends"].append({"appendfsync": policy, **row})
            finally:
                server.stop()

    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedValkey(Path(tmp))
        server.start()
        try:
            start = time.perf_counter()
            asyncio.run(bulk_load(server.port, server.password, args.records))
            result["bulk_load_s"] = time.perf_counter() - start
            result["query"] = asyncio.run(query_latency(server.port, server.password))
        finally:
            server.stop()

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        proc = subprocess.Popen(
            [sys.executable, "-m", "finsieve.cli", "serve", "--port", str(port), "--state-dir", tmp,
             "--model", str(REPO / ".finsieve/models/SmolLM2-135M-Instruct")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            target = f"127.0.0.1:{port}"
            assert asyncio.run(wait_ready(target, 180))
            prompts = ["What is a bond?", "What is an index fund?", "What does APR mean?",
                       "Why diversify?", "What is inflation?"]
            key = dev_key_path(tmp, "app").read_text().strip()
            result["ttft"] = asyncio.run(ttft(target, Credentials(key), prompts))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)

    print(f"{'appendfsync':>11} {'writers':>7} {'appends/s':>10} {'p50 ms':>7} {'p99 ms':>7} chain")
    for r in result["appends"]:
        print(f"{r['appendfsync']:>11} {r['writers']:>7} {r['per_s']:>10.0f} {r['p50_ms']:>7.2f} "
              f"{r['p99_ms']:>7.2f} {'ok' if r['chain_ok'] else 'BROKEN'}")
    print(f"\nquery latency on {args.records:,} records (loaded in {result['bulk_load_s']:.0f} s), "
          "first page of 50:")
    for name, q in result["query"].items():
        print(f"  {name:8} median {q['median_ms']:.2f} ms, max of 20 {q['p99_ms']:.2f} ms "
              f"({q['records']} records)")
    t = result["ttft"]
    print(f"\nTTFT over gRPC (median of 5 prompts): cache miss {t['miss_ms']:.0f} ms, "
          f"cache hit {t['hit_ms']:.1f} ms ({t['miss_ms'] / t['hit_ms']:.0f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
