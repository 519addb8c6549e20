"""Load benchmark: Chat streams through two gateways and two CPU engines; idle streams on a gateway.

Issue #44, "Load", on loopback, bounded in count and time.

    .venv/bin/python bench/bench_load.py [--levels 1 20 200] [--window 60] [--idle-streams 1000]
    .venv/bin/python bench/bench_load.py --quick [--target HOST:PORT --key-file F --gateway-pid PID]

The deployment (none with --target): one Valkey (audit trail, API keys, tenants' limits,
response cache), `finsieve serve --role engine` x2 (the default model and rule packs, default
engine settings), then `--role gateway` x2, each listing both engines, all on loopback.

Load, at each level of `--levels` streams: the streams are dealt evenly to the gateways and to
`--client-procs` client processes (one channel each). Each stream sends requests one after
another for `--window` seconds (a closed loop; short answers, `--max-tokens`; every prompt
unique, so every request reaches an engine), then its last request finishes. A level's row:
requests completed; errors, which must be 0: every error event by code, every stream that
ended with a status other than OK, every request unanswered at the end; TTFT p50/p99 of the
requests sent in the window; tokens/s delivered in the window; the gateway processes' CPU
seconds in the window per 1,000 tokens (their cores per 1,000 tokens/s). The first level is
the baseline: the table gives each level's ratios to it.

Idle: a fresh gateway (the same engines and Valkey; with --target, the server given); its RSS;
`--idle-streams` streams opened from one client process on `--idle-channels` channels, each
sending one request (answered from the response cache: the question a warm-up asked) and then
nothing for `--idle-window` seconds; the RSS again (memory per stream = the growth / streams);
then every stream asks again and must be answered: none was cut while idle.

The settings the defaults would refuse this load with are set, and named in the output's
conditions: tenants' request rate and concurrent streams. Bounded: every wait has a deadline,
and every process the bench starts is stopped when it ends (also on Ctrl-C, SIGTERM or an
error). Prints a table and writes bench/results/load.json (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from bench_gpu.harness import children, free_port, health
from bench_gpu.rows import pct
from provenance import cpu, provenance, with_provenance

from finsieve.app.client import Credentials, chat_request, stream_one
from finsieve.config import Settings
from finsieve.grpc_server import CHANNEL_OPTIONS
from finsieve.secretfiles import write_private
from finsieve.v1 import chat_pb2, chat_pb2_grpc
from finsieve.valkey import EmbeddedValkey

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".finsieve" / "models" / "SmolLM2-135M-Instruct"
QUESTIONS = ["What is a bond?", "What is an index fund?", "What does APR mean?", "Why diversify?",
             "What is inflation?", "What is a dividend?", "What is a credit score?",
             "What is compound interest?"]
IDLE_QUESTION = "In one sentence, what is a savings account?"
START_S = 300  # an engine's start-up on two busy cores (model, rule tables) is well under this
STOP_S = 30  # a server's drain on SIGTERM before it is killed
QUEUE_EVERY_S = 2.0
QUICK = {"levels": [1, 20], "window": 3.0, "drain": 60.0, "max_tokens": 8, "idle_streams": 40,
         "idle_window": 2.0}


# -- the servers --------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    target: str
    log: Path

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@dataclass
class Deployment:
    """Valkey, engines and gateways on loopback; everything started is stopped by stop()."""

    work: Path
    env: dict[str, str]
    valkey: Any = None
    engines: list[Server] = field(default_factory=list)
    gateways: list[Server] = field(default_factory=list)
    engine_metrics: list[str] = field(default_factory=list)
    key: str = ""

    def start(self, engines: int, gateways: int) -> None:
        self.valkey = EmbeddedValkey(self.work / "valkey")
        self.valkey.start()
        for name in ("audit.key", "keys.secret", "engine.secret"):
            write_private(self.work / name, secrets.token_hex(32) + "\n")
        # The password reaches the servers in a 0600 file, never in their environment.
        write_private(self.work / "redis.url",
                      f"redis://:{self.valkey.password}@127.0.0.1:{self.valkey.port}/0\n")
        self.env.update({"FINSIEVE_REDIS_URL_FILE": str(self.work / "redis.url"),
                         "FINSIEVE_AUDIT_KEY_FILE": str(self.work / "audit.key"),
                         "FINSIEVE_KEYS_SECRET_FILE": str(self.work / "keys.secret"),
                         "FINSIEVE_ENGINE_SECRET_FILE": str(self.work / "engine.secret")})
        # One engine at a time: the first writes the rule packs' token tables, the next reads them.
        for i in range(engines):
            port, metrics = free_port(), free_port()
            self.engines.append(self._serve(f"engine{i}", f"127.0.0.1:{port}", [
                "--role", "engine", "--engine-port", str(port), "--metrics-port", str(metrics),
                "--model", str(MODEL), "--rules", str(REPO / "rules"), "--luts", str(REPO / "luts")]))
            self.engine_metrics.append(f"http://127.0.0.1:{metrics}/metrics")
            self._wait(self.engines[-1])
        for i in range(gateways):
            self.gateways.append(self.start_gateway(f"gateway{i}"))
        self.key = self._create_key()

    def start_gateway(self, name: str) -> Server:
        port = free_port()
        server = self._serve(name, f"127.0.0.1:{port}", [
            "--role", "gateway", "--port", str(port), "--audit-port", str(free_port()),
            "--rules", str(REPO / "rules"),
            *(arg for e in self.engines for arg in ("--engine", e.target))])
        self._wait(server)
        return server

    def _serve(self, name: str, target: str, args: list[str]) -> Server:
        log = self.work / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "finsieve.app.cli", "serve", "--host", "127.0.0.1",
                 "--state-dir", str(self.work / name), *args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env, cwd=REPO)
        return Server(name, process, target, log)

    def _wait(self, server: Server) -> None:
        deadline = time.monotonic() + START_S
        while not health(server.target):
            if server.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} did not start:\n{server.tail()}")
            time.sleep(0.3)

    def _create_key(self) -> str:
        out = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "keys", "create", "--direct",
                              "--tenant", "bench", "--role", "app", "--name", "bench_load"],
                             capture_output=True, text=True, timeout=60, env=self.env, check=True)
        return out.stdout.splitlines()[0].strip()

    def check(self) -> None:
        """Raise if a server has exited."""
        for s in [*self.engines, *self.gateways]:
            if s.process.poll() is not None:
                raise RuntimeError(f"{s.name} exited with {s.process.returncode}:\n{s.tail()}")

    def stop(self) -> None:
        servers = [*self.gateways, *self.engines]
        for s in servers:
            if s.process.poll() is None:
                s.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        for s in servers:
            try:
                s.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                s.process.kill()
                s.process.wait()
        if self.valkey is not None:
            self.valkey.stop()


# -- what the processes cost ----------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    match = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(match[1]) if match else 0


def cpu_by_group(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_seconds(p) for p in pids) for name, pids in groups.items()}


def engine_queue(urls: list[str]) -> dict[str, float]:
    """The engines' requests waiting for a KV slot and holding one, summed (their metrics;
    each engine sets them after every step)."""
    out = {"waiting": 0.0, "running": 0.0}
    for url in urls:
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        for name in out:
            m = re.search(rf"^finsieve_engine_{name} (\S+)$", text, re.M)
            out[name] += float(m[1]) if m else 0.0
    return out


# -- the load clients -----------------------------------------------------------------------


def _channel(target: str, key: str) -> grpc.aio.Channel:
    """A channel of its own (its own TCP connection, not a subchannel shared in the process)."""
    return Credentials(api_key=key).channel(target, [*CHANNEL_OPTIONS,
                                                     ("grpc.use_local_subchannel_pool", 1)])


class ChatCall:
    """One Chat stream on which requests are sent one at a time, each read to its end."""

    def __init__(self, channel: grpc.aio.Channel, timeout: float) -> None:
        self._outbox: asyncio.Queue[Any] = asyncio.Queue()
        self.call = chat_pb2_grpc.GatewayStub(channel).Chat(self._requests(), timeout=timeout)

    async def _requests(self) -> Any:
        while (msg := await self._outbox.get()) is not None:
            yield msg

    async def ask(self, request_id: str, question: str, max_tokens: int) -> dict:
        """Send a request and read its events to the terminal one: its timings and outcome
        ("finished:<reason>", "error:<code>", or "ended" if the stream ended first)."""
        sent = time.monotonic()
        self._outbox.put_nowait(chat_pb2.ChatClientMessage(
            request=chat_request(request_id, question, max_tokens=max_tokens)))
        r: dict[str, Any] = {"sent": sent, "first": None, "deltas": [], "outcome": "ended",
                             "cache_hit": False}
        while (e := await self.call.read()) is not grpc.aio.EOF:
            kind = e.WhichOneof("event")
            if kind == "started":
                r["cache_hit"] = e.started.cache_hit
            elif kind == "delta" and (e.delta.tokens or e.delta.text):
                now = time.monotonic()
                r["first"] = r["first"] or now
                r["deltas"].append((now, e.delta.tokens))
            elif kind == "finished":
                r["outcome"] = "finished:" + chat_pb2.FinishReason.Name(
                    e.finished.finish_reason).removeprefix("FINISH_REASON_").lower()
                break
            elif kind == "error":
                r["outcome"] = "error:" + _code_name(e.error.code)
                break
        r["end"] = time.monotonic()
        return r

    async def close(self) -> str:
        """Half-close, then the stream's status: "OK" or the code's name."""
        self._outbox.put_nowait(None)
        try:
            while await self.call.read() is not grpc.aio.EOF:
                pass
            return (await self.call.code()).name
        except grpc.aio.AioRpcError as e:
            return e.code().name


def _code_name(code: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))


def question(stream: int, n: int) -> str:
    """A unique prompt: no request is answered from the response cache."""
    return f"{QUESTIONS[(stream + n) % len(QUESTIONS)]} (client {stream}, question {n})"


async def load_streams(targets: list[str], key: str, streams: list[int], start: float, end: float,
                       deadline: float, max_tokens: int) -> list[dict]:
    """Each stream (its own channel to targets[stream % len]) sends requests one after another
    from `start` until `end`; the last is read to its end, at the latest by `deadline`."""
    async def one(i: int) -> dict:
        channel = _channel(targets[i % len(targets)], key)
        out: dict[str, Any] = {"stream": i, "requests": [], "status": ""}
        try:
            call = ChatCall(channel, timeout=deadline - time.monotonic())
            await asyncio.sleep(max(0.0, start - time.monotonic()))
            n = 0
            while time.monotonic() < end:
                r = await call.ask(f"s{i}-{n}", question(i, n), max_tokens)
                out["requests"].append(r)
                n += 1
                if r["outcome"] == "ended":
                    break
            out["status"] = await call.close()
        except grpc.aio.AioRpcError as e:  # the stream ended (its deadline: a request unanswered)
            out["status"] = e.code().name
        finally:
            await channel.close()
        return out

    return list(await asyncio.gather(*(one(i) for i in streams)))


def _load_client(targets: list[str], key: str, streams: list[int], window: float, drain: float,
                 max_tokens: int, start_at: Any, ready: Any, go: Any, queue: Any) -> None:
    """A client process: its share of the streams, from the start the parent sets."""
    ready.wait(120)  # every client has imported what it needs: start-up is not the servers' time
    go.wait(30)
    start = start_at.value
    queue.put(asyncio.run(load_streams(targets, key, streams, start, start + window,
                                       start + window + drain, max_tokens)))


# -- a level --------------------------------------------------------------------------------


@dataclass
class Watch:
    """What a level's row reads from the servers: their pids by group, the engines' metrics,
    and a check that they are still up."""

    groups: dict[str, list[int]]
    engine_metrics: list[str]
    check: Callable[[], None]


def run_level(targets: list[str], key: str, n: int, args: argparse.Namespace, watch: Watch) -> dict:
    ctx = mp.get_context("spawn")
    procs = min(args.client_procs, n)
    shares = [list(range(n))[i::procs] for i in range(procs)]
    ready, go = ctx.Barrier(procs + 1), ctx.Barrier(procs + 1)
    start_at, queue = ctx.Value("d", 0.0), ctx.Queue()
    workers = [ctx.Process(target=_load_client, daemon=True,
                           args=(targets, key, share, args.window, args.drain, args.max_tokens,
                                 start_at, ready, go, queue))
               for share in shares]
    streams: list[dict] = []
    try:
        for w in workers:
            w.start()
        ready.wait(120)
        start = start_at.value = time.monotonic() + 0.5
        go.wait(30)
        groups = {**watch.groups, "clients": [w.pid for w in workers if w.pid]}
        time.sleep(max(0.0, start - time.monotonic()))
        cpu0 = cpu_by_group(groups)
        queues = []  # the engines' queue every QUEUE_EVERY_S of the window
        while (left := start + args.window - time.monotonic()) > 0:
            time.sleep(min(QUEUE_EVERY_S, left))
            if watch.engine_metrics and left > QUEUE_EVERY_S / 2:
                queues.append(engine_queue(watch.engine_metrics))
        cpu1 = cpu_by_group(groups)
        load = os.getloadavg()[0]
        watch.check()
        for _ in workers:
            streams += queue.get(timeout=args.drain + 60)
        for w in workers:
            w.join(10)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
    cpu_s = {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0}
    row = summarize(streams, start, args.window)
    row.update(streams=n, client_procs=procs, cpu_s=cpu_s, load_1min_at_end=round(load, 2),
               engine_queue_mean={k: round(sum(q[k] for q in queues) / len(queues), 1)
                                  for k in ("waiting", "running")} if queues else None,
               gateway_cpu_s_per_1k_tokens=(cpu_s["gateways"] / (row["window_tokens"] / 1000)
                                            if row["window_tokens"] else None))
    return row


def summarize(streams: list[dict], start: float, window: float) -> dict:
    """A level's figures from its streams' requests (see the module's docstring)."""
    end = start + window
    reqs = [r for s in streams for r in s["requests"]]
    outcomes = Counter(r["outcome"] for r in reqs)
    errors: Counter[str] = Counter()
    for outcome, count in outcomes.items():
        if outcome.startswith("error:"):
            errors[outcome.removeprefix("error:")] += count
        elif outcome == "ended":
            errors["STREAM_ENDED_FIRST"] += count
    for s in streams:
        if s["status"] != "OK":
            errors[f"stream {s['status']}"] += 1
    ttft = [r["first"] - r["sent"] for r in reqs if r["first"] is not None]
    window_tokens = sum(t for r in reqs for at, t in r["deltas"] if start <= at <= end)
    return {
        "window_s": window,
        "requests": len(reqs),
        "completed": sum(c for o, c in outcomes.items() if o.startswith("finished:")),
        "completed_in_window": sum(1 for r in reqs if r["outcome"].startswith("finished:")
                                   and r["end"] <= end),
        "finishes": {o.removeprefix("finished:"): c for o, c in sorted(outcomes.items())
                     if o.startswith("finished:")},
        "errors": sum(errors.values()),
        "errors_by_code": dict(sorted(errors.items())),
        "ttft_p50_ms": _ms(pct(ttft, 0.5)),
        "ttft_p99_ms": _ms(pct(ttft, 0.99)),
        "tokens": sum(t for r in reqs for _, t in r["deltas"]),
        "window_tokens": window_tokens,
        "tokens_per_s": window_tokens / window,
        "drain_s": round(max((r["end"] for r in reqs), default=end) - end, 2),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def warm_up(targets: list[str], key: str, args: argparse.Namespace, check: Callable[[], None]) -> None:
    """A request on every gateway to every engine (two streams a gateway at once: a gateway
    sends to its least loaded engine), until a round has no error: a gateway's first request
    costs it more than the next, and none of that is the load's."""
    n = 2 * len(targets)
    for attempt in range(10):
        streams = asyncio.run(load_streams(targets, key, list(range(n)), time.monotonic(),
                                           time.monotonic(), time.monotonic() + 120, args.max_tokens))
        errors = summarize(streams, time.monotonic(), 1.0)["errors_by_code"]
        if not errors:
            return
        check()
        print(f"  warm-up round {attempt + 1}: {errors}; again", flush=True)
        time.sleep(1)
    raise RuntimeError(f"the warm-up requests keep failing: {errors}")


# -- idle streams ---------------------------------------------------------------------------


async def idle_streams(target: str, key: str, n: int, channels: int, max_tokens: int, conn: Any,
                       hold_s: float) -> None:
    """n streams on `channels` channels: each asks once, then nothing until the parent says
    "ask" (at most hold_s seconds); then each asks again and half-closes. Reports to the
    parent through conn after each step."""
    chans = [_channel(target, key) for _ in range(channels)]
    calls = [ChatCall(chans[i % channels], timeout=hold_s + 300) for i in range(n)]
    try:
        first = await asyncio.gather(*(c.ask(f"i{i}-0", IDLE_QUESTION, max_tokens)
                                       for i, c in enumerate(calls)))
        conn.send({"step": "opened", **_idle_outcomes(first)})
        deadline = time.monotonic() + hold_s
        ended_while_idle = 0
        while not conn.poll() and time.monotonic() < deadline:
            ended_while_idle = sum(1 for c in calls if c.call.done())
            await asyncio.sleep(0.5)
        conn.recv()
        second = await asyncio.gather(*(c.ask(f"i{i}-1", IDLE_QUESTION, max_tokens)
                                        for i, c in enumerate(calls)))
        statuses = Counter(await asyncio.gather(*(c.close() for c in calls)))
        conn.send({"step": "asked again", "ended_while_idle": ended_while_idle,
                   "statuses": dict(statuses), **_idle_outcomes(second)})
    finally:
        for ch in chans:
            await ch.close()


def _idle_outcomes(reqs: list[dict]) -> dict:
    return {"outcomes": dict(Counter(r["outcome"] for r in reqs)),
            "cache_hits": sum(r["cache_hit"] for r in reqs)}


def _idle_client(target: str, key: str, n: int, channels: int, max_tokens: int, conn: Any,
                 hold_s: float) -> None:
    asyncio.run(idle_streams(target, key, n, channels, max_tokens, conn, hold_s))


def run_idle(target: str, key: str, gateway_pid: int | None, args: argparse.Namespace) -> dict:
    """See the module's docstring. The warm-up's answer is cached; every stream's request
    is then a cache hit (audited, answered by the gateway from Valkey): cheap to serve, so
    that a thousand streams can prove they are live on two cores."""
    async def warm() -> bool:
        hit = False
        for i in range(20):  # the answer is stored just after it is delivered
            async for e in stream_one(target, chat_request(f"warm{i}", IDLE_QUESTION,
                                                           max_tokens=args.max_tokens),
                                      timeout=120, credentials=Credentials(key)):
                hit = hit or (e.WhichOneof("event") == "started" and e.started.cache_hit)
            if hit:
                return True
            await asyncio.sleep(0.25)
        return False

    if not asyncio.run(warm()):
        raise RuntimeError("the idle streams' question is never answered from the cache")
    rss = {"before_kib": rss_kib(gateway_pid) if gateway_pid else None}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    client = ctx.Process(target=_idle_client, daemon=True,
                         args=(target, key, args.idle_streams, args.idle_channels, args.max_tokens,
                               child, args.idle_window + 60))
    client.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("the idle streams did not open within 300 s")
        opened = parent.recv()
        t0 = time.monotonic()
        rss["opened_kib"] = rss_kib(gateway_pid) if gateway_pid else None
        time.sleep(args.idle_window)
        rss["after_window_kib"] = rss_kib(gateway_pid) if gateway_pid else None
        held = time.monotonic() - t0
        parent.send("ask")
        if not parent.poll(300):
            raise RuntimeError("the idle streams' second requests were not answered within 300 s")
        again = parent.recv()
        client.join(30)  # its channels closed
    finally:
        if client.is_alive():
            client.kill()
    n = args.idle_streams
    answered = sum(v for k, v in again["outcomes"].items() if k.startswith("finished:"))
    growth = (rss["opened_kib"] - rss["before_kib"]) if gateway_pid else None
    return {"streams": n, "channels": args.idle_channels, "held_s": round(held, 1),
            "opened": opened, "asked_again": again, "rss": rss,
            "kib_per_stream": round(growth / n, 1) if growth is not None else None,
            "answered_after_idle": answered,
            "ended_while_idle": again["ended_while_idle"],
            # requests of either round not answered, and streams not ending with OK
            "errors": (n - sum(v for k, v in opened["outcomes"].items() if k.startswith("finished:")))
            + (n - answered) + sum(v for k, v in again["statuses"].items() if k != "OK")}


# -- the run --------------------------------------------------------------------------------


def server_env(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """The servers' environment, and the settings the bench sets (for its conditions)."""
    most = max([*args.levels, args.idle_streams])
    defaults, needed = Settings(), {}
    # Each level starts with one request a stream at once, and the idle streams ask all at
    # once: the tenant's burst (its rate a second) must hold them. Every stream here is one
    # tenant's, and the idle streams are calls open at once on one gateway.
    if 2 * most > defaults.tenant_requests_per_s:
        needed["FINSIEVE_TENANT_REQUESTS_PER_S"] = str(2 * most)
    if 2 * most > defaults.tenant_concurrent_streams:
        needed["FINSIEVE_TENANT_CONCURRENT_STREAMS"] = str(2 * most)
    if args.idle_streams > defaults.max_streams:
        needed["FINSIEVE_MAX_STREAMS"] = str(args.idle_streams + 100)
    env = {**os.environ, **needed, "FINSIEVE_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
    # torch's threads wait passively, as in the test suite: spinning, they keep a core from
    # the other engine and the gateways (tests/conftest.py).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    shown = {**needed, "OMP_WAIT_POLICY": env["OMP_WAIT_POLICY"]}
    return env, shown


def raise_fd_limit(streams: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * streams + 1024))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want


def _stop_on_signals() -> None:
    """SIGTERM and SIGHUP end the bench as Ctrl-C does: through its cleanup."""
    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def run(args: argparse.Namespace) -> dict:
    env, settings = server_env(args)
    result: dict[str, Any] = {
        "levels_streams": args.levels, "window_s": args.window, "max_tokens": args.max_tokens,
        "client_procs": args.client_procs, "settings_set": {} if args.target else settings,
        "machine": {"cpu": cpu(), "fd_limit": raise_fd_limit(max([*args.levels, args.idle_streams])),
                    "load_before": [round(x, 2) for x in os.getloadavg()]}}
    if args.target:
        targets, key = [args.target], Path(args.key_file).read_text().strip()
        pids = [args.gateway_pid] if args.gateway_pid else []
        watch = Watch({"gateways": pids, "gateway children": [c for p in pids for c in children(p)]},
                      [], lambda: None)
        result["deployment"] = f"the server at {args.target} (started elsewhere)"
        warm_up(targets, key, args, watch.check)
        result["levels"] = [_level(targets, key, n, args, watch) for n in args.levels]
        result["idle"] = run_idle(args.target, key, args.gateway_pid, args)
    else:
        work = Path(tempfile.mkdtemp(prefix="bench_load-"))
        d = Deployment(work, env)
        try:
            d.start(args.engines, args.gateways)
            result["deployment"] = (f"{args.engines} engines (--role engine, {MODEL.name}, rules/), "
                                    f"{args.gateways} gateways (--role gateway, each listing every "
                                    "engine), one Valkey; loopback")
            gateway_pids = [g.process.pid for g in d.gateways]
            engine_pids = [e.process.pid for e in d.engines]
            watch = Watch({"gateways": gateway_pids,
                           "gateway children": [c for p in gateway_pids for c in children(p)],
                           "engines": engine_pids,
                           "engine children": [c for p in engine_pids for c in children(p)],
                           "valkey": [d.valkey.process.pid]}, d.engine_metrics, d.check)
            targets = [g.target for g in d.gateways]
            warm_up(targets, d.key, args, d.check)
            result["levels"] = [_level(targets, d.key, n, args, watch) for n in args.levels]
            idle = d.start_gateway("gateway-idle")
            d.gateways.append(idle)
            result["idle"] = run_idle(idle.target, d.key, idle.process.pid, args)
            d.check()
        finally:
            d.stop()
            if args.keep:
                print(f"servers' logs kept in {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
    result["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


def _level(targets: list[str], key: str, n: int, args: argparse.Namespace, watch: Watch) -> dict:
    row = run_level(targets, key, n, args, watch)
    print(f"  {n:>4} streams: {row['completed']} requests, {row['tokens_per_s']:.1f} tokens/s, "
          f"errors {row['errors']} {row['errors_by_code'] or ''}, engines' queue (mean) "
          f"{row['engine_queue_mean']}, load {row['load_1min_at_end']}", flush=True)
    return row


def conditions(result: dict) -> str:
    m = result["machine"]
    during = [r["load_1min_at_end"] for r in result["levels"]]
    return (f"{m['cpu']}, shared with other work: 1-min load average {m['load_before'][0]} before, "
            f"{', '.join(map(str, during))} at the end of each level's window, {m['load_after'][0]} "
            f"after; {result['deployment']}; "
            + ("settings the bench set: " + ", ".join(f"{k}={v}" for k, v in result["settings_set"].items())
               + "; the rest at their defaults" if result["settings_set"] else "the server's own settings"))


def report(result: dict) -> None:
    base = result["levels"][0]
    print(f"\n{result['deployment']}")
    print(f"window {result['window_s']:g} s a level, max_tokens {result['max_tokens']}; "
          f"ratios to {base['streams']} stream{'s' if base['streams'] > 1 else ''} (same run)")
    head = (f"{'streams':>7} {'requests':>8} {'errors':>6} {'TTFT p50 ms':>11} {'p99 ms':>8} "
            f"{'tokens/s':>8} {'gw CPU s/1k tok':>15} {'x tok/s':>7} {'x TTFT p50':>10} {'x gw CPU':>8}")
    print(head)
    for r in result["levels"]:
        def ratio(k: str, r: dict = r) -> str:
            return f"{r[k] / base[k]:.2f}" if r[k] and base[k] else "-"
        gw = r["gateway_cpu_s_per_1k_tokens"]
        print(f"{r['streams']:>7} {r['completed']:>8} {r['errors']:>6} {_num(r['ttft_p50_ms']):>11} "
              f"{_num(r['ttft_p99_ms']):>8} {r['tokens_per_s']:>8.1f} {_num(gw, 2):>15} "
              f"{ratio('tokens_per_s'):>7} {ratio('ttft_p50_ms'):>10} "
              f"{ratio('gateway_cpu_s_per_1k_tokens'):>8}")
    for r in result["levels"]:
        if r["errors"]:
            print(f"  {r['streams']} streams: errors {r['errors_by_code']}")
    i = result["idle"]
    print(f"\nidle: {i['streams']} streams on {i['channels']} channels held {i['held_s']} s; "
          f"ended while idle {i['ended_while_idle']}; answered after the window "
          f"{i['answered_after_idle']}/{i['streams']}; errors {i['errors']}; gateway RSS "
          f"{_num(i['rss']['before_kib'])} -> {_num(i['rss']['opened_kib'])} -> "
          f"{_num(i['rss']['after_window_kib'])} KiB: {_num(i['kib_per_stream'])} KiB a stream")
    print(f"\n{conditions(result)}")


def _num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 20, 200],
                    help="streams at each level, the first the baseline (default 1 20 200)")
    ap.add_argument("--window", type=float, default=60.0, help="seconds each level sends requests")
    ap.add_argument("--drain", type=float, default=180.0,
                    help="seconds the last requests of a level may take after its window")
    ap.add_argument("--max-tokens", type=int, default=12, help="of each answer")
    ap.add_argument("--client-procs", type=int, default=4, help="client processes of a level")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--gateways", type=int, default=2)
    ap.add_argument("--idle-streams", type=int, default=1000)
    ap.add_argument("--idle-channels", type=int, default=0,
                    help="channels the idle streams share (default: one per 100 streams)")
    ap.add_argument("--idle-window", type=float, default=90.0,
                    help="seconds the idle streams are held (default 90: past one keepalive ping "
                    "of the gateway, FINSIEVE_KEEPALIVE_TIME_S=60)")
    ap.add_argument("--quick", action="store_true",
                    help="a check of seconds: levels 1 and 20, 3 s each, 40 idle streams for 2 s "
                    "(within the default tenant limits: with --target, the server's own)")
    ap.add_argument("--target", default="", help="an existing gateway instead of a deployment")
    ap.add_argument("--key-file", default="", help="with --target: an app key's file")
    ap.add_argument("--gateway-pid", type=int, default=0,
                    help="with --target: the gateway's pid, for its CPU and memory (role all: "
                    "the engine's CPU is in it)")
    ap.add_argument("--keep", action="store_true", help="keep the servers' logs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "load.json")
    args = ap.parse_args()
    if args.quick:  # its sizes, under the options given
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    if args.target and not args.key_file:
        ap.error("--target needs --key-file (an app key of that server)")
    args.idle_channels = args.idle_channels or math.ceil(args.idle_streams / 100)
    if args.idle_streams / args.idle_channels > 200:
        ap.error("--idle-channels: at most 200 streams a channel (each asks at once; "
                 "FINSIEVE_MAX_IN_FLIGHT_PER_CONNECTION is 256)")
    _stop_on_signals()
    result = run(args)
    origin = provenance("bench_load", conditions(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_provenance(result, origin), indent=2) + "\n")
    report(result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
