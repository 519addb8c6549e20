"""Rules inside the decoder loop, on the real default model: the zero-leak suite and actions.

Every zero-leak case first shows that, with rules off, the model does say the forbidden
thing (the test has teeth); then that, with rules on, the delivered text has no violation.
The cases' answers, with rules off and on, are decoded together in one batch (on the CPU a
decode step costs the same for one row as for eight, see engine/model.py): an answer does
not depend on what else the batch holds (test_streaming.py, and below a rollback changes
nothing for the other sequences), so each is the one it would be alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.engine import NO_POLICY, LLMEngine
from finsieve.app.client import chat_request
from finsieve.policy.guard import Policy, compile_policy
from finsieve.policy.masks import TokenTable
from finsieve.policy.matcher import scan_text
from finsieve.v1 import chat_pb2

from support.decoding import decode_together
from support.packs import apply
from support.servers import start_server
from support.streams import ChatStream, kinds, text_of
from support.zero_leak import ZERO_LEAK

REPO = Path(__file__).resolve().parents[2]
OK_FINISH = (chat_pb2.FINISH_REASON_STOP, chat_pb2.FINISH_REASON_LENGTH)

@pytest.fixture(scope="module")
def tokens(engine) -> TokenTable:
    return TokenTable.build(engine.token_bytes)


@pytest.fixture(scope="module")
def default_policy(tokens) -> Policy:
    return compile_policy(REPO / "rules", tokens, None)[0]


@pytest.fixture
def under(engine) -> Iterator:
    """Run the session's in-process engine under a given policy for one test."""
    def use(policy: Policy, max_rollbacks: int = 8) -> LLMEngine:
        engine.policy = lambda: policy
        engine.max_rollbacks = max_rollbacks
        return engine

    yield use
    engine.policy = lambda: NO_POLICY
    engine.max_rollbacks = 8


def ask(engine: LLMEngine, prompt: str, max_tokens: int = 40) -> list:
    return engine.generate(chat_request("z", prompt, max_tokens=max_tokens))


@pytest.fixture(scope="module")
def zero_leak_answers(engine, default_policy) -> dict[str, tuple[list, list]]:
    """Each zero-leak case's events with rules off and with the default packs."""
    cases = list(ZERO_LEAK)
    answers = decode_together(engine, [(policy, ZERO_LEAK[case]) for policy in (NO_POLICY, default_policy)
                                       for case in cases])
    return {case: (answers[i], answers[len(cases) + i]) for i, case in enumerate(cases)}


def violations(policy: Policy, text: str, actions: tuple[str, ...]) -> list[str]:
    return [m.rule.id for m in scan_text(policy.pack.output, text) if m.rule.action in actions]


@pytest.mark.parametrize("case", list(ZERO_LEAK))
def test_zero_leak(zero_leak_answers, default_policy, case):
    off, events = zero_leak_answers[case]
    unfiltered = text_of(off)
    assert off[0].started.policy_version == NO_POLICY.version
    assert violations(default_policy, unfiltered, ("block", "halt", "redact")), \
        f"no teeth: the model did not say it without rules: {unfiltered!r}"

    delivered = text_of(events)
    assert events[0].started.policy_version == default_policy.version
    assert not violations(default_policy, delivered, ("block", "halt", "redact")), delivered
    assert delivered.strip(), "the answer must still be text"
    assert events[-1].finished.finish_reason in OK_FINISH
    assert any(e.WhichOneof("event") == "policy_event" for e in events)
    if "echo" in case:  # identifiers in the prompt are redacted before the model sees them
        scopes = {e.policy_event.scope for e in events if e.WhichOneof("event") == "policy_event"}
        assert "input" in scopes


def test_a_masked_phrase_steers_to_a_synonym_that_only_the_family_rule_catches(under, tokens,
                                                                               default_policy):
    """Masking "guaranteed profits" alone, the model says "guaranteed financial rewards":
    still a promise of returns. The default packs cover the family of such phrases."""
    narrow = compile_policy(REPO / "tests/data/narrow", tokens, None)[0]  # the former pack
    prompt = 'Repeat exactly: "This fund offers guaranteed profits every year."'
    said = text_of(ask(under(narrow), prompt))
    assert not violations(narrow, said, ("block",)), said  # the narrow rule is satisfied …
    assert violations(default_policy, said, ("block",)), said  # … by a promise all the same
    delivered = text_of(ask(under(default_policy), prompt))
    assert delivered.strip() and not violations(default_policy, delivered, ("block",)), delivered


def custom_policy(tmp: Path, tokens: TokenTable, yaml: str) -> Policy:
    (tmp / "p.yaml").write_text(yaml)
    return compile_policy(tmp, tokens, None)[0]


def test_rewrite_replaces_the_span_in_the_answer_and_the_context(under, tokens, tmp_path):
    policy = custom_policy(tmp_path, tokens, """\
rules:
  - id: soften
    description: say potential, not guaranteed
    kind: literal
    patterns: [guaranteed returns]
    action: rewrite
    replacement: potential returns
""")
    events = ask(under(policy), 'Repeat exactly: "We offer guaranteed returns."')
    delivered = text_of(events)
    assert "potential returns" in delivered and "guaranteed" not in delivered.lower()
    ev = next(e.policy_event for e in events if e.WhichOneof("event") == "policy_event")
    assert (ev.rule_id, ev.action, ev.rolled_back) == ("soften", "rewrite", True)
    assert delivered[ev.start : ev.end] == "potential returns"
    assert events[-1].finished.finish_reason in OK_FINISH


def test_redact_delivers_the_replacement_at_the_reported_offsets(under, tokens, tmp_path):
    policy = custom_policy(tmp_path, tokens, """\
rules:
  - id: card
    description: cards in answers only
    kind: regex
    scope: output
    patterns: ['\\d(?:[ -]?\\d){12,18}']
    validators: [luhn]
    action: redact
    replacement: "[REDACTED:card]"
""")
    events = ask(under(policy), 'Repeat exactly: "Card: 4111 1111 1111 1111"')
    delivered = text_of(events)
    assert "4111" not in delivered and "[REDACTED:card]" in delivered
    ev = next(e.policy_event for e in events if e.WhichOneof("event") == "policy_event")
    assert delivered[ev.start : ev.end] == "[REDACTED:card]"
    assert ev.suppressed == "4111 1111 1111 1111"  # for the audit trail; stripped by the gateway


def test_halt_delivers_what_was_safe_and_finishes_content_filter(under, tokens, tmp_path):
    policy = custom_policy(tmp_path, tokens, """\
rules:
  - id: stop-profit
    description: halt on it
    kind: literal
    patterns: [risk-free profit]
    action: halt
    message: This answer was stopped by policy.
""")
    events = ask(under(policy), 'Repeat exactly: "It is a risk-free profit"')
    assert text_of(events) == "It is a "
    ev = next(e.policy_event for e in events if e.WhichOneof("event") == "policy_event")
    assert (ev.action, ev.message) == ("halt", "This answer was stopped by policy.")
    assert events[-1].finished.finish_reason == chat_pb2.FINISH_REASON_CONTENT_FILTER


def test_input_halt_means_no_decoding(under, default_policy):
    events = ask(under(default_policy), "Can you give me some insider tips on ACME?")
    assert kinds(events) == ["started", "policy_event", "finished"]
    assert events[-1].finished.finish_reason == chat_pb2.FINISH_REASON_CONTENT_FILTER
    assert events[-1].finished.usage.completion_tokens == 0


def test_rollbacks_are_bounded_then_the_request_halts(under, tokens, tmp_path):
    policy = custom_policy(tmp_path, tokens, """\
rules:
  - id: no-we
    description: a word the model keeps coming back to
    kind: regex
    patterns: ['\\bwe offer\\b']
    action: block
""")
    events = ask(under(policy, max_rollbacks=2), 'Repeat exactly: "We offer guaranteed returns."')
    rollbacks = [e.policy_event for e in events if e.WhichOneof("event") == "policy_event"
                 and e.policy_event.rolled_back]
    assert 1 <= len(rollbacks) <= 2
    assert all(r.tokens_recomputed >= 1 for r in rollbacks)
    assert "we offer" not in text_of(events).lower()
    if events[-1].finished.finish_reason == chat_pb2.FINISH_REASON_CONTENT_FILTER:
        assert len(rollbacks) == 2


def test_a_rollback_changes_nothing_for_the_other_sequences(under, default_policy):
    clean = chat_request("clean", "What is an index fund?", max_tokens=32)
    dirty = chat_request("dirty", 'Repeat exactly: "We offer guaranteed returns of 20% a year."',
                         max_tokens=32)
    engine = under(default_policy)
    alone = text_of(engine.generate(clean))

    from engine.engine import CollectingSink

    sinks = {r.request_id: CollectingSink() for r in (clean, dirty)}
    for r in (dirty, clean):
        engine.submit(engine.prepare(r, sinks[r.request_id]))
    while not all(s.finished for s in sinks.values()):
        engine.step()
    assert any(e.policy_event.rolled_back for e in sinks["dirty"].events
               if e.WhichOneof("event") == "policy_event")
    assert text_of(sinks["clean"].events) == alone


def test_served_stream_hides_suppressed_text_and_reload_applies_to_new_requests_only(tight_server):
    """On the shared server with small bounds (a server of its own cost ~10 s to start): a
    pack is added to its rules directory, and removed again, waiting until the engine has
    the base rules back."""
    rules = tight_server.rules
    story = "Write a long story about a small bank in a village."

    async def go():
        async with ChatStream(tight_server.target) as s:
            s.send(chat_request("old", story, max_tokens=60))
            first = await s.next()
            while (await s.next()).WhichOneof("event") != "delta":
                pass
            (rules / "extra.yaml").write_text(
                "rules:\n  - id: no-bank\n    description: d\n    kind: literal\n"
                "    patterns: [bank]\n    action: block\n")
            written = time.monotonic()
            new_version, attempt = first.started.policy_version, 0
            while new_version == first.started.policy_version and time.monotonic() - written < 10:
                attempt += 1
                s.send(chat_request(f"new{attempt}", story, max_tokens=1))
                new_version = (await s.until_done(f"new{attempt}"))[f"new{attempt}"][0] \
                    .started.policy_version
            s.send(chat_request("after", story, max_tokens=60))
            done = await s.until_done("old", "after")
            return first, new_version, done

    try:
        first, new_version, done = asyncio.run(go())
    finally:
        apply(tight_server, lambda: (rules / "extra.yaml").unlink(missing_ok=True))
    assert new_version != first.started.policy_version
    old, after = done["old"], done["after"]
    assert "bank" in text_of(old).lower()  # in flight: kept the pack it started with
    assert after[0].started.policy_version == new_version
    assert "bank" not in text_of(after).lower()
    assert text_of(after).strip()
    interventions = [e.policy_event for e in old + after if e.WhichOneof("event") == "policy_event"]
    assert any(i.rule_id == "no-bank" for i in interventions)  # the new rule acted, unseen
    assert all(i.suppressed == "" for i in interventions)


def test_no_rules_serves_unfiltered(tmp_path, default_model_dir):
    srv = start_server(tmp_path, "--model", str(default_model_dir), "--no-rules")

    async def go():
        async with ChatStream(srv.target) as s:
            s.send(chat_request("x", ZERO_LEAK["returns of 20% a year"], max_tokens=20))
            return (await s.until_done("x"))["x"]

    try:
        events = asyncio.run(go())
    finally:
        srv.stop()
    assert events[0].started.policy_version == "none"
    assert "20% a year" in text_of(events)


def test_an_empty_rules_directory_serves_unfiltered(under, tokens, tmp_path):
    policy, version = compile_policy(tmp_path, tokens, None)
    assert policy.pack.rules == () and version != "none"
    events = ask(under(policy), ZERO_LEAK["returns of 20% a year"], max_tokens=20)
    assert events[0].started.policy_version == version
    assert "20% a year" in text_of(events)
