"""The engine's limits and switches, as the server's settings give them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLimits:
    max_batch: int
    max_context: int
    default_max_tokens: int
    batch_invariant: bool = True
    max_rollbacks: int = 8
    max_waiting: int = 256
    prefill_chunk: int = 2048
    gpu_memory_utilization: float = 0.9
    compile: bool = True  # CUDA only
    cuda_graphs: bool = True  # CUDA only
    # CUDA only, mixed steps off: where a step's chunks share one forward (on the CPU, and for
    # the transformers fallback, each chunk runs alone and costs its tokens, so waiting would
    # gain nothing)
    prompt_batch_tokens: int = 1024
    prompt_wait_steps: int = 16
    prepare_workers: int = 2  # processes that prepare requests (preparer.py); 0: the caller's thread
    # CUDA only (the compact forward): prompt tokens a step with decode rows feeds as rows of
    # their forward; 0: off. (On the CPU a prompt's chunks would then depend on the batch.)
    mixed_tokens: int = 256
    # On the CPU a step's prefill is at most this many tokens (and at most prefill_chunk): a
    # chunk of 2,048 tokens held every running stream for seconds there, and a step of 32
    # stays near 0.25 s on two cores (bench/bench_cpu.py's burst).
    cpu_prefill_chunk: int = 32
