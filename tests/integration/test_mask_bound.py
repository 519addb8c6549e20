"""Exact masks have a bounded cost (issue #42, finding 5).

With tens of thousands of block literals under one short prefix, building the exact ban
set of a state that ends in that prefix enumerates every one of them (60-400 ms on the
decode thread, where every stream waits). Past FINSIEVE_MASK_WORK_LIMIT the guard hands
out the base bans instead; the token sampled under them is checked exactly (is_banned),
and a refused one is banned at that position and drawn again. These tests hold the
bound (by counting the enumeration's prefix lookups, not by timing), that the bounded
path never lets a banned completion through, and that greedy decoding gives the same
answer as under the exact mask.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import engine as engine_module
from finsieve.app.client import chat_request
from finsieve.policy import masks as masks_module
from finsieve.policy.guard import Guard, Policy, Verdict
from finsieve.policy.masks import MaskTables, TokenTable
from finsieve.policy.matcher import StreamMatcher
from finsieve.policy.pack import Pack
from finsieve.policy.schema import Rule
from finsieve.v1 import chat_pb2

from support.mask_texts import PATTERNS, texts
from support.streams import text_of

PREFIX = "bloc"


def block_rule(patterns: list[str], rule_id: str = "listed") -> Rule:
    return Rule(rule_id, "d", "literal", tuple(patterns), "output", "block", "", (), 20,
                "high", (), "", "test")


def policy_of(table: TokenTable, patterns: list[str], work_limit: int,
              always_banned: list[int] | None = None) -> Policy:
    pack = Pack([block_rule(patterns)])
    masks = MaskTables(table, patterns, always_banned, work_limit=work_limit)
    return Policy(pack, masks, pack.version)


@pytest.fixture(scope="module")
def bpe(default_model_dir: Path) -> tuple[list[bytes], TokenTable]:
    from transformers import AutoTokenizer

    from engine.tokens import token_byte_table

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    vocab = token_byte_table(tok.get_vocab(), special)
    return vocab, TokenTable.build(vocab)


@pytest.fixture(scope="module")
def huge(bpe) -> list[str]:
    """50,000 block literals under one 4-character prefix, as the review's pack had."""
    rng = random.Random(42)
    out: set[str] = set()
    while len(out) < 50_000:
        out.add(PREFIX + "".join(rng.choice(string.ascii_lowercase) for _ in range(5)))
    return sorted(out)


class Lookups:
    """Counts the prefix lookups of the ban-set enumeration (the real ones still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        real = masks_module._Sorted.starting_with

        def counted(index, prefix: str) -> list[int]:
            self.n += 1
            return real(index, prefix)

        monkeypatch.setattr(masks_module._Sorted, "starting_with", counted)


def byte_ids(vocab: list[bytes], data: bytes) -> list[int]:
    """One single-byte token per byte (a byte-level vocabulary has them all)."""
    single = {t: i for i, t in enumerate(vocab) if len(t) == 1}
    return [single[bytes([b])] for b in data]


@pytest.mark.parametrize("text", [
    b"We " + PREFIX.encode(),  # many literals under the live suffix
    b"We " + PREFIX.encode() + b"\xd0",  # and a pending UTF-8 lead byte: once per group before
    b"We bl\xd0\xbec",  # a look-alike spelling (Cyrillic o): another state, same patterns
])
def test_a_huge_pack_never_enumerates_past_the_work_limit(bpe, huge, monkeypatch, text):
    vocab, table = bpe
    limit = masks_module.DEFAULT_WORK_LIMIT
    policy = policy_of(table, huge, limit, always_banned=[])
    guard = Guard(policy, vocab)
    guard.force(byte_ids(vocab, text))
    lookups = Lookups(monkeypatch)
    banned = guard.banned()
    # Before: every pattern under the live suffix was looked up (50,000 and more).
    assert lookups.n <= limit, lookups.n
    # (a step may overshoot by its own units: at most a join's)
    assert policy.masks is not None and policy.masks.bounded_work <= limit + masks_module.JOIN_UNITS
    assert guard.mask_exact is False and banned == policy.masks.always_banned
    assert policy.masks.over_limit == 1
    again = lookups.n
    guard.banned()  # the same state again: given up at once, not retried
    assert lookups.n == again and policy.masks.over_limit == 1

    # What it did not enumerate is still enforced: the exact check refuses a token just
    # when the exact mask (the unbounded reference) bans it.
    reference = set(policy.masks.ban_set_for(guard.matcher))
    candidates = [i for p in huge[:3000] for i in table.index.starting_with(p[len(PREFIX):])[:1]]
    candidates += [i for g in table.groups.values() for i in g.ids[:2]] + list(range(200, 260))
    assert reference & set(candidates) or guard.matcher.norm.pending  # (few complete "bloc" + Д…)
    for t in candidates:
        decision = guard.check(t, exact_mask=True)
        assert (decision is None) == (t in reference), vocab[t]
        if decision is not None:
            assert decision.verdict is Verdict.ACCEPT
            guard._undo_last()


def test_under_the_limit_the_exact_mask_is_built(bpe):
    vocab, table = bpe
    policy = policy_of(table, ["guaranteed returns"], masks_module.DEFAULT_WORK_LIMIT)
    guard = Guard(policy, vocab)
    guard.force(byte_ids(vocab, b"Our guaranteed ret"))
    banned = guard.banned()
    assert guard.mask_exact is True
    assert policy.masks is not None and banned == policy.masks.ban_set_for(guard.matcher)
    assert table.index.starting_with("urns")[0] in banned


# -- the bounded path lets nothing through, and chooses what the exact mask would -------

def greedy(guard: Guard, preferences: list[list[int]], max_redraws: int = 10_000) -> list[int]:
    """The engine's loop for greedy rows, one position a step: the first preferred token
    outside the row's ban list; checked exactly when the list was not the exact mask; a
    refused token banned at that position and the position drawn again."""
    out = []
    for prefs in preferences:
        bans = set(guard.banned())
        checked = not guard.mask_exact
        for _ in range(max_redraws):
            token = next((t for t in prefs if t not in bans), None)
            if token is None:
                return out  # nothing allowed: the engine halts
            decision = guard.check(token, exact_mask=checked)
            if decision is not None:
                break
            guard.refuse(token)
            bans.add(token)
        assert decision is not None and decision.verdict is Verdict.ACCEPT, decision
        out.append(token)
    return out


@pytest.fixture(scope="module")
def small(bpe) -> tuple[Policy, Policy, list[int]]:
    """The mask property tests' patterns, exact (no limit) and bounded (limit 1: every
    state with a live suffix or a pending byte goes over it); and candidate tokens that
    complete them."""
    _, table = bpe
    exact = policy_of(table, PATTERNS, 0)
    assert exact.masks is not None
    bounded = policy_of(table, PATTERNS, 1, always_banned=exact.masks.always_banned)
    pool = {i for g in table.groups.values() for i in g.ids[:4]}
    for p in PATTERNS:
        for k in range(1, len(p)):
            pool.update(table.index.starting_with(p[k:])[:4])
            pool.update(table.index.starting_with(" " + p[k:])[:4])
    return exact, bounded, sorted(pool)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_bounded_path_never_lets_a_banned_completion_through(bpe, small, data):
    vocab, _ = bpe
    exact, bounded, pool = small
    text = data.draw(texts(vocab))
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    extra = data.draw(st.lists(st.integers(0, len(vocab) - 1), min_size=8, max_size=8))
    preferences = [rng.sample(pool + extra, 40) for _ in range(4)]
    answers = []
    for policy in (exact, bounded):
        guard = Guard(policy, vocab)
        guard.force(byte_ids(vocab, text))
        answers.append(greedy(guard, preferences))
    assert answers[0] == answers[1], text  # the same tokens as under the exact mask
    # Zero leak: no token chosen completes a block literal (the streaming matcher's word).
    m = StreamMatcher(bounded.pack.output)
    m.feed(text)
    for t in answers[1]:
        assert not m.feed(vocab[t]), (text, vocab[t])


def test_the_bounded_path_is_taken_and_agrees_with_the_exact_mask(bpe, small):
    """Deterministic: texts that end inside a pattern, or inside a character, go over a
    limit of 1, and the model's first choices complete the pattern."""
    vocab, table = bpe
    exact, bounded, _ = small
    assert bounded.masks is not None
    for text in (b"Our guaranteed ret", b"it is risk", "稳赚不".encode(), "稳赚不".encode()[:-1]):
        rest = {"Our guaranteed ret": "urns", "it is risk": " free"}.get(text.decode("utf-8", "ignore"))
        first = table.index.starting_with(rest)[:5] if rest else [
            i for g in table.groups.values() for i in g.ids][:200]
        preferences = [first + list(range(100, 140))] * 3
        answers = []
        for policy in (exact, bounded):
            guard = Guard(policy, vocab)
            guard.force(byte_ids(vocab, text))
            answers.append(greedy(guard, preferences))
        assert answers[0] == answers[1] != [], text
    assert bounded.masks.over_limit > 0


# -- the engine: same answer, and the redraws are bounded -------------------------------

BLOCKED = ["type of financial", "tracks and aggregates", "a single, widely"]


def _engine_policy(engine, work_limit: int) -> Policy:
    """The blocked phrases, and look-alikes under each of their prefixes: with a limit of 1,
    a text inside a phrase has more patterns under its live suffix than the limit."""
    table = TokenTable.build(engine.token_bytes)
    fillers = [p[:k] + "qzx" for p in BLOCKED for k in range(1, len(p))]
    return policy_of(table, BLOCKED + fillers, work_limit)


def _answer(engine, monkeypatch, policy: Policy, max_tokens: int = 28) -> list:
    monkeypatch.setattr(engine, "policy", lambda: policy)
    return engine.generate(chat_request("b", "What is an index fund?", max_tokens=max_tokens))


def test_the_engine_decodes_greedy_answers_alike_with_and_without_the_bound(engine, monkeypatch):
    exact = _engine_policy(engine, 0)
    bounded = _engine_policy(engine, 1)
    want = _answer(engine, monkeypatch, exact)
    got = _answer(engine, monkeypatch, bounded)
    assert bounded.masks is not None and bounded.masks.over_limit > 0  # the bound was hit
    assert [e.SerializeToString() for e in got] == [e.SerializeToString() for e in want]
    blocked = [e.policy_event for e in got if e.WhichOneof("event") == "policy_event"]
    assert any(p.action == "block" for p in blocked), "the rules steered the answer"
    for phrase in BLOCKED:
        assert phrase not in text_of(got).lower()


def test_past_the_redraw_cap_the_sequence_halts_fail_closed(engine, monkeypatch):
    monkeypatch.setattr(engine_module, "MAX_REDRAWS", 0)
    events = _answer(engine, monkeypatch, _engine_policy(engine, 1))
    finished = events[-1].finished
    assert finished.finish_reason == chat_pb2.FINISH_REASON_CONTENT_FILTER
    halts = [e.policy_event for e in events
             if e.WhichOneof("event") == "policy_event" and e.policy_event.action == "halt"]
    assert halts and "refused" in halts[-1].message
    for phrase in BLOCKED:
        assert phrase not in text_of(events).lower()
