"""The engine's CUDA graphs, and the one helper that captures work into a graph and times
its replays (for the engine's graphs and for the benchmarks that time kernels the way the
engine launches them).

`DecodeGraphs`: the decode step (and the mixed step) per batch-size bucket; `PrefillGraphs`:
the prefill forward per token bucket. Each replays over persistent input buffers that the
model runner fills with one copy a step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from .attention import VarlenKeys
from .embed import embed_rows
from .model import prefill_arrays
from .sampler import sample_greedy


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


class DecodeGraphs:
    """The decode step captured once per batch-size bucket; padding rows write to the
    cache's scratch slot. mixed_tokens > 0: the mixed step too (decode rows, then the tokens
    of prefill chunks as rows; model.decode with heads), per bucket of rows up to max_rows +
    mixed_tokens, its logits those of at most max_rows rows (the most a step samples).

    A graph also feeds its optimistic rows the previous step's samples (`prev`, which it
    then overwrites with its own greedy sample: the runner writes there instead when the
    step was masked or sampled) and returns that greedy sample (`sample` without bans or
    parameters) beside the logits."""

    def __init__(self, model, max_rows: int, mixed_tokens: int = 0) -> None:
        self.model = model
        self.buckets = sorted({*(b for b in (1, 2, 4, 8) if b < max_rows),
                               *range(16, max_rows, 16), max_rows})
        most = max_rows + mixed_tokens
        # Past max_rows a mixed step is mostly prompt tokens, compute-bound: coarser buckets
        # (half the graphs) cost its padding rows little. Multiples of 32, so that a step the
        # scheduler ends at a whole matmul tile (MIXED_TILE, a multiple of 32) is not padded
        # into the next.
        self.mixed_buckets = sorted({*range(16, min(max_rows, most), 16), max_rows,
                                     *range(-(-max_rows // 32) * 32, most, 32), most}) if mixed_tokens else []
        self.max_heads = max_rows
        # ids, positions, slots, from-previous flag, previous row (as model_runner._decode_inputs lays out)
        self.inputs = torch.zeros(5, most, dtype=torch.long, device=model.device)
        self.inputs[2].fill_(model.cache.scratch)
        self.heads = torch.zeros(max_rows, dtype=torch.long, device=model.device)
        self.groups = torch.zeros(2, most, dtype=torch.long, device=model.device)
        self.prev = torch.zeros(max_rows, dtype=torch.long, device=model.device)
        # captured in each graph (bench_one_row times them against the torch ops they replaced)
        self.embed_rows, self.greedy = embed_rows, sample_greedy
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor]]] = {}

    def bucket(self, rows: int, mixed: bool = False) -> int:
        return next(b for b in (self.mixed_buckets if mixed else self.buckets) if b >= rows)

    def head_rows(self, size: int) -> int:
        """The logits rows of mixed bucket `size`."""
        return min(size, self.max_heads)

    def capture(self) -> None:
        pool = None  # one for both kinds: a step replays one graph, then samples its logits
        shapes = [(size, False) for size in self.buckets] + [(size, True) for size in self.mixed_buckets]
        for size, mixed in sorted(shapes, reverse=True):  # largest first: the smaller reuse its memory
            heads, groups = (self.heads[: self.head_rows(size)], self.groups[:, :size]) if mixed \
                else (None, None)
            graph, out = capture(functools.partial(self._step, size, heads, groups), pool)
            pool = graph.pool()
            self._graphs[size, mixed] = (graph, out)
        torch.cuda.synchronize()

    def _step(self, size: int, heads: Tensor | None, groups: Tensor | None) -> tuple[Tensor, Tensor]:
        inputs = self.inputs[:, :size]
        x, lengths = self.embed_rows(inputs, self.prev, self.model.embed)
        logits = self.model.decode_embedded(x, inputs[1], lengths, inputs[2], heads, groups)
        return logits, self.greedy(logits, self.prev)

    def run(self, inputs: Tensor, rows: int, heads: Tensor | None = None,
            groups: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """inputs: (5, bucket) as model_runner._decode_inputs lays them out, padding
        included; heads and groups (mixed): the rows whose logits are wanted, padded to the
        bucket's head_rows, and the rows' attention groups, (2, bucket). The logits of the
        first `rows` rows and their greedy sample, (2, rows) as `sample` returns it."""
        size = inputs.shape[1]
        self.inputs[:, :size].copy_(inputs)
        if heads is not None:
            assert groups is not None  # (a mixed step has both)
            self.heads[: heads.numel()].copy_(heads)
            self.groups[:, :size].copy_(groups)
        graph, (logits, greedy) = self._graphs[size, heads is not None]
        graph.replay()
        return logits[:rows], greedy[:, :rows]


class PrefillGraphs:
    """The prefill forward captured once per token bucket (CUDA, varlen attention): issuing
    a prefill forward eagerly costs the host ~20 ms whatever its size up to ~1,000 tokens
    (the compiled layers' wrappers and guards, bench.bench_gpu --phases profile), more than
    the device takes for a few hundred tokens, and a stream's first token waited for it.

    Every shape is fixed per bucket of T tokens: K = T + a slot's positions gathered keys
    (so one chunk can continue anywhere in its slot) and C chunks. A step's chunks come
    first; a dummy chunk in the scratch slot takes the padding tokens (at position 0) and
    keys (as many as its queries or more, so each has a key), and empty chunks fill the
    rest. A step with more cached keys before its chunks than a slot holds, or more chunks
    than the largest bucket takes, runs eagerly."""

    def __init__(self, model, max_tokens: int) -> None:
        self.model = model
        self.scratch = model.cache.scratch
        self.cached_keys = model.cache.max_len  # K - T
        # 64 apart from 256 to 512 tokens, where a step costs about what it computes: one
        # prompt's prefill from its graph on an H200 took 8.34 / 8.49 / 10.38 / 11.61 / 12.55
        # / 12.97 ms at 192 / 256 / 320 / 384 / 448 / 512 tokens (no faster under 256).
        self.buckets = sorted({*(b for b in (64, 128, 256, 320, 384, 448, 512, 768, 1024, 1536)
                                 if b < max_tokens), max_tokens})
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, Tensor]] = {}

    def shape(self, t: int) -> tuple[int, int, int]:
        """(T, K, C) of bucket t."""
        return t, t + self.cached_keys, min(self.model.n_slots, max(t // 16, 16)) + 1

    def layout(self, chunks: list[tuple[int, int, list[int]]], sample: list[bool]
               ) -> tuple[int, np.ndarray] | None:
        """The smallest bucket that takes the step, and its inputs as one int64 array; None
        when none does."""
        n_tokens, cached = sum(len(toks) for _, _, toks in chunks), sum(s for _, s, _ in chunks)
        if cached > self.cached_keys:
            return None
        for t in self.buckets:
            if t >= n_tokens and len(chunks) < self.shape(t)[2]:  # the dummy chunk's place too
                return t, self._layout(chunks, sample, t)
        return None

    def _layout(self, chunks: list[tuple[int, int, list[int]]], sample: list[bool], t: int) -> np.ndarray:
        """The eager prefill's host arrays (ids, positions and slots per token; the sampled
        rows; key slots and positions; cumulative query and key counts), each padded to the
        bucket: the dummy chunk follows the step's."""
        t, k, c = self.shape(t)
        ids, positions, slots, last = prefill_arrays(chunks, sample)
        key_slots, key_positions, cu_q, cu_k = VarlenKeys.host_arrays(
            [(slot, start, len(toks)) for slot, start, toks in chunks])
        scratch = self.scratch
        return np.concatenate([padded(ids, t, 0), padded(positions, t, 0), padded(slots, t, scratch),
                               padded(last, c, 0), padded(key_slots, k, scratch),
                               padded(key_positions, k, 0), padded(cu_q, c + 1, t),
                               padded(cu_k, c + 1, k)])

    def capture(self) -> None:
        pool = None  # its own: the decode graph's logits are still to be sampled after a replay
        for t in reversed(self.buckets):  # largest first: the smaller reuse its memory
            inputs = torch.from_numpy(self._layout([], [], t)).to(self.model.device)  # padding alone
            graph, out = capture(functools.partial(self._forward, inputs, t), pool)
            pool = graph.pool()
            self._graphs[t] = (graph, inputs, out)
        torch.cuda.synchronize()

    def run(self, t: int, inputs: Tensor, sampled: int) -> Tensor:
        """inputs: bucket t's layout on the device; the logits of the `sampled` chunks."""
        graph, static, out = self._graphs[t]
        static.copy_(inputs)
        graph.replay()
        return out[:sampled]

    def _forward(self, inputs: Tensor, t: int) -> Tensor:
        t, k, c = self.shape(t)
        ids, positions, slots, last, key_slots, key_positions, cu_q, cu_k = inputs.split(
            [t, t, t, c, k, k, c + 1, c + 1])
        keys = VarlenKeys(key_slots, key_positions, cu_q.int(), cu_k.int(), t, k)
        return self.model.forward_prefill(ids, positions, slots, last, keys)


def padded(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    return np.concatenate([values, np.full(size - values.size, fill, dtype=np.int64)])
