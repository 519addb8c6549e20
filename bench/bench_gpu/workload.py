"""What the GPU benchmark runs, for it and for the other benches that measure the same
thing (bench_host, bench_one_row): the Qwen2-7B-shaped model with random weights, the
prompts, and the rules ("rules on": the default packs plus 10,000 synthetic literals)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from .harness import REPO

QWEN2_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 49152,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")
DEFAULT_TOKENIZER = REPO / ".finsieve/models/SmolLM2-135M-Instruct"


def random_model(device: str, tiny: bool = False) -> Any:
    """The benchmark's Qwen2 model (QWEN2_7B, or TINY) with random weights, seeded, on
    `device`: bfloat16 on CUDA, float32 on the CPU."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cuda = device == "cuda"
    config = Qwen2Config(**(TINY if tiny else QWEN2_7B), bos_token_id=1, eos_token_id=2,
                         torch_dtype="bfloat16" if cuda else "float32")
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32)


def step_bytes(model: Any) -> int:
    """Weight bytes a decode step reads (one embedding row per token: none of the table)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "embed_tokens" not in n)


def save_model(model_dir: str | Path, tokenizer_dir: str | Path, tiny: bool) -> dict:
    """The random model saved as a Hugging Face directory with the tokenizer's files (on
    the GPU when there is one); the seconds it took and what a decode step reads."""
    import torch

    start = time.perf_counter()
    out = Path(model_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(device, tiny)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return {"seconds": time.perf_counter() - start, "weight_bytes_per_step": step_bytes(model),
            "matmul_params": params, "config": model.config.hidden_size}


def prompts(tokenizer_dir: str, n: int, tiny: bool) -> list[str]:
    """n user messages whose prompts are 128-512 tokens (32-64 with --tiny), spread evenly."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    words = [w for ln in (REPO / "tests/data/clean_corpus.txt").read_text().splitlines()
             if ln and not ln.startswith("#") and ln.isascii() for w in ln.split()]
    lo, hi = (32, 64) if tiny else (128, 512)
    out = []
    for i in range(n):
        target = lo + (i * 97) % (hi - lo + 1)

        def text(k: int, i: int = i) -> str:
            return "Summarise this note for a client: " + " ".join(
                words[(i * 13 + j) % len(words)] for j in range(k))

        low, high = 1, 2 * hi  # the fewest words whose prompt reaches the target
        while low < high:
            mid = (low + high) // 2
            if len(prompt_ids(tok, text(mid))) >= target:
                high = mid
            else:
                low = mid + 1
        out.append(text(low))
    return out


def prompt_ids(tok: Any, text: str) -> list[int]:
    """The engine's own prompt: the chat template, then the tokenizer (no extra specials)."""
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                     add_generation_prompt=True)
    return list(tok(prompt, add_special_tokens=False)["input_ids"])


def rules_dir(root: Path, tokenizer_dir: str, synthetic: bool = True) -> Path:
    """The default packs copied into root/rules (their guide left out), plus the 10,000
    synthetic literals of bench_rules' pack unless not `synthetic`."""
    from bench_rules import synthetic_pack  # a script beside this package (see __init__)

    d = root / "rules"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(REPO / "rules", d)
    for extra in d.glob("*.md"):
        extra.unlink()
    if synthetic:
        synthetic_pack(d, 10_000, 0)
    return d


def load_hf(model_dir: str, **kw: Any) -> tuple[Any, Any, str]:
    """The saved model through transformers (bf16 on CUDA, else float32, in eval mode), its
    tokenizer, and the device."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device, **kw)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir), device
