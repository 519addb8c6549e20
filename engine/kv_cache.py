"""Slot KV cache: one fixed region per live sequence, and a length per slot.

A sequence owns a slot from admission to finish. Its cache is the first `lengths[slot]`
positions of that slot, so rolling a sequence back (SAR) is setting its length: the
positions past it are overwritten by the next forward pass.
"""

from __future__ import annotations

import torch


class Slots:
    """Which slots are free, and how many positions each live one holds."""

    def __init__(self, n_slots: int) -> None:
        self.lengths = [0] * n_slots
        self._free = list(range(n_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)

    def truncate(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length


class SlotKVCache(Slots):
    """Slots backed by one K and one V tensor: (layer, slot, kv_head, position, head_dim)."""

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(n_slots)
        shape = (n_layers, n_slots, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
