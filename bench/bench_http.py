"""The HTTP door's cost: the same answers through OpenAI-compatible HTTP/SSE and through gRPC
Chat, at 1 and 16 concurrent streams, in one run on one server (issue 46).

    .venv/bin/python bench/bench_http.py [--streams 1 16] [--rounds 3] [--requests 2] [--max-tokens 32]

One `finsieve serve` (role all: gateway, CPU engine, embedded Valkey; the default model and rule
packs; `--max-batch` 16 so that 16 streams decode together) with its HTTP door on. The response
cache is off and every prompt is unique, so every request reaches the engine; tenants' limits
are off. At each level, each of `--streams` streams sends `--requests` requests one after another
(greedy, `--max-tokens` each). gRPC: one channel, a Chat stream per request (as `finsieve chat`
does); HTTP: httpx with a connection per stream, `stream: true`, the SSE parsed line by line.
Rounds alternate the door that goes first (gRPC, HTTP, then HTTP, gRPC, ...), so that drift on
a shared machine falls on both. A row: tokens/s delivered (completion tokens of the round's
requests / the round's wall time), TTFT p50/p99 (request sent -> first text), over all rounds;
the ratio is HTTP's over gRPC's, of the totals and the median of each round's pair (the two
doors measured back to back, which cancels slower drift best). The client runs in this
process, on the same cores as the server: each door's client cost is in its figures.

Prints a table and writes bench/results/http/<date>-cpu.json (`--out`). Bounded: every wait
has a deadline, and the server is stopped when the bench ends (also on an error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_gpu.harness import free_port
from bench_gpu.rows import pct
from provenance import provenance, with_provenance

from finsieve.app.client import Credentials, chat_request, is_terminal, wait_ready
from finsieve.v1 import chat_pb2, chat_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".finsieve" / "models" / "SmolLM2-135M-Instruct"
QUESTIONS = ["What is a bond?", "What is an index fund?", "What does APR mean?", "Why diversify?",
             "What is inflation?", "What is a dividend?", "What is a credit score?",
             "What is compound interest?"]
START_S = 300
REQUEST_S = 600  # one request's deadline


@dataclass
class Round:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)


class Prompts:
    """Unique prompts: no two requests of a run share one (the cache could not answer
    anyway; the prefix of each is the same length, so both doors prefill alike)."""

    def __init__(self) -> None:
        self.n = 0

    def next(self) -> str:
        self.n += 1
        return f"Request {self.n:05d}. {QUESTIONS[self.n % len(QUESTIONS)]}"


async def grpc_one(stub: chat_pb2_grpc.GatewayStub, prompt: str, max_tokens: int,
                   out: Round) -> None:
    request = chat_request("r", prompt, max_tokens=max_tokens)
    sent = time.perf_counter()
    first = None
    call = stub.Chat(iter([chat_pb2.ChatClientMessage(request=request)]), timeout=REQUEST_S)
    async for event in call:
        if first is None and event.WhichOneof("event") == "delta" and event.delta.text:
            first = time.perf_counter()
        if is_terminal(event):
            if event.WhichOneof("event") == "error":
                raise RuntimeError(f"gRPC error: {event.error.message}")
            out.tokens += event.finished.usage.completion_tokens
            break
    call.cancel()
    assert first is not None
    out.ttft.append(first - sent)


async def http_one(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int,
                   out: Round) -> None:
    body = {"model": MODEL.name, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = None
    async with client.stream("POST", f"{base}/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
            if chunk.get("usage"):
                out.tokens += chunk["usage"]["completion_tokens"]
    assert first is not None
    out.ttft.append(first - sent)


async def run_round(door: str, streams: int, requests: int, max_tokens: int, prompts: Prompts,
                    target: str, base: str, key: str) -> Round:
    out = Round()
    if door == "grpc":
        async with Credentials(key).channel(target) as channel:
            stub = chat_pb2_grpc.GatewayStub(channel)

            async def loop() -> None:
                for _ in range(requests):
                    await grpc_one(stub, prompts.next(), max_tokens, out)

            started = time.perf_counter()
            await asyncio.gather(*(loop() for _ in range(streams)))
    else:
        async with httpx.AsyncClient(timeout=REQUEST_S, headers={"Authorization": f"Bearer {key}"},
                                     limits=httpx.Limits(max_connections=streams)) as client:

            async def loop() -> None:
                for _ in range(requests):
                    await http_one(client, base, prompts.next(), max_tokens, out)

            started = time.perf_counter()
            await asyncio.gather(*(loop() for _ in range(streams)))
    out.seconds = time.perf_counter() - started
    return out


def start(state: Path, port: int, http_port: int, max_batch: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "FINSIEVE_LOG_FORMAT": "json", "OMP_WAIT_POLICY": "PASSIVE",
           "FINSIEVE_CACHE_TTL_S": "0", "FINSIEVE_TENANT_REQUESTS_PER_S": "0",
           "FINSIEVE_TENANT_TOKENS_PER_MIN": "0", "FINSIEVE_TENANT_CONCURRENT_STREAMS": "0"}
    log = (state.parent / "serve.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "finsieve.app.cli", "serve", "--port", str(port), "--audit-port",
         str(free_port()), "--http-port", str(http_port), "--state-dir", str(state), "--model",
         str(MODEL), "--max-batch", str(max_batch)], stdout=log, stderr=subprocess.STDOUT, env=env)


def summary(rounds: list[Round]) -> dict[str, float | int | None]:
    tokens, seconds = sum(r.tokens for r in rounds), sum(r.seconds for r in rounds)
    ttft = [t for r in rounds for t in r.ttft]
    return {"requests": len(ttft), "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 2),
            "ttft_p50_ms": round(1000 * (pct(ttft, 0.5) or 0), 1),
            "ttft_p99_ms": round(1000 * (pct(ttft, 0.99) or 0), 1)}


async def measure(args: argparse.Namespace, target: str, base: str, key: str) -> list[dict]:
    prompts = Prompts()
    await run_round("grpc", 1, 1, args.max_tokens, prompts, target, base, key)  # warm both doors
    await run_round("http", 1, 1, args.max_tokens, prompts, target, base, key)
    rows = []
    for streams in args.streams:
        by_door: dict[str, list[Round]] = {"grpc": [], "http": []}
        for i in range(args.rounds):
            for door in (("grpc", "http") if i % 2 == 0 else ("http", "grpc")):
                r = await run_round(door, streams, args.requests, args.max_tokens, prompts,
                                    target, base, key)
                by_door[door].append(r)
                print(f"  {streams:>2} streams, round {i + 1}, {door}: "
                      f"{r.tokens / r.seconds:.1f} tokens/s", flush=True)
        grpc_row, http_row = summary(by_door["grpc"]), summary(by_door["http"])
        paired = sorted((h.tokens / h.seconds) / (g.tokens / g.seconds)
                        for g, h in zip(by_door["grpc"], by_door["http"], strict=True))
        rows.append({"streams": streams, "grpc": grpc_row, "http": http_row,
                     "http_over_grpc_tokens_per_s_by_round": [round(r, 3) for r in paired],
                     "http_over_grpc_tokens_per_s_median_round": round(pct(paired, 0.5) or 0, 3),
                     "http_over_grpc_tokens_per_s": round(
                         float(http_row["tokens_per_s"] or 0) / float(grpc_row["tokens_per_s"] or 1), 3),
                     "http_over_grpc_ttft_p50": round(
                         float(http_row["ttft_p50_ms"] or 0) / float(grpc_row["ttft_p50_ms"] or 1), 3)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| streams | door | tokens/s | TTFT p50 ms | TTFT p99 ms | requests |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        for door in ("grpc", "http"):
            r = row[door]
            lines.append(f"| {row['streams']} | {door} | {r['tokens_per_s']} | {r['ttft_p50_ms']} | "
                         f"{r['ttft_p99_ms']} | {r['requests']} |")
        lines.append(f"| {row['streams']} | HTTP / gRPC | {row['http_over_grpc_tokens_per_s']} "
                     f"(rounds: median {row['http_over_grpc_tokens_per_s_median_round']}) | "
                     f"{row['http_over_grpc_ttft_p50']} | | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=2, help="per stream and round")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--load", default="", help="what else ran on the machine (for the record)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or REPO / "bench" / "results" / "http" / f"{time.strftime('%Y-%m-%d')}-cpu.json"
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        state = Path(tmp) / "state"
        port, http_port = free_port(), free_port()
        server = start(state, port, http_port, args.max_batch)
        try:
            target, base = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}/v1"
            if not asyncio.run(wait_ready(target, START_S)):
                raise RuntimeError("the server did not come up: " +
                                   (Path(tmp) / "serve.log").read_text()[-2000:])
            key = (state / "keys" / "app.key").read_text().strip()
            load_before = os.getloadavg()
            rows = asyncio.run(measure(args, target, base, key))
            load_after = os.getloadavg()
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    conditions = (f"CPU, one server (role all, default model and rules, max_batch {args.max_batch}, "
                  f"cache and tenant limits off), client in the bench process on the same cores; "
                  f"{args.rounds} rounds per level alternating which door goes first, "
                  f"{args.requests} requests per stream and round, max_tokens {args.max_tokens}, "
                  f"greedy, unique prompts; 1-minute load average {load_before[0]:.2f} before, "
                  f"{load_after[0]:.2f} after" + (f"; {args.load}" if args.load else ""))
    result = with_provenance({"levels": rows}, provenance("bench_http", conditions))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
