"""Next-token choice for a whole step at once: rules mask, greedy, temperature, top-k, top-p.

One call per step on the device, whatever the batch holds:

  * every row's ban list becomes one index_fill on the float32 logits;
  * greedy rows take the argmax; sampled rows take the argmax of logits/T plus Gumbel
    noise (the Gumbel-max trick: an exact draw from softmax(logits/T));
  * the noise of a row is a hash of (the request's seed, the position, the token id),
    computed on the device: a seeded request draws the same tokens whatever else is in the
    batch, and a row refused by the rules and decoded again draws the same noise, so the
    draw is the best allowed token under it;
  * float32 throughout, non-finite values made safe, and a row with nothing allowed
    returns -1 instead of raising: no input can make this function fail.

Returns a (2, rows) int64 tensor: the chosen tokens, and each row's first choice before
the rules' mask (so the engine can say when the mask steered the answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .attention import gdc_launch_dependents, gdc_wait, overlapped
from .sequence import MIN_TEMPERATURE

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships no Triton
    triton = None

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_FLOAT_MAX = torch.finfo(torch.float32).max
_NO_BANS = np.empty(0, dtype=np.int64)
# Logits a loop iteration of the greedy kernel, and its warps: on an H200 from a graph at
# 1 / 16 / 64 / 128 / 256 rows 9.0 / 10.7 / 10.0 / 9.3 / 16.7 us, against 10.2 / 12.2 / 11.9
# / 11.6 / 16.4 with 4096 and 8 (bench_one_row.py)
GREEDY_BLOCK, GREEDY_WARPS = 8192, 16


def noise_key(seed: int, position: int) -> int:
    """A 32-bit key per (request seed, position): splitmix64 of the two, on the host."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xC2B2AE3D27D4EB4F + 0x165667B19E3779F9) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) & _M32


def uniform_noise(keys: Tensor, vocab: int) -> Tensor:
    """(rows, vocab) floats in (0, 1), a pure function of each row's key and the token id.

    A 32-bit integer hash evaluated in int64 with multipliers below 2**31, so no product
    overflows on any device."""
    v = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    h = (v[None, :] * 0x27D4EB2F + keys[:, None]) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & _M32
    h = h ^ (h >> 12)
    h = (h * 0x297A2D39) & _M32
    h = h ^ (h >> 15)
    # 23 bits: (k + 0.5) / 2**23 is exact in float32 and never rounds to 0 or 1, so the
    # Gumbel noise is finite and a banned (-inf) logit stays -inf.
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingRows:
    """Per-row parameters of one step, built on the host."""

    temperature: list[float]  # 0: greedy
    top_k: list[int]  # 0: off
    top_p: list[float]  # 1: off
    keys: list[int]  # noise_key(seed, position)
    bans: list[Sequence[int]]  # sorted token ids each row may not take

    @property
    def sampled(self) -> bool:
        return any(t > 0 for t in self.temperature)  # NaN is not: greedy

    @property
    def filtered(self) -> bool:
        return any(k > 0 for k in self.top_k) or any(p < 1.0 for p in self.top_p)


@dataclass
class DeviceParams:
    """SamplingRows' numbers on the device (the runner stages them through pinned memory)."""

    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    keys: Tensor
    filtered: bool

    @classmethod
    def of(cls, rows: SamplingRows, device: torch.device) -> DeviceParams:
        floats = torch.tensor([rows.temperature, rows.top_p], dtype=torch.float32).to(device)
        ints = torch.tensor([rows.top_k, rows.keys], dtype=torch.int64).to(device)
        return cls(floats[0], floats[1], ints[0], ints[1], rows.filtered)


class BanIndex:
    """Host arrays of ban lists, kept by identity: the rules hand out the same list object for
    the same matcher state, so a step's mask is one concatenation, not a list walk.

    Only ids in [0, vocab) are kept: the mask is one fill of flat indices row * vocab + id,
    so an id past the logits' width (a tokenizer's added tokens beyond the model's
    embedding) would ban a token of the next row, or fail the step in the last one. The
    model cannot produce such a token, so it needs no ban; filtering here, once per list,
    keeps the device step free of checks (and of a synchronization)."""

    def __init__(self, vocab: int, capacity: int = 4096) -> None:
        self._vocab = vocab
        self._arrays: dict[int, tuple[Sequence[int], np.ndarray]] = {}
        self._capacity = capacity

    def array(self, bans: Sequence[int]) -> np.ndarray:
        hit = self._arrays.get(id(bans))
        if hit is not None and hit[0] is bans:
            return hit[1]
        if len(self._arrays) >= self._capacity:
            self._arrays.clear()
        arr = np.asarray(bans, dtype=np.int64)
        inside = (arr >= 0) & (arr < self._vocab)
        if not inside.all():
            arr = arr[inside]
        self._arrays[id(bans)] = (bans, arr)  # the list is kept alive, so its id stays its own
        return arr

    def flat(self, bans: list[Sequence[int]]) -> np.ndarray | None:
        """(2, n) row and column indices of every ban of the step, or None."""
        arrays = [self.array(b) if b else _NO_BANS for b in bans]
        lengths = [len(a) for a in arrays]
        if not any(lengths):
            return None
        rows = np.repeat(np.arange(len(bans), dtype=np.int64), lengths)
        return np.stack([rows, np.concatenate(arrays)])


def sample(logits: Tensor, rows: SamplingRows | DeviceParams | None, bans: Tensor | None) -> Tensor:
    """Tokens for a step: logits (rows, vocab); rows None when every row is greedy; bans a
    (2, n) index tensor on the logits' device."""
    x = logits.float()
    first = x.argmax(-1)
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=_FLOAT_MAX, neginf=float("-inf"))
    if bans is not None:
        # One fill of flat indices with a scalar: `x[rows, cols] = -inf` moves its value to
        # the device with a blocking copy, which waits for every step queued before it, and
        # the engine's host work then no longer overlaps the device's.
        x.view(-1).index_fill_(0, bans[0] * x.shape[-1] + bans[1], float("-inf"))
    if isinstance(rows, SamplingRows):
        rows = DeviceParams.of(rows, x.device) if rows.sampled else None
    if rows is not None:
        x = _sampled(x, rows)
    best, token = x.max(-1)
    token = torch.where(best > float("-inf"), token, -1)  # nothing allowed: the engine halts it
    return torch.stack([token, first])


def sample_greedy(logits: Tensor, prev: Tensor | None = None) -> Tensor:
    """sample(logits, None, None), the same tokens, also written to prev[: rows] when given
    (the decode graphs' feed of the next step). On CUDA one kernel that reads the logits
    once, where the torch ops wrote and read them as float32 four times in eight kernels
    (H200, from a graph: 9 us against 35 at one row, 9 against 70 at 128; bench_one_row.py)."""
    if not logits.is_cuda or triton is None:
        out = sample(logits, None, None)
        if prev is not None:
            prev[: out.shape[1]].copy_(out[0])
        return out
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the kernel reads each row's logits as one span"
    assert prev is None or (prev.numel() >= rows and prev.dtype == torch.long and prev.stride(0) == 1)
    out = torch.empty(2, rows, dtype=torch.long, device=logits.device)
    _greedy_kernel[(rows,)](logits, out, prev if prev is not None else out, logits.stride(0),
                            vocab, PREV=prev is not None, BLOCK=GREEDY_BLOCK, num_warps=GREEDY_WARPS,
                            **overlapped(logits))
    return out


def _sampled(x: Tensor, p: DeviceParams) -> Tensor:
    sampled = p.temperature > 0  # NaN is not: greedy
    # Within [MIN_TEMPERATURE, 1e4]: -inf / inf would be NaN, and x / 1e-45 is not finite.
    scale = torch.where(sampled, p.temperature, 1.0).clamp(MIN_TEMPERATURE, 1e4)
    scaled = (x / scale[:, None]).clamp(max=_FLOAT_MAX)
    if p.filtered:
        scaled = _top_k_top_p(scaled, p.top_k, p.top_p)
    gumbel = -torch.log(-torch.log(uniform_noise(p.keys, x.shape[-1])))
    return torch.where(sampled[:, None], scaled + gumbel, x)


def _top_k_top_p(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Drop what is outside each row's top k and nucleus; a row keeps at least one token."""
    ordered, order = x.sort(-1, descending=True)
    k = torch.where(top_k > 0, top_k, x.shape[-1]).clamp(max=x.shape[-1])
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]
    drop = rank >= k[:, None]
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), -1).nan_to_num(0.0)
    # The smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
    drop |= ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False
    return x.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))


if triton is not None:

    @triton.jit
    def _greedy_kernel(Logits, Out, Prev, stride, vocab, PREV: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
        """Row r's best token after NaN -> -inf, +inf -> float32's max (-1 when nothing is
        above -inf), and its first choice as torch.argmax makes it (a NaN wins, the first
        one); ties go to the lowest id, as in torch's max and argmax.

        Each lane keeps its own best, first choice and first NaN over the row's blocks (a
        strictly greater value replaces it, so a lane keeps its lowest id of a tie), and the
        lanes are reduced once at the end: a reduction per block made the loop wait on each
        block in turn (one program a row, 6 blocks for a 49,152-token vocabulary)."""
        if PDL:  # the logits come from the kernel before
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        at = Logits + row.to(tl.int64) * stride
        lane = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        token = tl.full([BLOCK], 0, tl.int32)
        top = tl.full([BLOCK], float("-inf"), tl.float32)  # the first choice, NaN aside
        first = tl.full([BLOCK], 0, tl.int32)  # (a row of -inf: 0, as torch.argmax)
        nan = tl.full([BLOCK], vocab, tl.int32)  # each lane's first NaN (vocab: none)
        for start in range(0, vocab, BLOCK):
            ids = start + lane
            x = tl.load(at + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
            is_nan = x != x
            safe = tl.where(is_nan, float("-inf"), tl.minimum(x, 3.4028234663852886e38))
            better = safe > best
            best = tl.where(better, safe, best)
            token = tl.where(better, ids, token)
            higher = (x > top) & ~is_nan
            top = tl.where(higher, x, top)
            first = tl.where(higher, ids, first)
            nan = tl.where(is_nan & (nan == vocab), ids, nan)
        row_best = tl.max(best, 0)
        row_token = tl.min(tl.where(best == row_best, token, vocab), 0)
        row_top = tl.max(top, 0)
        row_first = tl.min(tl.where(top == row_top, first, vocab), 0)
        row_nan = tl.min(nan, 0)
        row_token = tl.where(row_best > float("-inf"), row_token, -1)
        tl.store(Out + row, row_token.to(tl.int64))
        if PREV:
            tl.store(Prev + row, row_token.to(tl.int64))
        tl.store(Out + tl.num_programs(0) + row,
                 tl.where(row_nan < vocab, row_nan, row_first).to(tl.int64))
