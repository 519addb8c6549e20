"""Phase `model`: the benchmark's random Qwen2-7B-shaped model (TINY with --tiny) saved as a
Hugging Face directory (--work/model) with the tokenizer's files, for the phases after it."""

from __future__ import annotations

from argparse import Namespace

from .workload import save_model


def phase_model(args: Namespace) -> dict:
    return save_model(args.model_dir, args.tokenizer, args.tiny)
