"""Slot KV cache: one fixed region per live sequence.

A sequence owns a slot from admission to finish, and its cache is the first `kv_len`
positions of that slot (the scheduler keeps the length, per sequence). Rolling a sequence
back (SAR) is setting that length: the positions past it are overwritten by the next
forward pass. One extra slot, past the last, takes the writes of padding rows (a CUDA
graph runs a fixed batch size).
"""

from __future__ import annotations

import torch

Chunk = tuple[int, int, list[int]]  # a prompt's piece: (slot, first KV position, token ids)


class SlotKVCache:
    """One K and one V tensor: (layer, slot, kv_head, position, head_dim)."""

    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (n_layers, n_slots + 1, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_slots = n_slots
        self.scratch = n_slots  # the padding rows' slot
        self.max_len = max_len

    @staticmethod
    def bytes_per_slot(n_layers: int, n_kv_heads: int, max_len: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return 2 * n_layers * n_kv_heads * max_len * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
