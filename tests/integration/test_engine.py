"""The engine's parts on the CPU: scheduler, batched sampler, and one request never hurting another."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time

import grpc
import pytest
import torch

from engine.engine import NO_POLICY, CollectingSink, LLMEngine
from engine.sampler import BanIndex, SamplingRows, noise_key, sample
from engine.scheduler import Scheduler
from engine.sequence import Finish, Sampling, Sequence, Status
from finsieve.app.client import chat_request
from finsieve.errors import RequestError
from finsieve.policy.guard import Guard, Verdict
from finsieve.v1 import chat_pb2

from support.paths import REPO
from support.streams import text_of

INTERNAL = grpc.StatusCode.INTERNAL.value[0]
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


# -- scheduler (no torch, no model) ----------------------------------------------------

def _seq(rid: str, prompt: int, sink: object = "sink", max_tokens: int = 50) -> Sequence:
    sampling = Sampling.safe(max_tokens, 0.0, 1.0, 0, None, ())
    return Sequence(rid, sink, list(range(prompt)), sampling, Guard(NO_POLICY, [b"x"] * 100))


# -- stop strings (no torch, no model) --------------------------------------------------

_STOP_BYTES = [b"\xff", b"p", b"ay", b"ok", b"\xe4", b"o", b"k", b"\xe4\xb8", b"\xad", b"x"]


def _deltas(tokens: list[int], stop: str) -> tuple[list[str], Sequence]:
    """Feed tokens as the engine does (guard, sequence, then what may be delivered): the
    text delivered after each token."""
    sampling = Sampling.safe(50, 0.0, 1.0, 0, None, (stop,))
    seq = Sequence("r", "sink", [0], sampling, Guard(NO_POLICY, _STOP_BYTES))
    deltas = []
    for t in tokens:
        assert not seq.done
        assert seq.guard.check(t).verdict is Verdict.ACCEPT
        seq.append(t, is_eos=False)
        if seq.done:
            seq.guard.finish()
        delta = seq.take_delta()
        deltas.append(delta[0] if delta else "")
    return deltas, seq


@pytest.mark.parametrize(
    ("tokens", "stop", "deltas"),
    [  # a U+FFFD (1 raw byte, 3 bytes encoded) before the stop string
     ([0, 1, 2, 3], "ok", ["\ufffd", "p", "ay", ""]),
     ([0, 1, 2, 5, 6], "ok", ["\ufffd", "p", "ay", "", ""]),  # … split across tokens
     ([4, 3], "ok", ["", "\ufffd"]),  # right after incomplete UTF-8 that turned out invalid
     ([4, 5, 6], "ok", ["", "\ufffd", ""]),  # … split: "o" held back meanwhile
     ([4, 5, 9, 5, 6], "ok", ["", "\ufffd", "ox", "", ""]),  # "o" released once it is not
     # a stop string with a U+FFFD of its own: held back as a prefix, and cut, in raw bytes
     ([7, 8, 0, 5, 9, 1, 0, 5, 6], "\ufffdok", ["", "中", "", "", "\ufffdox", "p", "", "", ""]),
     ([0, 7, 8, 5, 6], "中ok", ["\ufffd", "", "", "", ""])],
)
def test_a_stop_string_is_never_delivered(tokens, stop, deltas):
    delivered, seq = _deltas(tokens, stop)
    assert seq.finish_reason is Finish.STOP
    assert delivered == deltas


def test_prompts_are_prefilled_in_fixed_chunks_within_the_step_budget():
    s = Scheduler(n_slots=4, max_waiting=8, prefill_chunk=100, max_context=1000)
    long, short, other = _seq("long", 250), _seq("short", 30), _seq("other", 90)
    for seq in (long, short, other):
        s.add(seq)
    assert s.admit() == [long, short, other]
    first = s.schedule()  # one whole chunk of the long prompt fills the step's budget
    assert [(r.seq.request_id, r.start, len(r.tokens), r.sample) for r in first] == [("long", 0, 100, False)]
    second = s.schedule()
    assert [(r.seq.request_id, r.start, len(r.tokens)) for r in second] == [("long", 100, 100)]
    third = s.schedule()  # the rest of the long prompt (50) and the short one (30) fit together
    assert [(r.seq.request_id, len(r.tokens), r.sample) for r in third] == [("long", 50, True),
                                                                         ("short", 30, True)]
    fourth = s.schedule()  # both now decode ahead of the host; "other" gets its chunk
    assert [(r.seq.request_id, r.optimistic) for r in fourth] == [("long", True), ("short", True),
                                                                 ("other", False)]
    assert long.kv_len == 251 and long.ahead == 2


def test_a_redone_sequence_feeds_what_the_cache_lacks_and_drops_launched_results():
    s = Scheduler(n_slots=2, max_waiting=8, prefill_chunk=100, max_context=1000)
    seq = _seq("a", 10)
    s.add(seq)
    s.admit()
    s.schedule()  # prompt
    seq.ahead -= 1
    seq.output_ids += [1, 2, 3]  # three tokens accepted meanwhile
    seq.kv_len, seq.ahead = 13, 1
    s.schedule()  # optimistic row for the token in flight
    assert seq.ahead == 2
    seq.output_ids[1:] = [7, 8, 9]  # a rewrite after the first answer token
    seq.redo(valid=11)
    assert (seq.stale, seq.ahead, seq.kv_len) == (2, 0, 11)
    (row,) = s.schedule()
    assert (row.start, row.tokens, row.sample) == (11, [7, 8, 9], True)


def _step(s: Scheduler) -> list[tuple[str, int]]:
    """One step, the host accepting every sampled token before the next: (request, tokens fed)."""
    rows = s.schedule()
    for row in rows:
        if row.sample:
            row.seq.ahead -= 1
            row.seq.output_ids.append(7)
    return [(r.seq.request_id, len(r.tokens)) for r in rows]


def test_fresh_prompts_wait_for_company_while_streams_decode():
    s = Scheduler(n_slots=4, max_waiting=8, prefill_chunk=100, max_context=1000,
                  prompt_batch=60, prompt_wait_steps=50)
    s.add(_seq("running", 10))
    s.admit()
    assert _step(s) == [("running", 10)]
    s.add(_seq("first", 25))
    s.admit()
    # decode alone: 25 prompt tokens are fewer than 60
    assert [_step(s) for _ in range(5)] == [[("running", 1)]] * 5
    s.add(_seq("second", 40))
    s.admit()
    # together 65 tokens: both are prefilled beside the decode row
    assert _step(s) == [("running", 1), ("first", 25), ("second", 40)]


def test_a_lone_prompt_waits_no_longer_than_the_steps_allowed_and_never_when_idle():
    s = Scheduler(n_slots=4, max_waiting=8, prefill_chunk=100, max_context=1000,
                  prompt_batch=60, prompt_wait_steps=3)
    s.add(_seq("idle", 5))
    s.admit()
    assert _step(s) == [("idle", 5)]  # nothing decodes: at once
    s.add(_seq("late", 5))
    s.admit()
    assert [_step(s) for _ in range(4)] == [[("idle", 1)]] * 3 + [[("idle", 1), ("late", 5)]]


def _running_and(s: Scheduler, *prompts: tuple[str, int]) -> None:
    """A sequence that decodes, then each prompt admitted one step after the other."""
    s.add(_seq("running", 5))
    s.admit()
    _step(s)
    for name, n in prompts:
        s.add(_seq(name, n))
        s.admit()
        assert _step(s) == [("running", 1)]  # held


def test_the_oldest_prompt_sets_the_wait():
    s = Scheduler(n_slots=6, max_waiting=8, prefill_chunk=200, max_context=1000,
                  prompt_batch=150, prompt_wait_steps=3)
    _running_and(s, ("first", 60), ("second", 50))  # the newer does not restart the wait
    assert _step(s) == [("running", 1)]
    assert _step(s) == [("running", 1), ("first", 60), ("second", 50)]  # first waited 3


def test_a_prompt_released_once_is_not_held_again():
    s = Scheduler(n_slots=6, max_waiting=8, prefill_chunk=100, max_context=1000,
                  prompt_batch=100, prompt_wait_steps=50)
    _running_and(s, ("first", 60))
    s.add(_seq("second", 50))
    s.admit()
    # 110 tokens: released; the step's chunk takes the first, the second follows at once
    assert _step(s) == [("running", 1), ("first", 60)]
    assert _step(s) == [("running", 1), ("first", 1), ("second", 50)]


def test_a_rewrite_is_never_held_and_fresh_prompts_join_it():
    s = Scheduler(n_slots=4, max_waiting=8, prefill_chunk=100, max_context=1000,
                  prompt_batch=60, prompt_wait_steps=50)
    seq = _seq("rewritten", 10)
    s.add(seq)
    s.admit()
    _step(s)
    seq.output_ids[-1:] = [1, 2, 3]  # a rewrite: the cache lacks these three tokens
    s.add(_seq("fresh", 5))
    s.admit()
    assert _step(s) == [("rewritten", 3), ("fresh", 5)]


def test_beside_decode_rows_prompts_are_fed_in_mixed_chunks():
    """A step with decode rows takes at most mixed_tokens of prefill (its rows ride in the
    decode forward), chunks filling the budget; a step without any, or beside a burst of
    prompts (prefill_chunk tokens waiting), up to prefill_chunk."""
    s = Scheduler(n_slots=6, max_waiting=8, prefill_chunk=100, max_context=1000, mixed_tokens=30)
    s.add(_seq("first", 70))
    s.admit()
    assert _step(s) == [("first", 70)]  # nothing decodes: one prefill chunk
    s.add(_seq("long", 70))
    s.add(_seq("short", 10))
    s.admit()
    assert [_step(s) for _ in range(3)] == [[("first", 1), ("long", 30)], [("first", 1), ("long", 30)],
                                            [("first", 1), ("long", 10), ("short", 10)]]
    for i in range(3):  # a burst: 120 prompt tokens waiting, more than a prefill chunk
        s.add(_seq(f"burst{i}", 40))
    s.admit()
    assert _step(s) == [("first", 1), ("long", 1), ("short", 1), ("burst0", 40), ("burst1", 40),
                        ("burst2", 20)]
    assert _step(s)[-1] == ("burst2", 20)  # 20 left: mixed again


def test_a_mixed_steps_prompt_tokens_end_at_a_whole_matmul_tile():
    """A mixed step's rows are its matmuls' M, computed in tiles (cuBLAS's 128 rows, 16
    here): the prompt tokens stop at the last whole tile when the rows past it would fill
    at most three quarters of the next, and what is cut rides in the next step; no cut
    when it keeps fewer tokens than it drops, or when a whole budget would still wait."""

    def decoding(n: int, tile: int) -> Scheduler:
        s = Scheduler(n_slots=n + 2, max_waiting=8, prefill_chunk=1000, max_context=1000,
                      mixed_tokens=50, mixed_tile=tile)
        for i in range(n):
            s.add(_seq(f"run{i}", 5))
        s.admit()
        _step(s)  # nothing decodes yet: one prefill step
        return s

    def feeds(s: Scheduler, prompt: int, steps: int) -> list[int]:
        s.add(_seq("p", prompt))
        s.admit()
        return [_step(s)[-1][1] for _ in range(steps)]

    # 3 + 40 rows: 11 past the second tile; cut (29 tokens end it), the 11 follow
    assert feeds(decoding(3, 16), 40, 2) == [29, 11]
    # 12 rows past it, three quarters of a tile: cut; 13: all taken
    assert feeds(decoding(3, 16), 41, 2) == [29, 12]
    assert feeds(decoding(3, 16), 42, 1) == [42]
    # 5 + 22 rows: a cut keeps 11 tokens and drops 11, no more than it keeps: cut
    assert feeds(decoding(5, 16), 22, 2) == [11, 11]
    # 3 + 3 rows in tiles of 4: a cut would keep one token and drop two
    assert feeds(decoding(3, 4), 3, 1) == [3]
    # The budget (50) ends the step at 53 rows: a cut to 48 takes 45 tokens. With 94 waiting,
    # 49 would wait after it, less than a budget: cut; with 95, a whole budget: no cut
    assert feeds(decoding(3, 16), 94, 3) == [45, 45, 4]
    assert feeds(decoding(3, 16), 95, 2) == [50, 45]
    assert feeds(decoding(3, 10**9), 40, 1) == [40]  # a tile no step fills: no cut


def test_a_long_prompt_is_prefilled_in_steps_of_its_own_beside_decode_rows():
    """Past MIXED_MAX_POSITION a prompt's tokens would each re-read a long prefix in a mixed
    step: its prefill gets steps of up to prefill_chunk, as with mixed steps off."""
    from engine.scheduler import MIXED_MAX_POSITION

    s = Scheduler(n_slots=4, max_waiting=8, prefill_chunk=4096, max_context=8192, mixed_tokens=64)
    s.add(_seq("running", 10))
    s.admit()
    _step(s)
    s.add(_seq("long", MIXED_MAX_POSITION + 1))
    s.add(_seq("short", 30))
    s.admit()
    assert _step(s) == [("running", 1), ("long", MIXED_MAX_POSITION + 1), ("short", 30)]
    s.add(_seq("alone", MIXED_MAX_POSITION))
    s.admit()
    assert _step(s)[-1] == ("alone", 64)


def test_the_waiting_queue_is_bounded_with_a_retry_hint_and_ids_are_unique():
    s = Scheduler(n_slots=1, max_waiting=2, prefill_chunk=100, max_context=1000)
    s.add(_seq("a", 5))
    s.add(_seq("b", 5))
    with pytest.raises(RequestError) as full:
        s.add(_seq("c", 5))
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and full.value.retry_after_ms > 0
    with pytest.raises(RequestError) as dup:
        s.add(_seq("a", 5))
    assert dup.value.field == "request_id"
    s.admit()  # "a" takes the slot: the queue has room again
    s.add(_seq("a", 5, sink="another stream"))  # ids are unique per stream only


def test_cancel_lookups_and_release_free_the_slot_at_once():
    s = Scheduler(n_slots=1, max_waiting=8, prefill_chunk=100, max_context=1000)
    a, b = _seq("a", 5, "s1"), _seq("b", 5, "s1")
    s.add(a)
    s.add(b)
    s.admit()
    assert s.find("s1", "nope") is None and s.find("s2", "a") is None
    assert s.find("s1", "a") is a and set(s.of_sink("s1")) == {a, b}
    s.release(a)
    assert a.status is Status.FINISHED and s.admit() == [b]
    s.release(a)  # twice: nothing happens
    assert len(s) == 1


# -- batched sampler -----------------------------------------------------------------

def _rows(n: int, temperature: float, seeds: list[int], positions: list[int]) -> SamplingRows:
    return SamplingRows([temperature] * n, [0] * n, [1.0] * n,
                        [noise_key(s, p) for s, p in zip(seeds, positions, strict=True)], [[]] * n)


def test_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    row = torch.randn(1000)
    alone = sample(row[None], _rows(1, 1.0, [42], [7]), None)[0].tolist()
    others = torch.randn(40, 1000)
    batch = torch.cat([others[:13], row[None], others[13:]])
    seeds = [*range(13), 42, *range(100, 127)]
    together = sample(batch, _rows(41, 1.0, seeds, [7] * 41), None)[0].tolist()
    assert together[13] == alone[0]
    draws = {sample(row[None], _rows(1, 1.0, [s], [7]), None)[0, 0].item() for s in range(30)}
    assert len(draws) > 5  # other seeds draw other tokens: it is sampling, not argmax


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, float("nan"), float("inf"), -1.0, 0.7])
def test_no_temperature_makes_the_sampler_fail(temperature):
    """Whatever reaches it: the sampler itself survives, and the engine's parameters are safe."""
    logits = torch.randn(3, 500) * 30
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")  # nothing allowed: -1, the engine halts that row alone
    rows = SamplingRows([temperature] * 3, [0] * 3, [0.5] * 3, [1, 2, 3], [[], [7], []])
    tokens = sample(logits, rows, torch.tensor([[0], [1]]))[0].tolist()
    assert 0 <= tokens[0] < 500 and tokens[0] != 1 and 0 <= tokens[1] < 500 and tokens[2] == -1
    s = Sampling.safe(10, temperature, 1.0, 0, 1, ())
    assert s.greedy == (not (math.isfinite(temperature) and temperature >= 1e-4))


def test_a_ban_outside_the_vocabulary_bans_nothing_in_another_row():
    """The mask fills flat indices row * vocab + id: an id >= vocab (a tokenizer's added
    token past the model's embedding) would be a token of the next row."""
    index = BanIndex(vocab=500)
    flat = index.flat([[3, 500, 507], [], [-1, 499, 1000]])
    assert flat.tolist() == [[0, 2], [3, 499]]
    assert index.flat([[500], [600]]) is None  # nothing the model can produce: no mask
    logits = torch.zeros(3, 500)
    logits[:, 7] = 1.0  # every row's best token is 7
    rows = SamplingRows([0.0] * 3, [0] * 3, [1.0] * 3, [0] * 3, [[3, 507], [], [499, 500]])
    tokens = sample(logits, None, torch.from_numpy(index.flat(rows.bans)))[0].tolist()
    assert tokens == [7, 7, 7]


# -- the engine: one request never hurts the others ------------------------------------

def _run(engine: LLMEngine, requests: list[chat_pb2.ChatRequest]) -> dict[str, list]:
    sinks = {r.request_id: CollectingSink() for r in requests}
    for r in requests:
        engine.submit(engine.prepare(r, sinks[r.request_id]))
    while not all(s.finished for s in sinks.values()):
        engine.step()
    return {rid: s.events for rid, s in sinks.items()}


def test_a_temperature_of_1e_45_fails_nothing_else_in_the_batch(engine):
    tiny = chat_request("tiny", "Say hello.", max_tokens=8, temperature=1e-45)
    others = [chat_request(f"o{i}", "What is a bond?", max_tokens=8, temperature=0.7, seed=i)
              for i in range(3)]
    out = _run(engine, [tiny, *others])
    for rid, events in out.items():
        assert events[-1].WhichOneof("event") == "finished", rid
        assert text_of(events), rid
    greedy = _run(engine, [chat_request("g", "Say hello.", max_tokens=8)])["g"]
    assert text_of(out["tiny"]) == text_of(greedy)  # a temperature that small is greedy


def test_prompts_prefilled_in_mixed_steps_get_the_answers_of_a_prefill_forward(float32_engine,
                                                                                monkeypatch):
    """The engine with mixed steps (the compact forward's; on the CPU only for this test:
    there they would make a prompt's chunks depend on the batch): prompts that arrive while
    another stream decodes ride in its decode forward, and every greedy answer is the one
    prefill forwards give. Prefill chunks of CUDA's 2,048 tokens (the CPU's are smaller)."""
    from engine.model_runner import ModelRunner

    engine = float32_engine
    monkeypatch.setattr(engine.scheduler, "prefill_chunk", 2048)
    questions = ["What is a bond?", "Explain what a stock split does to a share's price.",
                 "Why do banks pay interest on savings?"]
    prefills = []
    prefill = engine.model.prefill
    monkeypatch.setattr(engine.model, "prefill", lambda *a: prefills.append(1) or prefill(*a))

    def answers() -> list[str]:
        sinks = [CollectingSink() for _ in questions]
        for i, (q, sink) in enumerate(zip(questions, sinks, strict=True)):
            engine.submit(engine.prepare(chat_request(f"m{i}", q, max_tokens=12), sink))
            for _ in range(3 if i == 0 else 0):  # the others arrive while the first decodes
                engine.step()
        while not all(s.finished for s in sinks):
            engine.step()
        return [text_of(s.events) for s in sinks]

    apart = answers()
    assert len(prefills) == 2  # the first prompt alone, then the other two together
    runner, chunk = engine.runner, engine.scheduler.mixed_tokens
    engine.runner = ModelRunner(engine.model, engine.device, mixed_tokens=40)
    engine.scheduler.mixed_tokens = 40
    try:
        prefills.clear()
        mixed = answers()
    finally:
        engine.runner, engine.scheduler.mixed_tokens = runner, chunk
    assert len(prefills) == 1  # the first prompt alone; the others in 40-token mixed steps
    assert mixed == apart and all(apart)


def test_each_step_reports_the_rows_it_feeds(engine):
    """finsieve_engine_step_rows: a step feeds its prompt tokens (a chunk a step) and one row a
    decode row, so an answer cut by max_tokens takes a step a prompt chunk and one a token
    after the first, fed its prompt and every token but its last (run-ahead stops before the
    token that ends it)."""
    from engine.events import STEP_ROWS

    def count_and_sum() -> tuple[float, float]:
        values = {s.name: s.value for s in STEP_ROWS.collect()[0].samples}
        return values["finsieve_engine_step_rows_count"], values["finsieve_engine_step_rows_sum"]

    sink = CollectingSink()
    seq = engine.prepare(chat_request("rows", "What is a bond?", max_tokens=6), sink)
    steps, rows = count_and_sum()
    engine.submit(seq)
    while not sink.finished:
        engine.step()
    assert seq.finish_reason is Finish.LENGTH and len(seq.output_ids) == 6
    after = count_and_sum()
    chunks = -(-len(seq.prompt_ids) // engine.scheduler.prefill_chunk)
    assert (after[0] - steps, after[1] - rows) == (chunks + 5, len(seq.prompt_ids) + 5)


def test_the_loop_splits_its_host_work_into_launching_and_acting_on_tokens(engine, monkeypatch):
    """finsieve_engine_loop_seconds: `tokens` is the time spent acting on a step's tokens
    (here a guard slowed by 2 ms a token), `launch` the time spent launching (on the CPU
    the forward), both inside `host`."""
    from engine.events import LOOP_SECONDS

    def parts() -> dict[str, float]:
        return {s.labels["part"]: s.value for s in LOOP_SECONDS.collect()[0].samples
                if s.name.endswith("_total")}

    sink = CollectingSink()
    seq = engine.prepare(chat_request("parts", "What is a bond?", max_tokens=5), sink)
    check = seq.guard.check

    def slow_check(token, **kw):
        time.sleep(0.002)
        return check(token, **kw)

    monkeypatch.setattr(seq.guard, "check", slow_check)
    before = parts()
    engine.submit(seq)
    while not sink.finished:
        engine.step()
    spent = {k: v - before.get(k, 0.0) for k, v in parts().items()}
    assert len(seq.output_ids) == 5
    assert spent["tokens"] >= 5 * 0.002
    assert spent["launch"] > 0
    assert spent["tokens"] + spent["launch"] <= spent["host"]


def test_an_exception_in_one_sequence_fails_that_sequence_alone(engine, monkeypatch):
    requests = [chat_request(f"r{i}", "Name a kind of savings account.", max_tokens=10) for i in range(3)]
    sinks = {r.request_id: CollectingSink() for r in requests}
    seqs = [engine.prepare(r, sinks[r.request_id]) for r in requests]

    def broken(token):  # a fault that no input produces today: injected
        raise RuntimeError("injected")

    monkeypatch.setattr(seqs[1].guard, "check", broken)
    for seq in seqs:
        engine.submit(seq)
    while not all(s.finished for s in sinks.values()):
        engine.step()
    failed = sinks["r1"].events[-1]
    assert failed.WhichOneof("event") == "error" and failed.error.code == INTERNAL
    for rid in ("r0", "r2"):
        assert sinks[rid].events[-1].WhichOneof("event") == "finished"
        assert sinks[rid].events[-1].finished.usage.completion_tokens == 10


def test_a_full_queue_answers_resource_exhausted_with_a_retry_hint(default_model_dir):
    from engine.engine import EngineLimits
    from engine.loader import load_model

    from support.paths import MODEL_STATE

    cpu = torch.device("cpu")
    small = LLMEngine(load_model(str(default_model_dir), MODEL_STATE, cpu),
                      EngineLimits(max_batch=1, max_context=256, default_max_tokens=4, max_waiting=2), cpu)
    out = _run(small, [chat_request(f"q{i}", "Hi", max_tokens=4) for i in range(3)])
    assert out["q0"][-1].WhichOneof("event") == "finished"
    assert out["q1"][-1].WhichOneof("event") == "finished"
    refused = out["q2"][-1].error
    assert refused.code == EXHAUSTED and refused.retry_after_ms > 0


def test_cancels_for_unknown_ids_change_nothing(engine):
    sink = CollectingSink()
    keep = engine.prepare(chat_request("keep", "What is an index fund?", max_tokens=12), sink)
    engine.submit(keep)
    engine.step()
    for i in range(5000):
        engine.cancel(sink, f"unknown-{i}")
    engine.cancel(CollectingSink())  # a stream that has nothing in flight
    while not sink.finished:
        engine.step()
    assert sink.events[-1].finished.finish_reason == chat_pb2.FINISH_REASON_LENGTH


def test_a_prompt_too_long_for_the_context_is_refused_before_any_rule_scans_it(engine, monkeypatch):
    from finsieve.policy.guard import compile_policy
    from finsieve.policy.masks import TokenTable
    from finsieve.policy.matcher import StreamMatcher

    policy = compile_policy(REPO / "rules", TokenTable.build(engine.token_bytes), None)[0]
    assert policy.pack.input, "the default packs have input rules"
    monkeypatch.setattr(engine, "policy", lambda: policy)
    fed = []
    original = StreamMatcher.feed
    monkeypatch.setattr(StreamMatcher, "feed", lambda self, data: fed.append(1) or original(self, data))
    big = chat_request("big", "insider tips on ACME. " * 12_000, max_tokens=4)  # ~260 KB
    with pytest.raises(RequestError) as refused:
        engine.prepare(big, CollectingSink())
    assert refused.value.field == "messages" and "tokens" in refused.value.message
    assert fed == []


# -- the engine's gRPC stream survives what one request does ---------------------------

@contextlib.contextmanager
def _engine_thread(engine: LLMEngine):
    engine._stopping = False
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        engine.stop()
        thread.join(30)


async def _generate(engine: LLMEngine, frames: list[bytes], wanted: set[str],
                    on_event=lambda event: None, half_close: bool = False) -> dict[str, list]:
    """Raw frames on the engine's Generate stream (a real gRPC server on loopback)."""
    from engine.server import EngineService, add_to_server
    from finsieve.grpc_server import Service, start_server
    from finsieve.v1 import engine_pb2

    running = await start_server("127.0.0.1:0", [Service("finsieve.v1.Engine", EngineService(engine),
                                                         add_to_server)])
    out: dict[str, list] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            call = channel.stream_stream("/finsieve.v1.Engine/Generate", request_serializer=None,
                                         response_deserializer=engine_pb2.EngineStep.FromString)

            async def send():
                for f in frames:
                    yield f
                if not half_close:
                    await asyncio.sleep(600)

            async for step in call(send()):
                for e in step.events:
                    out.setdefault(e.request_id, []).append(e)
                    on_event(e)
                if all(rid in out and out[rid][-1].WhichOneof("event") in ("finished", "error")
                       for rid in wanted):
                    break
    finally:
        await running.server.stop(0)
    return out


def _frame(request: chat_pb2.ChatRequest) -> bytes:
    return chat_pb2.ChatClientMessage(request=request).SerializeToString()


def test_a_bad_frame_or_a_failing_prepare_fails_that_request_and_the_stream_goes_on(engine, monkeypatch):
    bad = _frame(chat_request("bad", "XXXX", max_tokens=3)).replace(b"XXXX", b"\xff\xfe\xfd\xfc")
    crash = _frame(chat_request("crash", "Hello", max_tokens=3))
    good = _frame(chat_request("good", "Say hello.", max_tokens=3))
    prepare = engine.prepare

    def flaky(request, sink):  # a fault that no input produces today: injected
        if request.request_id == "crash":
            raise ValueError("injected")
        return prepare(request, sink)

    monkeypatch.setattr(engine, "prepare", flaky)
    with _engine_thread(engine):
        out = asyncio.run(asyncio.wait_for(_generate(engine, [bad, crash, good],
                                                     {"bad", "crash", "good"}), 120))
    assert out["bad"][-1].error.code == INVALID
    assert out["crash"][-1].error.code == INTERNAL
    assert out["good"][-1].WhichOneof("event") == "finished" and text_of(out["good"])


def test_a_slow_preparation_holds_up_no_other_request_and_its_early_cancel_still_applies(
        engine, monkeypatch):
    """Requests of one gateway stream are prepared concurrently: "slow" cannot finish
    preparing until "fast" has finished; its cancel, sent while it is being prepared, ends it."""
    fast_done = threading.Event()
    prepare = engine.prepare

    def gated(request, sink):
        if request.request_id == "slow":
            assert fast_done.wait(60), "the other request was held up by this one"
        return prepare(request, sink)

    monkeypatch.setattr(engine, "prepare", gated)
    frames = [_frame(chat_request("slow", "What is a bond?", max_tokens=40)),
              chat_pb2.ChatClientMessage(cancel=chat_pb2.Cancel(request_id="slow")).SerializeToString(),
              _frame(chat_request("fast", "Say hello.", max_tokens=3))]

    def seen(event) -> None:
        if event.request_id == "fast" and event.WhichOneof("event") == "finished":
            fast_done.set()

    with _engine_thread(engine):
        out = asyncio.run(asyncio.wait_for(_generate(engine, frames, {"slow", "fast"}, seen), 120))
    assert out["fast"][-1].WhichOneof("event") == "finished"
    assert [e.WhichOneof("event") for e in out["slow"]] == ["finished"]
    assert out["slow"][-1].finished.finish_reason == chat_pb2.FINISH_REASON_CANCELLED


def test_requests_sent_before_the_gateway_half_closes_are_still_answered(engine, monkeypatch):
    prepare = engine.prepare

    def slow(request, sink):
        time.sleep(0.5)  # still preparing when the gateway closes its side
        return prepare(request, sink)

    monkeypatch.setattr(engine, "prepare", slow)
    frames = [_frame(chat_request("last", "Say hello.", max_tokens=3))]
    with _engine_thread(engine):
        out = asyncio.run(asyncio.wait_for(_generate(engine, frames, {"last"}, half_close=True), 60))
    assert out["last"][-1].WhichOneof("event") == "finished"


def test_the_stream_reports_the_engines_load_and_its_drain(engine):
    """Each gateway stream hears the engine's load when it changes (the first step, a request
    running, back to idle, draining); a request that comes while the engine drains is
    refused UNAVAILABLE with a retry hint (its gateway runs it elsewhere)."""
    from engine.server import DRAINING_MESSAGE, EngineService, add_to_server
    from finsieve.grpc_server import Service, start_server
    from finsieve.v1 import engine_pb2

    async def run() -> tuple[list[tuple[int, int, int, bool]], chat_pb2.ChatServerMessage]:
        service = EngineService(engine)
        running = await start_server("127.0.0.1:0", [Service("finsieve.v1.Engine", service,
                                                             add_to_server)])
        frames: asyncio.Queue[bytes] = asyncio.Queue()
        loads, finished = [], set()

        async def send():
            while True:
                yield await frames.get()

        async def until(done) -> engine_pb2.EngineStep:
            while True:
                step = await asyncio.wait_for(call.read(), 30)
                finished.update(e.request_id for e in step.events if e.HasField("finished"))
                if step.HasField("load"):
                    load = step.load
                    loads.append((load.running, load.waiting, load.max_batch, load.draining))
                if done(step):
                    return step

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                call = channel.stream_stream("/finsieve.v1.Engine/Generate", request_serializer=None,
                                             response_deserializer=engine_pb2.EngineStep.FromString)(send())
                await until(lambda step: step.HasField("load"))  # the first step says it
                frames.put_nowait(_frame(chat_request("busy", "Say hello.", max_tokens=4)))
                # Idle again: said by the step of its last events, or by one of its own.
                await until(lambda step: "busy" in finished and loads[-1][:2] == (0, 0))
                await service.drain(0)
                await until(lambda step: loads[-1][3])
                frames.put_nowait(_frame(chat_request("late", "Say hello.", max_tokens=4)))
                late = await until(lambda step: bool(step.events))
                call.cancel()
        finally:
            await running.server.stop(0)
        return loads, late.events[0]

    with _engine_thread(engine):
        loads, late = asyncio.run(run())
    assert loads[0][2:] == (engine.max_batch, False) and (1, 0, engine.max_batch, False) in loads
    assert loads[-1] == (0, 0, engine.max_batch, True)
    assert (late.request_id, late.error.code, late.error.message) == (
        "late", grpc.StatusCode.UNAVAILABLE.value[0], DRAINING_MESSAGE)
    assert late.error.retry_after_ms > 0


def test_a_device_that_stops_computing_stops_the_engine_and_fails_its_requests(engine, monkeypatch):
    """A CUDA error cannot be produced on the CPU: the step's failure and the lost device are
    injected. Every request gets UNAVAILABLE and `failed` is set (serve then exits with 1)."""
    sinks = [CollectingSink() for _ in range(3)]
    for i, sink in enumerate(sinks):
        engine.submit(engine.prepare(chat_request(f"d{i}", "What is a bond?", max_tokens=50), sink))
    engine.step()

    def lost(rows):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    monkeypatch.setattr(engine.runner, "launch", lost)
    monkeypatch.setattr(engine.runner, "healthy", lambda: False)
    engine.failed.clear()
    with _engine_thread(engine):
        assert engine.failed.wait(60)
    unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
    for sink in sinks:
        assert sink.events[-1].WhichOneof("event") == "error"
        assert sink.events[-1].error.code == unavailable
    assert len(engine.scheduler) == 0
    engine._in_flight = None  # the session's engine goes on serving the next tests
