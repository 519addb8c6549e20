"""One row's decode step: each layer's matmuls as GEMV kernels, the elementwise work inside.

At one row a step reads every weight once and computes almost nothing, so what is left
above the bandwidth floor is the number of kernels and the time between them. The compiled
path (cuBLAS + torch.compile) runs 14 kernels per layer at one row (norm, matmul, two RoPE,
attention and merge, matmul and split-K reduce, norm, matmul, SiLU, matmul and reduce, a
copy): on an H200, 4.4-4.5 ms a step for a 3.2 ms floor. Here a layer is four GEMVs around
the attention (3.68 ms a step, the launches overlapped, see attention.overlapped):

    qkv  = rope(rms_norm(x) @ Wqkv.T + b)     the norm's 1/rms applied after the sum
    x   += attn @ Wo.T
    h    = silu(rms_norm(x) @ Wgate.T) * (rms_norm(x) @ Wup.T)
    x   += h @ Wdown.T                        split-K over the long K

and the head one more after the last layer, logits = rms_norm(x) @ Whead.T (the final
norm's eager kernels and cuBLAS's GEMV cost 0.5% of a step more; bench/bench_one_row.py).

Each program of the first three owns BLOCK_N output rows, two blocks where a pair meets in
the epilogue (the two RoPE halves of a head; the gate and up rows of a unit), and sums them
over the whole K: no split-K, so no reduce kernel and one fixed order of summation (a
replay is exact). Programs read the input row whole, so each computes the norm itself.

The down projection's K (the MLP width) is too long for that: a program per few rows kept
too few bytes in flight (76% of the copy rate on an H200). Its K is cut into a few parts,
and the last program of each row block to finish (an atomic counter) adds the parts in
their order, so the sum is still in one fixed order and no reduce kernel runs: on an H200
34.4 us a layer (94% of the copy rate) against cuBLAS's split-K and reduce at 38.8 (83%).

Tried and kept out (one H200, the one-row decode graph, both ways in one run): each program
loading its first weight tile before the PDL wait, to overlap the kernel before, replayed in
3.68 ms against 3.63 (the gate/up kernel alone 68.0 us against 64.8); prefetching each
program's whole slice into L2 before the wait, 4.24 ms.

A row decoding alone is summed in another order than the same row in a batch, which the
compiled layers run: in bfloat16 the logits differ by rounding (the GPU test allows 2e-2),
as they already did between cuBLAS's kernels for different batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import gdc_launch_dependents, gdc_wait, overlapped

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships no Triton
    triton = None

PLAIN, ROPE, SILU = 0, 1, 2


@dataclass(frozen=True)
class Tile:
    """Output rows per program (per block of a pair), K per iteration, warps, stages
    (`python -m bench.bench_gpu --phases profile` times the alternatives on the device)."""

    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 1
    splits: int = 1  # K cut into this many parts (the down projection's)


# Per matmul, the fastest at one row on an H200 (Qwen2-7B shape); a smaller block_k is used
# where it does not divide K. Swept alone (`bench.bench_gpu --phases profile --sweeps gemv`),
# two parts beat these for the down projection (33.8 against 34.4 us on one H200, 35.7
# against 37.2 on another) and for the output projection (16 rows, 256: 7.12 against 7.68
# us), but the one-row decode graph on a third H200 replayed in 3.68 ms with either set
# (the GPU tests passed with both): these are the tiles every end-to-end figure ran.
TILES = {"qkv": Tile(4, 512), "o": Tile(16, 512, warps=8), "gate_up": Tile(4, 512),
         "down": Tile(8, 512, splits=4), "head": Tile(8, 512)}


def add_matmul_split(x: Tensor, w: Tensor, residual: Tensor, counters: Tensor,
                     tile: Tile) -> None:
    """residual += x @ w.T, in place, K cut into tile.splits parts: program (n, s) sums its
    rows over part s into a float32 partial, and the last of a row block's programs to
    finish adds the partials in part order and the residual (an atomic counter per row
    block, reset by that program: zeros before and after each launch, graph replays
    included). The order of summation is fixed, so a replay is exact. counters: int32 zeros,
    one per row block (w.shape[0] // tile.block_n), used by one stream only: a counter left
    non-zero (two launches at once on it) would make a program merge before the others."""
    n, k = w.shape
    assert w.is_contiguous() and n % tile.block_n == 0
    assert x.shape == (k,) and residual.shape == (n,) and x.data_ptr() != residual.data_ptr()
    assert x.stride(0) == residual.stride(0) == 1
    assert counters.dtype == torch.int32 and counters.numel() >= n // tile.block_n
    block_k = block_k_for(k, tile.block_k)
    blocks = k // block_k
    per_split = -(-blocks // min(tile.splits, blocks))  # K blocks a part
    splits = -(-blocks // per_split)  # no part left empty
    partial = torch.empty(splits, n, device=x.device, dtype=torch.float32)
    _split_k_kernel[(n // tile.block_n, splits)](
        x, w, residual, partial, counters, k, n, per_split * block_k,
        SPLITS=splits, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        num_warps=tile.warps, num_stages=tile.stages, **overlapped(x),
    )


def block_k_for(k: int, block_k: int) -> int:
    """The largest power of two up to block_k that divides k (0: none of at least 16)."""
    while block_k >= 16 and k % block_k:
        block_k //= 2
    return block_k if block_k >= 16 else 0


def fits(hidden: int, intermediate: int, heads: int, head_dim: int,
         tiles: dict[str, Tile] = TILES) -> bool:
    """Can each GEMV take a layer of this shape (tiles divide the rows, and the Ks; the
    attention kernel after it takes a power-of-two head_dim)?"""
    half = head_dim // 2
    return (triton is not None and head_dim & (head_dim - 1) == 0
            and half % tiles["qkv"].block_n == 0
            and intermediate % tiles["gate_up"].block_n == 0 and hidden % tiles["o"].block_n == 0
            and hidden % tiles["down"].block_n == 0
            and block_k_for(intermediate, tiles["down"].block_k) > 0
            and block_k_for(hidden, tiles["qkv"].block_k) > 0
            and block_k_for(hidden, tiles["gate_up"].block_k) > 0
            and block_k_for(heads * head_dim, tiles["o"].block_k) > 0)


def norm_qkv_rope(x: Tensor, norm: Tensor, eps: float, w: Tensor, bias: Tensor | None,
                  cos: Tensor, sin: Tensor, position: Tensor, rope_rows: int,
                  tile: Tile = TILES["qkv"]) -> Tensor:
    """x (hidden,) -> q, k, v back to back (rows of w,), RoPE on the first rope_rows rows."""
    out = torch.empty(w.shape[0], device=x.device, dtype=x.dtype)
    half = cos.shape[-1] // 2
    _launch(ROPE, x, w, out, tile, w.shape[0] // (2 * tile.block_n), norm=norm, eps=eps,
            bias=bias, cos=cos, sin=sin, position=position, pair_offset=half,
            rope_rows=rope_rows, half=half)
    return out


def add_matmul(x: Tensor, w: Tensor, residual: Tensor, tile: Tile = TILES["o"],
               counters: Tensor | None = None) -> None:
    """residual += x @ w.T, in place (x must be another tensor: every program reads all of it);
    a tile with splits > 1 cuts K into parts (add_matmul_split, on these counters)."""
    if tile.splits > 1:
        assert counters is not None, "a split-K tile needs its counters"
        add_matmul_split(x, w, residual, counters, tile)
        return
    _launch(PLAIN, x, w, residual, tile, w.shape[0] // tile.block_n, residual=residual)


def norm_matmul(x: Tensor, norm: Tensor, eps: float, w: Tensor, tile: Tile = TILES["head"]) -> Tensor:
    """rms_norm(x) @ w.T (rows of w,): the head, its final norm inside."""
    out = torch.empty(w.shape[0], device=x.device, dtype=x.dtype)
    _launch(PLAIN, x, w, out, tile, w.shape[0] // tile.block_n, norm=norm, eps=eps)
    return out


def norm_gate_up_silu(x: Tensor, norm: Tensor, eps: float, w: Tensor,
                      tile: Tile = TILES["gate_up"]) -> Tensor:
    """x (hidden,) -> silu(gate) * up, w holding the gate rows then the up rows."""
    units = w.shape[0] // 2
    out = torch.empty(units, device=x.device, dtype=x.dtype)
    _launch(SILU, x, w, out, tile, units // tile.block_n, norm=norm, eps=eps, pair_offset=units)
    return out


def _launch(mode: int, x: Tensor, w: Tensor, out: Tensor, tile: Tile, programs: int, *,
            norm: Tensor | None = None, eps: float = 0.0, bias: Tensor | None = None,
            residual: Tensor | None = None, cos: Tensor | None = None, sin: Tensor | None = None,
            position: Tensor | None = None, pair_offset: int = 0, rope_rows: int = 0,
            half: int = 1) -> None:
    k = w.shape[1]
    assert w.is_contiguous(), "a GEMV weight must be contiguous: its row stride is taken as K"
    # Unused pointers get a real tensor: Triton needs an address, the kernel never reads it.
    _gemv_kernel[(programs,)](
        x, norm if norm is not None else w, w, bias if bias is not None else w,
        residual if residual is not None else out, out,
        cos if cos is not None else w, sin if sin is not None else w,
        position if position is not None else out,
        k, pair_offset, rope_rows, eps,
        MODE=mode, NORM=norm is not None, HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None, HALF=half,
        BLOCK_N=tile.block_n, BLOCK_K=block_k_for(k, tile.block_k),
        num_warps=tile.warps, num_stages=tile.stages, **overlapped(x),
    )


if triton is not None:

    @triton.jit
    def _gemv_kernel(X, Norm, W, Bias, Res, Out, Cos, Sin, Pos,
                     K, pair_offset, rope_rows, eps,
                     MODE: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                     RESIDUAL: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # the input row comes from the kernel before
            gdc_wait()
            gdc_launch_dependents()
        pid = tl.program_id(0)
        r = tl.arange(0, BLOCK_N)
        if MODE == 1:  # ROPE: rows j and j + HALF of one head
            per_head = HALF // BLOCK_N
            lo = (pid // per_head) * (2 * HALF) + (pid % per_head) * BLOCK_N + r
        else:
            lo = pid * BLOCK_N + r
        hi = lo + pair_offset
        w_lo = W + lo.to(tl.int64)[:, None] * K
        w_hi = W + hi.to(tl.int64)[:, None] * K
        # Products accumulate per lane and are summed once at the end (no reduction per tile).
        acc_lo = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_hi = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + k).to(tl.float32)
            if NORM:
                squares += x * x
                x = x * tl.load(Norm + k).to(tl.float32)
            acc_lo += tl.load(w_lo + k[None, :]).to(tl.float32) * x[None, :]
            if MODE != 0:
                acc_hi += tl.load(w_hi + k[None, :]).to(tl.float32) * x[None, :]
        out_lo = tl.sum(acc_lo, 1)
        out_hi = tl.sum(acc_hi, 1)
        if NORM:
            rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
            out_lo = out_lo * rstd
            out_hi = out_hi * rstd
        if HAS_BIAS:
            out_lo += tl.load(Bias + lo).to(tl.float32)
            out_hi += tl.load(Bias + hi).to(tl.float32)
        if MODE == 1:  # ROPE
            # cos and sin hold each frequency twice (positions, 2 * HALF): column j serves
            # both halves. The value rows (past rope_rows) pass unrotated.
            table = tl.load(Pos) * (2 * HALF) + lo % (2 * HALF)
            cos = tl.load(Cos + table).to(tl.float32)
            sin = tl.load(Sin + table).to(tl.float32)
            rotate = lo < rope_rows
            tl.store(Out + lo, tl.where(rotate, out_lo * cos - out_hi * sin, out_lo)
                     .to(Out.dtype.element_ty))
            tl.store(Out + hi, tl.where(rotate, out_hi * cos + out_lo * sin, out_hi)
                     .to(Out.dtype.element_ty))
        elif MODE == 2:  # SILU
            silu = out_lo / (1.0 + tl.exp(-out_lo))
            tl.store(Out + lo, (silu * out_hi).to(Out.dtype.element_ty))
        else:
            if RESIDUAL:
                out_lo += tl.load(Res + lo).to(tl.float32)
            tl.store(Out + lo, out_lo.to(Out.dtype.element_ty))

    @triton.jit
    def _split_k_kernel(X, W, Res, Partial, Counters, K, N, per_split,
                        SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
        if PDL:  # the input row comes from the kernel before
            gdc_wait()
            gdc_launch_dependents()
        block = tl.program_id(0)
        part = tl.program_id(1)
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        w_at = W + rows.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(part * per_split, tl.minimum(K, (part + 1) * per_split), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            acc += tl.load(w_at + k[None, :]).to(tl.float32) * tl.load(X + k).to(tl.float32)[None, :]
        tl.store(Partial + part * N + rows, tl.sum(acc, 1))
        tl.debug_barrier()  # every thread's partial stored before the release
        counter = Counters + block
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            tl.store(counter, 0)
            total = tl.zeros([BLOCK_N], tl.float32)
            for j in tl.static_range(SPLITS):  # the other programs' partials: from L2
                total += tl.load(Partial + j * N + rows, cache_modifier=".cg")
            total += tl.load(Res + rows).to(tl.float32)
            tl.store(Res + rows, total.to(Res.dtype.element_ty))
