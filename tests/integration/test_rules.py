"""Rule packs: schema validation, normalized view, streaming matcher, default packs. No model."""

from __future__ import annotations

import functools
import itertools
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from finsieve.policy.guard import ACCEPT, Guard, Policy, Verdict
from finsieve.policy.matcher import StreamMatcher, scan_text
from finsieve.policy.normalize import Normalizer, fold, normalize
from finsieve.policy.pack import Literals, Pack
from finsieve.policy.schema import PackError
from finsieve.policy.utf8 import replaced
from finsieve.policy.validators import cn_resident_id, iban_mod97, luhn

REPO = Path(__file__).resolve().parents[2]
DEFAULT = Pack.load(REPO / "rules")
CORPUS = [
    line for line in (REPO / "tests/data/clean_corpus.txt").read_text().splitlines()
    if line and not line.startswith("#")
]


def stream(rules, text: str, seed: int = 0, max_chunk: int = 4) -> StreamMatcher:
    """Feed text in random byte chunks (splitting UTF-8 characters as BPE tokens do)."""
    rng = random.Random(seed)
    data = text.encode()
    m = StreamMatcher(rules)
    pos = 0
    while pos < len(data):
        n = rng.randint(1, max_chunk)
        m.feed(data[pos : pos + n])
        pos += n
    m.finish()
    return m


def hits(rules, text: str, seed: int = 0) -> set[str]:
    return {m.rule.id for m in stream(rules, text, seed).matches}


# -- the normalized view -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "norm"),
    [("１５％", "15%"), ("GUARANTEED", "guaranteed"), ("a \n\t b", "a b"), ("a\u00a0\u3000b", "a b"),
     ("gu\u200daran\u00adteed", "guaranteed"), ("café", "cafe"), ("cafe\u0301", "cafe"),
     ("ﬁnance", "finance"), ("年化收益率", "年化收益率"), ("Straße", "strasse")],
)
def test_normalized_view(raw, norm):
    assert normalize(raw) == norm


def test_normalizer_maps_back_to_raw_bytes_across_split_characters():
    raw = "Ａ稳\u200d赚  x".encode()
    n = Normalizer()
    for i in range(len(raw)):  # one byte at a time: every multi-byte char is split
        n.feed(raw[i : i + 1])
    assert "".join(n.text) == "a稳赚 x"
    spans = [raw[s:e].decode() for s, e in zip(n.raw_start, n.raw_end, strict=True)]
    assert spans == ["Ａ", "稳", "赚", "  ", "x"]


def test_a_token_seen_after_plain_text_joins_a_space_or_cjk_character_as_ever():
    """The normalizer's memo of plain tokens is filled after plain text; after a space, a
    CJK character or a held space the same token must still join as the rules say."""
    for before, after, expect in [(b"a", b" b", "a b"), (b"a ", b" b", "a b"),
                                  ("稳".encode(), b" b", "稳 b"), ("稳 ".encode(), b" b", "稳 b"),
                                  ("稳 ".encode(), "赚".encode(), "稳赚"), (b"a\n", b" b", "a b")]:
        for _ in range(2):  # the second time from the memo
            n = Normalizer()
            n.feed(before)
            n.feed(after)
            n.flush()
            assert "".join(n.text) == expect, (before, after)


def test_a_literal_is_reported_once_whatever_tail_its_text_was_scanned_with(tmp_path):
    """Scans of (live tail, new text) are memoized: a match that ended in the tail is not
    reported again, and one ending in the new text is, each time."""
    write(tmp_path, "a.yaml", "rules:\n  - id: s\n    description: t\n    kind: literal\n"
                              "    patterns: [ab, abc, bc]\n    action: redact\n    replacement: x\n")
    pack = Pack.load(tmp_path)
    for _ in range(2):
        for tokens in ([b"a", b"b", b"c"], [b"ab", b"c"], [b"x", b"b", b"c"], [b"a", b"bc"]):
            m = StreamMatcher(pack.output)
            for t in tokens:
                m.feed(t)
            m.finish()
            assert sorted(x.text for x in m.matches) == sorted(
                x.text for x in scan_text(pack.output, b"".join(tokens).decode())), tokens


def test_incomplete_utf8_stays_pending():
    n = Normalizer()
    n.feed("稳".encode()[:2])
    assert n.text == [] and n.pending == "稳".encode()[:2]
    n.feed("稳".encode()[2:])
    assert n.text == ["稳"] and n.pending == b""
    assert fold("\u200b") == ""


# -- invalid UTF-8: the raw bytes behind each U+FFFD -------------------------------------


def _fed(pieces: list[bytes]) -> tuple[Normalizer, bytes]:
    """A normalizer fed `pieces` one by one, and the raw bytes it decoded."""
    n = Normalizer()
    for piece in pieces:
        n.feed(piece)
    return n, b"".join(pieces)[: n.decoded_len]


@pytest.mark.parametrize(
    ("pieces", "spans"),
    [
        # A stray byte, then a 3-byte character cut short: 1 byte, then 2.
        ([b"\xff\xe4\xb8A"], [b"\xff", b"\xe4\xb8", b"A"]),
        # A 4-byte character cut short, split over tokens, then a stray byte.
        ([b"\xf0\x9f", b"\x98", b"\xffx"], [b"\xf0\x9f\x98", b"\xff", b"x"]),
        # Overlong '/' (each byte its own U+FFFD), a cut-short character, valid CJK around.
        ([b"\xe5\xb9", b"\xb4\xc0\xaf\xe4\xb8x\xe4\xb8\xad"],
         ["年".encode(), b"\xc0", b"\xaf", b"\xe4\xb8", b"x", "中".encode()]),
        # An encoded surrogate (three U+FFFD), a genuine U+FFFD, a cut-short 4-byte one.
        ([b"\xed\xa0\x80\xef\xbf\xbd\xf4\x8f\xbfz"],
         [b"\xed", b"\xa0", b"\x80", b"\xef\xbf\xbd", b"\xf4\x8f\xbf", b"z"]),
        # A lone lead byte pending from the token before, valid text between invalid bytes.
        ([b"\xc3", b"ok\xe4\xb8!\x80"], [b"\xc3", b"o", b"k", b"\xe4\xb8", b"!", b"\x80"]),
    ],
)
def test_each_replacement_character_maps_to_the_invalid_bytes_it_stands_for(pieces, spans):
    """Python's "replace" writes one U+FFFD per maximal invalid subsequence, 1 to 3 bytes:
    its raw span is those bytes, not a share of all the invalid bytes in the token."""
    n, data = _fed(pieces)
    assert [data[s:e] for s, e in zip(n.raw_start, n.raw_end, strict=True)] == spans
    assert (n.decoded_len, n.pending) == (sum(map(len, spans)), b"")


# Bytes that make every kind of invalid UTF-8 (stray continuations, lone and cut-short
# leads, overlongs, surrogates, past U+10FFFF) and valid characters around them; no
# whitespace, so each side of a cut normalizes on its own as it does in the whole.
_UTF8_PIECES = st.lists(st.sampled_from(
    [bytes([b]) for b in (0x61, 0x80, 0xBF, 0xC0, 0xC3, 0xA9, 0xE0, 0xA0, 0xED, 0xE4, 0xB8,
                          0xAD, 0xF0, 0x90, 0x8D, 0xF4, 0x8F, 0xF5, 0xFF)]
    + [b"ok", b"\xef\xbf\xbd", "年".encode(), "😀".encode()]), max_size=12)


@settings(max_examples=500, deadline=None)
@given(pieces=st.lists(_UTF8_PIECES.map(b"".join), max_size=6))
def test_raw_offsets_cut_the_bytes_where_the_normalized_view_is_cut(pieces):
    """Holdback, rollback and redaction cut raw bytes at a character's raw offsets: the
    bytes before each offset must read as the text before it, however the bytes came in
    tokens."""
    n, data = _fed(pieces)
    assert n.decoded_len + len(n.pending) == n.raw_len == sum(map(len, pieces))
    text = "".join(n.text)
    assert normalize(data.decode("utf-8", "replace")) == text
    # Characters from one raw character (a fold into several) share its offsets.
    for i in range(len(text) + 1):
        if 0 < i < len(text) and n.raw_start[i] == n.raw_start[i - 1]:
            continue
        start = n.raw_start[i] if i < len(text) else n.decoded_len
        assert normalize(data[:start].decode("utf-8", "replace")) == text[:i]
        assert normalize(data[start:].decode("utf-8", "replace")) == text[i:]
        end = n.raw_end[i - 1] if i else 0
        assert normalize(data[:end].decode("utf-8", "replace")) == text[:i]


@settings(max_examples=500, deadline=None)
@given(data=st.one_of(st.binary(max_size=24), _UTF8_PIECES.map(b"".join)))
def test_replacement_sizes_cut_the_bytes_where_the_decoded_text_is_cut(data):
    """The sizes `replaced` gives (UTF-8 lengths elsewhere) sum to the bytes, and the bytes
    before each character's offset decode to exactly the text before it."""
    text = data.decode("utf-8", "replace")
    sizes = [len(c.encode()) for c in text]
    for i, size in replaced(data):
        sizes[i] = size
    assert sum(sizes) == len(data)
    offset = 0
    for i, size in enumerate(sizes):
        assert data[:offset].decode("utf-8", "replace") == text[:i]
        assert data[offset:].decode("utf-8", "replace") == text[i:]
        offset += size


def _guard(tmp_path: Path, action: str) -> Guard:
    """A guard whose one rule acts on the word 'secret'."""
    extra = "message: m" if action == "halt" else "replacement: '[gone]'"
    write(tmp_path, "a.yaml", "rules:\n  - id: s\n    description: t\n    kind: literal\n"
                              f"    patterns: [secret]\n    action: {action}\n    {extra}\n")
    pack = Pack.load(tmp_path)
    # The token after a lone lead byte holds valid text between two invalid sequences.
    return Guard(Policy(pack, None, pack.version), [b"ok ", b"\xc3", b"my secret\xe4\xb8 is out"])


def test_a_redaction_after_invalid_bytes_replaces_exactly_its_span(tmp_path):
    guard = _guard(tmp_path, "redact")
    assert [guard.check(t).verdict for t in range(3)] == [Verdict.ACCEPT] * 3
    assert guard.finish().verdict is Verdict.ACCEPT
    assert guard.release(final=True) == "ok \ufffdmy [gone]\ufffd is out"
    [event] = guard.events
    assert (event.start, event.end, event.suppressed) == (7, 13, "secret")


def _guard_of(tmp_path: Path, rules: list[tuple[str, str, str]], tokens: list[bytes]) -> Guard:
    """A guard over literal rules (id, pattern, action), each replacing with "[id]"."""
    write(tmp_path, "a.yaml", "rules:\n" + "".join(
        f"  - {{id: {i}, description: t, kind: literal, patterns: [{pattern}], action: {action},"
        f" replacement: '[{i}]'}}\n" for i, pattern, action in rules))
    pack = Pack.load(tmp_path)
    return Guard(Policy(pack, None, pack.version), tokens)


def test_a_halt_never_delivers_a_block_span_that_its_token_completed(tmp_path):
    """Found by review (2026-12-03): a token that completed a block span and a later halt
    span halted on the halt rule (its priority) and delivered everything before the halt
    span, the block span included."""
    guard = _guard_of(tmp_path, [("b", "xabc", "block"), ("h", "cd", "halt")], [b"yyxa", b"bc cd"])
    assert (guard.check(0).verdict, guard.release()) == (Verdict.ACCEPT, "")
    decision = guard.check(1)
    assert (decision.verdict, decision.match.rule.id) == (Verdict.HALT, "h")
    text, event = guard.halt(decision)
    assert text == "yy" and event.rule_id == "h"


def test_a_redaction_is_delivered_whole_and_once_when_a_match_over_its_end_holds_it(tmp_path):
    """Found by review (2026-12-03): a release could end inside a completed redaction while
    an overlapping match still grew over its end: its replacement was delivered then and
    again with the rest, and its event never sent."""
    guard = _guard_of(tmp_path, [("r1", "abcd", "redact"), ("r2", "cdef", "redact")],
                      [b"ab", b"cd", b"ef"])
    out = ""
    for t in range(3):
        assert guard.check(t) is ACCEPT
        out += guard.release()
    assert guard.finish() is ACCEPT
    out += guard.release(final=True)
    assert out == "[r1][r2]"
    assert [(e.rule_id, e.start, e.end, e.suppressed) for e in guard.events] == [
        ("r1", 0, 4, "abcd"), ("r2", 4, 8, "cdef")]


def test_a_rewrite_after_invalid_bytes_keeps_exactly_the_text_before_its_span(tmp_path):
    guard = _guard(tmp_path, "rewrite")
    assert [guard.check(t).verdict for t in range(2)] == [Verdict.ACCEPT] * 2
    decision = guard.check(2)
    assert (decision.verdict, decision.keep) == (Verdict.REWRITE, 1)
    assert decision.text == "\ufffdmy [gone]"
    assert guard.rollback(decision).suppressed == "secret"


def test_a_halt_after_invalid_bytes_delivers_exactly_the_text_before_its_span(tmp_path):
    guard = _guard(tmp_path, "halt")
    assert [guard.check(t).verdict for t in range(2)] == [Verdict.ACCEPT] * 2
    decision = guard.check(2)
    assert decision.verdict is Verdict.HALT
    text, event = guard.halt(decision)
    assert (text, event.suppressed) == ("ok \ufffdmy ", "secret")


# -- the default packs -------------------------------------------------------------------


PHRASES = {
    "promissory-guarantee-en": "We have a risk-free profit for you",
    "promissory-guarantee-zh": "这个产品稳赚不赔",
    "promissory-guaranteed-returns-en": "Enjoy guaranteed returns today",
    "promissory-guaranteed-returns-zh": "我们保证收益",
    "performance-projection-en": "It offers an annualized return above 15%",
    "performance-projection-zh": "年化收益率超过15%",
}


def variants(phrase: str) -> list[str]:
    """The phrase in other case, full-width, doubled spaces, a newline, a zero-width joiner."""
    full_width = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in phrase)
    mid = len(phrase) // 2
    return [
        phrase, phrase.upper(), phrase.title(), full_width,
        phrase.replace(" ", "  "), phrase.replace(" ", "\n", 1),
        phrase[:mid] + "\u200d" + phrase[mid:], phrase[:mid] + "\u00ad" + phrase[mid:],
    ]


@pytest.mark.parametrize("rule_id", list(PHRASES))
def test_every_variant_of_a_forbidden_phrase_is_caught_in_any_chunking(rule_id):
    for text in variants(PHRASES[rule_id]):
        for seed in range(5):
            assert rule_id in hits(DEFAULT.output, f"Note: {text}. Thanks", seed), repr(text)


@pytest.mark.parametrize(
    ("text", "rule_id"),
    [("an annualized return of twenty percent", "performance-projection-en"),
     ("returns of 20% a year", "performance-projection-en"),
     ("annual yields of 12.5 per cent", "performance-projection-en"),
     ("年化收益率超过百分之十五", "performance-projection-zh"),
     ("年化回报率达到２０％", "performance-projection-zh"),
     ("保本保息，放心投资", "promissory-guarantee-zh")],
)
def test_number_grammar_and_chinese_forms(text, rule_id):
    assert rule_id in hits(DEFAULT.output, text)


@pytest.mark.parametrize(
    ("text", "rule_id", "found"),
    [("card 4111 1111 1111 1111 ok", "payment-card-number", "4111 1111 1111 1111"),
     ("card 4111-1111-1111-1111.", "payment-card-number", "4111-1111-1111-1111"),
     ("IBAN GB82 WEST 1234 5698 7654 32 today", "iban", "GB82 WEST 1234 5698 7654 32"),
     ("ssn 123-45-6789 on file", "us-ssn", "123-45-6789"),
     ("身份证号11010519491231002X已登记", "cn-resident-id", "11010519491231002X"),
     ("my account number 123456789012 please", "account-number-in-context", "account number 123456789012"),
     ("卡号6222020200112233445", "account-number-in-context", "卡号6222020200112233445")],
)
def test_identifiers_are_found_with_their_raw_span(text, rule_id, found):
    m = stream(DEFAULT.output, text, seed=3)
    spans = {(x.rule.id, m.raw[x.start : x.end].decode()) for x in m.matches}
    assert (rule_id, found) in spans


@pytest.mark.parametrize(
    "text",
    ["card 4111 1111 1111 1112 ok", "IBAN GB82 WEST 1234 5698 7654 33 x", "ssn 000-45-6789 x",
     "id 110105194912310021 x"],
)
def test_checksums_keep_look_alikes_out(text):
    assert not hits(DEFAULT.output, text)


def test_validators():
    assert luhn("4111111111111111") and not luhn("4111111111111112") and not luhn("1234")
    assert iban_mod97("DE89 3704 0044 0532 0130 00") and not iban_mod97("DE88 3704 0044 0532 0130 00")
    assert cn_resident_id("11010519491231002X") and not cn_resident_id("110105194912310021")


def test_inside_information_requests_halt_only_as_input():
    rules = DEFAULT.input
    for text in ["Can you give me some insider tips on ACME?", "有没有内幕消息？"]:
        actions = {m.rule.action for m in stream(rules, text).matches}
        assert actions == {"halt"}, text
    assert not hits(rules, "What is insider trading, and why is it illegal?")


def test_clean_corpus_has_no_false_positive():
    assert len(CORPUS) >= 200
    for line in CORPUS:
        for rules in (DEFAULT.input, DEFAULT.output):
            assert not hits(rules, line), line


def test_quoting_a_promise_counts_as_making_it():
    # Known and intended: a literal rule cannot tell a quoted promise from a made one.
    assert "promissory-guarantee-en" in hits(DEFAULT.output, "Scammers offer guaranteed profits.")


# -- streaming properties ----------------------------------------------------------------

TEXT = st.lists(
    st.sampled_from([
        "guaranteed returns", "GUARANTEED  Returns", "稳赚不赔", "年化收益率超过15%", " ", "\n",
        "\u200d", "returns of 20% a year", "4111 1111 1111 1111", "ok. ", "annual", "保本", "保息",
        "1", "%", "no ", "card ", "x",
    ]),
    max_size=12,
).map("".join)


# Patterns that begin, end and contain one another; two longer than the live suffix that
# Literals.scan walks (WALK_CHARS).
_NESTED = ("ab", "abc", "abcd", "bc", "bcab", "cab", "ca", "d", "aaa", "a b", "ab" * 10,
           "ab" * 9 + "c")


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(["a", "b", "c", "d", " ", "ab", "abab" * 3]),
                     max_size=16).map("".join),
       cuts=st.lists(st.integers(1, 5), max_size=30))
def test_a_literal_scan_piece_by_piece_finds_each_occurrence_once_and_the_live_suffix(text, cuts):
    """Literals.scan, fed a text in pieces with the live suffix it returned before, reports
    every occurrence of every pattern once, where it ends, in the automaton's order (by end,
    the longest first), and returns the longest suffix that is a proper prefix of a pattern:
    what the matcher holds back."""
    literals = Literals({p: (p, ()) for p in _NESTED})
    found, live, pos = [], "", 0
    for n in itertools.chain(cuts, itertools.repeat(5)):
        if pos >= len(text):
            break
        new = text[pos : pos + n]
        hits, live = literals.scan(live, new)
        assert [(end, -len(p)) for end, p, _ in hits] == sorted((end, -len(p)) for end, p, _ in hits)
        found += [(pos + end, p) for end, p, _ in hits]
        pos += len(new)
        seen = text[:pos]
        assert live == next((seen[i:] for i in range(len(seen))
                             if any(p.startswith(seen[i:]) and p != seen[i:] for p in _NESTED)), "")
    assert sorted(found) == sorted((i + len(p) - 1, p) for p in _NESTED
                                   for i in range(len(text)) if text.startswith(p, i))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT, seed=st.integers(0, 10_000))
def test_chunking_never_changes_the_matches(text, seed):
    whole = {(m.rule.id, m.start, m.end) for m in scan_text(DEFAULT.output, text)}
    chunked = {(m.rule.id, m.start, m.end) for m in stream(DEFAULT.output, text, seed).matches}
    assert chunked == whole


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT, seed=st.integers(0, 10_000))
def test_safe_point_never_releases_a_byte_of_a_later_match(text, seed):
    rng = random.Random(seed)
    data = text.encode()
    m = StreamMatcher(DEFAULT.output)
    released = []
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 4)
        m.feed(data[pos : pos + n])
        pos += n
        released.append((m.safe_point, len(m.matches)))
    for match in m.matches:
        for safe, known in released:
            if known <= m.matches.index(match):  # before this match was reported
                assert safe <= match.start


def test_rollback_restores_the_exact_state():
    tokens = [t.encode() for t in ["We ", "offer ", "guar", "anteed ", "ret", "urns", " and 4111 ", "1111"]]
    m = StreamMatcher(DEFAULT.output)
    for t in tokens:
        m.feed(t)
    m.rollback(3)
    assert m.raw == b"".join(tokens[:3]) and m.tokens == 3
    assert m.matches == []
    # " ok. Then" settles the match: "guaranteed returns ok returns" could still have grown.
    for t in [b"anteed returns", b" ok. Then"]:
        m.feed(t)
    fresh = StreamMatcher(DEFAULT.output)
    for t in [*tokens[:3], b"anteed returns", b" ok. Then"]:
        fresh.feed(t)
    assert [(x.rule.id, x.start, x.end) for x in m.matches] == \
           [(x.rule.id, x.start, x.end) for x in fresh.matches] != []
    assert m.safe_point == fresh.safe_point


def test_text_of_mixed_character_widths_never_crashes_the_matcher():
    """An emoji (a 4-byte-wide string in CPython), then ASCII: a pyahocorasick iterator fed
    both with `set()` frees memory it does not own, and the engine process died for every
    tenant. Run in a child process, where such a crash fails this test, not the test run."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from finsieve.policy.matcher import StreamMatcher\n"
        "from finsieve.policy.pack import Pack\n"
        "pack = Pack.load(Path(sys.argv[1]))\n"
        "for _ in range(300):\n"
        "    m = StreamMatcher(pack.output)\n"
        "    for chunk in ('Hello', ' \\U0001F600', ' you get', ' guaranteed', ' profits', '!'):\n"
        "        m.feed(chunk.encode())\n"
        "    m.rollback(2)\n"
        "    m.feed(' \u00e9t\u00e9 \U0001F4B0 guaranteed profits'.encode())\n"
        "    assert {x.rule.action for x in m.matches} == {'block'}, m.matches\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(REPO / "rules")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_render_replaces_redacted_spans():
    m = stream(DEFAULT.output, "Pay with 4111 1111 1111 1111 today.")
    assert m.render(0, len(m.raw)) == "Pay with [REDACTED:card] today."


@functools.cache
def _overlapping_edits() -> Pack:
    """redact and rewrite rules whose matches begin inside, end inside and contain others."""
    directory = Path(tempfile.mkdtemp())
    rules = [("r1", "literal", "['ab', 'abcd']", "redact"), ("r2", "literal", "[bc]", "redact"),
             ("r3", "literal", "[ca]", "rewrite"), ("r4", "regex", "['d+']", "redact"),
             ("r5", "literal", "[dd]", "halt")]
    (directory / "a.yaml").write_text("rules:\n" + "".join(
        f"  - {{id: {i}, description: t, kind: {kind}, patterns: {patterns}, action: {action},"
        f" replacement: '[{i}]', max_span: 10}}\n" for i, kind, patterns, action in rules))
    return Pack.load(directory)


def _render_every_match(m: StreamMatcher, start: int, end: int) -> str:
    """What render() returned before it kept the edits apart: every match, sorted each call."""
    out, pos = [], start
    for x in sorted(m.matches, key=lambda x: x.start):
        if x.rule.action not in ("redact", "rewrite") or x.end <= pos or x.start >= end:
            continue
        out.append(m.raw[pos : max(pos, x.start)].decode("utf-8", "replace"))
        out.append(x.rule.replacement)
        pos = max(pos, x.end)
    out.append(m.raw[pos:end].decode("utf-8", "replace") if pos < end else "")
    return "".join(out)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.sampled_from(["a", "b", "c", "d", "dd", "abc", "é", "rollback"]),
                      max_size=30),
       data=st.data())
def test_render_reads_only_the_edits_that_can_overlap_and_renders_as_from_every_match(steps, data):
    m = StreamMatcher(_overlapping_edits().output)
    for step in steps:
        if step == "rollback":
            m.rollback(data.draw(st.integers(0, m.tokens)))
        else:
            m.feed(step.encode())
        assert m.edits == sorted((x for x in m.matches if x.rule.action in ("redact", "rewrite")),
                                 key=lambda x: x.start)
        start = data.draw(st.integers(0, len(m.raw)))
        end = data.draw(st.integers(start, len(m.raw)))
        assert m.render(start, end) == _render_every_match(m, start, end)


# -- validation of rule packs ------------------------------------------------------------


GOOD = """\
rules:
  - id: r1
    description: ok
    kind: literal
    patterns: [foo]
    action: block
"""


def write(tmp: Path, name: str, text: str) -> Path:
    (tmp / name).write_text(text)
    return tmp


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("rules: [\n  - id: x\n", "a.yaml:2: -: yaml: not valid YAML"),
        (GOOD.replace("action: block", "action: block\n    colour: red"),
         "a.yaml:7: r1: colour: unknown field"),
        (GOOD.replace("    description: ok\n", ""), "a.yaml:2: r1: description: missing (required)"),
        (GOOD.replace("[foo]", "[]"), "a.yaml:5: r1: patterns: empty"),
        (GOOD.replace("kind: literal", "kind: regex").replace("[foo]", "['(unclosed']"),
         "a.yaml:5: r1: patterns: '(unclosed' does not compile"),
        (GOOD.replace("kind: literal", "kind: regex").replace("[foo]", "['\\d+ percent']"),
         "a.yaml:2: r1: max_span: required"),
        (GOOD.replace("action: block", "action: redact"), "a.yaml:2: r1: replacement: missing"),
        (GOOD.replace("action: block", "action: shred"), "a.yaml:6: r1: action: unknown value 'shred'"),
        (GOOD.replace("kind: literal", "kind: regex").replace("action: block",
                                                              "action: block\n    validators: [crc]"),
         "a.yaml:7: r1: validators: unknown validator 'crc'"),
        ("rulez: []\n", "a.yaml:1: -: rulez: unknown top-level key"),
    ],
)
def test_each_problem_is_reported_with_file_line_rule_field(tmp_path, text, expected):
    with pytest.raises(PackError) as err:
        Pack.load(write(tmp_path, "a.yaml", text))
    reported = [str(p).removeprefix(f"{tmp_path}/") for p in err.value.problems]
    assert any(line.startswith(expected) for line in reported), reported


def test_duplicate_ids_across_files_and_all_problems_at_once(tmp_path):
    write(tmp_path, "a.yaml", GOOD)
    write(tmp_path, "b.yaml", GOOD + GOOD.replace("rules:\n", "").replace("action: block", "action: x"))
    with pytest.raises(PackError) as err:
        Pack.load(tmp_path)
    lines = [str(p).replace(f"{tmp_path}/", "") for p in err.value.problems]
    assert any(line.startswith("b.yaml:2: r1: id: duplicate id (first defined at a.yaml:2)")
               for line in lines)
    assert any("b.yaml:11: r1: action: unknown value 'x'" in line for line in lines)


def test_policy_version_is_a_hash_of_the_compiled_rules(tmp_path):
    v1 = Pack.load(write(tmp_path, "a.yaml", GOOD)).version
    assert Pack.load(write(tmp_path, "a.yaml", "# a comment\n" + GOOD)).version == v1
    assert Pack.load(write(tmp_path, "a.yaml", GOOD.replace("[foo]", "['FOO ']"))).version == v1
    assert Pack.load(write(tmp_path, "a.yaml", GOOD.replace("[foo]", "[bar]"))).version != v1


def test_rules_check_cli(tmp_path):
    def run(d: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "finsieve.app.cli", "rules", "check", str(d)],
                              capture_output=True, text=True, timeout=60)

    ok = run(REPO / "rules")
    assert ok.returncode == 0 and DEFAULT.version in ok.stdout and f"{len(DEFAULT.rules)} rules" in ok.stdout
    write(tmp_path, "a.yaml", GOOD.replace("action: block", "action: shred").replace("[foo]", "[]"))
    bad = run(tmp_path)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.replace(f"{tmp_path}/", "").splitlines() == [
        "a.yaml:5: r1: patterns: empty: give at least one pattern",
        "a.yaml:6: r1: action: unknown value 'shred' (expected one of block, redact, rewrite, halt)",
    ]


def test_rules_scan_cli_finds_split_patterns():
    text = "Buy now: guaranteed  RETURNS!\nCard: 4111 1111 1111 1111. 稳赚不赔"
    out = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "rules", "scan", str(REPO / "rules"),
                          "--seed", "7"], input=text.encode(), capture_output=True, timeout=60)
    import json

    found = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert {(f["rule_id"], f["text"]) for f in found} == {
        ("promissory-guaranteed-returns-en", "guaranteed  RETURNS"),
        ("payment-card-number", "4111 1111 1111 1111"),
        ("promissory-guarantee-zh", "稳赚不赔"),
    }
    card = next(f for f in found if f["rule_id"] == "payment-card-number")
    assert text[card["start"] : card["end"]] == "4111 1111 1111 1111"


# Digits of three scripts (\\d takes them all), the letters of country codes and rule words,
# separators: where the default packs' identifiers and projections begin and end.
_NEAR_MATCHES = "0123456789\u0663\u09e8 abcdeginorstuy-./%#:"


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(st.text(alphabet=_NEAR_MATCHES, max_size=24))
def test_the_first_characters_never_rule_out_a_match_of_the_default_packs(text):
    """Wherever a default pack's regex has a match, or one in the making, beginning at a
    position, its prefix filter lets it begin there (a skipped search is a leak)."""
    for rules in (DEFAULT.output, DEFAULT.input):
        for r, f in zip(rules.regexes, rules._first, strict=True):  # the filters it runs
            if f is None:
                continue
            for j in range(len(text)):
                m = r.pattern.match(text, pos=j, partial=True)
                if m is not None and m.end() > j:
                    assert f.can_begin(text[j:]), (r.rule.id, text[j:])


def test_a_regex_is_skipped_only_where_its_lookbehind_or_first_characters_rule_it_out():
    from finsieve.policy.first_chars import DIGIT, first_chars

    iban = first_chars(r"(?<![a-z0-9])(?:gb|de)\d{2}[a-z0-9]{11,30}")
    assert iban is not None and iban.prefixes == {"gb" + 2 * DIGIT, "de" + 2 * DIGIT}
    assert iban.can_begin("g") and iban.can_begin("gb") and iban.can_begin("gb8")
    assert iban.can_begin("de\u0663")  # an Arabic-Indic three is a digit to \d
    assert not iban.can_begin("the") and not iban.can_begin("gbp") and not iban.can_begin("de ")
    assert iban.can_follow(" ") and iban.can_follow("中") and not iban.can_follow("x")
    assert not iban.can_follow("7")
    phrase = first_chars(r"\b(?:annual|yearly) (?:returns?|yields?)")
    assert phrase is not None and phrase.prefixes == {"annua", "yearl"} and phrase.can_follow("x")
    assert phrase.can_begin("annu") and not phrase.can_begin("annex")  # five letters tell
    assert first_chars(r"a{0,2}z").prefixes == {"aaz", "az", "z"}
    assert first_chars(r"(?:a\d|bc)x").prefixes == {"a" + DIGIT + "x", "bcx"}
    assert first_chars(r"\d+a").prefixes == {DIGIT * 5, *(DIGIT * n + "a" for n in range(1, 5))}
    assert first_chars(r"[0-3]7").prefixes == {DIGIT * 2}  # digits written out read as one
    for other in (r"[^\d]a", r"\Da"):  # every character but a digit: no prefixes
        f = first_chars(other)
        assert f is None or f.prefixes is None
    # Case as the engine matches it: İ matches the text's i, I also its ı.
    dotted = first_chars("\u0130x")
    assert dotted is not None and "i" in dotted and dotted.prefixes == {"ix"}
    assert first_chars("Ix").prefixes == {"ix", "ıx"}
    # A lookbehind that not every alternative passes rules nothing out.
    assert first_chars(r"(?<![a-z])x|b").not_after is None
    assert first_chars(r"(?:(?<![a-z])|c)b").not_after is None
    # Comments and verbose mode, which Python's parser reads otherwise than `regex`: no
    # filter (each of these let a match through before).
    for unreadable in ("(?x)pro\u2028fit", "(?x:pro\u00a0fit)", "(?#[)\\p{L}x",
                       "(?#[)(?:profit){e<=1}", "(?x)#[\n\\p{L}x", "(?x)(?:#(?<!\n)q(\n)ab"):
        assert first_chars(unreadable) is None, unreadable
    # Syntax Python reads as literal text but `regex` does not: no filter at all.
    assert first_chars(r"ab{e<=1}") is None and first_chars(r"[[:alpha:]]x") is None
    assert "g" in first_chars(r"[A-Z]{2}\d{2}")  # a class is matched case-insensitively too
    assert first_chars(r"(?<![a-z])?x").not_after is None  # quantified: it may not apply
    assert first_chars(r"a(?<!b){2}c").prefixes == {"a"}  # the {2} repeats the lookbehind
    # \b before a class that holds ":" too: a start after a letter is possible ("a:x").
    assert first_chars(r"\b[a-z]x").word_start and not first_chars(r"\b[0-z]x").word_start


def test_every_default_pack_regex_runs_only_where_it_can_start():
    """No shipped regex falls back to being searched after every token (a character class
    with ":" once read as a POSIX class did that to the Chinese account-number rule)."""
    rules = Pack.load(REPO / "rules").output
    assert [r.rule.id for r, f in zip(rules.regexes, rules._first, strict=True) if f is None] == []


def test_start_filters_find_every_match_streaming_finds_without_them():
    """The default packs streamed in chunks of 1-7 bytes over clean text, identifiers and
    violations: the same matches with the start filters as with every regex searched."""
    lines = [ln for ln in (REPO / "tests/data/clean_corpus.txt").read_text().splitlines()
             if ln and not ln.startswith("#")]
    lines += [ln.split("\t")[2] for ln in (REPO / "tests/data/identifiers.tsv").read_text().splitlines()
              if ln and not ln.startswith("#")]
    lines += ["We offer guaranteed returns on this fund.", "年化收益率超过15%，稳赚不赔。",
              "Pay with 4111 1111 1111 1111 today.", "Expect returns of 20% a year.",
              "IBAN GB82 WEST 1234 5698 7654 32, or de89370400440532013000."]
    filtered, unfiltered = Pack.load(REPO / "rules").output, Pack.load(REPO / "rules").output
    for f in unfiltered._first:
        if f is not None:
            f.not_after, f.prefixes = None, None
    rng = random.Random(3)
    found = 0
    for _ in range(60):
        data = " ".join(rng.choice(lines) for _ in range(8)).encode()
        cuts = [0]
        while cuts[-1] < len(data):
            cuts.append(cuts[-1] + rng.randint(1, 7))
        results = []
        for rules in (filtered, unfiltered):
            m = StreamMatcher(rules)
            for a, b in itertools.pairwise(cuts):
                m.feed(data[a:b])
            m.finish()
            results.append([(x.rule.id, x.start, x.end) for x in m.matches])
        assert sorted(results[0]) == sorted(results[1])
        found += len(results[0])
    assert found > 30  # the texts did hold violations


def test_a_pattern_that_searches_backwards_is_refused(tmp_path):
    """`(?r)` makes `regex` search from the end: the streaming matcher would report only the
    last match (and could loop), so a pack with one is refused at its line."""
    write(tmp_path, "a.yaml", "rules:\n  - id: r\n    description: t\n    kind: regex\n"
                              "    patterns: ['(?r)foo']\n    action: block\n")
    with pytest.raises(PackError) as e:
        Pack.load(tmp_path)
    assert "a.yaml:5: r: patterns: '(?r)foo' searches backwards ((?r)): not supported" in str(e.value)


@pytest.mark.parametrize(("pattern", "refused"), [
    (r"\Gab", True), (r"x|(?:\G\d+)", True), (r"\\Gab", False), (r"\\\Gab", True),
    (r"G\d", False),
])
def test_a_pattern_anchored_where_a_search_starts_is_refused(tmp_path, pattern, refused):
    r"""`\G` matches where a search starts, and a stream is searched from wherever the matcher
    resumes (a token's end, past a match), so whether it matches would depend on how the
    answer was cut: refused at its line. An escaped backslash before a G is no anchor."""
    write(tmp_path, "a.yaml", "rules:\n  - id: r\n    description: t\n    kind: regex\n"
                              f"    patterns: ['{pattern}']\n    max_span: 20\n    action: block\n")
    if not refused:
        Pack.load(tmp_path)
        return
    with pytest.raises(PackError) as e:
        Pack.load(tmp_path)
    assert f"a.yaml:5: r: patterns: {pattern!r} anchors where a search starts" in str(e.value)


def test_a_lookbehind_at_the_start_of_the_answer_sees_nothing_before_it(tmp_path):
    """Nothing precedes the first character: `(?<!\\s)` passes there (it was taken for a
    space, and the match was never searched)."""
    write(tmp_path, "a.yaml", "rules:\n  - id: r\n    description: t\n    kind: regex\n"
                              "    patterns: ['(?<!\\s)foo']\n    action: block\n")
    m = StreamMatcher(Pack.load(tmp_path).output)
    m.feed(b"foo")
    m.finish()
    assert [(x.rule.id, x.start, x.end) for x in m.matches] == [("r", 0, 3)]


def test_regexes_with_negations_and_han_classes_run_only_when_their_first_characters_arrive():
    """The phrase families' negations are variable-width lookbehinds and their gaps use
    \\p{Han}, which Python's parser refuses: such a regex used to be searched after every
    token of every answer."""
    from finsieve.policy.first_chars import first_chars

    zh = first_chars(r"(?:(?<!不|无法|没有人能))(?:保证|确保)[\p{Han}\d%]{0,6}?(?:收益|回报)")
    en = first_chars(r"(?<!\b(?:no|not|never) )\b(?:guaranteed|assured) (?:returns?|profits?)")
    assert zh is not None and "保" in zh and "确" in zh and "a" not in zh and "不" not in zh
    assert en is not None and en.word_start and "g" in en and "n" not in en
    assert first_chars(r"\p{Han}+x") is None  # a property class first: any character


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=st.sampled_from([r"a.*z|b", r"ab+c", r"(?:xy)+q|y", r"\bab\d{2,4}\b", r"a(?=bc)",
                                r"[a-c]{3}z?", r"x*"]),
       text=st.text(alphabet="abcxyzq 12", max_size=40), pos=st.integers(0, 40),
       kept_from=st.integers(-5, 45))
def test_a_whole_text_search_finds_what_one_partial_search_did_where_it_is_kept(
        pattern, text, pos, kept_from):
    """A whole text's search in two passes (complete, then partial from where a growing match
    could still be kept) answers as `regex`'s one partial search: the same complete match,
    the same partial one when it starts where it is kept, else the first partial one there."""
    import regex

    from finsieve.policy.matcher import _first_match

    search = regex.compile(pattern).search
    pos = min(pos, len(text))
    one = search(text, pos=pos, partial=True)
    two = _first_match(search, text, pos, kept_from, 1.0, None)
    if one is not None and (not one.partial or one.start() >= kept_from):
        assert two is not None and (two.span(), two.partial) == (one.span(), one.partial)
    else:
        rest = search(text, pos=max(pos, kept_from), partial=True)
        assert (two and (two.span(), two.partial)) == (rest and (rest.span(), rest.partial))


def test_a_complete_match_that_regex_calls_growing_is_reported_once_past_its_span(tmp_path):
    """`regex`'s partial fullmatch calls a complete match after a lookbehind holding an
    optional letter still growing; once the text passes the rule's span it must be
    reported, not dropped (it was: a leak in streaming only, found by the no-risk family)."""
    write(tmp_path, "a.yaml", "rules:\n  - id: rf\n    description: t\n    kind: regex\n"
                              "    patterns: ['(?<!\\bscams? (?:\\w+ ){0,2})\\brisk-free\\b']\n"
                              "    action: block\n    max_span: 40\n")
    pack = Pack.load(tmp_path)
    tail = " and you should talk to an adviser about what suits you before you invest."
    for text in ("This fund is risk-free.", "This fund is risk-free" + tail):
        assert [m.text for m in scan_text(pack.output, text)] == ["risk-free"], text
        for seed in range(5):
            assert [m.text for m in stream(pack.output, text, seed).matches] == ["risk-free"]
