"""Phase `serve`: `finsieve serve --role engine` plus gateway processes on one SO_REUSEPORT
port, one Valkey and one set of secrets for all, and client processes over gRPC: rules on,
then off (hot reload to an empty pack), at each level (steady rows with --serve-steady);
the engine's start-up until SERVING; each level's CPU seconds by process group and the
engine's own step counters (with --py-spy: where the engine's and a gateway's CPU goes)."""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from argparse import Namespace
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from .harness import children, free_port, gpu_used_gib, health, time_left
from .rows import finish_name, no_row, step_metrics, step_stats, summarize
from .workload import prompts, rules_dir


def _client_proc(target: str, key: str, texts: list[str], streams: list[int], rounds: int,
                 max_tokens: int, queue: Any, start: Any, spread_s: float = 0.0, n: int = 1) -> None:
    """A client process: its share of the streams, one channel (TCP connection) each. It
    starts when every client has imported what it needs (`start`, a barrier): a client's
    start-up is not the server's time. spread_s: stream i of n sends its first request
    i * spread_s / n seconds after the start (see grpc_level)."""
    from finsieve.app.client import Credentials, chat_request
    from finsieve.grpc_server import CHANNEL_OPTIONS
    from finsieve.v1 import chat_pb2, chat_pb2_grpc

    start.wait(120)

    async def stream(i: int) -> list[dict]:
        out = []
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        async with Credentials(api_key=key).channel(target, options) as channel:
            stub = chat_pb2_grpc.GatewayStub(channel)
            await asyncio.sleep(spread_s * i / n)
            for r in range(rounds):
                req = chat_request(f"s{i}-{r}", texts[(i + r * 7) % len(texts)], max_tokens=max_tokens)

                async def send(req: Any = req) -> AsyncIterator[Any]:
                    yield chat_pb2.ChatClientMessage(request=req)

                t0 = time.perf_counter()
                times, tokens, error, version, finish = [], [], "", "", ""
                async for e in stub.Chat(send(), timeout=180):
                    kind = e.WhichOneof("event")
                    if kind == "started":
                        version = e.started.policy_version
                    elif kind == "delta":
                        times.append(time.perf_counter())
                        tokens.append(e.delta.tokens)
                    elif kind == "error":
                        error = e.error.message
                        break
                    elif kind == "finished":
                        finish = finish_name(e.finished.finish_reason)
                        break
                out.append({"ttft": times[0] - t0 if times else None, "tokens": sum(tokens),
                            "gaps": [b - a for a, b in itertools.pairwise(times)],
                            "error": error, "policy_version": version, "finish": finish,
                            # for a steady window (perf_counter is one clock for every process)
                            "stream": i, "round": r, "sent": t0, "end": time.perf_counter(),
                            "deltas": list(zip(times, tokens, strict=True)) if spread_s else []})
        return out

    async def main() -> list[dict]:
        results = await asyncio.gather(*(stream(i) for i in streams))
        return [r for rs in results for r in rs]

    queue.put(asyncio.run(main()))


def grpc_level(target: str, key: str, texts: list[str], n: int, rounds: int, max_tokens: int,
               procs: int, timeout: float = 300, spread_s: float = 0.0) -> dict:
    """n streams of `rounds` requests each through the gateways, from `procs` client
    processes. spread_s > 0: the streams start spread_s / n seconds apart (about one answer's
    time in all, so that they run out of phase, as a server's clients do past a start-up),
    and the row counts only the tokens delivered while every stream has a request running:
    from the last stream's first token to the first stream's last answer (the steady state,
    as bench_gpu's in-process `steady` rows; without it a level is two cold rounds, whose
    prefill bursts and TTFT weigh as much as the decode steps)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    shares = [list(range(n))[i::procs] for i in range(min(procs, n))]
    barrier = ctx.Barrier(len(shares) + 1)
    workers = [ctx.Process(target=_client_proc,
                           args=(target, key, texts, share, rounds, max_tokens, queue, barrier,
                                 spread_s, n))
               for share in shares]
    for w in workers:
        w.start()
    barrier.wait(120)
    start = time.perf_counter()
    reqs = []
    try:
        for _ in workers:
            reqs += queue.get(timeout=max(timeout - (time.perf_counter() - start), 1))
    finally:
        for w in workers:
            w.join(1)
            if w.is_alive():
                w.kill()
    if not reqs:
        raise TimeoutError(f"{n} streams: no client finished within {timeout:.0f} s")
    # From the first request sent to the last answer received (perf_counter is one clock for
    # every process): the clients' own start-up and exit, and the trip of their results
    # back here, are not the server's time
    wall = max(r["end"] for r in reqs) - min(r["sent"] for r in reqs)
    row = summarize(reqs, wall) if not spread_s else _steady_row(reqs)
    row["policy_versions"] = sorted({r["policy_version"] for r in reqs})
    return row


def _steady_row(reqs: list[dict]) -> dict:
    """A spread level's row over its steady window (see grpc_level)."""
    streams = {r["stream"] for r in reqs}
    firsts = {r["stream"]: r["deltas"][0][0] for r in reqs if r["round"] == 0 and r["deltas"]}
    lasts = {}
    for r in reqs:
        lasts[r["stream"]] = max(lasts.get(r["stream"], 0.0), r["end"])
    if len(firsts) < len(streams):
        return no_row("a stream's first request delivered nothing", errors=0)
    t_a, t_b = max(firsts.values()), min(lasts.values())
    if t_b <= t_a:
        return no_row("no steady window (answers too short for the streams' spread)", errors=0)
    row = summarize(reqs, t_b - t_a)
    row["tokens"] = sum(n for r in reqs for t, n in r["deltas"] if t_a <= t <= t_b)
    row["tokens_per_s"] = row["tokens"] / row["wall_s"]
    row["steady_window_s"] = row["wall_s"]
    return row


def phase_serve(args: Namespace) -> dict:
    work = Path(args.work) / "serve"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rules = rules_dir(work, args.tokenizer)
    engine_port, port = free_port(), free_port()
    from finsieve.secretfiles import write_private
    from finsieve.valkey import EmbeddedValkey

    # One Valkey and one set of secrets for every process, as in a deployment: the gateways
    # share keys and tenants' limits (generous here, so that they cost their Redis round trips
    # without refusing anything).
    valkey = EmbeddedValkey(work / "valkey")
    valkey.start()
    secret_files = {}
    for name in ("audit.key", "keys.secret", "engine.secret"):
        secret_files[name] = work / name
        write_private(secret_files[name], secrets.token_hex(32) + "\n")
    env = {**os.environ, "FINSIEVE_LOG_FORMAT": "json", "FINSIEVE_CACHE_TTL_S": "0",
           "PYTHONUNBUFFERED": "1",
           "FINSIEVE_REDIS_URL": f"redis://:{valkey.password}@127.0.0.1:{valkey.port}/0",
           "FINSIEVE_AUDIT_KEY_FILE": str(secret_files["audit.key"]),
           "FINSIEVE_KEYS_SECRET_FILE": str(secret_files["keys.secret"]),
           "FINSIEVE_ENGINE_SECRET_FILE": str(secret_files["engine.secret"]),
           "FINSIEVE_TENANT_REQUESTS_PER_S": "100000", "FINSIEVE_TENANT_TOKENS_PER_MIN": "1000000000",
           "FINSIEVE_TENANT_CONCURRENT_STREAMS": "10000"}
    device = "cuda" if not args.tiny else "cpu"
    logs = []

    def start(cmd: list[str], name: str) -> subprocess.Popen:
        log = open(work / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        logs.append(work / f"{name}.log")
        return subprocess.Popen([sys.executable, "-m", "finsieve.app.cli", "serve", *cmd],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)

    t0 = time.perf_counter()
    metrics_port = free_port()
    engine = start(["--role", "engine", "--host", "127.0.0.1", "--engine-port", str(engine_port),
                    "--metrics-port", str(metrics_port), "--device", device,
                    "--model", args.model_dir, "--rules", str(rules),
                    "--luts", str(work / "luts"), "--max-batch", str(max(args.levels)),
                    "--max-context", str(args.max_context), "--max-waiting", "1024",
                    "--state-dir", str(work / "engine-state")], "engine")
    gateways = [start(["--role", "gateway", "--host", "127.0.0.1", "--port", str(port),
                       "--audit-port", str(free_port()), "--engine", f"127.0.0.1:{engine_port}",
                       "--state-dir", str(work / f"gw{i}")], f"gateway{i}")
                for i in range(args.gateways)]
    result: dict = {"gateways": args.gateways, "client_procs": args.client_procs}
    try:
        key = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "keys", "create", "--direct",
                              "--tenant", "bench", "--role", "app", "--name", "bench_gpu"],
                             capture_output=True, text=True, timeout=60, env=env,
                             check=True).stdout.splitlines()[0]
        while not health(f"127.0.0.1:{engine_port}"):
            if engine.poll() is not None or time.perf_counter() - t0 > 400:
                raise RuntimeError("the engine did not start:\n" + (work / "engine.log").read_text()[-3000:])
            time.sleep(0.5)
        result["ready_s"] = time.perf_counter() - t0
        while not health(f"127.0.0.1:{port}"):
            time.sleep(0.2)
        texts = prompts(args.model_dir, 128, args.tiny)
        target = f"127.0.0.1:{port}"
        # Warm-up: enough streams that every gateway process serves some (SO_REUSEPORT
        # spreads connections; a cold gateway's first request costs it ~0.2 s), until none
        # fails (a gateway probes an engine it saw down in the background, with backoff).
        for _ in range(30):
            if not grpc_level(target, key, texts, min(8 * args.gateways, max(args.levels)), 1, 8,
                              2)["errors"]:
                break
            time.sleep(1)
        result["gpu_memory_gib"] = gpu_used_gib()
        levels: list[dict] = []
        result["levels"] = levels
        for name in ("on", "off"):
            if name == "off":
                for f in rules.glob("*.yaml"):
                    f.unlink()  # hot reload to an empty pack: the guard runs, nothing matches
                time.sleep(3)
            for n in args.levels:
                if time_left(args) < 45:
                    result["skipped"] = f"levels from {n} streams rules {name}: no time left"
                    break
                samples = {who: Path(args.log_dir) / f"py-spy-{who}-{n}-{name}.txt"
                           for who in ("engine", "gateway0")}
                spies = [_py_spy(pid, samples[who], args)
                         for who, pid in (("engine", engine.pid), ("gateway0", gateways[0].pid))]
                processes = {"engine": [engine.pid], "preparation workers": children(engine.pid),
                             "gateways": [g.pid for g in gateways], "valkey": [valkey.process.pid]}
                cpu, steps = _cpu_seconds(processes), _engine_metrics(metrics_port)
                steady = args.serve_steady > 0 and n > 1
                try:
                    row = grpc_level(target, key, texts, n,
                                     args.serve_rounds if steady else args.rounds,
                                     args.max_tokens, args.client_procs,
                                     timeout=time_left(args) - 25,
                                     spread_s=args.serve_steady if steady else 0.0)
                except Exception as e:
                    row = no_row(repr(e)[:300])
                for spy in filter(None, spies):
                    spy.send_signal(signal.SIGINT)  # py-spy writes its samples and exits
                    spy.wait(30)
                if any(spies):
                    row["py_spy"] = {who: _py_spy_summary(path) for who, path in samples.items()}
                row["cpu_s"] = {k: round(v - cpu[k], 2) for k, v in _cpu_seconds(processes).items()}
                row["engine_steps"] = step_stats(steps, _engine_metrics(metrics_port))
                row.update(streams=n, rules=name, steady=steady)
                levels.append(row)
                print(f"  gRPC {n:>3} streams rules {name}{' steady' if steady else ''}: "
                      f"{row['tokens_per_s']:.0f} tok/s, "
                      f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, errors {row.get('errors')} "
                      f"{row.get('error_examples') or row.get('error', '')}, finishes "
                      f"{row.get('finishes')}; engine steps {row['engine_steps']}; CPU seconds "
                      f"{row['cpu_s']}", flush=True)
                _save_logs(logs, args)
                Path(args.result).write_text(json.dumps(result))
    finally:
        for p in [*gateways, engine]:
            p.send_signal(signal.SIGTERM)
        for p in [*gateways, engine]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        valkey.stop()
        result["engine_log_tail"] = (work / "engine.log").read_text(errors="replace")[-1500:]
        _save_logs(logs, args)
    return result


def _cpu_seconds(processes: dict[str, list[int]]) -> dict[str, float]:
    """User + system CPU seconds so far of each group of processes (Linux /proc)."""
    out = {}
    for name, pids in processes.items():
        total = 0.0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        out[name] = total
    return out


def _engine_metrics(port: int) -> dict[str, float]:
    """The engine's own finsieve_decode_step_seconds (count, sum, and the cumulative buckets
    by their bound: "le=0.01") and finsieve_engine_loop_seconds by part ("loop:host")."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    return step_metrics(text)


def _py_spy(pid: int, output: Path, args: Namespace) -> subprocess.Popen | None:
    """With --py-spy: sample a process's Python stacks (collapsed) into `output`, so a level's
    CPU time can be read by function."""
    if not (args.py_spy and args.log_dir and shutil.which("py-spy")):
        return None
    output.parent.mkdir(parents=True, exist_ok=True)  # py-spy writes nothing into a missing folder
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "250", "--format",
                             "raw", "--nonblocking", "--threads", "--output",
                             str(output)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _py_spy_summary(path: Path, top: int = 30) -> dict:
    """Shares of the samples per thread, per innermost function and per function anywhere on
    the stack (the raw file stays beside it, for a closer look)."""
    if not path.exists():
        return {"error": "py-spy wrote nothing (is ptrace allowed here?)"}
    threads, leaf, anywhere = Counter(), Counter(), Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        total += n
        threads[frames[0]] += n
        leaf[frames[-1]] += n
        for frame in set(frames[1:]):
            anywhere[frame] += n

    def shares(c: Counter) -> list[tuple[str, float]]:
        return [(k[:140], round(v / total, 4)) for k, v in c.most_common(top)]

    return {"samples": total, "threads": shares(threads), "leaf": shares(leaf),
            "anywhere": shares(anywhere)} if total else {"samples": 0}


def _save_logs(logs: list[Path], args: Namespace) -> None:
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        for f in logs:
            shutil.copy(f, Path(args.log_dir) / f.name)


