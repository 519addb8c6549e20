"""The compact forward against transformers' own, batch invariance, and the fallback runner."""

from __future__ import annotations

import asyncio

import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoModelForCausalLM

from finsieve.client import chat_request
from finsieve.engine.engine import EngineLimits, LLMEngine
from finsieve.engine.hf_runner import HFRunner
from finsieve.engine.loader import LoadedModel

from conftest import text_of


def _hf_greedy(hf_model, tokenizer, question: str, n: int) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                            do_sample=False, min_new_tokens=n)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_compact_forward_matches_transformers_greedy(engine, default_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    question = "What is compound interest?"
    ours = text_of(engine.generate(chat_request("c", question, max_tokens=24)))
    assert ours == _hf_greedy(hf, engine.tokenizer, question, 24)


def test_decode_logits_do_not_depend_on_the_rest_of_the_batch(engine):
    runner = engine.runner
    prompts = [engine.tokenizer(f"Question number {i} about money").input_ids for i in range(5)]
    slots = [runner.cache.allocate() for _ in prompts]
    try:
        for ids, slot in zip(prompts, slots, strict=True):
            runner.prefill(ids, slot)
        alone = runner.decode([42], slots[:1])
        runner.cache.truncate(slots[0], runner.cache.lengths[slots[0]] - 1)
        together = runner.decode([42, 7, 8, 9, 10], slots)
        assert torch.equal(alone[0], together[0])
    finally:
        for slot in slots:
            runner.cache.release(slot)


def test_rollback_by_truncation_reproduces_the_same_logits(engine):
    runner = engine.runner
    slot = runner.cache.allocate()
    try:
        runner.prefill(engine.tokenizer("The bank said").input_ids, slot)
        first = runner.decode([11], [slot])
        runner.decode([12], [slot])
        runner.cache.truncate(slot, runner.cache.lengths[slot] - 2)
        again = runner.decode([11], [slot])
        assert torch.equal(first, again)
    finally:
        runner.cache.release(slot)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory, engine):
    """A real model directory of an architecture the compact forward does not cover."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(engine.tokenizer), n_positions=256, n_embd=64,
                        n_layer=2, n_head=4, eos_token_id=2, bos_token_id=1)
    GPT2LMHeadModel(config).save_pretrained(path)
    engine.tokenizer.save_pretrained(path)
    return path


def test_other_architectures_fall_back_to_transformers_forward(tiny_gpt2):
    from finsieve.engine.loader import load_model

    cpu = torch.device("cpu")
    model: LoadedModel = load_model(str(tiny_gpt2), tiny_gpt2, cpu)
    eng = LLMEngine(model, EngineLimits(max_batch=2, max_context=128, default_max_tokens=8), cpu)
    assert isinstance(eng.runner, HFRunner)
    events = eng.generate(chat_request("g", "Hello there", max_tokens=12))
    assert events[-1].finished.usage.completion_tokens == 12
    assert text_of(events) == _hf_greedy(model.hf_model, model.tokenizer, "Hello there", 12)


def test_health_and_reflection_are_served(server):
    import grpc

    async def go():
        async with grpc.aio.insecure_channel(server.target) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="finsieve.v1.Gateway"))
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)

            async def ask():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            async for reply in stub.ServerReflectionInfo(ask()):
                return health, {s.name for s in reply.list_services_response.service}

    health, services = asyncio.run(go())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert {"finsieve.v1.Gateway", "grpc.health.v1.Health"} <= services
