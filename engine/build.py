"""The forward and its runner, built once at start-up: compiled and in CUDA graphs where
that works, each failure falling back one feature at a time (a compiler or capture failure
must not stop the service)."""

from __future__ import annotations

from typing import NamedTuple

import structlog
import torch

from finsieve.errors import ModelLoadError

from .hf_runner import HFRunner
from .limits import EngineLimits
from .llamacpp import LlamaCppModel
from .loader import LoadedModel
from .model import SUPPORTED_ARCHITECTURES, CompactLM
from .model_runner import ModelRunner

log = structlog.get_logger(__name__)


class Features(NamedTuple):
    """One way to run the compact forward, from the fastest to the safest."""

    compiled: bool
    graphs: bool
    kernels: bool  # the Triton decode attention and the varlen flash prefill
    one_row: bool  # the GEMVs of one-row steps


def build(model: LoadedModel, limits: EngineLimits, device: torch.device,
          max_context: int) -> tuple[CompactLM | HFRunner | LlamaCppModel, ModelRunner, str]:
    """The forward, its runner, and the mode they run in (for the logs and engine info)."""
    if model.gguf is not None:  # the CPU's fast path: llama.cpp's forward over the GGUF
        llama = LlamaCppModel(model.gguf, limits.max_batch, max_context,
                              max(limits.cpu_prefill_chunk, limits.max_batch),
                              torch.get_num_threads())
        if len(model.tokenizer) > llama.vocab_size:  # see load_model: ids past the logits
            raise ModelLoadError(f"--model {model.path}: the tokenizer has {len(model.tokenizer)} "
                                 f"tokens and the GGUF's vocabulary {llama.vocab_size}")
        llama.warm_up()
        return llama, ModelRunner(llama, device), "llama.cpp"
    hf = model.hf_model
    if hf.config.model_type not in SUPPORTED_ARCHITECTURES:
        log.warning("no compact forward for this architecture; using transformers' forward",
                    architecture=hf.config.model_type)
        runner_model = HFRunner(hf, limits.max_batch)
        return runner_model, ModelRunner(runner_model, device), "transformers"
    compact = _compact(model, limits, device, max_context)
    # What the model could do, before a try switches any of it off.
    attention_kernel, varlen = compact.attention_kernel, compact.varlen_prefill
    for features in _tries(limits, device, compact.gemv):
        try:
            runner = _runner(compact, features, limits, device, attention_kernel, varlen)
        except Exception as e:  # a compiler or capture failure must not stop the service
            log.warning("falling back", compiled=features.compiled, cuda_graphs=features.graphs,
                        kernels=features.kernels, gemv_one_row=features.one_row,
                        error=repr(e)[:800])
            continue
        return compact, runner, _mode(features, compact, runner)
    raise RuntimeError("no runner could be built")


def _compact(model: LoadedModel, limits: EngineLimits, device: torch.device,
             max_context: int) -> CompactLM:
    cuda = device.type == "cuda"
    # On the CPU, fixed matmul tiles make decoding independent of the batch (model.py).
    row_tile = 8 if not cuda and limits.batch_invariant else 0
    compact = CompactLM(model.hf_model, limits.max_batch, max_context, row_tile,
                        own_weights=cuda, memory_fraction=limits.gpu_memory_utilization if cuda else None,
                        prefill_tokens=limits.prefill_chunk,
                        mixed_tokens=limits.mixed_tokens if cuda else 0)
    if cuda:
        log.info("kv cache", slots=compact.n_slots, positions_per_slot=max_context,
                 gib=round(compact.cache.nbytes / 2**30, 2),
                 free_gib=round(torch.cuda.mem_get_info(device)[0] / 2**30, 1))
    return compact


def _tries(limits: EngineLimits, device: torch.device, gemv: bool) -> list[Features]:
    """The features to try in turn (each distinct once): on the CPU only the plainest."""
    if device.type != "cuda":
        return [Features(False, False, False, False)]
    compile_, graphs = limits.compile, limits.cuda_graphs
    tries = [Features(compile_, graphs, True, gemv), Features(compile_, graphs, True, False),
             Features(False, graphs, True, False), Features(False, False, True, False),
             Features(False, False, False, False)]
    return list(dict.fromkeys(tries))


def _runner(compact: CompactLM, features: Features, limits: EngineLimits,
            device: torch.device, attention_kernel: bool, varlen: bool) -> ModelRunner:
    """The runner with these features, warmed up on CUDA (raises where they fail)."""
    cuda = device.type == "cuda"
    compact.set_compiled(features.compiled)
    compact.attention_kernel = attention_kernel and features.kernels
    compact.varlen_prefill = varlen and features.kernels
    compact.gemv = features.one_row
    # Mixed steps need the attention kernel: the per-row SDPA path would run one attention
    # per prompt token and layer.
    runner = ModelRunner(compact, device, features.graphs,
                         limits.prefill_chunk if compact.varlen_prefill else 0,
                         limits.mixed_tokens if cuda and features.kernels else 0)
    if cuda:
        runner.warm_up()
    return runner


def _mode(features: Features, compact: CompactLM, runner: ModelRunner) -> str:
    parts = ["compiled" if features.compiled else "eager"]
    for on, name in ((features.graphs, "cuda-graphs"), (features.kernels, "triton-attention"),
                     (features.one_row, "gemv-one-row"), (compact.varlen_prefill, "varlen-prefill"),
                     (runner.prefill_graphs is not None, "prefill-graphs"),
                     (bool(runner.mixed_rows), "mixed-steps")):
        if on:
            parts.append(name)
    return "+".join(parts)
