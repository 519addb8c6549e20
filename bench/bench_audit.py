"""Audit and cache benchmark: appends/s and p99 with anchoring on against the audit trail
before issue 12 (measured in the same run), query latency on 1,000,000 records, cache hit
vs miss TTFT, and the streams' inter-token latency while an officer exports 100,000 records.

    .venv/bin/python bench/bench_audit.py [--records 1000000] [--export-records 100000]

Real embedded Valkey servers on loopback. The baseline appends run the audit trail of
`--baseline-ref` (`gateway/audit.py` as it was there, loaded from git into a subprocess)
against the same Valkey right before the current code. The export part starts a real
server (gateway + engine + officers' process + embedded Valkey), loads records straight
into its Valkey, and measures the inter-token latency of 8 chat streams in rounds without
the export, with `finsieve audit export` running (the officer's client at nice 10, as it
would run on another machine), then without again. Prints tables and writes
bench/results/audit.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as redis
from provenance import provenance, with_provenance

from finsieve import logs
from finsieve.app.client import Credentials, chat_request, dev_key_path, stream_one, wait_ready

from prompts import LONG_ANSWERS

REPO = Path(__file__).resolve().parents[1]
KEY = b"bench-key-of-thirty-two-bytes-or-more"
PRE_ISSUE_12 = "928c8e4"  # main before the audit trail was anchored


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- appends ------------------------------------------------------------------------------


async def appends(port: int, password: str, n: int, writers: int, old_module: Path | None,
                  anchors: Path) -> dict:
    """n appends from `writers` concurrent logs (each its own connection), with this code's
    anchoring on (one anchor file per writer, 1 s), or the old module's plain appends."""
    clients = [redis.Redis(port=port, password=password) for _ in range(writers)]
    if old_module is not None:
        spec = importlib.util.spec_from_file_location("old_audit", old_module)
        old = sys.modules["old_audit"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        logs = [old.AuditLog(c, KEY) for c in clients]
        anchoring = []
    else:
        from gateway.anchors import Anchoring, AnchorWriter
        from gateway.audit import AuditLog

        logs = [AuditLog(c, KEY) for c in clients]
        anchoring = [Anchoring(log, AnchorWriter(anchors, f"w{i}", KEY), 1.0) for i, log in enumerate(logs)]
    for a in anchoring:
        a.start()
    latencies: list[float] = []

    async def writer(log, count: int) -> None:
        for i in range(count):
            start = time.perf_counter()
            await log.append("request", {"request_id": f"b{i}", "user": "u", "delivered": "x" * 400})
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(writer(log, n // writers) for log in logs))
    wall = time.perf_counter() - start
    for a in anchoring:
        await a.stop()
    if old_module is not None:
        ok = (await logs[0].verify()).ok
    else:
        from gateway.audit_verify import verify

        ok = (await verify(logs[0], anchor_dir=anchors)).ok
    for c in clients:
        await c.aclose()
    return {"writers": writers, "appends": len(latencies), "per_s": len(latencies) / wall,
            "p50_ms": 1000 * pct(latencies, 0.5), "p99_ms": 1000 * pct(latencies, 0.99),
            "chain_ok": ok, "anchor_lines": sum(len(p.read_text().splitlines())
                                                for p in anchors.glob("*.jsonl"))}


def old_appends(port: int, password: str, n: int, writers: int, old_module: Path) -> dict:
    """The baseline in a subprocess: both modules register the same Prometheus metric."""
    out = subprocess.run([sys.executable, __file__, "--_old", str(old_module), "--_port", str(port),
                          "--appends", str(n), "--_writers", str(writers)],
                         input=password,  # the Valkey password: never in argv
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def append_rows(args: argparse.Namespace) -> list[dict]:
    from finsieve.valkey import EmbeddedValkey

    old_module = Path(tempfile.mkdtemp()) / "old_audit.py"
    old_module.write_text(subprocess.run(
        ["git", "-C", str(REPO), "show", f"{args.baseline_ref}:gateway/audit.py"],
        capture_output=True, text=True, check=True).stdout)
    rows = []
    for policy in ("everysec", "always"):
        for writers in (1, 8):
            runs: dict[str, list[dict]] = {"before": [], "now": []}
            for _ in range(args.repeats):
                for code in ("before", "now"):  # alternately, each on a fresh Valkey
                    with tempfile.TemporaryDirectory() as tmp:
                        server = EmbeddedValkey(Path(tmp) / "valkey", appendfsync=policy)
                        server.start()
                        try:
                            if code == "before":
                                row = old_appends(server.port, server.password, args.appends, writers,
                                                  old_module)
                            else:
                                row = asyncio.run(appends(server.port, server.password, args.appends,
                                                          writers, None, Path(tmp) / "anchors"))
                        finally:
                            server.stop()
                    runs[code].append(row)
            for code, done in runs.items():  # the median run (by appends/s) of each
                median = sorted(done, key=lambda r: r["per_s"])[len(done) // 2]
                rows.append({"appendfsync": policy, "code": code, **median,
                             "chain_ok": all(r["chain_ok"] for r in done),
                             "runs_per_s": [round(r["per_s"]) for r in done]})
    return rows


# -- queries on a big trail -------------------------------------------------------------


def bulk_record(seq: int, ts: int, rng: random.Random, size: int) -> tuple[dict, str]:
    user = f"user{rng.randrange(10_000)}"
    rule = "card" if rng.random() < 0.01 else ""
    return {"seq": seq, "ts_ms": ts, "type": "request", "user": user, "request_id": f"r{seq}",
            "messages": [{"role": "user", "content": "What is a bond? " * (size // 32)}],
            "delivered": "x" * (size // 2),
            "interventions": [{"rule_id": rule, "action": "redact"}] if rule else []}, user


async def bulk_load(port: int, password: str, n: int, size: int = 200, first: int = 1) -> None:
    """Records with indexes as the gateway writes them (not chained: only reads are timed),
    numbered from `first` (far past a live chain's head, which never overwrites a record)."""
    from gateway.audit import TIME, index_key, record_key

    client = redis.Redis(port=port, password=password)
    rng = random.Random(0)
    now = int(time.time() * 1000) - n
    for start in range(0, n, 10_000):
        async with client.pipeline(transaction=False) as pipe:
            for i in range(start + 1, min(n, start + 10_000) + 1):
                seq = first - 1 + i
                rec, user = bulk_record(seq, now + i, rng, size)
                pipe.set(record_key(seq), json.dumps(rec))
                pipe.zadd(TIME, {seq: rec["ts_ms"]})
                pipe.zadd(index_key("user", user), {seq: rec["ts_ms"]})
                for x in rec["interventions"]:
                    pipe.zadd(index_key("rule_id", x["rule_id"]), {seq: rec["ts_ms"]})
            await pipe.execute()
    await client.aclose()


async def query_latency(port: int, password: str) -> dict:
    from gateway.audit import AuditLog, Filters

    client = redis.Redis(port=port, password=password)
    log = AuditLog(client, KEY)
    out = {}
    for name, f in (("by rule", Filters(rule_id="card")), ("by user", Filters(user="user42")),
                    ("by time", Filters(since_ms=0))):
        times = []
        for _ in range(20):
            start = time.perf_counter()
            page, _ = await log.query(f, limit=50)
            times.append(time.perf_counter() - start)
        out[name] = {"median_ms": 1000 * statistics.median(times), "max_ms": 1000 * max(times),
                     "records": len(page)}
    await client.aclose()
    return out


def query_rows(args: argparse.Namespace) -> dict:
    from finsieve.valkey import EmbeddedValkey

    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedValkey(Path(tmp))
        server.start()
        try:
            start = time.perf_counter()
            asyncio.run(bulk_load(server.port, server.password, args.records))
            loaded = time.perf_counter() - start
            return {"records": args.records, "bulk_load_s": loaded,
                    **asyncio.run(query_latency(server.port, server.password))}
        finally:
            server.stop()


# -- a real server ------------------------------------------------------------------------


async def ttft(target: str, creds: Credentials, prompts: list[str]) -> dict:
    async def first_delta(i: int, prompt: str) -> tuple[float, bool]:
        # Read to the end: a stream cancelled after its first delta is never cached.
        start = time.perf_counter()
        hit, first = False, float("nan")
        async for e in stream_one(target, chat_request(f"t{i}", prompt, max_tokens=32),
                                  credentials=creds):
            if e.WhichOneof("event") == "started":
                hit = e.started.cache_hit
            if e.WhichOneof("event") == "delta" and e.delta.text and first != first:
                first = time.perf_counter() - start
        return first, hit

    miss = [await first_delta(i, p) for i, p in enumerate(prompts)]
    await asyncio.sleep(0.5)  # entries are stored after the answer
    hit = [await first_delta(i, p) for i, p in enumerate(prompts)]
    assert not any(h for _, h in miss) and all(h for _, h in hit)
    return {"miss_ms": 1000 * statistics.median(t for t, _ in miss),
            "hit_ms": 1000 * statistics.median(t for t, _ in hit)}


async def chat_round(target: str, creds: Credentials, streams: int, max_tokens: int, tag: str
                     ) -> list[tuple[float, float]]:
    """Inter-token latency: (arrival, gap since the stream's previous delta), as the client
    receives them."""
    async def one(i: int) -> list[tuple[float, float]]:
        # Sampled without a seed: never cached, every round decodes.
        request = chat_request(f"{tag}-{i}", LONG_ANSWERS[i % len(LONG_ANSWERS)],
                               max_tokens=max_tokens, temperature=0.7)
        arrivals = []
        async for e in stream_one(target, request, credentials=creds):
            if e.WhichOneof("event") == "delta":
                arrivals.append(time.perf_counter())
            elif e.WhichOneof("event") == "error":
                raise RuntimeError(e.error.message)
        return [(b, b - a) for a, b in itertools.pairwise(arrivals)]

    gaps = await asyncio.gather(*(one(i) for i in range(streams)))
    return [g for stream in gaps for g in stream]


async def itl_with_export(target: str, audit_target: str, creds: Credentials, state: str,
                          rounds: int, streams: int, max_tokens: int) -> dict:
    before, during, after = [], [], []
    for r in range(rounds):
        before += await chat_round(target, creds, streams, max_tokens, f"a{r}")
    start = time.perf_counter()
    export = await asyncio.create_subprocess_exec(
        "nice", "-n", "10", sys.executable, "-m", "finsieve.app.cli", "audit", "export", "--since", "0",
        "--target", audit_target, "--state-dir", state, stdout=asyncio.subprocess.PIPE)
    counted = asyncio.create_task(_count_lines(export.stdout))
    rounds_during = 0
    while not rounds_during or not counted.done():
        during += await chat_round(target, creds, streams, max_tokens, f"b{rounds_during}")
        rounds_during += 1
    exported = await counted
    await export.wait()
    end = time.perf_counter()
    export_s = end - start
    for r in range(rounds):
        after += await chat_round(target, creds, streams, max_tokens, f"c{r}")
    without = [gap for _, gap in before + after]
    during = [gap for at, gap in during if at <= end]  # only while the export ran
    return {
        "streams": streams, "max_tokens": max_tokens, "exported": exported, "export_s": export_s,
        "rounds_during_export": rounds_during,
        "without": {"samples": len(without), "p50_ms": 1000 * pct(without, 0.5),
                    "p99_ms": 1000 * pct(without, 0.99)},
        "with_export": {"samples": len(during), "p50_ms": 1000 * pct(during, 0.5),
                        "p99_ms": 1000 * pct(during, 0.99)},
    }


async def _count_lines(stream: asyncio.StreamReader) -> int:
    n = 0
    while await stream.readline():
        n += 1
    return n


def server_rows(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port, audit_port = free_port(), free_port()
        log_path = Path(tmp) / "serve.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "finsieve.app.cli", "serve", "--port", str(port),
                 "--audit-port", str(audit_port), "--state-dir", tmp,
                 "--model", str(REPO / ".finsieve/models/SmolLM2-135M-Instruct")],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "FINSIEVE_LOG_FORMAT": "json"})
        try:
            target, audit_target = f"127.0.0.1:{port}", f"127.0.0.1:{audit_port}"
            assert asyncio.run(wait_ready(target, 180)), log_path.read_text()
            out: dict = {}
            prompts = ["What is a bond?", "What is an index fund?", "What does APR mean?",
                       "Why diversify?", "What is inflation?"]
            creds = Credentials(dev_key_path(tmp, "app").read_text().strip())
            out["ttft"] = asyncio.run(ttft(target, creds, prompts))
            valkey = next(json.loads(line)["port"] for line in log_path.read_text().splitlines()
                          if '"embedded valkey started"' in line)
            password = re.search(r"^requirepass (\S+)$",
                                 (Path(tmp) / "valkey/valkey.conf").read_text(), re.M)[1]
            asyncio.run(bulk_load(valkey, password, args.export_records, args.record_bytes,
                                  first=10**9))
            out["export"] = asyncio.run(itl_with_export(target, audit_target, creds, tmp, args.rounds, 8,
                                                        args.max_tokens))
            return out
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000, help="for the query latency")
    ap.add_argument("--appends", type=int, default=2000)
    ap.add_argument("--baseline-ref", default=PRE_ISSUE_12, help="git ref of the baseline trail")
    ap.add_argument("--export-records", type=int, default=100_000)
    ap.add_argument("--record-bytes", type=int, default=2000, help="size of an exported record")
    ap.add_argument("--rounds", type=int, default=3, help="chat rounds before and after the export")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="append runs of each code, alternating")
    ap.add_argument("--parts", default="appends,query,server",
                    help="which parts to run (comma-separated)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "audit.json")
    ap.add_argument("--_old", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_writers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    logs.configure("console", "warning")  # no anchor lines in the tables
    if args._old:
        print(json.dumps(asyncio.run(appends(args._port, sys.stdin.read(), args.appends,
                                             args._writers, args._old,
                                             Path(tempfile.mkdtemp())))))
        return

    result = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()},
              "baseline_ref": args.baseline_ref}
    parts = set(args.parts.split(","))
    if "appends" in parts:
        result["appends"] = append_rows(args)
    if "query" in parts:
        result["query"] = query_rows(args)
    if "server" in parts:
        result.update(server_rows(args))
    result["machine"]["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_provenance(result, provenance("bench_audit")), indent=2))
    report(result, args)


def report(result: dict, args: argparse.Namespace) -> None:
    print(f"2 cores shared; load average before {result['machine']['load_before'][0]:.1f}, "
          f"after {result['machine']['load_after'][0]:.1f}")
    if "appends" in result:
        print_appends(result["appends"], args)
    if "query" in result:
        q = result["query"]
        print(f"\nquery latency on {q['records']:,} records (loaded in {q['bulk_load_s']:.0f} s), "
              "first page of 50:")
        for name in ("by rule", "by user", "by time"):
            print(f"  {name:8} median {q[name]['median_ms']:.2f} ms, max of 20 "
                  f"{q[name]['max_ms']:.2f} ms ({q[name]['records']} records)")
    if "ttft" in result:
        print_server(result)


def print_appends(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\naudit appends, {args.appends} per run, median of {args.repeats} alternating runs; "
          f"'before' = {args.baseline_ref} (no anchors), 'now' = anchoring on, 1 s")
    print(f"{'appendfsync':>11} {'writers':>7} {'code':>6} {'appends/s':>10} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'now/before':>10} chain  runs (appends/s)")
    for before, now in zip(rows[::2], rows[1::2], strict=True):
        for r in (before, now):
            ratio = f"{now['per_s'] / before['per_s']:.2f}x" if r is now else ""
            print(f"{r['appendfsync']:>11} {r['writers']:>7} {r['code']:>6} {r['per_s']:>10.0f} "
                  f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {ratio:>10} "
                  f"{'ok' if r['chain_ok'] else 'BROKEN':5}  {r['runs_per_s']}")


def print_server(result: dict) -> None:
    t = result["ttft"]
    print(f"\nTTFT over gRPC (median of 5 prompts): cache miss {t['miss_ms']:.0f} ms, "
          f"cache hit {t['hit_ms']:.1f} ms ({t['miss_ms'] / t['hit_ms']:.0f}x); a hit is verified, "
          "checked against the rules and audited before its first byte")
    e = result["export"]
    w, x = e["without"], e["with_export"]
    print(f"\ninter-token latency of {e['streams']} streams ({e['max_tokens']} tokens each), "
          f"while `audit export` streamed {e['exported']:,} records in {e['export_s']:.0f} s:")
    print(f"  {'':12} {'samples':>8} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"  {'no export':12} {w['samples']:>8} {w['p50_ms']:>8.1f} {w['p99_ms']:>8.1f}")
    print(f"  {'export':12} {x['samples']:>8} {x['p50_ms']:>8.1f} {x['p99_ms']:>8.1f}   "
          f"p99 ratio {x['p99_ms'] / w['p99_ms']:.2f}")


if __name__ == "__main__":
    main()
