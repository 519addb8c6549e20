"""The engine on CUDA (make test-gpu). Random weights of the default model's shape, real tokenizer."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
from pathlib import Path

import pytest
import torch

from finsieve.app.client import chat_request

from support.servers import start_server
from support.streams import ChatStream, kinds, text_of

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
        from engine.loader import default_model_dir

        from support.paths import MODEL_STATE

        tok_dir = str(default_model_dir(MODEL_STATE))
    path = tmp_path_factory.mktemp("llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json"):
        if (Path(tok_dir) / name).exists():
            shutil.copy(Path(tok_dir) / name, path / name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, rope_theta=100000.0,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _hf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


def _engine(path: Path, dtype: torch.dtype, **limits):
    from transformers import AutoTokenizer

    from engine.engine import EngineLimits, LLMEngine
    from engine.loader import LoadedModel

    hf = _hf(path, dtype)
    model = LoadedModel("random", path, hf, AutoTokenizer.from_pretrained(path), frozenset({2}), 2048)
    values = {"max_batch": 64, "max_context": 512, "default_max_tokens": 32} | limits
    return LLMEngine(model, EngineLimits(**values), torch.device("cuda"))


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _attention_case(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, slots: list[int],
                    lengths: list[int], rope: list[torch.Tensor] | None) -> tuple:
    """q, k, v (as the forward hands them over: strided views of one wider row), a random
    cache of 6 slots of 1,024 positions, and the per-row path's result on the CPU in float32
    with the cache it wrote."""
    from engine.attention import decode_attention

    slots_t, lengths_t = (torch.tensor(x, device="cuda") for x in (slots, lengths))
    cache = [torch.randn(6, kv_heads, 1024, dim, device="cuda", dtype=dtype) for _ in range(2)]
    qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)
    q, k, v = qkv.view(len(slots), -1, dim).split([heads, kv_heads, kv_heads], 1)
    ref_cache = [c.float().cpu() for c in cache]
    ref = decode_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), *ref_cache,
                           slots_t.cpu(), lengths_t.cpu(), False, rope and [t.float().cpu() for t in rope])
    return (q, k, v, slots_t, lengths_t), cache, ref, ref_cache


def _assert_attends(out: torch.Tensor, cache: list[torch.Tensor], ref: torch.Tensor,
                    ref_cache: list[torch.Tensor], slots: list[int], lengths: list[int],
                    tolerance: float) -> None:
    """out is the per-row path's, and each row's new key (rotated) and value were written at
    its last position, and nothing else."""
    assert _relative_error(out.cpu(), ref) < tolerance
    (new_k, new_v), (ref_k, ref_v) = [c.float().cpu() for c in cache], ref_cache
    written = (torch.tensor(slots), slice(None), torch.tensor(lengths) - 1)
    assert _relative_error(new_k[written], ref_k[written]) < tolerance / 2
    assert torch.equal(new_v[written], ref_v[written])
    unwritten = ref_k.clone()
    for c in (new_k, unwritten):
        c[written] = 0
    assert torch.equal(new_k, unwritten)


def _rope_tables(dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    angles = torch.rand(1024, dim // 2, device="cuda") * 6.3
    return [torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin)]


def test_triton_decode_attention_matches_sdpa():
    """The kernel writes each row's new key and value at its last position, and nowhere else,
    and attends like SDPA over exactly the row's length; with RoPE tables, it rotates q and
    the new key as the per-row path does. As tuned, and with the rows' positions in one
    span a program, in three and in a span a tile (the new key's program then stores it
    and reads it back), each tile size."""
    from engine.attention import _triton_decode

    torch.manual_seed(0)
    slots, lengths = [3, 0, 5, 1, 2], [1, 255, 1024, 257, 700]
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for heads, kv_heads, dim in ((9, 3, 64), (28, 4, 128)):
            for rope in (None, _rope_tables(dim, dtype)):
                inputs, cache, ref, ref_cache = _attention_case(heads, kv_heads, dim, dtype, slots,
                                                                lengths, rope)
                q, k, v, slots_t, lengths_t = inputs
                for launch in ({}, {"programs": 1, "block_n": 32}, {"programs": 3, "block_n": 64},
                               {"programs": 32, "block_n": 32}, {"programs": 16, "block_n": 64}):
                    written = [c.clone() for c in cache]
                    out = _triton_decode(q, k, v, *written, slots_t, lengths_t, rope=rope, **launch)
                    _assert_attends(out, written, ref, ref_cache, slots, lengths, tolerance)


def test_triton_decode_attention_with_rows_sharing_a_slot_matches_sdpa():
    """A mixed step's rows: the tokens of prefill chunks, each attending to the ones before
    it in its slot, beside decode rows. Every new key (rotated) and value is stored first,
    at its row's position and nowhere else; the attention is the per-row path's, whether a
    chunk's rows attend alone or in groups (each reading a key tile once for all)."""
    from engine.attention import _triton_decode, chunk_groups

    torch.manual_seed(0)
    # decode rows in slots 3 and 5; a fresh chunk of 10 in slot 0, one continuing at 200 in slot 1
    slots = [3, 5, *[0] * 10, *[1] * 40]
    lengths = [300, 1024, *range(1, 11), *range(201, 241)]
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        rope = _rope_tables(128, dtype)
        inputs, cache, ref, ref_cache = _attention_case(28, 4, 128, dtype, slots, lengths, rope)
        q, k, v, slots_t, lengths_t = inputs
        # the rows alone, and each chunk's in groups of 2 and of 9 (the chunk's last shorter)
        for tokens, launch in itertools.product((0, 2, 9), ({}, {"programs": 1}, {"programs": 32})):
            groups = None if not tokens else \
                torch.from_numpy(chunk_groups(2, [10, 40], tokens, len(slots))).cuda()
            written = [c.clone() for c in cache]
            out = _triton_decode(q, k, v, *written, slots_t, lengths_t, rope=rope, shared=True,
                                 groups=groups, tokens=tokens, **launch)
            _assert_attends(out, written, ref, ref_cache, slots, lengths, tolerance)


def test_varlen_prefill_matches_sdpa_per_chunk():
    """One FlashAttention call for chunks of several slots, fresh and continued, attends like
    one SDPA per chunk (causal aligned to each chunk's last key, GQA)."""
    from engine.attention import VarlenKeys, prefill_attention, varlen_prefill

    torch.manual_seed(0)
    k_cache = torch.randn(6, 4, 1024, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    chunks = [(3, 0, 50), (0, 200, 37), (5, 1023, 1), (1, 64, 128), (2, 0, 1)]
    q = torch.randn(sum(n for _, _, n in chunks), 28, 128, device="cuda", dtype=torch.bfloat16)
    slots, positions, cu_q, cu_k = (torch.from_numpy(a).cuda() for a in VarlenKeys.host_arrays(chunks))
    keys = VarlenKeys(slots, positions, cu_q.int(), cu_k.int(), 128, 1024)
    ref = prefill_attention(q.float(), k_cache.float(), v_cache.float(), chunks)
    assert _relative_error(varlen_prefill(q, k_cache, v_cache, keys), ref) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_forward_matches_transformers_on_cuda(random_llama, dtype):
    from engine.model import CompactLM

    hf = _hf(random_llama, dtype)
    model = CompactLM(hf, n_slots=2, max_len=256)
    ids = list(range(100, 140))
    ours = model.prefill([(0, 0, ids)], [True])[0]
    step = model.decode(torch.tensor([7], device="cuda"), torch.tensor([40], device="cuda"),
                        torch.tensor([0], device="cuda"))[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([[*ids, 7]], device="cuda")).logits[0]
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert _relative_error(ours, ref[-2]) < tolerance
    assert _relative_error(step, ref[-1]) < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_through_the_gemv_kernels_matches_the_batched_layers(random_llama, dtype):
    """One row decodes through the GEMV kernels (norm, bias, RoPE, SiLU and residual
    fused); the same step through the layers every other batch size runs agrees."""
    from engine.model import CompactLM

    model = CompactLM(_hf(random_llama, dtype), n_slots=2, max_len=256)
    assert model.gemv
    model.prefill([(0, 0, list(range(100, 140)))], [False])
    inputs = [torch.tensor([v], device="cuda") for v in (7, 40, 0)]
    fused = model.decode(*inputs).clone()
    model.gemv = False
    layered = model.decode(*inputs)
    assert _relative_error(fused, layered) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_the_split_k_gemv_sums_every_part_once_in_a_fixed_order():
    """x += w @ h with K cut into parts (some uneven): the last program of each row block
    adds the parts; twice the same bits, and the counters back at zero; 50 launches queued
    back to back on one counters buffer (no host sync between them) sum as one at a time."""
    from engine.gemv import Tile, add_matmul_split

    torch.manual_seed(0)
    n, k = 96, 64 * 37  # 37 tiles of 64: in 4 parts 10, 10, 10, 7; 14 asked: 13 (12 x 3, 1)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = x.float() + w.float() @ h.float()
    counters = torch.zeros(n // 8, dtype=torch.int32, device="cuda")
    for splits in (1, 2, 4, 14, 37, 64):
        a, b = x.clone(), x.clone()
        for out in (a, b):
            add_matmul_split(h, w, out, counters, Tile(8, 64, splits=splits))
            assert not counters.any()
        assert torch.equal(a, b)
        assert _relative_error(a, ref) < 1e-2
    one = x.clone()
    add_matmul_split(h, w, one, counters, Tile(8, 64, splits=4))
    queued = [x.clone() for _ in range(50)]
    for out in queued:
        add_matmul_split(h, w, out, counters, Tile(8, 64, splits=4))
    assert all(torch.equal(out, one) for out in queued) and not counters.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_greedy_kernel_picks_the_tokens_of_the_torch_sample(dtype):
    """sample_greedy (one kernel) against sample(logits, None, None), both tokens and first
    choices, on rows made to break it: ties inside a block and across blocks (the lowest id
    wins), +inf (twice), every logit -inf (-1, first choice 0), NaNs (never the token; the
    first NaN is torch.argmax's first choice), a width that is no multiple of the block."""
    from engine.sampler import GREEDY_BLOCK, sample, sample_greedy

    torch.manual_seed(0)
    vocab = 3 * GREEDY_BLOCK + 123
    x = torch.randn(64, vocab, device="cuda").to(dtype)
    x[1, [5000, 7000]] = float("inf")
    x[2] = float("-inf")
    x[3, [123, 9000]] = float("nan")
    x[4] = 1.0
    x[5, [GREEDY_BLOCK - 1, GREEDY_BLOCK, vocab - 1]] = 100.0
    x[6] = float("nan")
    x[7, :-1] = float("-inf")
    x[8] = x[8].round()  # many ties below the best
    assert torch.equal(sample_greedy(x), sample(x, None, None))
    assert torch.equal(sample_greedy(x[:1]), sample(x[:1], None, None))
    prev = torch.full((70,), -7, device="cuda")  # the decode graphs' feed: the tokens, no more
    assert torch.equal(sample_greedy(x, prev), sample(x, None, None))
    assert torch.equal(prev[:64], sample(x, None, None)[0]) and (prev[64:] == -7).all()


def test_the_decode_graphs_head_kernel_gathers_as_the_torch_ops():
    """embed_rows (one kernel) against its torch ops, on inputs laid out as a graph's: a
    bucket's columns of a wider buffer, optimistic rows taking shuffled previous rows, one
    of them a -1 sample (fed as token 0), rows fed from the host between them, and a hidden
    size of more than one block and no multiple of it."""
    from engine.embed import embed_rows, optimistic_ids

    torch.manual_seed(0)
    vocab, hidden, most, rows = 1000, 4096 + 77, 24, 19
    embed = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    buffer = torch.zeros(5, most, dtype=torch.long, device="cuda")
    buffer[0, :rows] = torch.randint(0, vocab, (rows,))
    buffer[1, :rows] = torch.randint(0, 1000, (rows,))
    buffer[3, :rows] = torch.arange(rows) % 3 != 0  # every third row fed from the host
    buffer[4, :rows] = torch.randperm(rows) * (torch.arange(rows) % 3 != 0)
    prev = torch.randint(0, vocab, (rows,), device="cuda")
    prev[int(buffer[4, 1])] = -1
    inputs = buffer[:, :rows]
    x, lengths = embed_rows(inputs, prev, embed)
    ids = optimistic_ids(inputs.cpu(), prev.cpu())
    assert ids[1] == 0
    assert torch.equal(x.cpu(), embed.cpu()[ids]) and torch.equal(lengths.cpu(), inputs[1].cpu() + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_silu_mul_kernel_matches_the_torch_expression(dtype):
    """silu_mul's kernel against F.silu(gate) * up in float32: widths that are and are not
    a multiple of its block, no rows, rows that are prefixes of wider rows, a transposed
    input (copied first), and compiled for dynamic shapes as the layers call it."""
    import torch.nn.functional as F

    from engine.activation import BLOCK, silu_mul

    torch.manual_seed(0)
    for rows, width in ((1, 18944), (288, 18944), (3, BLOCK + 5), (0, 64)):
        x = torch.randn(rows, 2 * width, device="cuda").to(dtype) * 4
        gate, up = x.float().chunk(2, -1)
        expected = F.silu(gate) * up
        tolerance = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(silu_mul(x).float(), expected, rtol=tolerance, atol=tolerance)
    wide = torch.randn(4, 2 * 100 + 7, device="cuda").to(dtype)[:, : 2 * 100]
    transposed = torch.randn(2 * 100, 5, device="cuda").to(dtype).t()
    tall = torch.randn(37, 2 * 300, device="cuda").to(dtype)
    for x in (wide, transposed, tall):
        gate, up = x.float().chunk(2, -1)
        torch.testing.assert_close(silu_mul(x).float(), F.silu(gate) * up, rtol=8e-3, atol=8e-3)
    compiled = torch.compile(silu_mul, dynamic=True)
    for x in (tall, tall[:20]):
        assert torch.equal(compiled(x), silu_mul(x))


@pytest.fixture(scope="module")
def graphed(random_llama):
    """The bf16 engine as it serves: compiled, decode in CUDA graphs."""
    return _engine(random_llama, torch.bfloat16, max_batch=16)


def _inputs(rows: int, positions: list[int]) -> tuple[torch.Tensor, ...]:
    ids = torch.arange(100, 100 + rows, device="cuda")
    return ids, torch.tensor(positions, device="cuda"), torch.arange(rows, device="cuda")


def _graph_inputs(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A decode graph's (5, rows) inputs for rows fed from the host (none optimistic)."""
    zero = torch.zeros_like(ids)
    return torch.stack([ids, positions, slots, zero, zero])


@pytest.mark.parametrize("rows", [1, 16])  # buckets (the eager step runs the same shapes); 1: the GEMVs
def test_graph_replay_equals_the_eager_step(graphed, rows):
    model, runner = graphed.model, graphed.runner
    assert runner.graphs is not None, graphed.mode
    assert "gemv-one-row" in graphed.mode
    model.prefill([(s, 0, list(range(200 + s, 230 + s))) for s in range(rows)], [False] * rows)
    ids, positions, slots = _inputs(rows, [30] * rows)
    from engine.sampler import sample

    eager = model.decode(ids, positions, slots).clone()
    replayed, greedy = runner.graphs.run(_graph_inputs(ids, positions, slots), rows)
    assert torch.equal(eager, replayed)
    assert torch.equal(greedy, sample(eager, None, None))  # the graph's own greedy sample


@pytest.mark.parametrize("rows", [1, 4])  # buckets; 1: the GEMVs
def test_a_graphed_step_feeds_optimistic_rows_and_samples_as_the_eager_runner(graphed, monkeypatch, rows):
    """Three launches through the runner: the later ones' rows take the step before's samples
    on the device (optimistic rows) and the graph samples greedily itself; the same tokens
    as the runner without graphs (the eager gather and sample), and a banned token is
    masked (its step's sample fed to the next by the runner, not the graph)."""
    from engine.model_runner import StepRow

    model, runner = graphed.model, graphed.runner
    last = rows - 1

    def three_steps(bans: list[int]) -> list[list[tuple[int, int]]]:
        model.prefill([(s, 0, list(range(200 + s, 230 + s))) for s in range(rows)], [False] * rows)
        steps = [runner.launch([StepRow(s, 30, [100 + s]) for s in range(rows)])]
        for position in (31, 32):
            steps.append(runner.launch([*(StepRow(s, position, [], prev=s) for s in range(last)),
                                        StepRow(last, position, [], prev=last,
                                                bans=bans if position == 31 else ())]))
        return [step.tokens() for step in steps]

    graphed_tokens = three_steps([])
    monkeypatch.setattr(runner, "graphs", None)
    assert three_steps([]) == graphed_tokens
    banned = graphed_tokens[1][last][0]
    eager_masked = three_steps([banned])
    monkeypatch.undo()
    masked = three_steps([banned])
    assert masked == eager_masked
    assert masked[1][:last] == graphed_tokens[1][:last] and masked[1][last][0] != banned
    assert masked[1][last][1] == banned  # the first choice, before the mask


def test_prefill_graph_replay_matches_the_eager_prefill(graphed):
    """A step's chunks (fresh, continued, unsampled) replayed in a prefill graph's bucket give
    the eager prefill's logits and cache, and write no other slot but the scratch."""
    model, graphs = graphed.model, graphed.runner.prefill_graphs
    assert graphs is not None and "prefill-graphs" in graphed.mode, graphed.mode
    model.prefill([(3, 0, list(range(300, 340)))], [False])
    chunks = [(0, 0, list(range(100, 150))), (1, 0, list(range(200, 207))),
              (3, 40, list(range(400, 420))), (2, 0, [5, 6, 7])]
    sample = [True, False, True, True]
    caches = (*model.cache.k, *model.cache.v)
    before = [c.clone() for c in caches]
    eager = model.prefill(chunks, sample).clone()
    eager_cache = [c.clone() for c in caches]
    for c, b in zip(caches, before, strict=True):
        c.copy_(b)
    t, layout = graphs.layout(chunks, sample)
    replayed = graphs.run(t, torch.from_numpy(layout).cuda(), sum(sample)).clone()
    assert _relative_error(replayed, eager) < 2e-2
    assert _first_choices(eager, replayed.argmax(-1).tolist())
    scratch = model.cache.scratch
    for c, e, b in zip(caches, eager_cache, before, strict=True):
        assert _relative_error(c[:4], e[:4]) < 2e-2
        assert torch.equal(c[4:scratch], b[4:scratch])  # untouched slots


def _first_choices(logits: torch.Tensor, tokens: list[int], within: float = 0.05) -> bool:
    """Is each token the first choice of its row of logits, or as good within bf16's noise
    (other shapes round differently and may swap a near-tie)?"""
    rows = logits.float()
    picked = rows.gather(-1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0]
    return bool((picked >= rows.max(-1).values - within).all())


def test_a_step_of_decode_rows_and_prefill_chunks_samples_as_with_the_eager_prefill(graphed, monkeypatch):
    """Mixed steps off, through the runner's launch (one staging copy for both kinds of rows,
    the decode graph, then the prefill graph, one batched sample): the eager prefill's tokens."""
    from engine.model_runner import StepRow

    model, runner = graphed.model, graphed.runner
    monkeypatch.setattr(runner, "mixed_tokens", 0)
    model.prefill([(s, 0, list(range(300 + s, 330 + s))) for s in range(2)], [False] * 2)
    chunks = [(2, 0, list(range(100, 150))), (3, 0, list(range(200, 240)))]
    eager_logits = model.prefill(chunks, [True, True]).clone()

    def step() -> list[int]:
        rows = [StepRow(0, 30, [7]), StepRow(1, 30, [8]),
                *(StepRow(slot, start, tokens) for slot, start, tokens in chunks)]
        return [token for token, _ in runner.launch(rows).tokens()]

    graphs = runner.prefill_graphs
    assert graphs is not None, graphed.mode
    replayed = step()
    runner.prefill_graphs = None
    try:
        eager = step()
    finally:
        runner.prefill_graphs = graphs
    assert replayed[:2] == eager[:2]  # the decode rows: the same graph
    assert eager[2:] == eager_logits.argmax(-1).tolist()
    assert _first_choices(eager_logits, replayed[2:])


@pytest.mark.parametrize("mixed", [True, False])
def test_a_step_launches_without_waiting_for_the_device(graphed, monkeypatch, mixed):
    """The engine checks step N's tokens while the device computes step N+1: nothing in a
    launch may wait for the device. Under torch's sync debug mode, which raises at any call
    that does: decode rows and a prefill chunk (a mixed step, or the prefill graph beside
    the decode graph), bans, sampled and filtered rows."""
    from engine.model_runner import StepRow

    model, runner = graphed.model, graphed.runner
    if not mixed:
        monkeypatch.setattr(runner, "mixed_tokens", 0)
    model.prefill([(s, 0, list(range(300 + s, 330 + s))) for s in range(2)], [False] * 2)
    rows = [StepRow(0, 30, [7]),
            StepRow(1, 30, [8], temperature=0.7, top_k=40, top_p=0.9, key=123, bans=[3]),
            StepRow(2, 0, list(range(100, 150)), bans=[1, 2])]
    first = runner.launch(rows[:1]).tokens()[0][0]  # (a step again at the same positions
    rows[0] = rows[0]._replace(bans=[5, first, 49151])  # gives the same logits)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launch = runner.launch(rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tokens = launch.tokens()
    assert tokens[0] != (first, first)  # the mask steered it
    for row, (token, _) in zip(rows, tokens, strict=True):
        assert token >= 0 and token not in row.bans


def test_a_mixed_step_replays_its_graph_exactly_and_samples_as_decode_and_prefill_apart(
        graphed, monkeypatch):
    """Decode rows and a prefill chunk in one forward: its graph replays the eager mixed step
    bit for bit, and the runner (which then runs no prefill forward) samples the tokens that
    the decode step and the eager prefill give apart, within bf16's noise."""
    from engine.attention import chunk_groups
    from engine.model_runner import StepRow

    model, runner = graphed.model, graphed.runner
    graphs = runner.graphs
    assert graphs is not None and 64 in graphs.mixed_buckets, graphed.mode
    model.prefill([(s, 0, list(range(300 + s, 330 + s))) for s in range(2)], [False] * 2)
    chunk = list(range(100, 162))  # 2 decode rows + 62 tokens: bucket 64
    apart = torch.cat([model.decode(*_inputs(2, [30, 30])),
                       model.prefill([(2, 0, chunk)], [True])]).clone()
    rows = [StepRow(0, 30, [100]), StepRow(1, 30, [101]), StepRow(2, 0, chunk)]

    def refused(*args, **kwargs):
        raise AssertionError("a mixed step ran a prefill forward")

    monkeypatch.setattr(model, "prefill", refused)
    tokens = [token for token, _ in runner.launch(rows).tokens()]
    assert _first_choices(apart, tokens)
    ids = torch.tensor([100, 101, *chunk], device="cuda")
    positions = torch.tensor([30, 30, *range(62)], device="cuda")
    slots = torch.tensor([0, 1, *[2] * 62], device="cuda")
    heads = torch.zeros(graphs.head_rows(64), dtype=torch.long, device="cuda")
    heads[:3] = torch.tensor([0, 1, 63])
    groups = torch.from_numpy(chunk_groups(2, [62], model.chunk_tokens, 64)).cuda()
    eager = model.decode(ids, positions, slots, heads, groups)[:3].clone()
    replayed = graphs.run(_graph_inputs(ids, positions, slots), 3, heads, groups)[0].clone()
    assert torch.equal(eager, replayed)
    assert _first_choices(apart, eager.argmax(-1).tolist())
    # the chunk's rows attending in groups or each alone: the same logits (a group of a few
    # tokens fills the 16 query rows of the tile that one token's heads are padded to)
    alone = model.decode(ids, positions, slots, heads)[:3]
    assert torch.equal(eager, alone)


def test_a_failing_gemv_falls_back_to_the_batched_layers_only(random_llama, monkeypatch):
    """A GEMV the device refuses costs the one-row path, not the graphs or the attention kernel."""
    from engine import gemv

    def refused(*args, **kwargs):
        raise RuntimeError("refused by the test")

    monkeypatch.setattr(gemv, "norm_qkv_rope", refused)
    engine = _engine(random_llama, torch.bfloat16, max_batch=4, compile=False)
    assert engine.mode == ("eager+cuda-graphs+triton-attention+varlen-prefill+prefill-graphs"
                           "+mixed-steps"), engine.mode
    assert engine.generate(chat_request("t", "What is a bond?", max_tokens=4))[-1].HasField("finished")


def test_rollback_by_truncation_reproduces_logits_on_cuda(graphed):
    runner = graphed.runner
    graphed.model.prefill([(0, 0, list(range(100, 130)))], [False])

    def step(token: int, position: int) -> torch.Tensor:
        inputs = torch.tensor([[token], [position], [0], [0], [0]], device="cuda")
        return runner.graphs.run(inputs, 1)[0].clone()

    first = step(11, 30)
    step(12, 31)
    torch.testing.assert_close(step(11, 30), first, atol=0, rtol=0)  # SAR: two tokens back


def test_seeded_request_samples_the_same_tokens_alone_and_in_a_batch_of_64(random_llama):
    """float32 weights: cuBLAS picks other kernels for other batch sizes, and bf16 rounding
    would then flip near-ties (so would the attention's programs, which the batch's rows
    choose); the sampler is batch-invariant by design."""
    engine = _engine(random_llama, torch.float32, compile=False)
    probe = chat_request("probe", "What is a bond ladder?", max_tokens=24, temperature=0.8,
                         seed=1234)
    probe.params.top_p = 0.95
    alone = engine.generate(probe)
    from engine.engine import CollectingSink

    sinks = [CollectingSink() for _ in range(64)]
    for i, sink in enumerate(sinks):
        req = probe if i == 17 else chat_request(
            f"o{i}", f"Question {i}: explain an annuity.", max_tokens=24 + i % 7,
            temperature=(i % 3) * 0.5, seed=i)
        engine.submit(engine.prepare(req, sink))
    while not all(s.finished for s in sinks):
        engine.step()
    assert text_of(alone) and text_of(sinks[17].events) == text_of(alone)
    assert sinks[17].events[-1].finished == alone[-1].finished


def test_zero_leak_on_cuda(graphed, tmp_path):
    """Rules built from what the (random) model does say without rules: with them, none of it
    reaches the client, on the CUDA path (graphs, batched mask, optimistic decoding)."""
    import json

    from engine.engine import NO_POLICY, CollectingSink
    from finsieve.policy.guard import compile_policy
    from finsieve.policy.masks import TokenTable
    from finsieve.policy.normalize import normalize

    from support.zero_leak import ZERO_LEAK

    engine = graphed
    prompts = list(ZERO_LEAK.values())

    def run(policy) -> list[list]:
        engine.policy = lambda: policy
        sinks = [CollectingSink() for _ in prompts]
        for i, (p, sink) in enumerate(zip(prompts, sinks, strict=True)):
            engine.submit(engine.prepare(chat_request(f"z{i}", p, max_tokens=40), sink))
        while not all(s.finished for s in sinks):
            engine.step()
        return [s.events for s in sinks]

    unfiltered = [text_of(e) for e in run(NO_POLICY)]
    phrases = sorted({normalize(t[10:22]).strip() for t in unfiltered if len(t) > 30} - {""})
    assert phrases, unfiltered
    (tmp_path / "p.yaml").write_text(
        "rules:\n  - id: said\n    description: what the model says\n    kind: literal\n"
        f"    action: block\n    patterns: {json.dumps(phrases)}\n")
    policy = compile_policy(tmp_path, TokenTable.build(engine.token_bytes), None)[0]
    filtered = run(policy)
    for events in filtered:
        delivered = normalize(text_of(events))
        assert not any(p in delivered for p in phrases), delivered
        assert events[-1].WhichOneof("event") == "finished"
    assert any(e.WhichOneof("event") == "policy_event" for events in filtered for e in events)


def test_server_streams_on_cuda(tmp_path, random_llama):
    srv = start_server(tmp_path, "--device", "cuda", "--model", str(random_llama), "--max-batch", "8",
                       "--no-compile")

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
    assert "cuda-graphs" in srv.log()
