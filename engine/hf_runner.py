"""Fallback for architectures without a compact forward: transformers' own forward.

Slower (one sequence per forward call, a DynamicCache per slot) but correct, with the same
interface as CompactLM, rollback included: a call that starts before the end of the
slot's cache crops the cache there first.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from transformers import DynamicCache

from .loader import HFModule


class HFRunner:
    def __init__(self, hf_model: HFModule, n_slots: int) -> None:
        self.model = hf_model
        self.device = next(hf_model.parameters()).device
        self.n_slots = n_slots
        self.vocab_size = hf_model.config.vocab_size
        self._past: dict[int, DynamicCache] = {}
        # transformers renames `past_key_values` to `cache` in newer releases.
        params = inspect.signature(hf_model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def _feed(self, slot: int, start: int, token_ids: list[int]) -> Tensor:
        past = self._past.get(slot) if start else None
        if past is None:
            past = DynamicCache()
        elif past.get_seq_length() > start:
            past.crop(start)  # a rollback since the last call
        ids = torch.tensor([token_ids], device=self.device)
        logits = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: past}).logits
        self._past[slot] = past  # filled in place by the forward
        return logits[0, -1]

    def prefill(self, chunks: list[tuple[int, int, list[int]]], sample: list[bool]) -> Tensor:
        out = [self._feed(*c) for c in chunks]
        kept = [o for o, s in zip(out, sample, strict=True) if s]
        return torch.stack(kept) if kept else torch.empty(0, self.vocab_size, device=self.device)

    def decode(self, ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        return torch.stack([self._feed(s, p, [t]) for t, p, s in
                            zip(ids.tolist(), positions.tolist(), slots.tolist(), strict=True)])
