"""Device timings of the engine's own pieces that more than one phase reads: a decode
graph's replay by bucket, and the matmul weights a token is multiplied by."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.engine import LLMEngine


def graph_replay_ms(engine: LLMEngine) -> dict:
    """Device time of one decode step's graph alone (its greedy sample included, no host
    work), per bucket: the median of 20 replays, each waited for, as the engine waits for a
    step. Not engine.cuda_graphs.replay_ms (the mean of replays queued back to back, each
    one's issue hidden behind the one before): the runs' history of this figure is of this
    measure. Each replay writes the graphs' `prev`: not between an engine's launches."""
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


def matmul_params(m: Any) -> int:
    """The weights a token is multiplied by (the layers' and the head's): read from the
    engine's model, so that a run without the model phase (a baseline tree's) has them."""
    return sum(w.numel() for layer in m.layers
               for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)) + m.lm_head.numel()


