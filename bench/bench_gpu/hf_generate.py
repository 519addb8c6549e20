"""Phase `hf_generate`: transformers' `generate` at batch 1 on a static cache, compiled as
its generate compiles its decode step (CUDA graphs), or by torch.compile of the forward
(--hf-compile forward): the single-stream baseline."""

from __future__ import annotations

import time
from argparse import Namespace

from .workload import load_hf, prompt_ids, prompts


def phase_hf_generate(args: Namespace) -> dict:
    import torch

    model, tok, device = load_hf(args.model_dir)
    ids = torch.tensor([prompt_ids(tok, prompts(args.model_dir, 1, args.tiny)[0])], device=device)
    if device == "cuda" and args.hf_compile == "forward":
        # transformers' generate compiles its decode step itself on a static cache (its
        # CompileConfig: reduce-overhead, CUDA graphs), the default here: on one H200, back to
        # back, 141 tokens/s against 76 with our torch.compile of the whole forward (inductor
        # alone: our mode="reduce-overhead" failed inside the static cache's update).
        model.forward = torch.compile(model.forward, fullgraph=True)
    kw = {"max_new_tokens": args.max_tokens, "min_new_tokens": args.max_tokens, "do_sample": False,
          "cache_implementation": "static", "attention_mask": torch.ones_like(ids)}
    t = time.perf_counter()
    model.generate(ids, **kw)  # compiles
    compile_s = time.perf_counter() - t
    runs = []
    for _ in range(2):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - t))
    return {"tokens_per_s": max(runs), "first_call_s": compile_s, "new_tokens": args.max_tokens,
            "compile": args.hf_compile, **_dynamo_counts()}


def _dynamo_counts() -> dict:
    """How many graphs torch.compile made and where it broke them (a baseline whose decode
    step is cut into pieces, or not graphed, is not the one its name promises)."""
    from torch._dynamo.utils import counters  # internal, but what TORCH_LOGS reports from

    return {"compiled_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}
