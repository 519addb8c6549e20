"""Streaming, multiplexing, cancel and batching through the real server on loopback."""

from __future__ import annotations

import asyncio

import pytest

from finsieve.app.client import chat_request
from finsieve.v1 import chat_pb2

from support.streams import ChatStream, kinds, text_of


def run(coro):
    return asyncio.run(coro)


def test_streamed_deltas_equal_the_non_streamed_decode(server, engine):
    req = chat_request("s1", "Explain what a mutual fund is.", max_tokens=48,
                       temperature=0.8, seed=1234)

    async def go():
        async with ChatStream(server.target) as s:
            s.send(req)
            return (await s.until_done("s1"))["s1"]

    events = run(go())
    assert kinds(events)[0] == "started"
    assert events[0].started.model == "SmolLM2-135M-Instruct"
    assert kinds(events)[-1] == "finished"
    deltas = [e for e in events if e.WhichOneof("event") == "delta"]
    assert len(deltas) >= 10, "the answer must arrive in many deltas, not at the end"
    reference = engine.generate(req)
    assert text_of(events) == text_of(reference) != ""
    streamed, direct = events[-1].finished, reference[-1].finished
    assert (streamed.finish_reason, streamed.usage) == (direct.finish_reason, direct.usage)
    assert streamed.audit_id.isdigit()  # the gateway's, for the customer's reference
    assert sum(d.delta.tokens for d in deltas) == events[-1].finished.usage.completion_tokens


def test_same_seed_same_answer_other_seed_other_answer(engine):
    from engine.engine import CollectingSink

    def answers(*seeds: int) -> list[str]:
        """Decoded together, in one batch (a step costs the same for one row as for eight)."""
        sinks = [CollectingSink() for _ in seeds]
        for seed, sink in zip(seeds, sinks, strict=True):
            req = chat_request(f"x{seed}", "Name three kinds of savings accounts.", max_tokens=24,
                               temperature=1.0, seed=seed)
            engine.submit(engine.prepare(req, sink))
        while not all(s.finished for s in sinks):
            engine.step()
        return [text_of(s.events) for s in sinks]

    seven, eight = answers(7, 8)  # rows of one batch: each row draws from its own seed
    (again,) = answers(7)  # later, alone: nothing else (the batch, the steps before) counts
    assert seven == again
    assert seven != eight


def test_two_requests_interleave_and_cancel_stops_one(server):
    long_a = chat_request("a", "Write a long story about a small bank in a village.", max_tokens=200)
    long_b = chat_request("b", "Write a long poem about the stock market.", max_tokens=40)

    async def go():
        async with ChatStream(server.target) as s:
            s.send(long_a)
            s.send(long_b)
            seen_a = 0
            while seen_a < 5:  # both are decoding: let a produce a few deltas
                event = await s.next()
                seen_a += event.request_id == "a" and event.WhichOneof("event") == "delta"
            tokens_at_cancel = sum(e.delta.tokens for e in s.events if e.request_id == "a")
            s.cancel("a")
            await s.until_done("a", "b")
            return s.events, tokens_at_cancel

    events, tokens_at_cancel = run(go())
    a = [e for e in events if e.request_id == "a"]
    b = [e for e in events if e.request_id == "b"]
    assert a[-1].finished.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    # Decoding stops within a step or two of the cancel, far short of max_tokens.
    assert a[-1].finished.usage.completion_tokens <= tokens_at_cancel + 2
    assert b[-1].finished.finish_reason in (chat_pb2.FINISH_REASON_LENGTH, chat_pb2.FINISH_REASON_STOP)
    order = [e.request_id for e in events if e.WhichOneof("event") == "delta"]
    first_b = order.index("b")
    assert "a" in order[first_b:], "deltas of a and b must interleave"
    a_done = events.index(a[-1])
    assert any(e.WhichOneof("event") == "delta" for e in events[a_done:] if e.request_id == "b"), \
        "b goes on after a is cancelled"


PROMPTS = [
    "What is an index fund?",
    "Give one tip for budgeting.",
    "What does APR mean?",
    "Why do people buy insurance?",
]


# Slow (make test-slow): five served decodes, four of them one after another. In the default
# suite the same holds in parts: an answer decoded in a batch is the one decoded alone
# (test_same_seed_same_answer_other_seed_other_answer, test_model.py's
# test_decode_logits_do_not_depend_on_the_rest_of_the_batch), a served answer is the engine's
# (test_streamed_deltas_equal_the_non_streamed_decode), and concurrent requests are served
# together (test_two_requests_interleave_and_cancel_stops_one).
@pytest.mark.slow
def test_four_concurrent_streams_match_their_solo_greedy_answers(server):
    async def one(i: int) -> list:
        async with ChatStream(server.target) as s:
            s.send(chat_request(f"p{i}", PROMPTS[i], max_tokens=32))
            return (await s.until_done(f"p{i}"))[f"p{i}"]

    async def together():
        return await asyncio.gather(*(one(i) for i in range(4)))

    solo = [run(one(i)) for i in range(4)]
    batched = run(together())
    for i in range(4):
        assert kinds(batched[i])[-1] == "finished"
        assert text_of(batched[i]) == text_of(solo[i]) != "", PROMPTS[i]


# Slow (make test-slow): two decodes of the real model. In the default suite
# test_engine.py's test_a_stop_string_is_never_delivered holds the same for the sequence that
# cuts the answer (stop strings across tokens and inside invalid UTF-8, finish reason STOP),
# and test_audit.py's test_every_finish_reason_leaves_a_complete_record a served STOP.
@pytest.mark.slow
def test_stop_string_ends_the_answer_and_is_not_delivered(engine):
    full = text_of(engine.generate(chat_request("f", "Count from 1 to 10.", max_tokens=40)))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip()
    events = engine.generate(chat_request("s", "Count from 1 to 10.", max_tokens=40, stop=[stop]))
    assert text_of(events) == full[: full.index(stop)]
    assert events[-1].finished.finish_reason == chat_pb2.FINISH_REASON_STOP


def test_logs_never_carry_prompts_or_answers(server):
    marker = "ZEBRA-4711-SECRET"

    async def go():
        async with ChatStream(server.target) as s:
            s.send(chat_request("m", f"Repeat this code: {marker}", max_tokens=16))
            return (await s.until_done("m"))["m"]

    events = run(go())
    answer = text_of(events)
    log = server.log()
    assert "request finished" in log
    assert marker not in log
    assert answer.strip() and answer.strip() not in log
