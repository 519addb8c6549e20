"""Device state and one step on it: inputs, the forward, the rules' mask, the sample.

`launch` starts a step and returns at once on CUDA, in four parts: plan (which rows decode,
which are prefill chunks, in which order they sample, whether the step is mixed), stage
(every integer the step needs goes to the device in one copy), forward (the logits) and
sample (then the device-to-host copy). The decode rows run as one CUDA graph (captured at
start-up per batch-size bucket, over persistent input buffers; cuda_graphs.py) and prefill
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

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import structlog
import torch
from torch import Tensor

from .attention import chunk_groups
from .cuda_graphs import DecodeGraphs, PrefillGraphs, padded
from .embed import optimistic_ids
from .model import prefill_arrays
from .sampler import BanIndex, DeviceParams, SamplingRows, sample

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


class _Plan(NamedTuple):
    """A step as the device will run it."""

    order: list[int]  # the launched rows' index per sample row: decode rows first
    decode_rows: list[StepRow]
    chunks: list[tuple[int, int, list[int]]]  # the prefill chunks: slot, start, tokens
    chunk_sampled: list[bool]
    params: SamplingRows
    mixed: bool  # the chunks' tokens ride as rows of the decode forward
    graphed: tuple[int, np.ndarray] | None  # the prefill graph's bucket and its inputs


class _Staged(NamedTuple):
    """A step's inputs on the device."""

    inputs: Tensor | None  # the decode rows', (5, bucket)
    heads: Tensor | None  # a mixed step's logits rows
    groups: Tensor | None  # a mixed step's attention groups
    bans: Tensor | None
    params: DeviceParams | None  # None: every row greedy
    prefill: Tensor | None  # the prefill graph's inputs


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
        """Start a step (on CUDA it runs on while this returns); Launch.tokens waits for it."""
        self._staging.next_step()
        plan = self._plan(rows)
        staged = self._stage(plan)
        logits, greedy = self._forward(plan, staged)
        if not plan.order:
            return Launch(plan.order)
        return self._sample(plan.order, logits, greedy, staged)

    def _plan(self, rows: list[StepRow]) -> _Plan:
        decode = [i for i, r in enumerate(rows) if r.sample and len(r.tokens) <= 1]
        in_decode = set(decode)
        prefill = [rows[i] for i in range(len(rows)) if i not in in_decode]
        order = decode + [i for i in range(len(rows)) if i not in in_decode and rows[i].sample]
        chunks = [(r.slot, r.start, r.tokens) for r in prefill]
        chunk_sampled = [r.sample for r in prefill]
        mixed, graphed = self._prefill_kind(len(decode), chunks, chunk_sampled)
        return _Plan(order, [rows[i] for i in decode], chunks, chunk_sampled,
                     _sampling_rows([rows[i] for i in order]), mixed, graphed)

    def _prefill_kind(self, n_decode: int, chunks: list[tuple[int, int, list[int]]],
                      chunk_sampled: list[bool]) -> tuple[bool, tuple[int, np.ndarray] | None]:
        """How the chunks run: as rows of the decode forward (mixed), or in a prefill graph
        (its bucket and inputs), or neither (eagerly)."""
        # Decode rows and a few prefill tokens: one forward, the weights read once for both.
        mixed = bool(n_decode and chunks) and \
            n_decode + sum(len(toks) for _, _, toks in chunks) <= self.mixed_rows
        graphed = self.prefill_graphs.layout(chunks, chunk_sampled) \
            if chunks and not mixed and self.prefill_graphs is not None else None
        return mixed, graphed

    def _stage(self, plan: _Plan) -> _Staged:
        """Every integer the step needs goes to the device in one copy (its floats in one
        more); device views of each part."""
        decode, params = plan.decode_rows, plan.params
        parts = self._decode_inputs(decode, plan.chunks if plan.mixed else [], plan.chunk_sampled) \
            if decode else []
        flat_bans = self._bans.flat(params.bans) if plan.order else None
        if flat_bans is not None:
            parts.append(flat_bans.reshape(-1))
        if params.sampled:
            parts.append(np.asarray([params.top_k, params.keys], dtype=np.int64).reshape(-1))
        if plan.graphed is not None:
            parts.append(plan.graphed[1])
        staged = iter(self._staging.put(parts, torch.long) if parts else [])
        inputs = heads = groups = None
        if decode:
            inputs = next(staged).view(5, -1)
            if plan.mixed:
                heads, groups = next(staged), next(staged).view(2, -1)
        bans = next(staged).view(2, -1) if flat_bans is not None else None
        device_params = None
        if params.sampled:
            ints = next(staged).view(2, -1)
            floats = self._staging.put([np.asarray([params.temperature, params.top_p],
                                                   dtype=np.float32).reshape(-1)], torch.float32)[0]
            floats = floats.view(2, -1)
            device_params = DeviceParams(floats[0], floats[1], ints[0], ints[1], params.filtered)
        prefill = next(staged) if plan.graphed is not None else None
        return _Staged(inputs, heads, groups, bans, device_params, prefill)

    def _forward(self, plan: _Plan, staged: _Staged) -> tuple[list[Tensor], Tensor | None]:
        """The logits of the step's sampled rows in its order, in parts (the decode rows'
        first), and the decode graph's greedy sample of its rows (None without a graph)."""
        logits, greedy = [], None
        if plan.decode_rows:
            assert staged.inputs is not None
            decoded, greedy = self._decode(plan.decode_rows, staged.inputs, staged.heads,
                                           staged.groups, len(plan.order))
            logits.append(decoded)
        if plan.graphed is not None:
            assert self.prefill_graphs is not None and staged.prefill is not None
            logits.append(self.prefill_graphs.run(plan.graphed[0], staged.prefill,
                                                  sum(plan.chunk_sampled)))
        elif plan.chunks and not plan.mixed:
            logits.append(self.model.prefill(plan.chunks, plan.chunk_sampled))
        return [x for x in logits if x.shape[0]], greedy

    def _sample(self, order: list[int], logits: list[Tensor], greedy: Tensor | None,
                staged: _Staged) -> Launch:
        """One batched mask and sample over every row, then one device-to-host copy of the
        sampled ids (into pinned memory, two buffers in turn)."""
        if greedy is not None and len(logits) == 1 and staged.bans is None and staged.params is None:
            out = greedy  # the graph sampled the step and kept it in graphs.prev
        else:
            out = sample(logits[0] if len(logits) == 1 else torch.cat(logits), staged.params,
                         staged.bans)
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
        return [out.reshape(-1), padded(heads, width, 0), groups.reshape(-1)]

    def _decode(self, rows: list[StepRow], inputs: Tensor, heads: Tensor | None,
                groups: Tensor | None, sampled: int) -> tuple[Tensor, Tensor | None]:
        """The decode rows' logits (a mixed step's, heads, are the step's `sampled` rows'),
        and in a graph their greedy sample."""
        logit_rows = len(rows) if heads is None else sampled
        if self.graphs is not None:
            return self.graphs.run(inputs, logit_rows, heads, groups)
        ids = inputs[0]
        if any(not r.tokens for r in rows):  # optimistic rows: a launch sampled before
            assert self._prev is not None
            ids = optimistic_ids(inputs, self._prev)
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


def _sampling_rows(sampled: list[StepRow]) -> SamplingRows:
    """The sampled rows' parameters, column by column."""
    return SamplingRows([r.temperature for r in sampled], [r.top_k for r in sampled],
                        [r.top_p for r in sampled], [r.key for r in sampled],
                        [r.bans for r in sampled])
