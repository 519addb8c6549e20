"""Phase `inprocess`: LLMEngine without gRPC, its steps driven on this thread. Start-up
(load, compile, graph capture); rules off and on at each level, every stream started at
once and in the steady state; with --baselines the engine's own baselines; the tile and
budget sweeps; 64 requests at once; a bare prefill's FLOP/s."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from argparse import Namespace
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .engine_timing import graph_replay_ms, matmul_params
from .harness import time_left
from .rows import TimingSink, no_row, step_metrics, step_stats, summarize
from .workload import prompts, rules_dir

if TYPE_CHECKING:
    from engine.engine import LLMEngine


def run_engine_level(engine: LLMEngine, texts: list[str], streams: int, rounds: int, max_tokens: int,
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

    def prepare(req: Any, sink: TimingSink) -> None:
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
            return no_row("no steady window (answers too short for the streams' spread)", errors=0)
        row = summarize([r for r in done if t_a <= r["submitted"] <= t_b], t_b - t_a,
                        [d for t, d in steps if t_a <= t <= t_b])
        row["tokens"] = sum(n for sink in sinks for t, n in zip(sink.times, sink.tokens, strict=True)
                            if t_a <= t <= t_b)
        row["tokens_per_s"] = row["tokens"] / row["wall_s"]
    if not (spread and rows_to):
        rows_to, loop_to = _step_rows(), _loop_metrics()
    row["step_rows"] = {le: rows_to[le] - rows_from.get(le, 0) for le in rows_to}
    row["engine_steps"] = step_stats(loop_from, loop_to)
    row["late_repairs"] = LATE_REPAIRS._value.get() - repairs_before
    row["last_first_token_s"] = max((r["first_at"] or 0) for r in done)
    return row


def _loop_metrics() -> dict[str, float]:
    """This process's engine step and loop counters, as a served level reads the engine's
    (`_engine_metrics`): the in-process rows' loop per step by part (host work against
    waiting for the device)."""
    from prometheus_client import generate_latest

    return step_metrics(generate_latest().decode())


def _step_rows() -> dict[str, float]:
    """The engine's steps so far by rows fed (finsieve_engine_step_rows), per bucket: the
    count of steps of at most `le` rows and more than the bucket before's."""
    from engine.events import STEP_ROWS

    cumulative = [(s.labels["le"], s.value) for s in STEP_ROWS.collect()[0].samples
                  if s.name.endswith("_bucket")]
    return {le: n - (cumulative[i - 1][1] if i else 0) for i, (le, n) in enumerate(cumulative)}


def phase_inprocess(args: Namespace) -> dict:
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

    def in_force(policy: Any) -> None:
        """As `finsieve serve` puts a (re)loaded policy in force, the workers' copies of its
        input rules compiled before the rows (else the first requests wait for them)."""
        engine.policy = lambda: policy
        wait(engine.preparer.preload(policy.pack.input, policy.version), 60)

    in_force(NO_POLICY)
    run_engine_level(engine, texts, len(texts), 1, 2, burst=True)  # every prompt shape once
    result["graph_replay_ms"] = graph_replay_ms(engine)
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


def _baselines(engine: LLMEngine, texts: list[str], args: Namespace, result: dict) -> None:
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


def _swept(engine: LLMEngine, texts: list[str], args: Namespace, label: str,
           **setting: int) -> list[dict]:
    """Steady rows, rules on, at --sweep-from streams and more, under a scheduler setting."""
    with _attributes_set(engine.scheduler, **setting):
        return _baseline_rows(engine, texts, args, label, least=args.sweep_from)


def _rounds(args: Namespace, spread: bool) -> int:
    """Requests per stream: a steady row counts from the last stream's start to the first
    stream's end, about (rounds - 1) answers long."""
    return args.steady_rounds if spread else args.rounds


@contextlib.contextmanager
def _attributes_set(obj: object, **values: Any) -> Iterator[None]:
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
def _mixed_steps_off(engine: LLMEngine) -> Iterator[None]:
    """The engine as FINSIEVE_MIXED_TOKENS=0 serves (prompt batching then on, its default)."""
    from engine.engine import EngineLimits

    with _attributes_set(engine.scheduler, mixed_tokens=0,
                         prompt_batch=EngineLimits.prompt_batch_tokens), \
            _attributes_set(engine.runner, mixed_tokens=0):
        yield


def _baseline_rows(engine: LLMEngine, texts: list[str], args: Namespace, label: str, spread: bool = True,
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


def _req(text: str) -> Any:
    from finsieve.app.client import chat_request

    return chat_request("p", text, max_tokens=1)


def _prefill_flops(args: Namespace, tokens: int, engine: LLMEngine) -> float:
    """2 x matmul parameters per token, plus causal attention (QK and PV)."""
    m = engine.model
    params = matmul_params(m)
    per_seq = tokens / min(64, max(args.levels))
    attn = 2 * 2 * len(m.layers) * m.n_heads * m.head_dim * per_seq * per_seq / 2
    return 2 * params * tokens + attn * min(64, max(args.levels))


def _bare_prefill(engine: LLMEngine, args: Namespace) -> dict:
    """One prefill step of 4 x 512 fresh tokens, timed on the device (the achieved FLOP/s)
    and on the host (the time to issue it), eager and replayed from its CUDA graph; and one
    prompt of 320 tokens, a lone stream's first step."""
    import torch

    m, graphs = engine.model, engine.runner.prefill_graphs
    if m.device.type != "cuda":
        return {}
    params = matmul_params(m)
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


