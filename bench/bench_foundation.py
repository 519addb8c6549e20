"""Foundation benchmark: set-up time, TTFT and tokens/s for 1 vs N concurrent streams, memory.

    .venv/bin/python bench/bench_foundation.py [--setup] [--streams 1 4] [--max-tokens 128]

Starts a real server (gateway + engine + embedded Valkey) on loopback, runs each
concurrency level in the same run (1 stream is the baseline), prints a table and writes
bench/results/foundation.json. `--setup` also times `make setup` in a fresh clone with an
empty venv and state directory (the pip cache of the machine still helps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from provenance import provenance, with_provenance

from finsieve.app.client import Credentials, chat_request, dev_key_path, stream_one, wait_ready

from prompts import LONG_ANSWERS

REPO = Path(__file__).resolve().parents[1]


def time_setup() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "finsieve"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        start = time.perf_counter()
        subprocess.run(["make", "-C", str(clone), "setup"], check=True,
                       stdout=subprocess.DEVNULL)
        return time.perf_counter() - start


async def one_stream(target: str, credentials: Credentials, i: int, max_tokens: int) -> dict:
    # Greedy with a stop-free long prompt: most runs use the full max_tokens.
    request = chat_request(f"b{i}", LONG_ANSWERS[i % len(LONG_ANSWERS)], max_tokens=max_tokens)
    start = time.perf_counter()
    first = None
    tokens = 0
    async for event in stream_one(target, request, credentials=credentials):
        kind = event.WhichOneof("event")
        if kind == "delta" and first is None:
            first = time.perf_counter() - start
        if kind == "finished":
            tokens = event.finished.usage.completion_tokens
        if kind == "error":
            raise RuntimeError(event.error.message)
    return {"ttft_s": first, "tokens": tokens, "seconds": time.perf_counter() - start}


async def level(target: str, credentials: Credentials, n: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    runs = await asyncio.gather(*(one_stream(target, credentials, i, max_tokens) for i in range(n)))
    wall = time.perf_counter() - start
    total = sum(r["tokens"] for r in runs)
    return {
        "streams": n,
        "tokens": total,
        "wall_s": wall,
        "tokens_per_s": total / wall,
        "ttft_median_s": statistics.median(r["ttft_s"] for r in runs),
        "ttft_max_s": max(r["ttft_s"] for r in runs),
        "per_stream_tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
    }


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", action="store_true", help="also time `make setup` in a fresh clone")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "foundation.json")
    args = ap.parse_args()

    result: dict = {
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform(),
                    "torch": torch.__version__, "device": "cpu"},
        "max_tokens": args.max_tokens,
    }
    if args.setup:
        result["setup_s"] = time_setup()

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        model = REPO / ".finsieve" / "models" / "SmolLM2-135M-Instruct"
        cmd = [sys.executable, "-m", "finsieve.app.cli", "serve", "--port", str(port),
               "--state-dir", tmp, "--model", str(model)]
        start = time.perf_counter()
        # Cache off: the levels repeat greedy prompts, and this measures decoding.
        env = {**os.environ, "FINSIEVE_CACHE_TTL_S": "0"}
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            target = f"127.0.0.1:{port}"
            if not asyncio.run(wait_ready(target, 180)):
                raise SystemExit("server did not come up")
            result["server_ready_s"] = time.perf_counter() - start
            creds = Credentials(dev_key_path(tmp, "app").read_text().strip())
            asyncio.run(level(target, creds, 1, 8))  # warm-up
            result["levels"] = [asyncio.run(level(target, creds, n, args.max_tokens))
                                for n in args.streams]
            result["server_peak_rss_mib"] = peak_rss_mib(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)

    base = result["levels"][0]["tokens_per_s"]
    for lv in result["levels"]:
        lv["speedup_vs_first"] = lv["tokens_per_s"] / base
    print(f"{'streams':>7} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'x base':>7} "
          f"{'TTFT p50':>9} {'TTFT max':>9} {'tok/s/stream':>13}")
    for lv in result["levels"]:
        print(f"{lv['streams']:>7} {lv['tokens']:>7} {lv['wall_s']:>7.2f} {lv['tokens_per_s']:>7.1f} "
              f"{lv['speedup_vs_first']:>7.2f} {lv['ttft_median_s']:>9.3f} {lv['ttft_max_s']:>9.3f} "
              f"{lv['per_stream_tokens_per_s']:>13.1f}")
    print(f"server ready after {result['server_ready_s']:.1f} s; "
          f"server peak RSS {result['server_peak_rss_mib']:.0f} MiB")
    if "setup_s" in result:
        print(f"make setup in a fresh clone: {result['setup_s']:.1f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_provenance(result, provenance("bench_foundation")), indent=2))


if __name__ == "__main__":
    main()
