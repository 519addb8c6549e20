"""The MLP's activation for the batched layers: silu(gate) * up over the fused gate/up matmul.

torch.compile fused `F.silu(gate) * up` of the compiled layers into one kernel, but with the
layers compiled for dynamic shapes that kernel ran at ~1.3 TB/s on an H200 (10 us a layer at
128 rows, 21 at 288: 2-4% of a step, bench/bench_activation.py). Here each program takes
BLOCK columns of one row, so no index is divided by the width. It is a custom op, so the
compiled layers call it as it is. On the CPU (the batch-invariant path) it is the torch
expression, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships no Triton
    triton = None

BLOCK = 2048
WARPS = 4


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up (rows, 2 * width), the gate's columns first: silu(gate) * up, (rows, width);
    on CUDA computed in float32 and rounded once, on the CPU as F.silu(gate) * up rounds."""
    # By name, not through the object below: the op registered last is the one that works
    # (a second import of this module, as a reload does, registers it again).
    return torch.ops.finsieve.silu_mul(gate_up)


@torch.library.custom_op("finsieve::silu_mul", mutates_args=())
def _silu_mul(gate_up: Tensor) -> Tensor:
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    if not (gate_up.is_cuda and triton is not None):
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate) * up
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    out = gate_up.new_empty(rows, width)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(width, BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=BLOCK, num_warps=WARPS)
    return out


@_silu_mul.register_fake
def _(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(X, Out, stride_x, stride_out, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        gate = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + width + cols, mask=inside, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(Out + row * stride_out + cols, out.to(Out.dtype.element_ty), mask=inside)
