"""Device state and one step on it: inputs, the forward, the rules' mask, the sample.

`launch` starts a step and returns at once on CUDA: the decode rows run as one CUDA graph
(captured at start-up per batch-size bucket, over persistent input buffers) and prefill
chunks as one prefill forward (a graph per token bucket), or both together as one mixed
step (the chunks' tokens as more rows of the decode graph: the weights read once), then
one batched mask and sample over every row, and one device-to-host copy of the sampled ids
(into pinned memory, two buffers in turn). Nothing
else waits for the device: `Launch.tokens` is the only synchronisation of a step, and the
engine calls it for step N after launching step N+1.

A decode row whose token is still on the device (the engine's optimistic rows) takes it
from the previous step's samples by index, on the device. In a decode graph that gather,
and the greedy sample of a step without bans (most steps), are part of the graph: each
eager op costs the host ~10-20 us to issue, and at 128 rows the host sets the pace.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import structlog
import torch
from torch import Tensor

from .attention import VarlenKeys, chunk_groups, gdc_launch_dependents, gdc_wait, overlapped
from .cuda_graphs import capture
from .model import prefill_arrays
from .sampler import BanIndex, DeviceParams, SamplingRows, sample, sample_greedy

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships no Triton
    triton = None

log = structlog.get_logger(__name__)


class StepRow(NamedTuple):
    """One sequence's share of a step, as the device sees it (a tuple: the engine builds one
    per row and step)."""

    slot: int
    start: int  # KV position of the first token fed
    tokens: list[int]  # empty: the token the previous step sampled in row `prev`
    prev: int = -1
    sample: bool = True
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    key: int = 0  # noise key of the sampled position
    bans: Sequence[int] = ()  # sorted; the sampler keeps a list's array by its identity


@dataclass
class Launch:
    """A step in flight. `order[j]` is the index (in the launched rows) of sample row j. Its
    host buffer and event serve the launch after next again: read `tokens` before then (the
    engine reads step N's after launching N+1)."""

    order: list[int]
    _host: Tensor | None = None
    _done: torch.cuda.Event | None = None

    def tokens(self) -> list[tuple[int, int]]:
        """(token, first choice before the mask) per sampled row; waits for the device."""
        if self._host is None:
            return []
        if self._done is not None:
            self._done.synchronize()
        tokens, first = self._host.tolist()
        return list(zip(tokens, first, strict=True))


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
        # ids, positions, slots, from-previous flag, previous row (as _decode_inputs lays out)
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
        """inputs: (5, bucket) as _decode_inputs lays them out, padding included; heads and
        groups (mixed): the rows whose logits are wanted, padded to the bucket's head_rows,
        and the rows' attention groups, (2, bucket). The logits of the first `rows` rows and
        their greedy sample, (2, rows) as `sample` returns it."""
        size = inputs.shape[1]
        self.inputs[:, :size].copy_(inputs)
        if heads is not None:
            self.heads[: heads.numel()].copy_(heads)
            self.groups[:, :size].copy_(groups)
        graph, (logits, greedy) = self._graphs[size, heads is not None]
        graph.replay()
        return logits[:rows], greedy[:, :rows]


def optimistic_ids(inputs: Tensor, prev: Tensor) -> Tensor:
    """A decode step's token ids from its inputs (5, rows) as _decode_inputs lays them out:
    an optimistic row's is the previous step's sample prev[previous row]; one that had
    nothing allowed sampled -1: fed as token 0, its result is dropped."""
    ids, _, _, ahead, prev_row = inputs
    return torch.where(ahead.bool(), prev[prev_row].clamp(min=0), ids)


def embed_rows(inputs: Tensor, prev: Tensor, embed: Tensor) -> tuple[Tensor, Tensor]:
    """A decode step's rows as the model takes them: each row's embedding (of its
    optimistic_ids) and its length, positions + 1. On CUDA one kernel: as torch ops, the
    head of every decode graph was six kernels (0.4% of a one-row step on an H200,
    bench_one_row.py)."""
    if not inputs.is_cuda or triton is None:
        return embed[optimistic_ids(inputs, prev)], inputs[1] + 1
    rows, hidden = inputs.shape[1], embed.shape[1]
    assert inputs.dtype == prev.dtype == torch.long and inputs.stride(1) == prev.stride(0) == 1
    assert embed.is_contiguous()
    x = torch.empty(rows, hidden, device=embed.device, dtype=embed.dtype)
    lengths = torch.empty(rows, device=embed.device, dtype=torch.long)
    _embed_rows_kernel[(rows,)](inputs, inputs.stride(0), prev, embed, x, lengths, hidden,
                                embed.shape[0], BLOCK=min(triton.next_power_of_2(hidden), 4096),
                                **overlapped(embed))
    return x, lengths


if triton is not None:

    @triton.jit
    def _embed_rows_kernel(Inputs, stride, Prev, Embed, X, Lengths, hidden, vocab,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        ahead = tl.load(Inputs + 3 * stride + row) != 0
        previous = tl.load(Prev + tl.load(Inputs + 4 * stride + row))  # row 0 when not ahead
        token = tl.where(ahead, tl.maximum(previous, 0), tl.load(Inputs + row))
        # Every id is the tokenizer's or the sampler's, below vocab: the bound only keeps the
        # read inside the table whatever a buffer holds.
        token = tl.minimum(tl.maximum(token, 0), vocab - 1)
        tl.store(Lengths + row, tl.load(Inputs + stride + row) + 1)
        for h0 in range(0, hidden, BLOCK):
            h = h0 + tl.arange(0, BLOCK)
            tl.store(X + row.to(tl.int64) * hidden + h,
                     tl.load(Embed + token * hidden + h, mask=h < hidden), mask=h < hidden)


class PrefillGraphs:
    """The prefill forward captured once per token bucket (CUDA, varlen attention): issuing
    a prefill forward eagerly costs the host ~20 ms whatever its size up to ~1,000 tokens
    (the compiled layers' wrappers and guards, bench_gpu.py --phases profile), more than
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
        return np.concatenate([_padded(ids, t, 0), _padded(positions, t, 0), _padded(slots, t, scratch),
                               _padded(last, c, 0), _padded(key_slots, k, scratch),
                               _padded(key_positions, k, 0), _padded(cu_q, c + 1, t),
                               _padded(cu_k, c + 1, k)])

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


class _Staging:
    """A step's host-to-device inputs, through pinned buffers used in turn (three: a buffer is
    written again only after the device has finished the step that read it). A copy from
    pageable memory may wait for the device's earlier work, and so stall the pipeline."""

    def __init__(self, device: torch.device, size: int = 1 << 18) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._size = size
        self._buffers: dict[tuple[int, torch.dtype], Tensor] = {}
        # A buffer outgrown while a copy from it may be pending is kept, never freed: growth
        # doubles, so what is kept is at most the size of the buffers in use.
        self._outgrown: list[Tensor] = []
        self._turn = 0

    def next_step(self) -> None:
        self._turn = (self._turn + 1) % 3

    def put(self, parts: list[np.ndarray], dtype: torch.dtype) -> list[Tensor]:
        """One copy for all parts; device views of each, in order."""
        flat = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if not self._pinned:
            whole = torch.from_numpy(np.ascontiguousarray(flat)).to(dtype)
        else:
            key = (self._turn, dtype)
            buf = self._buffers.get(key)
            if buf is None or buf.numel() < flat.size:
                if buf is not None:
                    self._outgrown.append(buf)
                self._size = max(self._size, 2 * flat.size)
                buf = torch.empty(self._size, dtype=dtype, pin_memory=True)
                self._buffers[key] = buf
            buf.numpy()[: flat.size] = flat
            whole = buf[: flat.size].to(self.device, non_blocking=True)
        return list(whole.split([p.size for p in parts]))


class ModelRunner:
    def __init__(self, model, device: torch.device, graphs: bool = False,
                 prefill_tokens: int = 0, mixed_tokens: int = 0) -> None:
        """graphs: capture the decode step; prefill_tokens > 0: the prefill forward too, in
        buckets up to that many tokens a step (the scheduler's prefill chunk); mixed_tokens
        > 0: a step of decode rows and up to that many prefill tokens runs as one mixed
        step (the compact model's decode with heads; in graphs where graphs are captured)."""
        self.model = model
        self.device = device
        self.n_slots = model.n_slots
        self.mixed_tokens = mixed_tokens
        self._bans = BanIndex(model.vocab_size)  # the logits' width
        self._staging = _Staging(device)
        self._prev: Tensor | None = None  # the ids the last launch sampled, on the device
        self._cuda = device.type == "cuda"
        # The sampled ids' host copies and their events, two in turn (see Launch.tokens).
        self._pinned = [torch.empty(4 * self.n_slots, dtype=torch.long, pin_memory=True)
                        for _ in range(2)] if self._cuda else []
        self._done = [torch.cuda.Event() for _ in range(2)] if self._cuda else []
        self._flip = 0
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.startup_s = 0.0
        if graphs:
            start = time.perf_counter()
            self.graphs = self._captured_decode_graphs()
            if prefill_tokens:
                try:
                    prefill_graphs = PrefillGraphs(model, prefill_tokens)
                    prefill_graphs.capture()
                    self.prefill_graphs = prefill_graphs
                except Exception as e:  # the decode graphs stand; prefill runs eagerly
                    log.warning("prefill not captured in cuda graphs", error=repr(e)[:800])
            self.startup_s = time.perf_counter() - start
            log.info("cuda graphs captured", buckets=self.graphs.buckets,
                     mixed_buckets=self.graphs.mixed_buckets,
                     prefill_buckets=self.prefill_graphs.buckets if self.prefill_graphs else [],
                     seconds=round(self.startup_s, 1))

    def _captured_decode_graphs(self) -> DecodeGraphs:
        """The decode graphs, with the mixed steps' where they capture (else mixed steps are
        off: a failure there must not cost the decode graphs)."""
        if self.mixed_tokens:
            try:
                graphs = DecodeGraphs(self.model, self.n_slots, self.mixed_tokens)
                graphs.capture()
                return graphs
            except Exception as e:  # e.g. out of memory in the largest bucket
                log.warning("mixed steps not captured in cuda graphs; mixed steps off",
                            error=repr(e)[:800])
                self.mixed_tokens = 0
                torch.cuda.empty_cache()
        graphs = DecodeGraphs(self.model, self.n_slots)
        graphs.capture()
        return graphs

    @property
    def mixed_rows(self) -> int:
        """The most rows a mixed step holds (every slot's decode row and the prompt tokens);
        0: mixed steps off."""
        return self.n_slots + self.mixed_tokens if self.mixed_tokens else 0

    def launch(self, rows: list[StepRow]) -> Launch:
        self._staging.next_step()
        decode = [i for i, r in enumerate(rows) if r.sample and len(r.tokens) <= 1]
        in_decode = set(decode)
        prefill = [i for i in range(len(rows)) if i not in in_decode]
        order = decode + [i for i in prefill if rows[i].sample]
        sampled = [rows[i] for i in order]
        params = SamplingRows([r.temperature for r in sampled], [r.top_k for r in sampled],
                              [r.top_p for r in sampled], [r.key for r in sampled],
                              [r.bans for r in sampled])
        chunks = [(rows[i].slot, rows[i].start, rows[i].tokens) for i in prefill]
        chunk_sampled = [rows[i].sample for i in prefill]
        # Decode rows and a few prefill tokens: one forward, the weights read once for both.
        mixed = bool(decode and prefill) and \
            len(decode) + sum(len(toks) for _, _, toks in chunks) <= self.mixed_rows
        graphed = self.prefill_graphs.layout(chunks, chunk_sampled) \
            if prefill and not mixed and self.prefill_graphs is not None else None
        # Every integer the step needs goes to the device in one copy.
        decode_rows = [rows[i] for i in decode]
        parts = self._decode_inputs(decode_rows, chunks if mixed else [], chunk_sampled) \
            if decode else []
        flat_bans = self._bans.flat(params.bans) if order else None
        if flat_bans is not None:
            parts.append(flat_bans.reshape(-1))
        if params.sampled:
            parts.append(np.asarray([params.top_k, params.keys], dtype=np.int64).reshape(-1))
        if graphed is not None:
            parts.append(graphed[1])
        staged = self._staging.put(parts, torch.long) if parts else []
        logits, greedy = [], None
        if decode:
            inputs = staged.pop(0).view(5, -1)
            heads, groups = (staged.pop(0), staged.pop(0).view(2, -1)) if mixed else (None, None)
            decoded, greedy = self._decode(decode_rows, inputs, heads, groups, len(order))
            logits.append(decoded)
        bans = staged.pop(0).view(2, -1) if flat_bans is not None else None
        device_params = None
        if params.sampled:
            ints = staged.pop(0).view(2, -1)
            floats = self._staging.put([np.asarray([params.temperature, params.top_p],
                                                   dtype=np.float32).reshape(-1)], torch.float32)[0]
            floats = floats.view(2, -1)
            device_params = DeviceParams(floats[0], floats[1], ints[0], ints[1], params.filtered)
        if graphed is not None:
            logits.append(self.prefill_graphs.run(graphed[0], staged.pop(0), sum(chunk_sampled)))
        elif prefill and not mixed:
            logits.append(self.model.prefill(chunks, chunk_sampled))
        logits = [x for x in logits if x.shape[0]]
        if not order:
            return Launch(order)
        if greedy is not None and len(logits) == 1 and bans is None and device_params is None:
            out = greedy  # the graph sampled the step and kept it in graphs.prev
        else:
            out = sample(logits[0] if len(logits) == 1 else torch.cat(logits), device_params, bans)
            if self.graphs is not None:
                self.graphs.prev[: out.shape[1]].copy_(out[0])
        self._prev = out[0]
        if not self._cuda:
            return Launch(order, out)
        host = self._pinned[self._flip][: 2 * len(order)].view(2, len(order))
        done = self._done[self._flip]
        self._flip ^= 1
        host.copy_(out, non_blocking=True)
        done.record()
        return Launch(order, host, done)

    def _decode_inputs(self, rows: list[StepRow], chunks: list[tuple[int, int, list[int]]],
                       chunk_sampled: list[bool]) -> list[np.ndarray]:
        """The decode inputs, (5, bucket) flat: ids, positions, slots, from-previous flag,
        previous row, for the decode rows, then (a mixed step) each chunk's tokens as rows;
        padding rows feed token 0 at position 0 of the scratch slot. A mixed step's heads
        follow as a second array: the decode rows and each sampled chunk's last token (the
        launch's order), padded to the bucket's; and its attention groups as a third."""
        n_decode = len(rows)
        n = n_decode + sum(len(toks) for _, _, toks in chunks)
        size = self.graphs.bucket(n, mixed=bool(chunks)) if self.graphs else n
        out = np.zeros((5, size), dtype=np.int64)
        out[0, :n_decode] = [r.tokens[0] if r.tokens else 0 for r in rows]
        out[1, :n_decode] = [r.start for r in rows]
        out[2, :n_decode] = [r.slot for r in rows]
        if size > n:
            out[2, n:] = self.model.cache.scratch
        out[3, :n_decode] = [0 if r.tokens else 1 for r in rows]
        out[4, :n_decode] = [r.prev if not r.tokens else 0 for r in rows]
        if not chunks:
            return [out.reshape(-1)]
        ids, positions, slots, last = prefill_arrays(chunks, chunk_sampled)
        out[0, n_decode:n], out[1, n_decode:n], out[2, n_decode:n] = ids, positions, slots
        heads = np.concatenate([np.arange(n_decode, dtype=np.int64), n_decode + last])
        width = self.graphs.head_rows(size) if self.graphs else heads.size
        groups = chunk_groups(n_decode, [len(toks) for _, _, toks in chunks],
                              self.model.chunk_tokens, size)
        return [out.reshape(-1), _padded(heads, width, 0), groups.reshape(-1)]

    def _decode(self, rows: list[StepRow], inputs: Tensor, heads: Tensor | None,
                groups: Tensor | None, sampled: int) -> tuple[Tensor, Tensor | None]:
        """The decode rows' logits (a mixed step's, heads, are the step's `sampled` rows'),
        and in a graph their greedy sample."""
        logit_rows = len(rows) if heads is None else sampled
        if self.graphs is not None:
            return self.graphs.run(inputs, logit_rows, heads, groups)
        ids = optimistic_ids(inputs, self._prev) if any(not r.tokens for r in rows) else inputs[0]
        if heads is None:  # (the transformers fallback takes no heads)
            return self.model.decode(ids, inputs[1], inputs[2]), None
        return self.model.decode(ids, inputs[1], inputs[2], heads, groups)[:logit_rows], None

    def warm_up(self) -> None:
        """A prefill and an eager decode on the scratch slot: a kernel the device refuses
        fails here, at start-up (and the engine falls back), not on a request."""
        scratch = self.model.cache.scratch
        self.model.prefill([(scratch, 0, [0] * min(64, self.model.cache.max_len))], [True])
        for rows in (1, 2):  # one row and the batched layers (apart where GEMVs take one row)
            zero = torch.zeros(rows, dtype=torch.long, device=self.device)
            self.model.decode(zero, zero, zero + scratch)
        if self.mixed_tokens:  # a chunk's two rows, sharing a slot and attending together
            pair = torch.zeros(2, dtype=torch.long, device=self.device)
            groups = torch.from_numpy(chunk_groups(0, [2], self.model.chunk_tokens, 2))
            self.model.decode(pair, torch.arange(2, device=self.device), pair + scratch, pair[:1],
                              groups.to(self.device))
        torch.cuda.synchronize()

    def healthy(self) -> bool:
        """Can the device still compute? (After a CUDA error it cannot: the context is lost.)"""
        if not self._cuda:
            return True
        try:
            return torch.ones(1, device=self.device).add_(1).item() == 2.0
        except Exception:  # any failure here means the device is gone
            return False


def _padded(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    return np.concatenate([values, np.full(size - values.size, fill, dtype=np.int64)])
