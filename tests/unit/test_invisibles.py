"""Invisible characters and line-break hyphens inside and between the words of a rule's phrase.

Issue #42, finding 6: still invisible to the rules inside "guaranteed returns" were the
format characters outside Default_Ignorable_Code_Point (U+FFF9-FFFB, U+0600-0605, U+070F,
U+08E2, the Egyptian hieroglyph format controls U+13430-1343F), C0/C1 controls inside a word,
an invisible character standing as the only separator between two words, and a hyphen + line
break inside a word. Each case is checked in the output (the streaming matcher, fed at every
byte boundary, byte by byte, and token by token with the real tokenizer, never releasing a
byte of the match before it is found) and in the input rules, which share the view. Text that
only looks like a join (hyphenated words, list dashes, the risk-free rate, a negated promise)
stays clean.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tokens import token_byte_table
from finsieve.policy.guard import Guard, Policy, Verdict
from finsieve.policy.inputs import apply_input_rules
from finsieve.policy.matcher import Match, StreamMatcher, scan_text
from finsieve.policy.normalize import normalize, normalize_other
from finsieve.policy.pack import Pack

REPO = Path(__file__).resolve().parents[2]
DEFAULT = Pack.load(REPO / "rules")
FAMILY = "promissory-guaranteed-returns-en"

# Format characters that are not Default_Ignorable_Code_Point, and controls that are not
# whitespace: the listed ones, and the Hieroglyph controls Python's own Unicode 14 data lacks.
FORMAT_CHARS = ["\ufff9", "\ufffa", "\ufffb", *map(chr, range(0x600, 0x606)), "\u070f", "\u08e2",
                "\U00013430", "\U00013438", "\U00013439", "\U0001343f"]
CONTROLS = ["\x00", "\x01", "\x08", "\x0e", "\x1b", "\x1c", "\x1f", "\x7f", "\x80", "\x9b", "\x9f"]
# Line breaks that web pages and chat bubbles show as nothing (a review's finding: they read
# as a space inside a word, so `gua\x85ranteed` passed).
UNSEEN_BREAKS = ["\x0b", "\x0c", "\x85", "\u2028", "\u2029"]
# The only separator between two words.
SEPARATORS = ["\u200b", "\u200c", "\u200d", "\u200e", "\u200f", "\u00ad", "\u2060", "\ufeff",
              "\u061c", "\ufff9", "\u0600", "\x00", "\x9b", "\U00013430"]
LINE_BREAK_HYPHENS = ["-\n", "-\r\n", "-  \n", "- \r\n  ", "-\n\t", "\u00ad\n", "\u00ad\r\n",
                      "\u2010\n", "\u2011\n", "-\u2028", "-\x85", "-\r", "-\x0b", "-\u2029"]

# raw phrase -> the evasion's name; each one must be read as "guaranteed returns".
EVASIONS: dict[str, str] = {}
for ch in FORMAT_CHARS + CONTROLS + UNSEEN_BREAKS:
    EVASIONS[f"guar{ch}anteed returns"] = f"U+{ord(ch):04X} inside a word"
    EVASIONS[f"guaranteed ret{ch}urns"] = f"U+{ord(ch):04X} inside the second word"
for ch in SEPARATORS:
    EVASIONS[f"guaranteed{ch}returns"] = f"U+{ord(ch):04X} as the only separator"
for hy in LINE_BREAK_HYPHENS:
    EVASIONS[f"guaran{hy}teed returns"] = f"line-break hyphen {hy!r}"
EVASIONS["guaran\u00ad\nteed\u200dreturns"] = "a line-break soft hyphen, then ZWJ between the words"
EVASIONS["gua\u200bran\u2060teed\ufffb returns"] = "three format characters inside a word"
EVASIONS["gua\x01ran\x7fteed\x9b returns"] = "three controls inside a word"
EVASIONS["gua\u200bran\x00teed\ufffb returns"] = "format characters and a control inside a word"
EVASIONS["guaranteed\u200bfinancial\x00returns"] = "a format character and a control as separators"
EVASIONS["guar\x00anteed\u200breturns"] = "a control inside a word, a format character between"
CASES = list(EVASIONS)


def _fed(rules, chunks: list[bytes]) -> list[Match]:
    """Matches of chunks fed to a streaming matcher; asserts that no byte of a match lay
    before a safe point reported before the match was found (it would have been released)."""
    m = StreamMatcher(rules)
    released = 0
    found: list[Match] = []
    for chunk in chunks:
        new = m.feed(chunk)
        for x in new:
            assert x.start >= released, (chunks, x)
        found += new
        released = max(released, m.safe_point)
    for x in m.finish():
        assert x.start >= released, (chunks, x)
        found.append(x)
    return found


def _family_span(found: list[Match], data: bytes) -> bytes | None:
    spans = [data[x.start : x.end] for x in found if x.rule.id == FAMILY]
    return spans[0] if spans else None


@pytest.mark.parametrize("phrase", CASES, ids=[EVASIONS[c] for c in CASES])
def test_output_catches_the_evasion_at_every_byte_boundary(phrase):
    data = f"We offer {phrase}. Call us.".encode()
    raw = phrase.encode()
    assert _family_span(_fed(DEFAULT.output, [data]), data) == raw
    assert _family_span(_fed(DEFAULT.output, [data[i : i + 1] for i in range(len(data))]), data) == raw
    for k in range(1, len(data)):
        assert _family_span(_fed(DEFAULT.output, [data[:k], data[k:]]), data) == raw, k


@pytest.mark.parametrize("phrase", CASES, ids=[EVASIONS[c] for c in CASES])
def test_whole_text_scan_finds_it_with_its_raw_span(phrase):
    text = f"We offer {phrase}. Call us."
    assert {(x.rule.id, text.encode()[x.start : x.end].decode()) for x in scan_text(DEFAULT.output, text)} \
        >= {(FAMILY, phrase)}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return tok, token_byte_table(tok.get_vocab(), special)


def test_output_catches_each_evasion_token_by_token_with_the_real_tokenizer(tokenizer):
    tok, vocab = tokenizer
    for phrase in CASES:
        data = f"We offer {phrase}. Call us.".encode()
        ids = tok.encode(data.decode(), add_special_tokens=False)
        chunks = [vocab[i] for i in ids]
        assert b"".join(chunks) == data
        assert _family_span(_fed(DEFAULT.output, chunks), data) == phrase.encode(), EVASIONS[phrase]


def test_the_guard_never_delivers_the_evasion(tokenizer):
    """Through the guard the engine runs: the token that completes the phrase is refused
    (rollback or resample), and nothing of the phrase was delivered before."""
    tok, vocab = tokenizer
    policy = Policy(DEFAULT, None, DEFAULT.version)
    for phrase in ["guaranteed\u200breturns", "guar\ufff9anteed returns", "guaran-\nteed returns",
                   "guaranteed\x00returns", "guar\x00anteed returns", "guaran\u00ad\r\nteed returns"]:
        ids = tok.encode(f"We offer {phrase} today.", add_special_tokens=False)
        guard = Guard(policy, vocab)
        delivered = ""
        decision = None
        for t in ids:
            decision = guard.check(t)
            if decision.verdict is not Verdict.ACCEPT:
                break
            delivered += guard.release()
        else:
            decision = guard.finish()  # the regex waits for the text that settles it
        assert decision is not None and decision.verdict in (Verdict.ROLLBACK, Verdict.RESAMPLE), phrase
        assert decision.match is not None and decision.match.rule.id == FAMILY
        assert "guar" not in delivered, phrase


# -- input rules: the same view -----------------------------------------------------------

BOTH = """rules:
  - id: lit
    description: a literal in both scopes
    kind: literal
    scope: both
    action: halt
    message: m
    patterns: [guaranteed returns]
  - id: rx
    description: a regex in both scopes
    kind: regex
    scope: both
    action: redact
    replacement: '[rx]'
    patterns: ['\\bguaranteed returns\\b']
"""


@pytest.fixture(scope="module")
def both_pack(tmp_path_factory: pytest.TempPathFactory) -> Pack:
    d = tmp_path_factory.mktemp("both")
    (d / "a.yaml").write_text(BOTH)
    return Pack.load(d)


class Msg:
    def __init__(self, content: str) -> None:
        self.role, self.content = "user", content


TWO_WORDS = [c for c in CASES if "financial" not in c]  # what the literal below can spell


@pytest.mark.parametrize("phrase", TWO_WORDS, ids=[EVASIONS[c] for c in TWO_WORDS])
def test_input_and_output_rules_agree_on_each_evasion(both_pack, phrase):
    text = f"Do you offer {phrase}? Tell me."
    verdict = apply_input_rules(both_pack.input, [Msg(text)])
    assert verdict.halted
    assert {e.rule_id for e in verdict.events} == {"lit", "rx"}
    assert "[rx]" in verdict.messages[0]["content"] and "guar" not in verdict.messages[0]["content"]
    data = text.encode()
    for chunks in ([data], [data[i : i + 1] for i in range(len(data))]):
        found = _fed(both_pack.output, chunks)
        assert {x.rule.id for x in found} >= {"lit", "rx"}, phrase
        assert {data[x.start : x.end] for x in found} == {phrase.encode()}


def test_default_input_rules_see_through_the_new_classes():
    for text in ["Can you give me ins\ufff9ider tips?", "Can you give me ins\x00ider tips?",
                 "Can you give me ins\u0600ider tips?", "Can you give me insi-\r\nder tips?"]:
        verdict = apply_input_rules(DEFAULT.input, [Msg(text)])
        assert verdict.halted and "insider-request-en" in {e.rule_id for e in verdict.events}, repr(text)


# -- the two readings, and what stays as it was ---------------------------------------------


def test_the_two_readings_of_an_invisible():
    """Inside a word an invisible vanishes; as the only separator it is a space. The first
    reading takes a format character for the former and a control character for the latter,
    the other reading the reverse: the rules match both (a reader cannot tell them apart)."""
    assert normalize("guar\u200banteed\ufff9 ret\u0600urns") == "guaranteed returns"
    assert normalize("guaranteed\x00returns\x9bnow") == "guaranteed returns now"
    assert normalize_other("guaranteed\u200breturns\ufff9now") == "guaranteed returns now"
    assert normalize_other("gu\x00ar\x1fan\x7fteed\x9b") == "guaranteed"
    assert normalize("guaran-\nteed") == "guaran- teed"
    assert normalize_other("guaran-\nteed ret\u00ad\r\nurns") == "guaranteed returns"
    # Once both kinds are in the text: every invisible as nothing, and every one as a space.
    assert normalize_other("gua\u200bran\x00teed-\nly", "dropped") == "guaranteedly"
    assert normalize_other("guaranteed\u200bfinancial\x00returns", "spaced") == \
        "guaranteed financial returns"


def test_a_rollback_drops_the_readings_nothing_left_needs():
    m = StreamMatcher(DEFAULT.output)
    for piece in [b"We offer ", "gua\u200bran".encode(), b"\x00teed", b" returns", b". Call"]:
        m.feed(piece)
    assert len(m._others) == 3 and m.matches and m.matches[0].rule.id == FAMILY
    m.rollback(2)
    assert len(m._others) == 1 and not m.matches
    m.rollback(1)
    assert m._others == []
    assert [x.rule.id for x in m.feed("gua\u200bran\x00teed returns. Call".encode())] == [FAMILY]


@pytest.mark.parametrize(("raw", "first", "other"), [
    ("a well-known fund", "a well-known fund", "a well-known fund"),
    ("a well-\u200bknown fund", "a well-known fund", "a well- known fund"),
    ("a - b - c", "a - b - c", "a - b - c"),
    ("items:\n- one\n- two", "items: - one - two", "items: - one - two"),
    ("risk -\nfree", "risk - free", "risk - free"),
    ("the 5-\nyear plan", "the 5- year plan", "the 5- year plan"),
    ("end-\n-start", "end- -start", "end- -start"),
    ("end-\n\u4e00", "end- \u4e00", "end- \u4e00"),
    ("guaran-", "guaran-", "guaran-"),
    ("guaran- \n", "guaran- ", "guaran- "),
    ("guaran-\nteed", "guaran- teed", "guaranteed"),
])
def test_only_a_hyphen_and_a_line_break_between_letters_join(raw, first, other):
    assert (normalize(raw), normalize_other(raw)) == (first, other)


@pytest.mark.parametrize("text", [
    "The risk-free rate is 4%.",
    "The risk-\nfree rate is 4%.",
    "The risk\u200b-free rate is 4%.",
    "There are no guaranteed\u200breturns in investing.",
    "We do not offer guaran-\nteed returns.",
    "There are no guar\u00adanteed returns.",
    "A well-known, well-\nrespected fund.",
    "Step 1 - read\u200b the prospectus.",
    "Returns:\n- none are guaranteed\u200b.",
])
def test_clean_text_stays_clean(text):
    data = text.encode()
    assert not [x.rule.id for x in _fed(DEFAULT.output, [data[i : i + 1] for i in range(len(data))])]
    assert not scan_text(DEFAULT.output, text)


def test_rollback_over_an_invisible_and_back_finds_the_same():
    m = StreamMatcher(DEFAULT.output)
    for piece in [b"We offer ", b"guaranteed", "\u200b".encode(), b"ret"]:
        m.feed(piece)
    m.rollback(2)  # before the invisible: the other reading is gone with it
    assert m.feed(b"\xe2\x80") == [] and m.feed(b"\x8breturns") == [] and m.feed(b". Call") != []
    m.rollback(2)
    assert m.feed(b" returns. Call") != [] and m.text == "we offer guaranteed returns. call"
    m.rollback(1)
    assert m.feed(b"guaranteedreturns. Call") == [] and m.finish() == []
