"""A decode step's rows as the model takes them: each row's token id (an optimistic row's is
on the device, in the previous step's samples) and its embedding, in one kernel on CUDA."""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import gdc_launch_dependents, gdc_wait, overlapped

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships no Triton
    triton = None


def optimistic_ids(inputs: Tensor, prev: Tensor) -> Tensor:
    """A decode step's token ids from its inputs (5, rows) as model_runner._decode_inputs lays them out:
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
