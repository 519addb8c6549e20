"""A card number typed in pieces over a conversation is one number: found whatever turn sits
between its halves, and when the model's answer completes it (issue #42, red-team review of
finding 1: F3). The default rule pack, the real input rules and the gateway's real storage
masking (Sensitive, Trace)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.preparer import Message
from finsieve.app.client import chat_request
from finsieve.auth import Principal
from finsieve.policy.inputs import apply_input_rules, conversation_matches
from finsieve.policy.pack import Pack
from gateway.sensitive import Sensitive, value_hash
from gateway.trace import Trace

from support.pan_scan import card_numbers

DEFAULT = Pack.load(Path(__file__).resolve().parents[2] / "rules")
KEY = b"k"
CARD = "4111111111111111"


@pytest.mark.parametrize("turns", [
    [("user", "card: 4111"), ("assistant", "ok"), ("user", "1111 1111 1111")],
    [("user", "4111 1111"), ("user", "and then"), ("user", "1111 1111")],
    [("user", "4111 1111"), ("assistant", "and then?"), ("user", "1111 1111")],
    [("user", "4111 1111"), ("assistant", "go on, 2 more groups"), ("user", "1111 1111")],
])
def test_a_turn_between_the_halves_does_not_hide_the_number(turns):
    roles, contents = [r for r, _ in turns], [c for _, c in turns]
    verdict = apply_input_rules(DEFAULT.input, [Message(r, c) for r, c in turns])
    assert [(e.rule_id, e.action) for e in verdict.events] == [("payment-card-number", "redact")]
    assert "".join(c for c in verdict.events[0].suppressed if c.isdigit()) == CARD
    assert card_numbers(" ".join(m["content"] for m in verdict.messages)) == []
    hashes: set[str] = set()
    stored = Sensitive(DEFAULT, KEY).messages(contents, hashes, roles)
    assert card_numbers(" ".join(stored)) == [] and stored[1] == contents[1]
    assert stored[2] != contents[2]  # the first half: its first 6 digits stay
    assert value_hash(KEY, CARD) in hashes


def test_without_roles_a_turn_without_digits_between_the_halves_is_read_past():
    hashes: set[str] = set()
    assert Sensitive(DEFAULT, KEY).messages(["4111 1111", "and then", "1111 1111"], hashes) == [
        "4111 11**", "and then", "**** 1111"]
    assert hashes == {value_hash(KEY, CARD)}


def test_digits_that_make_no_card_number_together_stay():
    for turns in (["card: 4111", "ok", "1111 1111 1112"], ["I have 4111 1111", "ok", "1111 1112 apples"]):
        assert conversation_matches(DEFAULT.input, turns, ["user", "assistant", "user"]) == []


def test_the_streams_are_at_most_three_whatever_the_conversation():
    from finsieve.policy.inputs import streams

    contents = [f"turn {i}" if i % 2 else "no digit" for i in range(200)]
    roles = ["user" if i % 3 else "assistant" for i in range(200)]
    orders = streams(contents, roles)
    assert len(orders) <= 3 and orders[0] == list(range(200))


def test_an_answer_that_completes_a_number_is_stored_masked_with_the_message():
    request = chat_request("split-answer", "Repeat my card, I start: 4111 1111 1111", max_tokens=8)
    trace = Trace(request, Principal("k1", "bank-a", "app"), Sensitive(DEFAULT, KEY))
    trace.delivered = ["11", "11"]  # the model's answer, token by token
    final = trace.final_record()
    stored = final["messages"][-1]["content"] + " " + final["delivered"]
    assert card_numbers(stored) == [], stored
    assert final["delivered"] == "1111" and "4111 11** ****" in final["messages"][-1]["content"]
    assert value_hash(KEY, CARD) in final["match_hashes"]
    # The record written before the answer holds the message as it shows alone.
    assert trace.started_record()["messages"][-1]["content"].endswith("4111 1111 1111")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
