"""Phase `profile` (only when named): where a decode step's device time goes. The compiled
step's kernels by time at 1 and 64 rows, each weight's matmul alone against the copy
bandwidth (read from the run's `device` phase), a prefill forward's host and device time
by size, one row through the GEMV kernels and through cuBLAS; with --sweeps the tile
sweeps (sweeps.py)."""

from __future__ import annotations

import json
import statistics
import time
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .engine_timing import graph_replay_ms
from .sweeps import attention_configs, gemv_tiles

if TYPE_CHECKING:
    from engine.engine import LLMEngine


def phase_profile(args: Namespace) -> dict:
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
    out: dict = {"mode": engine.mode, "graph_replay_ms": graph_replay_ms(engine), "steps": {}}
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
        out["gemv"] = gemv_tiles(m, bandwidth)
    if "attention" in args.sweeps or "tiles" in args.sweeps:
        out["attention"] = attention_configs(m, bandwidth, tiles="tiles" in args.sweeps)
    return out


def _prefill_costs(engine: LLMEngine) -> dict:
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


def _one_row_paths(m: Any) -> dict:
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


