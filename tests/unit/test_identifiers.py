"""Identifier rules on a held-out set: every valid number in every way people and models
write it is found with its exact raw span; no invalid one is."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finsieve.policy.matcher import StreamMatcher
from finsieve.policy.pack import Pack
from finsieve.policy.validators import VALIDATORS

REPO = Path(__file__).resolve().parents[2]
DEFAULT = Pack.load(REPO / "rules")
ROWS = [line.split("\t") for line in (REPO / "tests/data/identifiers.tsv").read_text().splitlines()
        if line and not line.startswith("#")]
FULL_WIDTH = {ord(c): chr(ord(c) + 0xFEE0) for c in "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"}
# Between groups: space, dash, dot, slash, thin, no-break and narrow no-break spaces, an en
# dash, a dash with spaces, an ideographic space; and nothing at all.
SEPARATORS = [" ", "-", ".", "/", "\u2009", "\u00a0", "\u202f", "\u2013", " - ", "\u3000", ""]


def written(number: str, grouping: str, sep: str) -> str:
    groups, pos = [], 0
    for size in map(int, grouping.split(",")):
        groups.append(number[pos : pos + size])
        pos += size
    return sep.join(groups)


def styles(rule_id: str, number: str, grouping: str) -> list[str]:
    out = [written(number, grouping, sep) for sep in SEPARATORS
           if sep or rule_id != "us-ssn"]  # nine digits run together are not taken for an SSN
    out.append(written(number, grouping, " ").translate(FULL_WIDTH))
    if rule_id == "iban":
        out.append(written(number, grouping, " ").lower())
    return out


def spans(text: str, rule_id: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    data = text.encode()
    m = StreamMatcher(DEFAULT.output)
    pos = 0
    while pos < len(data):  # in small chunks that split characters, as tokens do
        n = rng.randint(1, 5)
        m.feed(data[pos : pos + n])
        pos += n
    m.finish()
    return [data[x.start : x.end].decode() for x in m.matches if x.rule.id == rule_id]


@pytest.mark.parametrize(("rule_id", "valid", "number", "grouping"), ROWS,
                         ids=[f"{r[0]}-{r[2]}" for r in ROWS])
def test_held_out_identifiers(rule_id, valid, number, grouping):
    for i, style in enumerate(styles(rule_id, number, grouping)):
        for context in ("Number: {}. Thanks", "号码{}已登记"):
            found = spans(context.format(style), rule_id, seed=i)
            if valid == "1":
                assert found == [style], (style, found)
            else:
                assert found == [], (style, found)


def test_mixed_separators_and_a_number_inside_a_longer_run():
    assert spans("card 4111 1111-1111.1111 ok", "payment-card-number", 0) == ["4111 1111-1111.1111"]
    # A longer run of groups (up to 25 digits) with a card in it is redacted whole (issue
    # 42: a reader sees the card); a run of whole groups with none is not a card number.
    assert spans("ref 4111-1111-1111-1111-1111 ok", "payment-card-number", 0) == [
        "4111-1111-1111-1111-1111"]
    assert spans("ref 4111-1111-1111-1112-1111 ok", "payment-card-number", 0) == []
    assert spans("v 123-45-6789-1 ok", "us-ssn", 0) == []
    # A number after a full stop or a label is still one.
    assert spans("No.4111.1111.1111.1111.", "payment-card-number", 0) == ["4111.1111.1111.1111"]


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=40))
def test_validators_never_raise_on_hostile_text(text):
    """A rule author's regex can hand a validator anything (superscript digits, Ethiopic
    numerals, which are digits but not decimal ones): it says no, it does not crash."""
    for validator in VALIDATORS.values():
        assert validator(text) in (True, False)
    for validator in VALIDATORS.values():
        assert validator("\u00b2" * 16 + "\u1369" * 2) is False
