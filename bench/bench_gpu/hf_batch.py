"""Phase `hf_batch`: transformers' continuous batching (`generate_batch`), 64 requests (at
most the largest level) of the benchmark's prompts: the many-stream baseline."""

from __future__ import annotations

import time
from argparse import Namespace

from .workload import load_hf, prompt_ids, prompts


def phase_hf_batch(args: Namespace) -> dict:
    from transformers import GenerationConfig

    model, tok, _ = load_hf(args.model_dir, attn_implementation="sdpa")
    n = min(64, max(args.levels))
    inputs = [prompt_ids(tok, t) for t in prompts(args.model_dir, n, args.tiny)]
    config = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    model.generate_batch(inputs=inputs[:4], generation_config=config)  # warm-up
    t = time.perf_counter()
    out = model.generate_batch(inputs=inputs, generation_config=config)
    wall = time.perf_counter() - t
    tokens = sum(len(o.generated_tokens) for o in out.values())
    errors = [o.error for o in out.values() if getattr(o, "error", None)]
    return {"requests": n, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "errors": errors[:3]}
