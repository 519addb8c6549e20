"""Capturing work into CUDA graphs, and timing a graph's replays: one helper for the engine's
graphs and for the benchmarks that time kernels the way the engine launches them."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(forward: Callable[[], object], pool=None, calls: int = 1):
    """forward warmed up on a side stream (compiles, autotunes, JITs Triton), then `calls`
    of it captured into one CUDA graph in `pool`; the graph and the last call's output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for _ in range(calls):
            out = forward()
    return graph, out


def replay_ms(replay: Callable[[], object], n: int = 40) -> float:
    """Device ms of one call of `replay` (a graph's replay: it cannot be captured in another),
    from n calls queued back to back after three to warm up."""
    for _ in range(3):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def call_ms(fn: Callable[[], object], calls: int = 28) -> float:
    """Device ms of one call of fn, from a graph of `calls` calls (no launch overhead)."""
    graph, _ = capture(fn, calls=calls)
    return replay_ms(graph.replay, n=10) / calls
