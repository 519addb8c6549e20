"""Next-token choice per sequence: greedy, or temperature / top-k / top-p with its own RNG.

Each sequence draws from its own generator, so a seeded request samples the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

import secrets

import torch
from torch import Tensor

from .sequence import Sampling


def make_generator(sampling: Sampling, device: torch.device) -> torch.Generator | None:
    if sampling.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(sampling.seed if sampling.seed is not None else secrets.randbits(63))
    return gen


def sample(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One token from one row of logits."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = cum - torch.softmax(sorted_logits, -1) >= sampling.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs, 1, generator=generator))
