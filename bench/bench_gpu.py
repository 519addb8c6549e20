"""GPU benchmark (issue 10): the engine against the memory-bandwidth floor and transformers.

    python bench/bench_gpu.py --tokenizer DIR [--deadline 570] [--phases ...]   # on a GPU
    .venv/bin/python bench/bench_gpu.py --tiny                                 # CPU dry run

One run of the default phases takes ~8 minutes on an H200 (2026-12-02: 9 s device, 41
model, 138 in-process, 74 transformers `generate_batch`, 131 served, ~65 transformers
`generate` of which ~41 compiling), each phase in its own process (GPU memory and compile
state stay apart), results written to the JSON after every phase, a table printed at the
end:

  device      copy bandwidth (device-to-device, bytes read + written; after ~1 s of copies,
              the clocks up) and bf16 matmul rate;
              the batch-1 floor = weight bytes read per step / bandwidth
  model       a Qwen2-7B-shaped model (hidden 3584, 28 layers, 28 heads, 4 KV heads,
              intermediate 18944) with random bf16 weights and the default model's
              tokenizer (vocabulary 49,152), saved as a Hugging Face directory
  inprocess   LLMEngine without gRPC: start-up (load, compile, graph capture), then rules
              off and rules on (default packs + 10,000 synthetic literals) at 1/16/64/128
              streams: tokens/s, TTFT p50/p99, step time (ITL) p50/p99, late repairs; each
              level twice: every stream started at once, and in the steady state (`steady`:
              streams out of phase, see run_engine_level); with --baselines, at 64+
              streams, rules on, the engine's own baselines: mixed steps off (`unmixed`
              and `steady-um`: FINSIEVE_MIXED_TOKENS=0, prefill in forwards of its own)
              and requests prepared on threads beside the loop (`steady-th`, the baseline
              of FINSIEVE_PREPARE_WORKERS); mixed steps whose prompt tokens are not cut to
              whole matmul tiles (`steady-ut`, the baseline of the scheduler's MIXED_TILE);
              64 requests arriving at once (TTFT, prefill FLOP/s); a bare prefill's FLOP/s
  serve       `finsieve serve --role engine` plus gateway processes on one SO_REUSEPORT
              port, client processes over gRPC: rules on, then off (hot reload to an
              empty pack), same levels, those of more than one stream in the steady state
              (`--serve-steady`); start-up until the engine is SERVING
  hf_batch    transformers continuous batching (`generate_batch`), 64 requests
  hf_generate transformers `generate`, static cache + torch.compile, batch 1 (as its
              generate compiles its decode step: CUDA graphs; --hf-compile)
  tests       (only when named) `make test-gpu`'s checks
  profile     (only when named) the decode step's kernels by device time at 1 and 64 rows,
              each weight's matmul alone against the copy bandwidth, a prefill forward's
              host and device time by size; `--sweeps`: the tile sweeps

Prompts are 128-512 tokens, 256 new tokens, greedy. Each stream sends `--rounds` requests
one after the other (a closed loop); tokens/s = completion tokens / wall time of the level
(through gRPC: from the first request sent to the last answer received).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

QWEN2_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 49152,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")


def time_left(args) -> float:
    return args.until - time.time() if args.until else 1e9


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile, interpolated between the nearest two samples: the median of two
    requests (one stream's default) is their mean, where the nearest rank took the larger."""
    if not values:
        return None
    s = sorted(values)
    k = q * (len(s) - 1)
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- phases ------------------------------------------------------------------------------

def phase_device(args) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu"}
    n = 2 * 1024**3 // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    # ~1 s of copies first: coming out of idle, the clocks take a while to rise, and copies
    # timed right away read up to 2% lower (an H200 read 4.13-4.21 TB/s after 2 s idle,
    # 4.225-4.231 after 2 s of copies, in one process), which lowered the floor's bar.
    for _ in range(1000):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1000)
    bandwidth = 2 * a.nbytes / statistics.median(times)
    del a, b
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    times = []
    for i in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        m @ m
        e.record()
        e.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e) / 1000)
    return {"device": torch.cuda.get_device_name(), "copy_bandwidth_bytes_s": bandwidth,
            "bf16_matmul_flops": 2 * 8192**3 / statistics.median(times),
            "torch": torch.__version__, "host_cpu": _host_cpu()}


def _host_cpu() -> str:
    """The host's CPU model and core count: at 128 streams with the rules on the engine's
    loop (one Python thread) is what sets the pace, so a row's host matters."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"unknown, {os.cpu_count()} cores"


def phase_model(args) -> dict:
    import torch

    start = time.perf_counter()
    out = Path(args.model_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(device, args.tiny)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(args.tokenizer) / name).exists():
            shutil.copy(Path(args.tokenizer) / name, out / name)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return {"seconds": time.perf_counter() - start, "weight_bytes_per_step": step_bytes(model),
            "matmul_params": params, "config": model.config.hidden_size}


def random_model(device: str, tiny: bool = False):
    """The benchmark's Qwen2 model (QWEN2_7B, or TINY) with random weights, seeded, on
    `device`: bfloat16 on CUDA, float32 on the CPU."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cuda = device == "cuda"
    config = Qwen2Config(**(TINY if tiny else QWEN2_7B), bos_token_id=1, eos_token_id=2,
                         torch_dtype="bfloat16" if cuda else "float32")
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32)


def step_bytes(model) -> int:
    """Weight bytes a decode step reads (one embedding row per token: none of the table)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "embed_tokens" not in n)


def prompts(tokenizer_dir: str, n: int, tiny: bool) -> list[str]:
    """n user messages whose prompts are 128-512 tokens (32-64 with --tiny), spread evenly."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    words = [w for ln in (REPO / "tests/data/clean_corpus.txt").read_text().splitlines()
             if ln and not ln.startswith("#") and ln.isascii() for w in ln.split()]
    lo, hi = (32, 64) if tiny else (128, 512)
    out = []
    for i in range(n):
        target = lo + (i * 97) % (hi - lo + 1)

        def text(k: int, i: int = i) -> str:
            return "Summarise this note for a client: " + " ".join(
                words[(i * 13 + j) % len(words)] for j in range(k))

        low, high = 1, 2 * hi  # the fewest words whose prompt reaches the target
        while low < high:
            mid = (low + high) // 2
            if len(prompt_ids(tok, text(mid))) >= target:
                high = mid
            else:
                low = mid + 1
        out.append(text(low))
    return out


def rules_dir(root: Path, tokenizer_dir: str, synthetic: bool = True) -> Path:
    from bench_rules import synthetic_pack

    d = root / "rules"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(REPO / "rules", d)
    for extra in d.glob("*.md"):
        extra.unlink()
    if synthetic:
        synthetic_pack(d, 10_000, 0)
    return d


class TimingSink:
    """Collects one request's events with their arrival times."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.done = False
        self.error = ""
        self.finish = ""

    def deliver(self, step) -> None:
        now = time.perf_counter()
        for e in step.events:
            kind = e.WhichOneof("event")
            if kind == "delta" and (e.delta.tokens or e.delta.text):
                self.times.append(now)
                self.tokens.append(e.delta.tokens)
            elif kind == "finished":
                self.done, self.finish = True, finish_name(e.finished.finish_reason)
            elif kind == "error":
                self.done, self.error = True, e.error.message


def finish_name(reason: int) -> str:
    from finsieve.v1 import chat_pb2

    return chat_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def summarize(reqs: list[dict], wall: float, steps: list[float] | None = None) -> dict:
    tokens = sum(r["tokens"] for r in reqs)
    ttft = [r["ttft"] for r in reqs if r["ttft"] is not None]
    gaps = [g for r in reqs for g in r["gaps"]]
    row = {"requests": len(reqs), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
           "ttft_p50_ms": 1000 * (pct(ttft, 0.5) or 0), "ttft_p99_ms": 1000 * (pct(ttft, 0.99) or 0),
           "itl_p50_ms": 1000 * (pct(gaps, 0.5) or 0), "itl_p99_ms": 1000 * (pct(gaps, 0.99) or 0),
           "errors": sum(1 for r in reqs if r["error"]),
           "error_examples": sorted({r["error"][:200] for r in reqs if r["error"]})[:3],
           # how the requests ended: a level whose answers end early (a refusal, a halt)
           # has fewer tokens, and a shorter wall, than its neighbours
           "finishes": dict(Counter(r.get("finish") or "none" for r in reqs))}
    if steps:
        row["step_p50_ms"] = 1000 * pct(steps, 0.5)
        row["step_p99_ms"] = 1000 * pct(steps, 0.99)
    return row


def _no_row(error: str, **more) -> dict:
    """A level's row when it measured nothing: the reason, and zeros where the figures go."""
    return {"error": error, "tokens_per_s": 0, "ttft_p50_ms": 0, "ttft_p99_ms": 0,
            "itl_p50_ms": 0, "itl_p99_ms": 0, **more}


def run_engine_level(engine, texts: list[str], streams: int, rounds: int, max_tokens: int,
                     burst: bool = False, spread: bool = False) -> dict:
    """`streams` closed-loop streams, `rounds` requests each, the engine's steps driven on
    this thread. Requests are prepared (tokenized, input rules) on worker threads, as the
    server's executor prepares them beside the engine's loop.

    All streams start at once by default: every request of a round then ends in the same few
    steps, and the next round's prompts are prefilled while nothing decodes (the worst case
    of a closed loop). spread: stream s starts at step s * max_tokens / streams, so the
    answers run evenly out of phase, as a server's concurrent clients do once past a
    start-up; the row then counts only the tokens delivered while every stream was running
    (the steady state)."""
    from engine.events import LATE_REPAIRS
    from finsieve.app.client import chat_request

    rows_from = rows_to = None  # the steps' rows (matmul M) over the row's window, by bucket
    loop_from = loop_to = None  # the engine's step and loop counters over the same window
    live: dict[int, tuple[TimingSink, float]] = {}
    done: list[dict] = []
    sinks: list[TimingSink] = []
    repairs_before = LATE_REPAIRS._value.get()
    next_text = 0

    def prepare(req, sink: TimingSink) -> None:
        try:
            engine.submit(engine.prepare(req, sink))
        except Exception as e:  # a refused request is counted, as the server would answer it
            sink.error, sink.done = repr(e), True

    def submit(stream: int) -> None:
        nonlocal next_text
        sink = TimingSink()
        req = chat_request(f"s{stream}-{next_text}", texts[next_text % len(texts)], max_tokens=max_tokens)
        next_text += 1
        t0 = time.perf_counter()  # preparation (tokenizing, input rules) is in the TTFT
        workers.submit(prepare, req, sink)
        live[stream] = (sink, t0)
        sinks.append(sink)

    starts: dict[int, list[int]] = {}  # step -> the streams whose first request it submits
    for s in range(streams):
        starts.setdefault(s * max_tokens // streams if spread else 0, []).append(s)
    last_start = max(starts)
    pending = dict.fromkeys(range(streams), rounds)
    start = time.perf_counter()
    all_running = idle_from = None  # the steady window: every stream started, none idle yet
    steps: list[tuple[float, float]] = []
    step = 0
    workers = ThreadPoolExecutor(4, thread_name_prefix="prepare")
    while live or step <= last_start:
        for s in starts.get(step, ()):
            submit(s)
            pending[s] -= 1
        if step == last_start:
            all_running = time.perf_counter()
            rows_from, loop_from = _step_rows(), _loop_metrics()
        t = time.perf_counter()
        if engine.step():
            steps.append((t, time.perf_counter() - t))
        else:  # nothing to do until a request is prepared: let the workers run
            time.sleep(0.0002)
        step += 1
        for s, (sink, t0) in list(live.items()):
            if sink.done:
                done.append({"ttft": sink.times[0] - t0 if sink.times else None,
                             "gaps": [b - a for a, b in zip(sink.times, sink.times[1:], strict=False)],
                             "tokens": sum(sink.tokens), "error": sink.error,
                             "finish": sink.finish,
                             "first_at": sink.times[0] - start if sink.times else None,
                             "submitted": t0})
                del live[s]
                if pending[s] and not burst:
                    pending[s] -= 1
                    submit(s)
                elif idle_from is None:
                    idle_from = time.perf_counter()
                    rows_to, loop_to = _step_rows(), _loop_metrics()
    wall = time.perf_counter() - start
    workers.shutdown()
    if not spread:
        row = summarize(done, wall, [d for _, d in steps[2:]])
    else:
        t_a, t_b = all_running, idle_from or time.perf_counter()
        if t_b <= t_a:  # a stream was done before the last one started: no steady window
            return _no_row("no steady window (answers too short for the streams' spread)", errors=0)
        row = summarize([r for r in done if t_a <= r["submitted"] <= t_b], t_b - t_a,
                        [d for t, d in steps if t_a <= t <= t_b])
        row["tokens"] = sum(n for sink in sinks for t, n in zip(sink.times, sink.tokens, strict=True)
                            if t_a <= t <= t_b)
        row["tokens_per_s"] = row["tokens"] / row["wall_s"]
    if not (spread and rows_to):
        rows_to, loop_to = _step_rows(), _loop_metrics()
    row["step_rows"] = {le: rows_to[le] - rows_from.get(le, 0) for le in rows_to}
    row["engine_steps"] = _step_stats(loop_from, loop_to)
    row["late_repairs"] = LATE_REPAIRS._value.get() - repairs_before
    row["last_first_token_s"] = max((r["first_at"] or 0) for r in done)
    return row


def _loop_metrics() -> dict[str, float]:
    """This process's engine step and loop counters, as a served level reads the engine's
    (`_engine_metrics`): the in-process rows' loop per step by part (host work against
    waiting for the device)."""
    from prometheus_client import generate_latest

    return _step_metrics(generate_latest().decode())


def _step_rows() -> dict[str, float]:
    """The engine's steps so far by rows fed (finsieve_engine_step_rows), per bucket: the
    count of steps of at most `le` rows and more than the bucket before's."""
    from engine.events import STEP_ROWS

    cumulative = [(s.labels["le"], s.value) for s in STEP_ROWS.collect()[0].samples
                  if s.name.endswith("_bucket")]
    return {le: n - (cumulative[i - 1][1] if i else 0) for i, (le, n) in enumerate(cumulative)}


def phase_inprocess(args) -> dict:
    import torch

    from engine.engine import NO_POLICY, EngineLimits, LLMEngine
    from engine.loader import load_model
    from finsieve.app.serve import ENGINE_SWITCH_INTERVAL_S, settle_heap
    from finsieve.config import Settings
    from finsieve.policy.guard import compile_policy
    from finsieve.policy.masks import TokenTable

    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)  # as `finsieve serve` runs the engine
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = load_model(args.model_dir, Path(args.work), device)
    t_load = time.perf_counter() - t0
    served = Settings.load(env={})
    limits = EngineLimits(max_batch=max(args.levels), max_context=args.max_context,
                          default_max_tokens=args.max_tokens, max_waiting=1024,
                          prepare_workers=served.prepare_workers,  # as served
                          mixed_tokens=args.mixed_tokens or served.mixed_tokens)
    engine = LLMEngine(model, limits, device)
    t_ready = time.perf_counter() - t0
    result = {"load_s": t_load, "ready_s": t_ready, "graphs_s": engine.runner.startup_s,
              "mode": engine.mode, "slots": engine.max_batch}
    if device.type == "cuda":
        result["gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    work = Path(args.work)
    t = time.perf_counter()
    policy = compile_policy(rules_dir(work, args.tokenizer), TokenTable.build(engine.token_bytes), None)[0]
    result["rules_compile_s"] = time.perf_counter() - t
    result["rules"] = len(policy.pack.rules)
    texts = prompts(args.model_dir, 128, args.tiny)

    def in_force(policy) -> None:
        """As `finsieve serve` puts a (re)loaded policy in force, the workers' copies of its
        input rules compiled before the rows (else the first requests wait for them)."""
        engine.policy = lambda: policy
        wait(engine.preparer.preload(policy.pack.input, policy.version), 60)

    in_force(NO_POLICY)
    run_engine_level(engine, texts, len(texts), 1, 2, burst=True)  # every prompt shape once
    result["graph_replay_ms"] = _graph_replay_ms(engine)
    settle_heap()  # as `finsieve serve` does before it serves
    result["levels"], result["steady"] = [], []
    for n in args.levels:
        for name, pol in (("off", NO_POLICY), ("on", policy)):
            for spread in (False, True) if n > 1 else (False,):
                if time_left(args) < 60:
                    result["skipped"] = f"levels from {n} streams rules {name}: no time left"
                    break
                in_force(pol)
                row = run_engine_level(engine, texts, n, _rounds(args, spread), args.max_tokens,
                                       spread=spread)
                row.update(streams=n, rules=name)
                result["steady" if spread else "levels"].append(row)
                print(f"  in-process {n:>3} streams rules {name}{' steady' if spread else ''}: "
                      f"{row['tokens_per_s']:.0f} tok/s, step p50 {row.get('step_p50_ms', 0):.2f} ms, "
                      f"loop ms/step {row.get('engine_steps', {}).get('loop_ms_per_step')}, "
                      f"errors {row['errors']}, finishes {row.get('finishes')}", flush=True)
                Path(args.result).write_text(json.dumps(result))  # what is measured survives a kill
    in_force(policy)
    if args.baselines:
        _baselines(engine, texts, args, result)
    # mixed steps cut to other tiles than MIXED_TILE, and other budgets
    result["tile_sweep"] = [{**row, "mixed_tile": t} for t in args.tile_sweep
                            for row in _swept(engine, texts, args, f"tiles of {t} rows", mixed_tile=t)]
    result["mixed_sweep"] = [{**row, "mixed_tokens": b}
                             for b in args.mixed_sweep if 0 < b <= engine.runner.mixed_tokens
                             for row in _swept(engine, texts, args, f"mixed steps of {b} tokens",
                                               mixed_tokens=b)]
    if time_left(args) < 30:
        return result
    burst = min(64, max(args.levels))
    prompt_tokens = sum(len(engine.prepare(_req(t), TimingSink()).prompt_ids) for t in texts[:burst])
    row = run_engine_level(engine, texts, burst, 1, args.max_tokens, burst=True)
    flops = _prefill_flops(args, prompt_tokens, engine)
    row.update(streams=burst, rules="on", prompt_tokens=prompt_tokens,
               prefill_flops_per_s=flops / row["last_first_token_s"])
    result["burst"] = row
    result["bare_prefill"] = _bare_prefill(engine, args)
    if device.type == "cuda":
        result["gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def _baselines(engine, texts: list[str], args, result: dict) -> None:
    """With --baselines: the engine's own baselines, rules on. Mixed steps off
    (FINSIEVE_MIXED_TOKENS=0: prefill in forwards of its own, fresh prompts batched while
    streams decode, as before mixed steps), cold and steady; mixed steps whose prompt tokens
    fill the budget wherever it ends (a tile no step fills); requests prepared on threads of
    this process (FINSIEVE_PREPARE_WORKERS=0)."""
    from engine.preparer import Preparer

    with _mixed_steps_off(engine):
        result["unmixed"] = _baseline_rows(engine, texts, args, "mixed steps off", spread=False)
        result["steady_unmixed"] = _baseline_rows(engine, texts, args, "mixed steps off")
    result["steady_untiled"] = _swept(engine, texts, args, "tile cut off", mixed_tile=2**62)
    with _attributes_set(engine, preparer=Preparer(engine.tokenizer, engine.max_context, 0)):
        result["steady_threads"] = _baseline_rows(engine, texts, args, "prepared on threads")


def _swept(engine, texts: list[str], args, label: str, **setting) -> list[dict]:
    """Steady rows, rules on, at --sweep-from streams and more, under a scheduler setting."""
    with _attributes_set(engine.scheduler, **setting):
        return _baseline_rows(engine, texts, args, label, least=args.sweep_from)


def _rounds(args, spread: bool) -> int:
    """Requests per stream: a steady row counts from the last stream's start to the first
    stream's end, about (rounds - 1) answers long."""
    return args.steady_rounds if spread else args.rounds


@contextlib.contextmanager
def _attributes_set(obj, **values):
    """obj's attributes set for the block, then restored."""
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


@contextlib.contextmanager
def _mixed_steps_off(engine):
    """The engine as FINSIEVE_MIXED_TOKENS=0 serves (prompt batching then on, its default)."""
    from engine.engine import EngineLimits

    with _attributes_set(engine.scheduler, mixed_tokens=0,
                         prompt_batch=EngineLimits.prompt_batch_tokens), \
            _attributes_set(engine.runner, mixed_tokens=0):
        yield


def _baseline_rows(engine, texts: list[str], args, label: str, spread: bool = True,
                   least: int = 64) -> list[dict]:
    """Rules on at `least` streams and more (steady, or every stream started at once), under
    a baseline's setting."""
    rows = []
    for n in [n for n in args.levels if n >= least]:
        if time_left(args) < 60:
            break
        row = run_engine_level(engine, texts, n, _rounds(args, spread), args.max_tokens,
                               spread=spread)
        row.update(streams=n, rules="on")
        rows.append(row)
        print(f"  in-process {n:>3} streams rules on{' steady' if spread else ''}, {label}: "
              f"{row['tokens_per_s']:.0f} tok/s, step p50 {row.get('step_p50_ms', 0):.2f} ms",
              flush=True)
    return rows


def _graph_replay_ms(engine) -> dict:
    """Device time of one decode step's graph alone (its greedy sample included, no host
    work), per bucket. Each replay writes the graphs' `prev`: not between an engine's launches."""
    import torch

    graphs = engine.runner.graphs
    if graphs is None:
        return {}
    out = {}
    for size in (1, 16, 64, 128):
        if size not in graphs.buckets:
            continue
        inputs = torch.zeros(5, size, dtype=torch.long, device="cuda")  # none optimistic
        inputs[1] = 500  # attend 501 positions, a typical context here
        inputs[2] = torch.arange(size, device="cuda") % engine.max_batch
        times = []
        for i in range(23):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graphs.run(inputs, size)
            e.record()
            e.synchronize()
            if i >= 3:
                times.append(s.elapsed_time(e))
        out[size] = statistics.median(times)
    return out


def _req(text: str):
    from finsieve.app.client import chat_request

    return chat_request("p", text, max_tokens=1)


def _prefill_flops(args, tokens: int, engine) -> float:
    """2 x matmul parameters per token, plus causal attention (QK and PV)."""
    m = engine.model
    params = _matmul_params(m)
    per_seq = tokens / min(64, max(args.levels))
    attn = 2 * 2 * len(m.layers) * m.n_heads * m.head_dim * per_seq * per_seq / 2
    return 2 * params * tokens + attn * min(64, max(args.levels))


def _matmul_params(m) -> int:
    """The weights a token is multiplied by (the layers' and the head's): read from the
    engine's model, so that a run without the model phase (a baseline tree's) has them."""
    return sum(w.numel() for layer in m.layers
               for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)) + m.lm_head.numel()


def _bare_prefill(engine, args) -> dict:
    """One prefill step of 4 x 512 fresh tokens, timed on the device (the achieved FLOP/s)
    and on the host (the time to issue it), eager and replayed from its CUDA graph; and one
    prompt of 320 tokens, a lone stream's first step."""
    import torch

    m, graphs = engine.model, engine.runner.prefill_graphs
    if m.device.type != "cuda":
        return {}
    params = _matmul_params(m)
    out = {}
    for n, count in ((512, 4), (320, 1)):
        if count > m.n_slots:  # (--levels below 4: fewer KV slots)
            continue
        chunks = [(s, 0, list(range(1000 + s, 1000 + s + n))) for s in range(count)]
        ways = {"eager": lambda chunks=chunks: m.prefill(chunks, [True] * len(chunks))}
        if graphs is not None and (fit := graphs.layout(chunks, [True] * len(chunks))):
            t, layout = fit[0], torch.from_numpy(fit[1]).cuda()
            ways["graph"] = lambda t=t, layout=layout, count=count: graphs.run(t, layout, count)
        attn = count * 2 * 2 * len(m.layers) * m.n_heads * m.head_dim * n * n / 2
        flops = 2 * params * count * n + attn
        for way, run in ways.items():
            for _ in range(2):
                run()
            device, issue = [], []
            for _ in range(5):
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                s.record()
                run()
                e.record()
                issue.append(1000 * (time.perf_counter() - t0))
                e.synchronize()
                device.append(s.elapsed_time(e) / 1000)
            out[f"{count * n} {way}"] = {
                "tokens": count * n, "seconds": statistics.median(device),
                "issue_ms": statistics.median(issue), "flops_per_s": flops / statistics.median(device)}
    best = out.get("2048 graph") or out["2048 eager"]
    return {**best, "ways": out}


# -- through gRPC ------------------------------------------------------------------------

def _client_proc(target: str, key: str, texts: list[str], streams: list[int], rounds: int,
                 max_tokens: int, queue, start, spread_s: float = 0.0, n: int = 1) -> None:
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

                async def send(req=req):
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
        return _no_row("a stream's first request delivered nothing", errors=0)
    t_a, t_b = max(firsts.values()), min(lasts.values())
    if t_b <= t_a:
        return _no_row("no steady window (answers too short for the streams' spread)", errors=0)
    row = summarize(reqs, t_b - t_a)
    row["tokens"] = sum(n for r in reqs for t, n in r["deltas"] if t_a <= t <= t_b)
    row["tokens_per_s"] = row["tokens"] / row["wall_s"]
    row["steady_window_s"] = row["wall_s"]
    return row


def _health(target: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def phase_serve(args) -> dict:
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
        while not _health(f"127.0.0.1:{engine_port}"):
            if engine.poll() is not None or time.perf_counter() - t0 > 400:
                raise RuntimeError("the engine did not start:\n" + (work / "engine.log").read_text()[-3000:])
            time.sleep(0.5)
        result["ready_s"] = time.perf_counter() - t0
        while not _health(f"127.0.0.1:{port}"):
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
        result["gpu_memory_gib"] = _gpu_used_gib()
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
                processes = {"engine": [engine.pid], "preparation workers": _children(engine.pid),
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
                    row = _no_row(repr(e)[:300])
                for spy in filter(None, spies):
                    spy.send_signal(signal.SIGINT)  # py-spy writes its samples and exits
                    spy.wait(30)
                if any(spies):
                    row["py_spy"] = {who: _py_spy_summary(path) for who, path in samples.items()}
                row["cpu_s"] = {k: round(v - cpu[k], 2) for k, v in _cpu_seconds(processes).items()}
                row["engine_steps"] = _step_stats(steps, _engine_metrics(metrics_port))
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


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


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
    return _step_metrics(text)


def _step_metrics(text: str) -> dict[str, float]:
    """_engine_metrics' figures from a Prometheus exposition (a served engine's /metrics, or
    this process's registry for the in-process rows)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "finsieve_decode_step_seconds":
            for sample in family.samples:
                kind = sample.name.removeprefix(family.name + "_")
                out[f"le={sample.labels['le']}" if kind == "bucket" else kind] = sample.value
        elif family.name == "finsieve_engine_loop_seconds":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[f"loop:{sample.labels['part']}"] = sample.value
        elif family.name == "finsieve_generated_tokens":
            out["tokens"] = sum(x.value for x in family.samples if x.name.endswith("_total"))
    return out


def _step_stats(before: dict[str, float], after: dict[str, float]) -> dict:
    """A level's engine steps (its own clock, launch to launch): how many, the mean, the
    share longer than 10 ms, the tokens the rules accepted per step, and the loop's
    milliseconds per step by part (device: waiting for the tokens; host: its own work;
    *_cpu: of those, on its thread's CPU clock)."""
    count = after.get("count", 0) - before.get("count", 0)
    if count <= 0:
        return {}
    under_10ms = after.get("le=0.01", 0) - before.get("le=0.01", 0)
    loop = {k.removeprefix("loop:"): round(1000 * (v - before.get(k, 0)) / count, 2)
            for k, v in after.items() if k.startswith("loop:")}
    return {"steps": int(count),
            "mean_ms": round(1000 * (after["sum"] - before.get("sum", 0)) / count, 2),
            "over_10ms": round(1 - under_10ms / count, 3),
            "tokens_per_step": round((after.get("tokens", 0) - before.get("tokens", 0)) / count, 1),
            "loop_ms_per_step": loop}


def _py_spy(pid: int, output: Path, args) -> subprocess.Popen | None:
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


def _save_logs(logs: list[Path], args) -> None:
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        for f in logs:
            shutil.copy(f, Path(args.log_dir) / f.name)


def _gpu_used_gib() -> float | None:
    try:
        import torch

        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30
    except Exception:
        return None


# -- transformers baselines --------------------------------------------------------------

def _hf_model(args, **kw):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, device_map=device, **kw)
    return model.eval(), AutoTokenizer.from_pretrained(args.model_dir), device


def _hf_prompt_ids(tok, texts: list[str]) -> list[list[int]]:
    return [prompt_ids(tok, t) for t in texts]


def prompt_ids(tok, text: str) -> list[int]:
    """The engine's own prompt: the chat template, then the tokenizer (no extra specials)."""
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                     add_generation_prompt=True)
    return list(tok(prompt, add_special_tokens=False)["input_ids"])


def phase_hf_generate(args) -> dict:
    import torch

    model, tok, device = _hf_model(args)
    ids = torch.tensor([_hf_prompt_ids(tok, prompts(args.model_dir, 1, args.tiny))[0]], device=device)
    if device == "cuda" and args.hf_compile == "forward":
        # transformers' generate compiles its decode step itself on a static cache (its
        # CompileConfig: reduce-overhead, CUDA graphs), the default here: on one H200, back to
        # back, 141 tokens/s against 76 with our torch.compile of the whole forward (inductor
        # alone: our mode="reduce-overhead" failed inside the static cache's update).
        model.forward = torch.compile(model.forward, fullgraph=True)
    kw = {"max_new_tokens": args.max_tokens, "min_new_tokens": args.max_tokens, "do_sample": False,
          "cache_implementation": "static", "attention_mask": torch.ones_like(ids)}
    t = time.perf_counter()
    model.generate(ids, **kw)  # compiles
    compile_s = time.perf_counter() - t
    runs = []
    for _ in range(2):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - t))
    return {"tokens_per_s": max(runs), "first_call_s": compile_s, "new_tokens": args.max_tokens,
            "compile": args.hf_compile, **_dynamo_counts()}


def _dynamo_counts() -> dict:
    """How many graphs torch.compile made and where it broke them (a baseline whose decode
    step is cut into pieces, or not graphed, is not the one its name promises)."""
    from torch._dynamo.utils import counters  # internal, but what TORCH_LOGS reports from

    return {"compiled_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def phase_hf_batch(args) -> dict:
    from transformers import GenerationConfig

    model, tok, _ = _hf_model(args, attn_implementation="sdpa")
    n = min(64, max(args.levels))
    inputs = _hf_prompt_ids(tok, prompts(args.model_dir, n, args.tiny))
    config = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    model.generate_batch(inputs=inputs[:4], generation_config=config)  # warm-up
    t = time.perf_counter()
    out = model.generate_batch(inputs=inputs, generation_config=config)
    wall = time.perf_counter() - t
    tokens = sum(len(o.generated_tokens) for o in out.values())
    errors = [o.error for o in out.values() if getattr(o, "error", None)]
    return {"requests": n, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "errors": errors[:3]}


def phase_tests(args) -> dict:
    env = {**os.environ, "FINSIEVE_TEST_TOKENIZER": args.tokenizer, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/test_gpu.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.tests_timeout)
    print(proc.stdout[-6000:], proc.stderr[-2000:], flush=True)
    return {"returncode": proc.returncode, "summary": proc.stdout.strip().splitlines()[-1:]}


def phase_profile(args) -> dict:
    """Where a decode step's device time goes: the compiled step's kernels by time at 1 and 64
    rows, each weight's matmul alone as a fraction of the copy bandwidth, and the attention
    kernel's tiles and splits at 1, 64 and 128 rows."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from engine.cuda_graphs import call_ms
    from engine.engine import EngineLimits, LLMEngine
    from engine.loader import load_model

    device = torch.device("cuda")
    engine = LLMEngine(load_model(args.model_dir, Path(args.work), device),
                       EngineLimits(max_batch=128, max_context=args.max_context,
                                    default_max_tokens=args.max_tokens), device)
    m = engine.model
    out: dict = {"mode": engine.mode, "graph_replay_ms": _graph_replay_ms(engine), "steps": {}}
    for rows in (1, 64):
        ids = torch.full((rows,), 1000, device=device)
        positions = torch.full((rows,), 500, device=device)
        slots = torch.arange(rows, device=device)
        for _ in range(3):
            m.decode(ids, positions, slots)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                m.decode(ids, positions, slots)
            torch.cuda.synchronize()
        kernels = [(k.key, getattr(k, "self_device_time_total", 0) / 10 / 1000, k.count // 10)
                   for k in prof.key_averages()]
        kernels.sort(key=lambda k: -k[1])
        total = sum(t for _, t, _ in kernels)
        out["steps"][rows] = {"kernel_ms": total, "top": [
            {"kernel": name[:90], "ms": t, "calls": n} for name, t, n in kernels[:14]]}
        print(f"  {rows} rows: kernels {total:.2f} ms/step", flush=True)
        for name, t, n in kernels[:14]:
            print(f"    {t:7.3f} ms {n:4d}x  {name[:90]}", flush=True)
    layer = m.layers[0]
    weights = {"wqkv": layer.wqkv, "wo": layer.wo, "w_gate_up": layer.w_gate_up,
               "w_down": layer.w_down, "lm_head": m.lm_head}
    device_result = json.loads(Path(args.out).read_text()).get("device", {}) \
        if Path(args.out).exists() else {}
    bandwidth = device_result.get("copy_bandwidth_bytes_s")
    out["matmuls"] = {}
    for rows in (1, 64):
        for name, w in weights.items():
            x = torch.randn(rows, w.shape[1], device=device, dtype=w.dtype)
            ms = call_ms(lambda x=x, w=w: F.linear(x, w))
            rate = w.numel() * w.element_size() / (ms / 1000)
            out["matmuls"][f"{name}@{rows}"] = {"ms": ms, "bytes_per_s": rate,
                                                "of_copy": rate / bandwidth if bandwidth else None}
            print(f"  matmul {name:>9} x {rows:>2} rows: {ms * 1000:7.1f} us, {rate / 1e12:.2f} TB/s"
                  + (f" ({rate / bandwidth:.0%} of copy)" if bandwidth else ""), flush=True)
    out["prefill"] = _prefill_costs(engine)
    out["one_row"] = _one_row_paths(m)
    if "gemv" in args.sweeps:
        out["gemv"] = _gemv_tiles(m, bandwidth)
    if "attention" in args.sweeps or "tiles" in args.sweeps:
        out["attention"] = _attention_configs(m, bandwidth, tiles="tiles" in args.sweeps)
    return out


def _prefill_costs(engine) -> dict:
    """A prefill forward of 320 to 2,048 fresh tokens (prompts of at most 512), alone and
    after a 128-row decode graph as in a mixed step: the host's time to issue it, the
    device's time, and the wall time of the step."""
    import torch

    m, graphs = engine.model, engine.runner.graphs
    size = graphs.buckets[-1] if graphs else 0  # the largest decode bucket (128 here)
    rows = torch.zeros(5, size, dtype=torch.long, device="cuda")  # none optimistic
    rows[1] = min(500, m.cache.max_len - 1)
    rows[2] = torch.arange(size, device="cuda") % m.n_slots
    out = {}
    for tokens in (320, 640, 1024, 2048):
        sizes = [min(512, tokens - i) for i in range(0, tokens, 512)] if tokens != 640 else [320, 320]
        sizes = [min(n, m.cache.max_len) for n in sizes]
        chunks = [(j % m.n_slots, 0, [1000 + j] * n) for j, n in enumerate(sizes)]
        for label, decode in (("alone", False), (f"after {size} rows", True))[:2 if size else 1]:
            issue, device, wall = [], [], []
            for i in range(8):
                torch.cuda.synchronize()
                t = time.perf_counter()
                if decode:
                    graphs.run(rows, size)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                m.prefill(chunks, [True] * len(chunks))
                e.record()
                issued = time.perf_counter()
                e.synchronize()
                if i >= 2:
                    issue.append(1000 * (issued - t))
                    device.append(s.elapsed_time(e))
                    wall.append(1000 * (time.perf_counter() - t))
            row = {"issue_ms": statistics.median(issue), "prefill_device_ms": statistics.median(device),
                   "wall_ms": statistics.median(wall)}
            out[f"{tokens} {label}"] = row
            print(f"  prefill {tokens:>5} tokens {label:>14}: host issues in {row['issue_ms']:6.2f} ms, "
                  f"device {row['prefill_device_ms']:6.2f} ms, step wall {row['wall_ms']:6.2f} ms",
                  flush=True)
    return out


def _one_row_paths(m) -> dict:
    """A one-row decode step's device time through the GEMV kernels and through the
    compiled layers with cuBLAS (what every other batch size runs)."""
    import torch

    from engine.cuda_graphs import call_ms

    ids, positions, slots = (torch.tensor([v], device="cuda") for v in (1000, 500, 0))
    out = {}
    for label, on in (("gemv", True), ("compiled", False)):
        m.gemv, was = on, m.gemv
        out[label] = call_ms(lambda: m.decode(ids, positions, slots), calls=4)
        m.gemv = was
        print(f"  one row through {label:>8}: {out[label]:.3f} ms/step", flush=True)
    return out


def _gemv_tiles(m, bandwidth: float | None) -> dict:
    """Each GEMV kernel of a layer over its weight at one row, per tile: microseconds and
    share of the copy rate; the current tiles and the best five."""
    import torch

    from engine import gemv
    from engine.cuda_graphs import call_ms

    layer, hd = m.layers[0], m.head_dim
    hidden = layer.wo.shape[0]
    x = torch.randn(hidden, device="cuda", dtype=m.dtype)
    position = torch.tensor([500], device="cuda")
    rope_rows = (m.n_heads + m.n_kv_heads) * hd
    calls = {
        "qkv": (layer.wqkv, lambda t: gemv.norm_qkv_rope(x, layer.attn_norm, m.eps, layer.wqkv,
                                                         layer.bqkv, m.cos, m.sin, position,
                                                         rope_rows, t)),
        "o": (layer.wo, lambda t: gemv.add_matmul(x[: layer.wo.shape[1]], layer.wo, x.clone(), t,
                                                  counters)),
        "gate_up": (layer.w_gate_up, lambda t: gemv.norm_gate_up_silu(x, layer.mlp_norm, m.eps,
                                                                      layer.w_gate_up, t)),
        "down": (layer.w_down, lambda t: gemv.add_matmul(h, layer.w_down, x.clone(), t, counters)),
    }
    h = torch.randn(layer.w_down.shape[1], device="cuda", dtype=m.dtype)
    counters = torch.zeros(hidden, dtype=torch.int32, device="cuda")
    results: dict = {}
    for name, (w, call) in calls.items():
        timings = []
        for block_n, block_k, warps, splits in itertools.product(
                (2, 4, 8, 16), (256, 512, 1024), (4, 8),
                {"down": (2, 3, 4, 8), "o": (1, 2, 4)}.get(name, (1,))):
            tile = gemv.Tile(block_n, block_k, warps, splits=splits)
            if not gemv.fits(hidden, layer.w_down.shape[1], m.n_heads, hd,
                             {**gemv.TILES, name: tile}):
                continue
            try:
                us = 1000 * call_ms(functools.partial(call, tile))
            except Exception as e:  # a tile the compiler refuses: skip it
                print(f"  gemv {name} {tile}: {e!r:.120}", flush=True)
                continue
            rate = w.numel() * w.element_size() / (us / 1e6)
            timings.append({"tile": [block_n, block_k, warps, splits], "us": us,
                            "of_copy": rate / bandwidth if bandwidth else None})
        timings.sort(key=lambda t: t["us"])
        now = gemv.TILES[name]
        current = next((t for t in timings if t["tile"] == [now.block_n, now.block_k, now.warps,
                                                            now.splits]), None)
        results[name] = {"best": timings[:5], "current": current}
        for label, t in [("current", current), *(("best", t) for t in timings[:3])]:
            if t:
                print(f"  gemv {name:>7} {label:>7}: tile {t['tile']}: {t['us']:6.1f} us"
                      + (f" ({t['of_copy']:.0%} of copy)" if t["of_copy"] else ""), flush=True)
    return results


def _attention_configs(m, bandwidth: float | None, tiles: bool) -> dict:
    """The decode attention kernel's choices, timed over one layer's cache (lengths 128-768)
    at 1, 64 and 128 rows: as launched, and by tile (positions an iteration), pipeline
    stages and programs a row (`--sweeps tiles`: every tile and stage count); a mixed step's
    (64 rows and a fresh 256-token chunk) with the chunk's rows alone and grouped.
    Microseconds per layer, share of the copy rate."""
    import torch

    from engine import attention
    from engine.cuda_graphs import call_ms

    cache_k, cache_v = m.cache.k[0], m.cache.v[0]
    dev = cache_k.device
    rows_max = min(128, cache_k.shape[0] - 1)  # the last slot is the scratch
    heads, kv_heads, dim = m.n_heads, m.n_kv_heads, m.head_dim
    sweep = [dict(block_n=bn, stages=st, programs=p) for bn, st, p in itertools.product(
        (32, 64), (1, 2, 3) if tiles else (2,), (1, 2, 3, 4, 8, 32))]

    def timed(label: str, configs: list[dict], kv_bytes: int, call) -> dict:
        timings = []
        for config in configs:
            try:
                us = 1000 * call_ms(functools.partial(call, **config))
            except Exception as e:  # a tile the compiler refuses: skip it
                print(f"  attention {label} {config}: {e!r:.120}", flush=True)
                continue
            shown = {k: v for k, v in config.items() if not isinstance(v, torch.Tensor)}
            timings.append({**shown, "us": us,
                            "of_copy": kv_bytes / (us / 1e6) / bandwidth if bandwidth else None})
        timings.sort(key=lambda t: t["us"])
        for t in [*timings[:3], *(t for t in timings[3:] if not t.get("programs"))]:
            print(f"  attention {label:>20}: {t}", flush=True)  # the best, and as launched
        return {"best": timings[:5], "all": timings}

    results: dict = {}
    for rows in sorted({1, min(64, rows_max), rows_max}):
        lengths = torch.tensor([500] if rows == 1 else [128 + (i * 37) % 641 for i in range(rows)],
                               device=dev)
        slots = torch.arange(rows, device=dev)
        q = torch.randn(rows, heads, dim, device=dev, dtype=cache_k.dtype)
        k = torch.randn(rows, kv_heads, dim, device=dev, dtype=cache_k.dtype)
        v = torch.randn_like(k)
        kv_bytes = 2 * int(lengths.sum()) * kv_heads * dim * cache_k.element_size()

        def call(q=q, k=k, v=v, slots=slots, lengths=lengths, **config):
            return attention._triton_decode(q, k, v, cache_k, cache_v, slots, lengths,
                                            rope=(m.cos, m.sin), **config)

        results[f"{rows} rows"] = timed(f"{rows} rows", [{}, *sweep], kv_bytes, call)
    chunk = 256
    if cache_k.shape[0] <= 64 or cache_k.shape[2] < 768:
        return results  # no room for the mixed step's 64 rows of up to 768 positions and a chunk
    slots = torch.tensor([*range(64), *[64] * chunk], device=dev)
    lengths = torch.tensor([128 + (i * 37) % 641 for i in range(64)] + list(range(1, chunk + 1)),
                           device=dev)
    n = slots.numel()
    q = torch.randn(n, heads, dim, device=dev, dtype=cache_k.dtype)
    k = torch.randn(n, kv_heads, dim, device=dev, dtype=cache_k.dtype)
    v = torch.randn_like(k)
    kv_bytes = 2 * int(lengths.sum()) * kv_heads * dim * cache_k.element_size()
    configs = []
    for tokens in sorted({2, m.chunk_tokens}):
        groups = torch.from_numpy(attention.chunk_groups(64, [chunk], tokens, n)).to(dev)
        configs += [{"tokens": tokens, "groups": groups},
                    *({"tokens": tokens, "groups": groups, **c} for c in sweep)]

    def mixed(tokens: int, **config):
        return attention._triton_decode(q, k, v, cache_k, cache_v, slots, lengths,
                                        rope=(m.cos, m.sin), shared=True, tokens=tokens, **config)

    results["mixed"] = timed("64 rows + 256 chunk", configs, kv_bytes, mixed)
    return results


PHASES = {"tests": phase_tests, "device": phase_device, "model": phase_model,
          "inprocess": phase_inprocess, "hf_batch": phase_hf_batch, "serve": phase_serve,
          "hf_generate": phase_hf_generate, "profile": phase_profile}


# -- driver ------------------------------------------------------------------------------

def run_phase(name: str, args, budget: float) -> dict:
    """A phase in its own process, with a time limit; its result or its error."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, __file__, "--phase", name, "--result", result_path,
           "--until", str(time.time() + budget - 10), *args.passthrough]
    t = time.perf_counter()
    error = ""
    try:
        proc = subprocess.run(cmd, timeout=budget)
        if proc.returncode:
            error = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {budget:.0f} s"
    try:
        data = json.loads(Path(result_path).read_text() or "{}")  # what it measured, even if cut
    except json.JSONDecodeError:
        data = {}
    if error and "error" not in data:
        data["error"] = error
    data["phase_s"] = time.perf_counter() - t
    return data


def _tokens_per_s(r: dict) -> dict[tuple[str, int, str], float]:
    """tokens/s by (path, streams, rules), path one of the table's: inprocess (every stream
    started at once), steady (each stream starts a new request as one ends), serve, serve-st."""
    rows = [("inprocess", row) for row in r.get("inprocess", {}).get("levels", [])]
    rows += [("steady", row) for row in r.get("inprocess", {}).get("steady", [])]
    rows += [("serve-st" if row.get("steady") else "serve", row)
             for row in r.get("serve", {}).get("levels", [])]
    return {(path, row["streams"], row["rules"]): row["tokens_per_s"] for path, row in rows
            if row.get("tokens_per_s")}


def _floor_tps(r: dict) -> float | None:
    """The batch-1 floor in tokens/s: the copy rate over the weights' bytes a step."""
    bw = r.get("device", {}).get("copy_bandwidth_bytes_s")
    step_bytes = r.get("model", {}).get("weight_bytes_per_step")
    return bw / step_bytes if bw and step_bytes else None


def targets(r: dict) -> list[dict]:
    """Issue #10's targets as measured in this run: what, the figure, the goal and whether
    it is met (None: not measured). Rules on unless said; at 64 and 128 streams the steady
    state (in-process: "steady"; through gRPC: "serve-st")."""
    peak, floor = r.get("device", {}).get("bf16_matmul_flops"), _floor_tps(r)
    tps = _tokens_per_s(r)
    one = tps.get(("serve", 1, "on"))
    ratios = [on / tps[path, n, "off"] for (path, n, rules), on in tps.items()
              if rules == "on" and (path, n, "off") in tps]
    b = r.get("inprocess", {}).get("burst", {})
    prefill = b.get("prefill_flops_per_s")
    checks = [
        ("1 stream through gRPC, share of the batch-1 floor", one and floor and one / floor, 0.85, ">="),
        ("1 stream through gRPC, tokens/s", one, 250, ">="),
        ("64 streams in-process, tokens/s", tps.get(("steady", 64, "on")), 10_000, ">="),
        ("64 streams through gRPC, tokens/s", tps.get(("serve-st", 64, "on")), 8_000, ">="),
        ("128 streams in-process, tokens/s", tps.get(("steady", 128, "on")), 14_000, ">="),
        ("rules on / off, the worst row measured both ways", min(ratios, default=None), 0.98, ">="),
        ("64 requests at once, TTFT p50 ms", b.get("ttft_p50_ms"), 500, "<="),
        ("64 requests at once, prefill share of the matmul peak", prefill and peak and prefill / peak,
         0.5, ">="),
        ("finsieve serve ready, graphs captured, s", r.get("serve", {}).get("ready_s"), 180, "<="),
    ]
    return [{"target": name, "measured": value, "goal": goal,
             "met": None if value is None else value >= goal if op == ">=" else value <= goal}
            for name, value, goal, op in checks]


def table(r: dict) -> str:
    lines = []
    dev, model = r.get("device", {}), r.get("model", {})
    bw = dev.get("copy_bandwidth_bytes_s")
    floor_tps = _floor_tps(r)
    if bw:
        floor = (f"; weights {model['weight_bytes_per_step'] / 1e9:.2f} GB/step -> batch-1 floor "
                 f"{1000 / floor_tps:.2f} ms/step = {floor_tps:.0f} tokens/s" if floor_tps else "")
        lines.append(f"device {dev.get('device')}: copy {bw / 1e12:.2f} TB/s, bf16 matmul "
                     f"{dev['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s{floor}")
        lines.append(f"host: {dev.get('host_cpu')}")
    hf1 = r.get("hf_generate", {}).get("tokens_per_s")
    hfb = r.get("hf_batch", {}).get("tokens_per_s")
    compiled = r.get("hf_generate", {}).get("compile", "forward")  # older JSON: forward
    lines.append(f"transformers generate (static cache + compile, {compiled}, batch 1): "
                 f"{(hf1 and f'{hf1:.0f} tok/s') or r.get('hf_generate', {}).get('error', 'not run')}")
    lines.append(f"transformers generate_batch (64 requests): "
                 f"{(hfb and f'{hfb:.0f} tok/s') or r.get('hf_batch', {}).get('error', 'not run')}")
    lines.append("")
    lines.append(f"{'path':<10} {'streams':>7} {'rules':>5} {'tok/s':>8} {'vs floor':>8} {'vs hf1':>7} "
                 f"{'vs hfB':>7} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>16} {'repairs':>7}")
    for phase, key, path in (("inprocess", "levels", "inprocess"), ("inprocess", "steady", "steady"),
                             ("inprocess", "unmixed", "unmixed"),
                             ("inprocess", "steady_unmixed", "steady-um"),
                             ("inprocess", "steady_threads", "steady-th"),
                             ("inprocess", "steady_untiled", "steady-ut"),
                             ("inprocess", "mixed_sweep", "steady-mix"),
                             ("inprocess", "tile_sweep", "steady-tile"), ("serve", "levels", "serve")):
        for row in r.get(phase, {}).get(key, []):
            label = f"mix-{row['mixed_tokens']}" if "mixed_tokens" in row else \
                f"tile-{row['mixed_tile']}" if "mixed_tile" in row else \
                "serve-st" if row.get("steady") else path
            tps = row.get("tokens_per_s", 0)
            per_stream_floor = floor_tps * row["streams"] if floor_tps else None
            itl = (row.get("step_p50_ms"), row.get("step_p99_ms")) if phase == "inprocess" else (
                row.get("itl_p50_ms"), row.get("itl_p99_ms"))
            lines.append(
                f"{label:<10} {row['streams']:>7} {row['rules']:>5} {tps:>8.0f} "
                f"{(f'{tps / per_stream_floor:.0%}' if per_stream_floor and row['streams'] == 1 else ''):>8} "
                f"{(f'{tps / hf1:.1f}x' if hf1 else ''):>7} {(f'{tps / hfb:.1f}x' if hfb else ''):>7} "
                f"{row.get('ttft_p50_ms', 0):>8.0f}/{row.get('ttft_p99_ms', 0):<8.0f}"
                f"{itl[0] or 0:>7.2f}/{itl[1] or 0:<8.2f}{row.get('late_repairs', ''):>7}")
    b = r.get("inprocess", {}).get("burst")
    if b:
        lines.append(f"\n{b['streams']} requests at once (rules on): TTFT p50 {b['ttft_p50_ms']:.0f} ms, "
                     f"p99 {b['ttft_p99_ms']:.0f} ms; all prefilled in {b['last_first_token_s']:.2f} s "
                     f"= {b['prefill_flops_per_s'] / 1e12:.0f} TFLOP/s incl. interleaved decode")
    gr = r.get("inprocess", {}).get("graph_replay_ms")
    if gr:
        lines.append("decode graph replay alone (device time, its greedy sample included, "
                     "501 positions): " + ", ".join(
            f"batch {k}: {v:.2f} ms" for k, v in gr.items()))
    bp = r.get("inprocess", {}).get("bare_prefill")
    if bp:
        peak = dev.get("bf16_matmul_flops")
        lines.append(f"bare prefill step ({bp['tokens']} tokens): {bp['flops_per_s'] / 1e12:.0f} TFLOP/s"
                     + (f" = {bp['flops_per_s'] / peak:.0%} of the measured matmul rate" if peak else ""))
        for name, w in bp.get("ways", {}).items():
            lines.append(f"  prefill {name:>11}: device {1000 * w['seconds']:6.2f} ms, host issues it in "
                         f"{w['issue_ms']:6.2f} ms")
    ip, sv = r.get("inprocess", {}), r.get("serve", {})
    if "ready_s" in ip:
        lines.append(f"start-up in-process: load {ip['load_s']:.0f} s, ready (compiled, graphs "
                     f"captured: {ip['graphs_s']:.0f} s) {ip['ready_s']:.0f} s, mode {ip['mode']}, "
                     f"{ip['slots']} KV slots, peak GPU memory {ip.get('gpu_memory_gib', 0):.1f} GiB")
    if "ready_s" in sv:
        lines.append(f"start-up finsieve serve (engine SERVING): {sv['ready_s']:.0f} s; "
                     f"{sv['gateways']} gateway processes, {sv['client_procs']} client processes")
    lines.append("\nissue #10's targets (for the H200; rules on unless said):")
    for t in targets(r):
        share = t["goal"] < 1  # a share of a floor or peak, else tokens/s, ms or s
        value = "not measured" if t["measured"] is None else \
            f"{t['measured']:.1%}" if share else f"{t['measured']:,.0f}"
        goal = f"{t['goal']:.0%}" if share else f"{t['goal']:,}"
        verdict = {True: "met", False: "MISSED", None: ""}[t["met"]]
        lines.append(f"  {t['target']:<56} {value:>12}  goal {goal:>7}  {verdict}")
    for name in PHASES:
        if isinstance(r.get(name), dict) and r[name].get("error"):
            lines.append(f"phase {name}: {r[name]['error'][-300:]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU dry run with a tiny random model")
    ap.add_argument("--tokenizer", default=str(REPO / ".finsieve/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "finsieve-bench-gpu"))
    ap.add_argument("--out", default=str(REPO / "bench/results/gpu.json"))
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--phases", nargs="*", default=[p for p in PHASES if p not in ("tests", "profile")],
                    help="phases to run (tests, profile: only when named)")
    ap.add_argument("--deadline", type=float, default=570.0, help="seconds for the whole run")
    ap.add_argument("--levels", type=int, nargs="*")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--sweeps", nargs="*", default=["attention", "gemv"],
                    help="profile: the sweeps to run (attention: programs and stages; "
                         "tiles: attention's tiles too; gemv)")
    ap.add_argument("--baselines", action="store_true",
                    help="in-process: also the engine's own baselines at 64+ streams, rules on "
                         "(mixed steps off, tile cut off, preparation on threads; ~70 s more)")
    ap.add_argument("--hf-compile", choices=["transformers", "forward"], default="transformers",
                    help="hf_generate: compiled only as transformers' generate compiles its "
                         "decode step on a static cache (CUDA graphs; the stronger baseline), or "
                         "by our torch.compile of the model's forward (inductor, as measured "
                         "before 2026-12-02)")
    ap.add_argument("--mixed-tokens", type=int, default=0,
                    help="in-process: the engine's mixed-step budget (0: the served default)")
    ap.add_argument("--mixed-sweep", type=int, nargs="*", default=[],
                    help="in-process: steady rows, rules on, at --sweep-from streams and more "
                         "with these budgets (each at most --mixed-tokens)")
    ap.add_argument("--tile-sweep", type=int, nargs="*", default=[],
                    help="in-process: steady rows, rules on, at --sweep-from streams and more "
                         "with mixed steps cut to these matmul tiles (multiples of 32, as the "
                         "mixed graphs' buckets) instead of MIXED_TILE")
    ap.add_argument("--sweep-from", type=int, default=64,
                    help="in-process: the fewest streams --mixed-sweep and --tile-sweep run at")
    ap.add_argument("--serve-steady", type=float, metavar="SECONDS",
                    help="serve: levels of more than one stream run --serve-rounds requests a "
                         "stream, the streams starting over SECONDS (about one answer's time), "
                         "and count the tokens of the window in which every stream runs (0: "
                         "every stream started at once, --rounds requests each); default 2.5, "
                         "with --tiny 0 (its answers are shorter than any spread)")
    ap.add_argument("--steady-rounds", type=int, default=4,
                    help="requests per stream in an in-process steady row (its window is "
                         "~rounds - 1 answers)")
    ap.add_argument("--serve-rounds", type=int, default=8,
                    help="requests per stream in a served steady row: the window of four (~5 s at "
                         "128 streams) read rules on / off 3.6%% apart where the engine's steps "
                         "(7.38 / 7.39 ms, 1,425 / 1,420 of them) said they ran alike")
    ap.add_argument("--gateways", type=int, default=2,
                    help="serve: gateway processes on one SO_REUSEPORT port (README, \"Running "
                         "engine and gateway apart\": each costs the engine a message a step)")
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--tests-timeout", type=float, default=240)
    ap.add_argument("--py-spy", action="store_true",
                    help="serve: py-spy the engine and one gateway at each level (into --log-dir)")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--until", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.levels = args.levels or ([1, 4] if args.tiny else [1, 16, 64, 128])
    args.max_tokens = args.max_tokens or (16 if args.tiny else 256)
    if args.serve_steady is None:
        args.serve_steady = 0.0 if args.tiny else 2.5
    args.model_dir = str(Path(args.work) / "model")
    if args.phase:  # a child: one phase, result to a file
        result: dict = {}
        try:
            result = PHASES[args.phase](args)
        except Exception:  # what the phase measured and saved before it failed is kept
            saved = Path(args.result).read_text() if Path(args.result).exists() else ""
            result = {**json.loads(saved or "{}"), "error": traceback.format_exc()[-3000:]}
            print(result["error"], flush=True)
        Path(args.result).write_text(json.dumps(result))
        return
    args.passthrough = [a for a in sys.argv[1:]]
    Path(args.work).mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"levels": args.levels, "rounds": args.rounds, "max_tokens": args.max_tokens,
                     "tiny": args.tiny}
    if out.exists() and set(args.phases) != set(PHASES):
        results = {**json.loads(out.read_text()), **results}  # a later call adds to an earlier one
    start = time.perf_counter()
    for name in args.phases:
        left = args.deadline - (time.perf_counter() - start)
        if left < 20:
            results[name] = {"error": "skipped: no time left in this run"}
            continue
        print(f"== {name} ({left:.0f} s left)", flush=True)
        results[name] = run_phase(name, args, left - 5)
        out.write_text(json.dumps(results, indent=2))
    results["targets"] = targets(results)
    print(table(results))
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
