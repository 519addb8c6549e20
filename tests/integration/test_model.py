"""The compact forward against transformers' own, batch invariance on both CPU paths (llama.cpp's,
the default, and the float32 reference), and the fallback runner."""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoModelForCausalLM

from engine.attention import VarlenKeys, chunk_groups
from engine.engine import EngineLimits, LLMEngine
from engine.hf_runner import HFRunner
from engine.loader import LoadedModel
from engine.sampler import SamplingRows
from finsieve.app.client import chat_request

from support.streams import text_of


def _hf_greedy(hf_model, tokenizer, question: str, n: int) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                            do_sample=False, min_new_tokens=n)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_compact_forward_matches_transformers_greedy(float32_engine, default_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    question = "What is compound interest?"
    ours = text_of(float32_engine.generate(chat_request("c", question, max_tokens=24)))
    assert ours == _hf_greedy(hf, float32_engine.tokenizer, question, 24)


def test_the_default_model_runs_on_llama_cpp_and_the_float32_path_on_request(engine, float32_engine):
    from engine.llamacpp import LlamaCppModel
    from engine.model import CompactLM

    assert isinstance(engine.model, LlamaCppModel) and engine.mode == "llama.cpp"
    assert isinstance(float32_engine.model, CompactLM)


BOTH_PATHS = pytest.mark.parametrize("path", ["engine", "float32_engine"])


def _decode(model, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
    return model.decode(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots))


@BOTH_PATHS
def test_decode_logits_do_not_depend_on_the_rest_of_the_batch(request, path):
    engine = request.getfixturevalue(path)
    model = engine.model
    prompts = [engine.tokenizer(f"Question number {i} about money").input_ids for i in range(5)]
    # one neighbour far longer: attention reads more cache positions in the batch than alone
    prompts[4] = engine.tokenizer("A long record of trades. " * 60).input_ids
    slots = list(range(5))
    model.prefill([(s, 0, ids) for s, ids in zip(slots, prompts, strict=True)], [False] * 5)
    lengths = [len(ids) for ids in prompts]
    alone = _decode(model, [42], lengths[:1], slots[:1])
    together = _decode(model, [42, 7, 8, 9, 10], lengths, slots)
    assert torch.equal(alone[0], together[0])


@BOTH_PATHS
def test_rollback_by_truncation_reproduces_the_same_logits(request, path):
    engine = request.getfixturevalue(path)
    model = engine.model
    ids = engine.tokenizer("The bank said").input_ids
    model.prefill([(0, 0, ids)], [False])
    n = len(ids)
    first = _decode(model, [11], [n], [0])
    _decode(model, [12], [n + 1], [0])
    again = _decode(model, [11], [n], [0])  # SAR: the length is set back by two tokens
    assert torch.equal(first, again)


@BOTH_PATHS
def test_chunked_prefill_gives_the_logits_of_a_whole_prefill(request, path):
    engine = request.getfixturevalue(path)
    model = engine.model
    ids = engine.tokenizer("Explain, step by step, how a mortgage is paid off over thirty years "
                           "and what an amortization table shows.").input_ids
    whole = model.prefill([(0, 0, ids)], [True])
    cut = [0, 5, 6, 17, len(ids)]
    chunks = [(1, a, ids[a:b]) for a, b in itertools.pairwise(cut)]
    last = [model.prefill([c], [i == len(chunks) - 1]) for i, c in enumerate(chunks)][-1]
    torch.testing.assert_close(last, whole, atol=1e-4, rtol=1e-4)
    assert int(last.argmax()) == int(whole.argmax())


def _mixed_step(engine) -> tuple[list, list, list]:
    """Two decode rows (slots 0, 1), a fresh chunk (slot 2, sampled), one that does not end
    its prompt (slot 4, between the sampled ones) and a chunk continuing a prefix (slot 3,
    sampled): StepRow fields."""
    tok = engine.tokenizer
    a, b = tok("The bank said").input_ids, tok("Interest rates rose").input_ids
    c = tok("A bond ladder spreads maturities over several years").input_ids
    d, e = tok("What is an index fund?").input_ids, tok("Dividends are paid").input_ids
    engine.model.prefill([(0, 0, a), (1, 0, b), (3, 0, c[:5])], [False] * 3)
    decode = [(0, len(a), [42]), (1, len(b), [7])]
    chunks = [(2, 0, d), (4, 0, e), (3, 5, c[5:])]
    return decode, chunks, [True, False, True]


def test_a_mixed_step_gives_the_logits_of_decode_rows_and_prefill_apart(float32_engine):
    """Prefill chunks fed as rows of the decode forward, beside decode rows (a mixed step):
    each chunk's tokens attend to its slot's prefix and to each other, causally."""
    engine = float32_engine
    model = engine.model
    decode, chunks, sample = _mixed_step(engine)
    tokens, positions, slots = zip(*[(toks[0], start, slot) for slot, start, toks in decode], strict=True)
    apart = torch.cat([_decode(model, list(tokens), list(positions), list(slots)),
                       model.prefill(chunks, sample)])
    cache = [c.clone() for c in (*model.cache.k, *model.cache.v)]
    rows = [(t, p + i, s) for s, p, toks in decode + chunks for i, t in enumerate(toks)]
    ids, positions, slots = (torch.tensor(x) for x in zip(*rows, strict=True))
    ends = np.cumsum([len(toks) for _, _, toks in chunks]) + len(decode) - 1
    heads = torch.tensor([0, 1, *ends[np.asarray(sample)]])
    mixed = model.decode(ids, positions, slots, heads)
    torch.testing.assert_close(mixed, apart, atol=1e-4, rtol=1e-4)
    assert mixed.argmax(-1).tolist() == apart.argmax(-1).tolist()
    for now, then in zip((*model.cache.k, *model.cache.v), cache, strict=True):
        torch.testing.assert_close(now, then, atol=1e-4, rtol=1e-4)


def test_the_runner_samples_a_mixed_step_as_decode_and_prefill_apart(float32_engine, monkeypatch):
    """Through ModelRunner.launch: one forward (the prefill entry point is never called)."""
    from engine.model_runner import ModelRunner, StepRow

    engine = float32_engine
    decode, chunks, sample = _mixed_step(engine)
    rows = [StepRow(slot, start, toks, sample=s)
            for (slot, start, toks), s in zip(decode + chunks, [True, True, *sample], strict=True)]
    apart = engine.runner.launch(rows).tokens()
    mixed_runner = ModelRunner(engine.model, torch.device("cpu"), mixed_tokens=64)

    def refused(*args, **kwargs):
        raise AssertionError("a mixed step ran a prefill forward")

    monkeypatch.setattr(engine.model, "prefill", refused)
    assert mixed_runner.launch(rows).tokens() == apart
    assert len(apart) == 4


def test_a_ban_past_the_models_vocabulary_leaves_the_other_rows_alone(engine):
    """Bans the tokenizer can name but the model cannot produce (ids >= its vocab size)
    change nothing: not the next row's token (a flat index past row 0 is row 1's), and
    the last row's do not fail the step."""
    from engine.model_runner import StepRow

    prompts = [engine.tokenizer(t).input_ids for t in ("The bank said", "Interest rates are")]
    free = engine.runner.launch([StepRow(s, 0, ids) for s, ids in enumerate(prompts)]).tokens()
    vocab = engine.model.vocab_size
    second = free[1][0]  # row 1's greedy token: vocab + second is its flat index
    rows = [StepRow(0, 0, prompts[0], bans=[vocab + second]), StepRow(1, 0, prompts[1])]
    assert engine.runner.launch(rows).tokens() == free
    rows = [StepRow(0, 0, prompts[0]), StepRow(1, 0, prompts[1], bans=[vocab, vocab + 1])]
    assert engine.runner.launch(rows).tokens() == free


def test_silu_mul_on_the_cpu_is_the_torch_expression_and_compiles_without_a_break():
    """The batch-invariant path keeps F.silu(gate) * up bit for bit; traced whole for dynamic
    shapes (as the CUDA layers are compiled: its fake shape serves), the op gives the same
    values at another row count."""
    import torch.nn.functional as F

    from engine.activation import silu_mul

    x = torch.randn(5, 2 * 96, dtype=torch.bfloat16)
    gate, up = x.chunk(2, -1)
    assert torch.equal(silu_mul(x), F.silu(gate) * up)
    compiled = torch.compile(lambda t: silu_mul(t * 2), dynamic=True, fullgraph=True,
                             backend="aot_eager")
    compiled(x)
    y = torch.randn(9, 2 * 96, dtype=torch.bfloat16)
    assert torch.equal(compiled(y), silu_mul(y * 2))


def test_varlen_keys_are_each_chunks_slot_prefix():
    """The index the CUDA prefill gathers keys with: each chunk's slot, positions 0 to its end."""
    cache = torch.randn(4, 2, 16, 3)
    chunks = [(2, 0, 5), (0, 7, 2), (3, 15, 1)]
    slots, positions, cu_q, cu_k = map(torch.from_numpy, VarlenKeys.host_arrays(chunks))
    gathered = cache[slots, :, positions]
    assert cu_q.tolist() == [0, 5, 7, 8]
    for i, (slot, start, n) in enumerate(chunks):
        assert torch.equal(gathered[cu_k[i] : cu_k[i + 1]], cache[slot, :, : start + n].transpose(0, 1))


@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_a_mixed_steps_attention_groups_are_decode_rows_alone_and_runs_of_each_chunk(tokens):
    """Every row of the bucket in one group: each decode row alone, each chunk's rows in runs
    of at most `tokens` that never cross into the next chunk (the rows of a group share a
    slot), each padding row alone; the groups after them are empty."""
    n_decode, sizes, size = 3, [5, 1, 0, 9], 24
    groups = chunk_groups(n_decode, sizes, tokens, size)
    padding = size - n_decode - sum(sizes)
    # decode and padding rows own themselves (negative), a chunk's rows their chunk
    owner = np.concatenate([-1 - np.arange(n_decode), np.repeat(np.arange(len(sizes)), sizes),
                            -100 - np.arange(padding)])
    seen = []
    for first, count in groups.T:
        if count:
            rows = list(range(first, first + count))
            assert count <= (1 if owner[first] < 0 else tokens)
            assert len({owner[r] for r in rows}) == 1
            seen += rows
    assert seen == list(range(size))
    used = n_decode + sum(-(-n // tokens) for n in sizes) + padding
    assert (groups[1, :used] > 0).all() and not groups[:, used:].any()


def _varlen_reference(q, k_cache, v_cache, keys: VarlenKeys) -> torch.Tensor:
    """FlashAttention's varlen contract on the CPU: chunk i's queries q[cu_q[i]:cu_q[i+1]]
    attend its gathered keys causally, aligned to the last key."""
    k, v = k_cache[keys.slots, :, keys.positions], v_cache[keys.slots, :, keys.positions]
    out = torch.zeros_like(q)
    cu_q, cu_k = keys.cu_q.tolist(), keys.cu_k.tolist()
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:], strict=False):
        if q1 > q0:
            sees = torch.arange(k1 - k0)[None, :] <= torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
            out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(
                q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1),
                attn_mask=sees, enable_gqa=True).transpose(0, 1)
    return out


def test_the_padded_prefill_of_the_cuda_graphs_matches_the_eager_prefill(float32_engine, monkeypatch):
    """The fixed-shape inputs the CUDA graphs prefill from (a bucket's tokens, keys and
    chunks, padding in a dummy chunk of the scratch slot) give the logits and the cache of
    the eager prefill, and write nothing outside the chunks' slots but the scratch slot."""
    from engine import model as model_module
    from engine.cuda_graphs import PrefillGraphs

    model = float32_engine.model
    monkeypatch.setattr(model_module, "varlen_prefill", _varlen_reference)
    model.prefill([(3, 0, list(range(300, 340)))], [False])  # a prefix that one chunk continues
    chunks = [(0, 0, list(range(100, 150))), (1, 0, list(range(200, 207))),
              (3, 40, list(range(400, 420))), (2, 0, [5, 6, 7])]
    sample = [True, False, True, True]
    before = [c.clone() for c in (*model.cache.k, *model.cache.v)]
    eager = model.prefill(chunks, sample)
    eager_cache = [c.clone() for c in (*model.cache.k, *model.cache.v)]
    for c, b in zip((*model.cache.k, *model.cache.v), before, strict=True):
        c.copy_(b)
    graphs = PrefillGraphs(model, 256)
    t, layout = graphs.layout(chunks, sample)
    assert t == 128  # 80 tokens: the smallest bucket that holds them
    padded = graphs._forward(torch.from_numpy(layout), t)[: sum(sample)]
    torch.testing.assert_close(padded, eager, atol=1e-4, rtol=1e-4)
    scratch = model.cache.scratch
    for c, e, b in zip((*model.cache.k, *model.cache.v), eager_cache, before, strict=True):
        torch.testing.assert_close(c[:scratch], e[:scratch], atol=1e-4, rtol=1e-4)
        assert torch.equal(c[4:scratch], b[4:scratch])  # untouched slots


def test_a_step_takes_the_smallest_prefill_bucket_that_holds_it(float32_engine):
    """Tokens exactly a bucket, a chunk continuing at the end of its slot, a chunk for every
    slot; eager when no bucket can: more tokens than the largest, more cached keys than a
    slot holds, more chunks than the largest takes."""
    from engine.cuda_graphs import PrefillGraphs

    graphs = PrefillGraphs(float32_engine.model, 256)  # buckets 64, 128, 256; 8 slots: 9 chunks at most
    end = float32_engine.model.cache.max_len
    assert graphs.buckets == [64, 128, 256]
    assert graphs.layout([(0, 0, [1] * 64)], [True])[0] == 64
    assert graphs.layout([(0, end - 65, [1] * 64)], [True])[0] == 64
    assert graphs.layout([(s, 0, [1]) for s in range(8)], [True] * 8)[0] == 64
    assert graphs.layout([(0, 0, [1] * 257)], [True]) is None
    assert graphs.layout([(0, end - 10, [1] * 5), (1, 20, [1] * 5)], [True] * 2) is None
    assert graphs.layout([(s % 8, 0, [1, 2]) for s in range(9)], [True] * 9) is None


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
    from engine.loader import load_model

    cpu = torch.device("cpu")
    model: LoadedModel = load_model(str(tiny_gpt2), tiny_gpt2, cpu)
    eng = LLMEngine(model, EngineLimits(max_batch=2, max_context=128, default_max_tokens=8), cpu)
    assert isinstance(eng.model, HFRunner)
    events = eng.generate(chat_request("g", "Hello there", max_tokens=12))
    assert events[-1].finished.usage.completion_tokens == 12
    assert text_of(events) == _hf_greedy(model.hf_model, model.tokenizer, "Hello there", 12)


def test_health_is_open_and_reflection_needs_a_key(server):
    import grpc

    from finsieve.app.client import Credentials

    async def go(key: str):
        async with Credentials(key).channel(server.target) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="finsieve.v1.Gateway"))
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)

            async def ask():
                # Without a key the client sends nothing: grpcio's asyncio client reports
                # INTERNAL, not the server's status, when a write races the server's abort
                # (grpc/grpc#36066); the server refuses at the call's start either way.
                if key:
                    yield reflection_pb2.ServerReflectionRequest(list_services="")

            try:
                async for reply in stub.ServerReflectionInfo(ask()):
                    return health, {s.name for s in reply.list_services_response.service}
            except grpc.aio.AioRpcError as e:
                return health, e.code()

    health, services = asyncio.run(go(server.key("app")))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert {"finsieve.v1.Gateway", "grpc.health.v1.Health"} <= services
    health, refused = asyncio.run(go(""))  # probes need no key; everything else does
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert refused == grpc.StatusCode.UNAUTHENTICATED


def test_a_qwen2_directory_runs_on_the_compact_forward(tmp_path, engine):
    """Qwen2 differs from Llama by its q/k/v biases; greedy tokens must match transformers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engine.loader import load_model
    from engine.model import CompactLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=len(engine.tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=2, bos_token_id=1,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # random biases, so a forward that ignored them would differ
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    engine.tokenizer.save_pretrained(tmp_path)
    cpu = torch.device("cpu")
    loaded = load_model(str(tmp_path), tmp_path, cpu)
    eng = LLMEngine(loaded, EngineLimits(max_batch=2, max_context=128, default_max_tokens=8), cpu)
    assert isinstance(eng.model, CompactLM)
    events = eng.generate(chat_request("q", "Hello there", max_tokens=12))
    assert text_of(events) == _hf_greedy(loaded.hf_model, loaded.tokenizer, "Hello there", 12)


def test_a_tokenizer_with_more_tokens_than_the_embedding_is_refused_at_load(tmp_path, engine):
    """An added token past the embedding, typed into a prompt, would index past it (on CUDA a
    device-side assert that stops the engine): the model directory is refused, by name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.loader import load_model
    from finsieve.errors import ModelLoadError

    config = LlamaConfig(vocab_size=len(engine.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.save_pretrained(tmp_path)
    load_model(str(tmp_path), tmp_path, torch.device("cpu"))  # as many tokens as embeddings: fine
    tokenizer.add_tokens(["<not-in-the-embedding>"])
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"tokenizer has 49153 tokens and the model's embedding 49152"):
        load_model(str(tmp_path), tmp_path, torch.device("cpu"))


def _rows(n: int, **kw) -> SamplingRows:
    values = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "keys": 0, "bans": []} | kw
    return SamplingRows(*([values[k]] * n if k != "keys" else list(range(n))
                          for k in ("temperature", "top_k", "top_p", "keys", "bans")))


def test_top_k_1_and_a_tiny_top_p_sample_the_greedy_token():
    from engine.sampler import sample

    torch.manual_seed(3)
    logits = torch.randn(500).expand(300, 500)
    best = int(torch.argmax(logits[0]))
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        assert set(sample(logits, _rows(300, **kw), None)[0].tolist()) == {best}
    drawn = set(sample(logits, _rows(300, top_k=5), None)[0].tolist())
    assert drawn <= set(torch.topk(logits[0], 5).indices.tolist()) and len(drawn) > 1


def test_without_llama_cpp_the_default_model_is_prepared_for_the_float32_forward(tmp_path,
                                                                                 default_model_dir):
    """A host without the extra `cpu` (a CUDA engine, a plain pip install): preparing the
    default model says why no Q8_0 file is written, leaves no partial file, and loads."""
    target = tmp_path / "models" / default_model_dir.name
    target.mkdir(parents=True)
    for f in default_model_dir.iterdir():
        if f.suffix != ".gguf":
            (target / f.name).symlink_to(f)
    script = (
        "import sys; sys.modules['llama_cpp'] = None  # import llama_cpp fails\n"
        "from pathlib import Path\n"
        "import torch\n"
        "from engine.loader import default_model_dir, load_model\n"
        f"path = default_model_dir(Path({str(tmp_path)!r}))\n"
        "model = load_model(str(path), Path('.'), torch.device('cpu'))\n"
        "print('gguf', model.gguf, 'weights', model.hf_model is not None)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "FINSIEVE_LOG_FORMAT": "json"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gguf None weights True" in done.stdout
    assert "Q8_0 file is not written" in done.stdout + done.stderr
    assert sorted(p.name for p in target.iterdir()) == sorted(
        f.name for f in default_model_dir.iterdir() if f.suffix != ".gguf")
