"""PCI DSS 3.4: no card number in clear anywhere the gateway writes, whatever the field or
spelling (issue #42, finding 1). Real server (gateway, engine, the real model, embedded
Valkey), real gRPC, the officers' real CLI.

The scanner (`card_numbers`, tests/support/pan_scan.py) looks for what a reader would take for one
card number; its module says what it leaves out by shape, and none of the numbers sent here
has one of those shapes.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from finsieve.app.client import chat_request
from finsieve.policy.inputs import apply_input_rules
from finsieve.policy.matcher import StreamMatcher
from finsieve.policy.pack import Pack
from gateway.sensitive import value_hash

from support.pan_scan import RUN, card_numbers, stored_texts
from support.servers import Server, wait_cached
from support.streams import ChatStream, text_of

# Luhn-valid test numbers of the card networks, in spellings a reader takes for one number.
COMMAS = "4111,1111,1111,1111"
UNDERSCORES = "4111_1111_1111_1111"
SPACED_DASHES = "4111 - 1111 - 1111 - 1111"
DOUBLE_DOTS = "5500..0000..0000..0004"
USER = "4111 1111 1111 1111"  # metadata `user`: an index of the trail
TAG = "3782_822463_10005"  # another metadata key's value (Amex)
STOP = "4000_0566_5566_5556"  # a stop sequence
REQUEST_ID = "pci-6011,0009,9013,9424"  # the request id: an index too
SPLIT = ("5425 2334", "3010 9903")  # one number over two user messages
# What the model writes on its own, from an input that holds no card number: the four
# groups of 4242 4242 4242 4242 joined by ", " (24 greedy tokens: the fourth and its ", ").
# Worded so that both CPU paths (llama.cpp's Q8_0 and the float32 reference) write all four:
# with "commas only:" the llama.cpp path wrote one group and stopped.
ECHO_PROMPT = "Write these numbers separated by commas: 4242, 4242, 4242 and 4242"

def test_the_scanner_finds_every_spelling_and_skips_what_the_server_must_write():
    for card in (COMMAS, UNDERSCORES, SPACED_DASHES, DOUBLE_DOTS, USER, TAG, STOP, "4111111111111111",
                 "6011\u00a00009\u00a09013\u00a09424", "{finsieve-audit}:idx:user:4111 1111 1111 1111"):
        assert card_numbers(f'"x":"a {card}."') != [], card
    assert card_numbers(REQUEST_ID) != []
    harmless = ('"ts_ms":1764811234567,"seq":12,"prev":"4111111111111111af09",'
                '"audit_id":"00000000000000000012","user":"4111 11** **** 1111",'
                "$13\r\n1764811234567\r\n$20\r\n00000000000000000012\r\n 1764811234.567890 "
                "2025-12-04T01:16:30.123456Z, 1,234,567.89 and 127.0.0.1:50051")
    assert card_numbers(harmless) == []


DEFAULT = Pack.load(Path(__file__).resolve().parents[2] / "rules")


def _cards(text: str, seed: int) -> list[str]:
    """The card numbers the default output rules find, fed in small chunks as tokens come."""
    rng, data = random.Random(seed), text.encode()
    m, pos = StreamMatcher(DEFAULT.output), 0
    while pos < len(data):
        n = rng.randint(1, 5)
        m.feed(data[pos : pos + n])
        pos += n
    m.finish()
    return [data[x.start : x.end].decode() for x in m.matches if x.rule.id == "payment-card-number"]


@pytest.mark.parametrize("card", [
    COMMAS, UNDERSCORES, SPACED_DASHES, DOUBLE_DOTS, TAG, STOP, "4111，1111，1111，1111",
    "4111、1111、1111、1111", "4111 | 1111 | 1111 | 1111", "6011,0009,9013,9424",
    "4242, 4242, 4242, 4242", "3782,822463,10005"])
def test_a_card_number_with_any_short_punctuation_between_its_groups_is_found(card):
    for i, context in enumerate(("Number: {}. Thanks", "1. {}, ok", "号码{}已登记")):
        assert _cards(context.format(card), seed=i) == [card], context.format(card)


@pytest.mark.parametrize("text", [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13", "12, 15, 18, 21, 24, 27, 30, 33",
    "1,234,567,890,123.45", "$4242, $4242, $4242, $4242", "4242, 4242, 4242 and 4242",
    "4111,1111,1111,1112", "4,111,111,111,111,111", "10; 20; 30; 40; 50; 60; 70; 80; 90",
    "2019, 2020, 2021, 2022", "call +86 138 0013 8000 or 2025-12-04 12:30:45",
    "4111_1111_1111_1111_1111_1111_1111", "4111_1111_1111_1112_1111"])
def test_lists_amounts_longer_runs_and_bad_check_digits_are_not_cards(text):
    # (12151821242730 33 and 4111 1111 1111 1111 1111 hold Luhn-valid digits: a list of
    # two-digit numbers and a run of more than 25 digits are no card number to a reader.)
    assert _cards(f"See {text} here.", seed=0) == []


# Digits of other scripts: \d takes them all, and a card rule has no letters, so no script
# of its digits makes its match foreign text (scripts.py).
OTHER_DIGITS = {
    "arabic-indic": "٠١٢٣٤٥٦٧٨٩", "extended arabic-indic": "۰۱۲۳۴۵۶۷۸۹",
    "devanagari": "०१२३४५६७८९", "bengali": "০১২৩৪৫৬৭৮৯", "thai": "๐๑๒๓๔๕๖๗๘๙",
    "full-width": "０１２３４５６７８９",
    # Digits whose shapes look like other Latin digits (Bengali ৪ like 8, ৭ like 9): read by
    # their value, not by the look-alike mapping.
    "gurmukhi": "੦੧੨੩੪੫੬੭੮੯", "oriya": "୦୧୨୩୪୫୬୭୮୯", "malayalam": "൦൧൨൩൪൫൬൭൮൯"}
NATIVE = [f"{n[:4]}{sep}{n[4:8]}{sep}{n[8:12]}{sep}{n[12:]}".translate(str.maketrans("0123456789", digits))
          for digits in OTHER_DIGITS.values()
          for n in ["4111111111111111", "4929721567327409"]
          for sep in (" ", "-", ",", "")]
# What a reader still takes for one number (the reviewer's list): digit by digit, long or
# symbol separators, groupings outside the networks' shapes, an extra group beside a card.
SPELLED = [
    "4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1", ",".join("4111111111111111"),
    "_".join("4111111111111111"), " ".join("4111111111111111"), "4111 -- 1111 -- 1111 -- 1111",
    "**4111** **1111** **1111** **1111**", "4111¦1111¦1111¦1111", "4111$1111$1111$1111",
    "4111°1111°1111°1111", "4111¤1111¤1111¤1111", "4111😀1111😀1111😀1111",
    "4111🔹1111🔹1111🔹1111", "4111_111111111111", "41111111,11111111", "411,111,111,111,1111",
    "411111111111,1111", "411111_1111111111", "4111*1111*11111111", "41111,11111,11111,1",
    "41,11,11,11,11,11,11,11", "4111,1111,1111,1111,111", "4111,1111,1111,1111,7",
    "7,4111,1111,1111,1111", "4111_1111_1111_1111_1", "12_4111_1111_1111_1111",
    "4111_1111_1111_1111_1111", "4111,1111,1111,1111,1111", "4111,1111_1111.1111"]


def _stored(text: str) -> str:
    from gateway.sensitive import Sensitive
    return Sensitive(DEFAULT, b"k").text(text, set())


@pytest.mark.parametrize("card", NATIVE + SPELLED)
def test_every_spelling_a_reader_takes_for_one_number_is_redacted_in_input_output_and_store(card):
    from engine.preparer import Message
    for i, context in enumerate(("Number: {}. Thanks", "1. {}, ok", "号码{}已登记")):
        text = context.format(card)
        # The Markdown stars around the number are not part of it; one group of digits
        # after a list's "1. " is redacted with it (a run of groups that holds a card).
        span = card.strip("*")
        if i == 1 and card.isdecimal():
            span, context = "1. " + card, "{}, ok"
        assert _cards(text, seed=i) == [span], text
        verdict = apply_input_rules(DEFAULT.input, [Message("user", text)])
        assert verdict.messages[0]["content"] == context.format(
            card.replace(span, "[REDACTED:card]") if span in card else "[REDACTED:card]"), text
        assert card_numbers(_stored(text)) == [], text
        assert card not in _stored(text)


def test_regex_scripts_reads_no_letter_in_regex_syntax():
    from finsieve.policy.scripts import LATIN, regex_scripts
    for pattern in (r"\d{4}[\p{P} ]\d{4}", r"\d\p{Sm}\P{L}\pN\N{EM DASH}\d", r"(?P<first>\d)(?P=first)",
                    r"(?<sep>[,_])\d(?&sep)\g<sep>\d", r"(?P>sep)(?(sep)\d|\s)", r"\d(?i:\d)\b",
                    r"[[:digit:]]\X\m\d\M", r"\d++(?>\d)\d{2,}"):
        assert regex_scripts(pattern) == frozenset(), pattern
    assert regex_scripts(r"guaranteed\p{P}(?P<r>returns)") == {LATIN}
    assert regex_scripts(r"(?P<x>\d)caf\N{LATIN SMALL LETTER E WITH ACUTE}") == {LATIN}
    # The card and SSN rules spell no letter (the PRC ID rule has its check letter X).
    for r in DEFAULT.output.regexes + DEFAULT.input.regexes:
        if r.rule.id in ("payment-card-number", "us-ssn"):
            assert r.scripts == frozenset(), r.rule.id


def test_a_digit_of_any_script_is_no_letter_of_it():
    from finsieve.policy.scripts import ALNUM, LATIN, accepts, script_tag
    assert {script_tag(d) for digits in OTHER_DIGITS.values() for d in digits} == {ALNUM}
    # A span of Devanagari digits counts even for a pattern written in Latin letters.
    assert accepts(frozenset({LATIN}), bytes(script_tag(c) for c in "४१११ ११११"))


def test_a_number_split_over_two_messages_is_redacted_and_masked_in_both():
    from engine.preparer import Message
    from gateway.sensitive import Sensitive

    turns = [f"My card number is {SPLIT[0]}", f"{SPLIT[1]}. Repeat it.", "Thanks, 1234"]
    verdict = apply_input_rules(DEFAULT.input, [Message("user", t) for t in turns])
    assert [m["content"] for m in verdict.messages] == [
        "My card number is [REDACTED:card]", "[REDACTED:card]. Repeat it.", "Thanks, 1234"]
    assert [(e.rule_id, e.suppressed) for e in verdict.events] == [
        ("payment-card-number", f"{SPLIT[0]} {SPLIT[1]}")]
    hashes: set[str] = set()
    assert Sensitive(DEFAULT, b"k").messages(turns, hashes) == [
        "My card number is 5425 23**", "**** 9903. Repeat it.", "Thanks, 1234"]
    assert hashes == {value_hash(b"k", "".join(SPLIT))}
    # Digits at a boundary that are no card number together stay as they are.
    apart = apply_input_rules(DEFAULT.input, [Message("user", "I have 4111 1111"),
                                              Message("user", "1111 1112 apples")])
    assert not apart.events


def _digits(text: str) -> str:
    return re.sub(r"\D", "", text)


def _requests():
    a = chat_request("pci-fields", f"Repeat exactly: {COMMAS} and {UNDERSCORES}.", max_tokens=6,
                     stop=[STOP])
    a.metadata.update({"app": "mobile", "user": USER, "loyalty": TAG})
    b = chat_request(REQUEST_ID, f"Repeat: {SPACED_DASHES} and {DOUBLE_DOTS}", max_tokens=6)
    c = chat_request("pci-split", f"My card number is {SPLIT[0]}", max_tokens=6)
    c.messages.add(role="user", content=f"{SPLIT[1]}. Repeat it.")
    d = chat_request("pci-echo", ECHO_PROMPT, max_tokens=24)
    return [a, b, c, d]


def _cli(server: Server, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "audit", *args, "--target",
                          server.audit_target, "--state-dir", str(server.state)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_no_card_number_in_clear_in_valkey_its_aof_the_exports_or_the_log(server):
    requests = _requests()

    async def chat() -> dict[str, list]:
        async with ChatStream(server.target) as s:
            for r in requests:
                s.send(r)
            return await s.until_done(*(r.request_id for r in requests), timeout=240)

    events = asyncio.run(chat())
    for r in requests:  # the answer is cached once its final audit record is in
        assert events[r.request_id][-1].WhichOneof("event") == "finished", events[r.request_id][-1]
        wait_cached(server, events[r.request_id], r)

    async def stored() -> dict[str, str]:
        client = server.valkey()
        try:
            return await stored_texts(client)
        finally:
            await client.aclose()

    # The officers' exports first: their queries are access records in the trail too.
    sources = {"export jsonl": _cli(server, "export", "--since", "1h")}
    for fmt in ("jsonl", "csv", "table"):
        sources[f"query {fmt}"] = _cli(server, "query", "--since", "1h", "--limit", "1000",
                                       "--format", fmt)
    by_user = _cli(server, "query", "--user", USER, "--format", "jsonl")
    by_id = _cli(server, "query", "--request-id", REQUEST_ID, "--format", "jsonl")
    matched = _cli(server, "query", "--match", "".join(SPLIT), "--format", "jsonl")
    sources["query --user"], sources["query --request-id"] = by_user, by_id
    sources["query --match"] = matched
    valkey = asyncio.run(stored())
    assert len(valkey) > 20 and any(where.startswith("aof ") for where in valkey)
    sources.update(valkey)
    sources["server log"] = server.log()

    assert "pci-split" in sources["export jsonl"]  # the records are there to be scanned
    # On the way to the client, too: the model wrote 4242, 4242, 4242, 4242 itself.
    sources.update({f"delivered to {r.request_id}": text_of(events[r.request_id]) for r in requests})
    leaks = {where: found for where, text in sources.items() if (found := card_numbers(text))}
    assert leaks == {}
    # The split number: neither half is anywhere whole (masked, the first keeps 6 digits,
    # the second 4).
    for where, text in sources.items():
        runs = [_digits(m.group()) for m in RUN.finditer(text)]
        assert not [r for r in runs if any(_digits(half) in r for half in SPLIT)], where

    # Officers still find the records: by user and by request id (looked up by their keyed
    # hash), and the split number by --match.
    assert {(r["request_id"], r["type"]) for r in map(json.loads, by_user.splitlines())} == {
        ("pci-fields", "request_started"), ("pci-fields", "request")}
    assert len(by_id.splitlines()) == 2
    final = next(r for r in map(json.loads, by_user.splitlines()) if r["type"] == "request")
    assert final["user"] == "4111 11** **** 1111"
    assert final["metadata"]["loyalty"] == "3782_82****_*0005"
    assert {json.loads(r)["request_id"] for r in matched.splitlines()} == {"pci-split"}
    assert "[REDACTED:card]" in text_of(events["pci-echo"])
    # The model never read the split number: the input rules redacted it from both messages.
    assert [e.policy_event.rule_id for e in events["pci-split"] if e.HasField("policy_event")] == [
        "payment-card-number"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
