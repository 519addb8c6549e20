"""The engine on CUDA (make test-gpu). Random weights of the default model's shape, real tokenizer."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import torch

from finsieve.client import chat_request

from conftest import ChatStream, kinds, start_server, text_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    # Only the tokenizer files are needed; FINSIEVE_TEST_TOKENIZER points at a copy of them
    # where the converted default model is not at hand (the GPU machine).
    tok_dir = os.environ.get("FINSIEVE_TEST_TOKENIZER")
    if tok_dir is None:
        from finsieve.engine.loader import default_model_dir

        from conftest import MODEL_STATE

        tok_dir = str(default_model_dir(MODEL_STATE))
    path = tmp_path_factory.mktemp("llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tok_dir) / name).exists():
            shutil.copy(Path(tok_dir) / name, path / name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, rope_theta=100000.0,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_compact_forward_matches_transformers_on_cuda(random_llama):
    from transformers import AutoModelForCausalLM

    from finsieve.engine.model import CompactLM

    hf = AutoModelForCausalLM.from_pretrained(random_llama, dtype=torch.float32).cuda().eval()
    runner = CompactLM(hf, n_slots=2, max_len=256)
    ids = list(range(100, 140))
    slot = runner.cache.allocate()
    ours = runner.prefill(ids, slot)
    step = runner.decode([7], [slot])[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([[*ids, 7]], device="cuda")).logits[0]
    torch.testing.assert_close(ours, ref[-2], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(step, ref[-1], atol=2e-3, rtol=2e-3)


def test_server_streams_on_cuda(tmp_path, random_llama):
    srv = start_server(tmp_path, "--device", "cuda", "--model", str(random_llama))

    async def go():
        async with ChatStream(srv.target) as s:
            for i in range(4):
                s.send(chat_request(f"q{i}", f"Question {i} about bonds?", max_tokens=24))
            return await s.until_done(*(f"q{i}" for i in range(4)))

    try:
        result = asyncio.run(go())
    finally:
        assert srv.stop() == 0
    for events in result.values():
        assert kinds(events)[0] == "started" and kinds(events)[-1] == "finished"
        assert events[-1].finished.usage.completion_tokens > 0
        assert isinstance(text_of(events), str)
    assert '"device": "cuda' in srv.log()


def test_rollback_by_truncation_reproduces_logits_on_cuda(random_llama):
    from transformers import AutoModelForCausalLM

    from finsieve.engine.model import CompactLM

    hf = AutoModelForCausalLM.from_pretrained(random_llama, dtype=torch.bfloat16).cuda().eval()
    runner = CompactLM(hf, n_slots=2, max_len=256)
    slot = runner.cache.allocate()
    runner.prefill(list(range(100, 130)), slot)
    first = runner.decode([11], [slot])
    runner.decode([12], [slot])
    runner.cache.truncate(slot, runner.cache.lengths[slot] - 2)  # SAR: two tokens back
    torch.testing.assert_close(runner.decode([11], [slot]), first, atol=0, rtol=0)
