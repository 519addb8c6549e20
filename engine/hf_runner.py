"""Fallback runner for architectures without a compact forward: transformers' own forward.

Slower (one sequence per forward call, a DynamicCache per slot) but correct, with the
same interface as CompactLM, rollback included (the cache is cropped to the slot length).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from transformers import DynamicCache

from .kv_cache import Slots


class HFRunner:
    def __init__(self, hf_model: torch.nn.Module, n_slots: int) -> None:
        self.model = hf_model
        self.device = next(hf_model.parameters()).device
        self.cache = Slots(n_slots)
        self._past: dict[int, DynamicCache] = {}
        # transformers renames `past_key_values` to `cache` in newer releases.
        params = inspect.signature(hf_model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], slot: int) -> Tensor:
        length = self.cache.lengths[slot]
        past = self._past.get(slot) if length else None
        if past is None:
            past = DynamicCache()
        elif past.get_seq_length() > length:
            past.crop(length)  # a rollback since the last call
        ids = torch.tensor([token_ids], device=self.device)
        logits = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: past}).logits
        self._past[slot] = past  # filled in place by the forward
        self.cache.lengths[slot] = length + len(token_ids)
        return logits[0, -1]

    def decode(self, token_ids: list[int], slots: list[int]) -> Tensor:
        return torch.stack([self.prefill([t], s) for t, s in zip(token_ids, slots, strict=True)])
