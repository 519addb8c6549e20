"""Attention over the slot KV cache: decode (one new token per row) and chunked prefill.

The cache of one layer is (slots, kv_heads, positions, head_dim); a row's keys are the first
`length` positions of its slot. Rolling a sequence back is setting its length, so every
kernel here reads each row's own length and nothing past it.

Decode takes the step's new keys and values with the queries, like flash-attn's
`flash_attn_with_kvcache(k=, v=)`: it writes them at position `length - 1` of each row's
slot and attends over the first `length` positions.

Decode, on CUDA: a Triton flash-decoding kernel. Each (row, kv head) runs in P programs,
program j taking a contiguous span of the row's positions in one pipelined loop over its
key tiles, for the whole group of query heads sharing that kv head, and writing one partial
softmax; a second kernel merges a row's P partials. P is picked per launch from the rows
(a tile a program at a few rows, to fill the device; two a row at 64 and more), so a row's
result depends on the launch's row count in its last bits, as cuBLAS's matmuls
do (the CPU path is the batch-invariant one). In a mixed step a program takes two tokens
of a prefill chunk (`chunk_groups`), which share their keys. The program whose span holds
the new position stores the new key and value there first and then reads them with the
rest, so the cache write costs no kernel of its own (two index kernels per layer did
before: 4% of a batch-1 step), except in a mixed step, where rows share a slot and a small
kernel stores them all first. The grid is static for a given row count, so the kernels
are captured in the decode step's CUDA graph. flash-attn's `flash_attn_with_kvcache` would
do the same job; it is not used because it is not installable on every target (no wheel
for this torch), and this kernel reads the same bytes.

Decode, on the CPU: one SDPA per row over exactly its own length, in the order the
batch-invariant path has always used.

Prefill, on CUDA in bfloat16/float16: every chunk of the step in one varlen flash-attention
call (torch's bundled FlashAttention-2, which takes GQA and aligns the causal mask to each
chunk's last key), over its keys gathered from the slots in one index per layer. One SDPA
per chunk launched ~4 kernels per chunk and layer: with 64 prompts in a step, thousands of
launches that kept the host busy longer than the device (py-spy on the H200).

Prefill, on the CPU (and CUDA in float32, which FlashAttention does not take): SDPA per
chunk over the chunk's slot (causal, aligned to the chunk's last key).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships no Triton
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one before 3.3: kernels launched one after the other
    gdc_launch_dependents = gdc_wait = None

# The split kernel's launch by the launch's rows: positions a loop iteration, pipeline
# stages, and the programs it aims at (programs_per_row). H200, Qwen2-7B shape, one layer's
# rows of 128-768 positions (bench/bench_attention.py), against the kernel before this one
# (splits of 64 positions, a partial each), in one run, microseconds: 1 row 4.4 / 5.1,
# 4 rows 5.2 / 5.9, 16 rows 8.6 / 10.5, 64 rows 21.5 / 28.8, 128 rows 39.5 / 51.0, 64 rows
# and a fresh 256-token chunk (a mixed step) 41.7 / 51.8.
FEW_ROWS = 16
FEW_ROWS_LAUNCH, MANY_ROWS_LAUNCH = (32, 2, 528), (64, 3, 264)
WARPS = 4
# Warps of a merge program (one per row and head: a few kilobytes of partials to read).
# One: more programs in flight. H200, per layer of the whole attention, 4 / 2 / 1 warps:
# 1 row 4.9 / 5.6 / 5.1 us, 64 rows 32.1 / 31.1 / 28.5, 128 rows 58.2 / 53.3 / 51.2, 64 rows
# + a 256-token chunk 66.6 / 51.4 / 51.6, 128 rows + 160 tokens at 160 78.4 / 65.9 / 64.1.
MERGE_WARPS = 1
# Query rows (tokens x query heads per kv head) a program takes of a prefill chunk's rows:
# the tile's 16 (two tokens of a 7-head group) are the fastest, its 32 and 64 cost more in
# compute than they save in loads (H200, a mixed step of 64 rows and a 256-token chunk:
# 67, 82 and 84 us a layer, against 73 with each row alone).
CHUNK_QUERIES = 16


def overlapped(t: Tensor) -> dict:
    """The keywords that launch a Triton kernel over t's device overlapped (programmatic
    dependent launch, Hopper and later): the kernel's `PDL` flag and, when set, the launch
    option, together, so that they cannot disagree (a Triton that has no griddepcontrol
    refuses the option). Such a kernel is started while the one before it drains and waits
    (griddepcontrol.wait) before it reads anything: at one row a step is ~180 kernels of a
    few microseconds, and the time between them was a tenth of the step."""
    if gdc_wait is not None and t.is_cuda and _hopper_or_later(t.device.index):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.cache
def _hopper_or_later(index: int | None) -> bool:
    # griddepcontrol is NVIDIA's; ROCm reports capabilities in the same form (MI300: 9.4)
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def attention_kernel_available() -> bool:
    """Whether the Triton decode kernel can be launched here (a CUDA device is the caller's
    to check)."""
    return triton is not None


def programs_per_row(row_heads: int, tiles: int, aim: int) -> int:
    """P, the programs per (row, kv head), each taking a contiguous span of the row's
    positions: at a few rows one program per tile, to fill the device; from 64 rows on
    two, each pipelining its span's tiles (short spans cost a partial each, and their
    programs' start-up latency was most of the kernel's time; one a row left the device
    waiting on the longest rows)."""
    return min(tiles, max(2, -(-aim // row_heads)))


def chunk_tokens(group: int) -> int:
    """A mixed step's chunk rows attend in groups of this many (a program's tile has
    tokens x group query rows), so a key tile loaded once serves them all; decode rows
    attend alone, in their own slots."""
    return max(1, CHUNK_QUERIES // group)


def chunk_groups(n_decode: int, chunk_sizes: Sequence[int], tokens: int, size: int) -> np.ndarray:
    """A mixed step's groups of rows for the attention, (2, size) int64: each group's first
    row and its number of rows. Each decode row alone, then each chunk's rows `tokens` at a
    time, then each padding row of the bucket alone (so that no row's output is left
    uninitialised); empty groups after."""
    starts = n_decode + np.cumsum([0, *chunk_sizes], dtype=np.int64)[:-1]
    rows = n_decode + sum(chunk_sizes)
    firsts = np.concatenate([np.arange(n_decode, dtype=np.int64),
                             *(np.arange(a, a + n, tokens, dtype=np.int64)
                               for a, n in zip(starts, chunk_sizes, strict=True)),
                             np.arange(rows, size, dtype=np.int64)])
    ends = np.concatenate([np.arange(1, n_decode + 1, dtype=np.int64),
                           *(np.minimum(np.arange(a, a + n, tokens, dtype=np.int64) + tokens, a + n)
                             for a, n in zip(starts, chunk_sizes, strict=True)),
                           np.arange(rows + 1, size + 1, dtype=np.int64)])
    out = np.zeros((2, size), dtype=np.int64)
    out[0, : firsts.size], out[1, : firsts.size] = firsts, ends - firsts
    return out


def decode_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                     slots: Tensor, lengths: Tensor, kernel: bool,
                     rope: tuple[Tensor, Tensor] | None = None, shared: bool = False,
                     groups: Tensor | None = None) -> Tensor:
    """q (rows, heads, head_dim), k and v (rows, kv_heads, head_dim): the new token's, written
    at position lengths - 1 of each row's slot; lengths: positions each row attends, its new
    token included. rope: the (positions, head_dim) cos and sin tables when q and k come
    unrotated (the Triton kernel rotates them as it loads them: at 64 rows the two RoPE
    kernels per layer it replaces were 4% of a step). kernel False: the per-row SDPA path
    (the CPU's, and CUDA's fallback if Triton fails).

    shared: rows may share a slot (a prefill chunk fed as rows, one token each, beside the
    decode rows: a mixed step), so a row attends to keys that other rows bring. Every new
    key and value is then stored first, by a kernel of its own, and the attention reads
    them all from the cache. groups (chunk_groups, CUDA): the rows that attend together, at
    most chunk_tokens a group (not checked on the device: the host lays them out)."""
    if q.is_cuda and kernel:
        return _triton_decode(q, k, v, k_cache, v_cache, slots, lengths, rope=rope,
                              shared=shared, groups=groups)
    positions = lengths - 1
    if rope is not None:
        cos, sin = (table[positions][:, None] for table in rope)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache[slots, :, positions] = k
    v_cache[slots, :, positions] = v
    return _attend_each(q, k_cache, v_cache, slots, lengths)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, the two halves of each head rotated together (Llama/Qwen2 layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _attend_each(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                 lengths: Tensor) -> Tensor:
    """One SDPA per row over exactly its own length (the batch-invariant path)."""
    out = torch.empty_like(q)
    for row, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist(), strict=True)):
        out[row] = F.scaled_dot_product_attention(
            q[row, :, None], k_cache[slot, :, :length], v_cache[slot, :, :length], enable_gqa=True,
        )[:, 0]
    return out


@dataclass(frozen=True)
class VarlenKeys:
    """Where a step's prefill chunks find their keys: every position each chunk attends, in
    the cache, and the chunks' cumulative query and key counts (FlashAttention's varlen)."""

    slots: Tensor
    positions: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int

    @staticmethod
    def host_arrays(chunks: list[tuple[int, int, int]]) -> tuple[np.ndarray, ...]:
        """slots, positions, cu_q, cu_k as int64 host arrays (the caller copies them once)."""
        ends = [start + n for _, start, n in chunks]
        slots = np.repeat(np.asarray([slot for slot, _, _ in chunks], dtype=np.int64), ends)
        positions = np.concatenate([np.zeros(0, np.int64), *(np.arange(end, dtype=np.int64) for end in ends)])
        cu_q = np.cumsum([0, *(n for _, _, n in chunks)], dtype=np.int64)
        cu_k = np.cumsum([0, *ends], dtype=np.int64)
        return slots, positions, cu_q, cu_k


def varlen_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, keys: VarlenKeys) -> Tensor:
    """prefill_attention for every chunk in one FlashAttention call (CUDA, bf16/fp16)."""
    k = k_cache[keys.slots, :, keys.positions]  # (keys, kv_heads, head_dim)
    v = v_cache[keys.slots, :, keys.positions]
    return torch.ops.aten._flash_attention_forward(
        q, k, v, keys.cu_q, keys.cu_k, keys.max_q, keys.max_k, 0.0, True, False,
        scale=q.shape[-1] ** -0.5)[0]


def prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                      chunks: Sequence[tuple[int, int, int]]) -> Tensor:
    """q (tokens, heads, head_dim) of several chunks back to back; chunks: (slot, start, n).
    Each chunk's tokens attend to the slot's first `start` positions and causally to each other."""
    out = torch.empty_like(q)
    offset = 0
    for slot, start, n in chunks:
        qc = q[offset : offset + n].transpose(0, 1)[None]
        keys = k_cache[slot, :, : start + n][None]
        values = v_cache[slot, :, : start + n][None]
        if q.is_cuda:
            # Causal aligned to the last key: flash attention when start == 0, the
            # memory-efficient kernel with its lower-right causal mask otherwise.
            groups = qc.shape[1] // keys.shape[1]
            from torch.nn.attention.bias import causal_lower_right

            o = F.scaled_dot_product_attention(
                qc, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1),
                attn_mask=causal_lower_right(n, start + n))
        else:
            mask = None
            if start > 0:
                positions = torch.arange(start, start + n, device=q.device)
                mask = torch.arange(start + n, device=q.device)[None, :] <= positions[:, None]
            o = F.scaled_dot_product_attention(qc, keys, values, attn_mask=mask,
                                               is_causal=mask is None, enable_gqa=True)
        out[offset : offset + n] = o[0].transpose(0, 1)
        offset += n
    return out


def _triton_decode(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slots: Tensor, lengths: Tensor, block_n: int = 0, stages: int = 0,
                   rope: tuple[Tensor, Tensor] | None = None, shared: bool = False,
                   programs: int = 0, groups: Tensor | None = None, tokens: int = 0) -> Tensor:
    """decode_attention's CUDA path; block_n, stages and programs (P a row) 0: as tuned."""
    rows, heads, dim = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    assert groups is None or (shared and groups.shape[1] == rows), \
        "groups: a mixed step's (chunk_groups), as wide as its rows"
    tokens = (tokens or chunk_tokens(group)) if groups is not None else 1
    n_groups = groups.shape[1] if groups is not None else rows
    tuned_n, tuned_stages, aim = FEW_ROWS_LAUNCH if rows < FEW_ROWS else MANY_ROWS_LAUNCH
    block_n, stages = block_n or tuned_n, stages or tuned_stages
    tiles = -(-max_len // block_n)
    span = block_n * -(-tiles // (programs or programs_per_row(n_groups * kv_heads, tiles, aim)))
    programs = -(-max_len // span)  # no program left without positions
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    overlap = overlapped(q)
    cos, sin = rope if rope is not None else (q, q)  # unread without ROPE
    assert rope is None or all(t.is_contiguous() and t.shape[-1] == dim for t in rope), \
        "RoPE tables must be (positions, head_dim), contiguous"
    if shared:
        _store_kernel[(rows, kv_heads)](
            k, v, k_cache, v_cache, slots, lengths, cos, sin,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            DIM=dim, ROPE=rope is not None, **overlap,
        )
    partial = torch.empty(rows, heads, programs, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(rows, heads, programs, device=q.device, dtype=torch.float32)
    groups = groups if groups is not None else lengths.view(1, -1)  # unread: a row a group
    _split_kernel[(n_groups, kv_heads, programs)](
        q, k, v, k_cache, v_cache, slots, lengths, groups, partial, lse, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), groups.stride(0),
        dim ** -0.5, span,
        GROUP=group, TOKENS=tokens, BLOCK_M=max(16, triton.next_power_of_2(tokens * group)),
        DIM=dim, BLOCK_N=block_n, ROPE=rope is not None, STORED=shared,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 stays float32
        STAGES=stages, num_warps=WARPS, num_stages=stages, **overlap,
    )
    out = torch.empty_like(q)
    _merge_kernel[(rows, heads)](
        partial, lse, out, lengths,
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), span,
        SPLITS_PAD=triton.next_power_of_2(programs), DIM=dim,
        num_warps=MERGE_WARPS, **overlap,
    )
    return out


if triton is not None:

    @triton.jit
    def _split_kernel(Q, Knew, Vnew, K, V, Slots, Lengths, Groups, Partial, Lse, Cos, Sin,
                      sq_row, sq_head, skn_row, skn_head, svn_row, svn_head,
                      sk_slot, sk_head, sk_pos,
                      sv_slot, sv_head, sv_pos,
                      sp_row, sp_head, sp_split,
                      sl_row, sl_head, sg,
                      scale, span,
                      GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
                      DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      ROPE: tl.constexpr, STORED: tl.constexpr, PRECISION: tl.constexpr,
                      STAGES: tl.constexpr, PDL: tl.constexpr):
        """Program (g, kv head, j): positions [j * span, (j + 1) * span) of group g's rows,
        for the query heads sharing the kv head, and their partial softmax. A group is one
        row, or (TOKENS > 1, Groups: each group's first row and row count) up to TOKENS
        consecutive rows of one prefill chunk: their queries are the tile's rows
        (token-major), so a key tile loaded once serves them all, each row masked to its
        own length."""
        if PDL:  # every input may come from the kernel before
            gdc_wait()
            gdc_launch_dependents()
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        if TOKENS == 1:
            row0 = tl.program_id(0)
            count = 1
        else:
            row0 = tl.load(Groups + tl.program_id(0))
            count = tl.load(Groups + sg + tl.program_id(0))
        r = tl.arange(0, BLOCK_M)
        in_use = r // GROUP < count
        rows = row0 + r // GROUP
        heads = kv_head * GROUP + r % GROUP
        lengths = tl.load(Lengths + rows, mask=in_use, other=0)
        end = tl.max(lengths, 0)  # the group's keys: its longest row's
        start = split * span
        if start < end:  # else the group has no position for this program
            slot = tl.load(Slots + row0)  # a group's rows share their slot
            d = tl.arange(0, DIM)
            q_at = Q + rows[:, None] * sq_row + heads[:, None] * sq_head
            if ROPE:
                q = _load_rotated(q_at, (lengths - 1)[:, None], in_use[:, None], Cos, Sin, DIM)
            else:
                q = tl.load(q_at + d[None, :], mask=in_use[:, None], other=0.0)
            k_base = K + slot.to(tl.int64) * sk_slot + kv_head * sk_head
            v_base = V + slot.to(tl.int64) * sv_slot + kv_head * sv_head
            if not STORED:
                # A decode row's new token, at position last: stored by the program whose
                # span holds it, which then loads it with the others (its loads follow the
                # barrier). STORED: in the cache already.
                last = end - 1
                if last // span == split:
                    k_at = Knew + row0 * skn_row + kv_head * skn_head
                    k_new = _load_rotated(k_at, last, last >= 0, Cos, Sin, DIM) if ROPE else tl.load(k_at + d)
                    tl.store(k_base + last * sk_pos + d, k_new)
                    tl.store(v_base + last * sv_pos + d,
                             tl.load(Vnew + row0 * svn_row + kv_head * svn_head + d))
                tl.debug_barrier()
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            total = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, DIM], tl.float32)
            # One loop over the span's tiles: the pipeliner loads the next tiles while
            # this one computes.
            for t in tl.range(0, tl.cdiv(tl.minimum(end - start, span), BLOCK_N), num_stages=STAGES):
                n = start + t * BLOCK_N + tl.arange(0, BLOCK_N)
                cached = n < end
                k = tl.load(k_base + n[:, None] * sk_pos + d[None, :], mask=cached[:, None], other=0.0)
                v = tl.load(v_base + n[:, None] * sv_pos + d[None, :], mask=cached[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
                s = tl.where(n[None, :] < lengths[:, None], s * scale, float("-inf"))
                # A tile past a row's end leaves its m, total and acc as they were
                # (exp(-inf) = 0, alpha = 1); a row with no key yet (a chunk's row
                # before the group's last span) keeps zeros: m_safe avoids inf - inf.
                m_new = tl.maximum(m, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m - m_safe)
                total = total * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m = m_new
            # Only the rows' own spans are stored: the merge reads no others.
            keep = in_use & (start < lengths)
            tl.store(Partial + rows[:, None] * sp_row + heads[:, None] * sp_head
                     + split * sp_split + d[None, :], acc / total[:, None], mask=keep[:, None])
            tl.store(Lse + rows * sl_row + heads * sl_head + split, m + tl.log(total), mask=keep)

    @triton.jit
    def _store_kernel(Knew, Vnew, K, V, Slots, Lengths, Cos, Sin,
                      skn_row, skn_head, svn_row, svn_head,
                      sk_slot, sk_head, sk_pos, sv_slot, sv_head, sv_pos,
                      DIM: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr):
        """Each row's new key (rotated) and value, stored at position length - 1 of its slot."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        last = tl.load(Lengths + row) - 1
        slot = tl.load(Slots + row).to(tl.int64)
        d = tl.arange(0, DIM)
        k_at = Knew + row * skn_row + kv_head * skn_head
        k = _load_rotated(k_at, last, last >= 0, Cos, Sin, DIM) if ROPE else tl.load(k_at + d)
        tl.store(K + slot * sk_slot + kv_head * sk_head + last * sk_pos + d, k)
        tl.store(V + slot * sv_slot + kv_head * sv_head + last * sv_pos + d,
                 tl.load(Vnew + row * svn_row + kv_head * svn_head + d))

    @triton.jit
    def _load_rotated(at, position, mask, Cos, Sin, DIM: tl.constexpr):
        """The head vectors at `at` (each one's first element) rotated to `position`:
        x * cos + rotate_half(x) * sin in float32, rounded once (as torch.compile does)."""
        d = tl.arange(0, DIM)
        x = tl.load(at + d, mask=mask, other=0.0)
        x_swap = tl.load(at + (d + DIM // 2) % DIM, mask=mask, other=0.0)
        cos = tl.load(Cos + position * DIM + d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(Sin + position * DIM + d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.where(d < DIM // 2, -sin, sin)
        return (x.to(tl.float32) * cos + x_swap.to(tl.float32) * sin).to(x.dtype)

    @triton.jit
    def _merge_kernel(Partial, Lse, Out, Lengths,
                      sp_row, sp_head, sp_split, sl_row, sl_head, so_row, so_head, span,
                      SPLITS_PAD: tl.constexpr, DIM: tl.constexpr,
                      PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, DIM)
        used = s * span < tl.load(Lengths + row)  # every used span saw a position
        lse = tl.load(Lse + row * sl_row + head * sl_head + s, mask=used, other=float("-inf"))
        weight = tl.exp(lse - tl.max(lse, 0))
        parts = tl.load(Partial + row * sp_row + head * sp_head + s[:, None] * sp_split + d[None, :],
                        mask=used[:, None], other=0.0)
        out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(Out + row * so_row + head * so_head + d, out.to(Out.dtype.element_ty))
