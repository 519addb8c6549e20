"""Starting another reading of the text (matcher.StreamMatcher._reading) costs no replay.

The other readings of an invisible start at the first character where they can differ from the
first reading. They used to be fed every earlier token of the answer again when they started:
one token cost as much as all earlier ones had (72 ms at 1,000 tokens on the decode loop,
every stream waiting), once per stream, at a point a client can steer to. Now a reading's
state is built from the first reading's checkpoints. The oracle is the old code itself
(`Replaying`, the replay kept here): for random texts with invisibles, hyphens, line breaks,
marks and CJK at random places, cut into random tokens, with random rollbacks, both give the
same matches, safe points and rendered text after every step, and every reading ends in the
same state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from finsieve.policy.matcher import StreamMatcher
from finsieve.policy.pack import Pack

from support.readings import Replaying

REPO = Path(__file__).resolve().parents[2]
RULES = Pack.load(REPO / "rules").output
FAMILY = "promissory-guaranteed-returns-en"


@contextmanager
def other_feeds() -> Iterator[list[int]]:
    """[tokens fed to other readings meanwhile]: a reading started by replaying is fed every
    earlier token again; one built from checkpoints only the token that starts it."""
    fed = [0]
    feed = StreamMatcher.feed

    def counted(self: StreamMatcher, data: bytes) -> list:
        if self._name is not None:
            fed[0] += 1
        return feed(self, data)

    StreamMatcher.feed = counted  # type: ignore[method-assign]
    try:
        yield fed
    finally:
        StreamMatcher.feed = feed  # type: ignore[method-assign]


PIECES = ["guaranteed", "guaran", "teed", " returns", "ret", "urns", " risk", "-free", "free",
          " no", " risk-free", " 15%", " annualized return", " of 20%", "a", "b", " ", "  ", "-",
          "- ", "\n", "-\n", "\u2013", "\u200b", "\u00ad", "\u200d", "\x00", "\x9b", "\u0301",
          "\u20dd", "\t", "\u7a33\u8d5a", " \u4e0d\u8d54", "\u4fdd\u672c", ".", " card 4111 1111 1111 1111",
          " We offer", "\ufff9", "\u3000"]
# Where the readings differ before an invisible: a hyphen after a letter (held by the other
# readings until a visible character), with spaces and marks after it.
HYPHENS = ["guaran-", "a-", " x-", "-", " ", "\u0301", "\u20dd", "teed", " returns", "\u2013",
           "\u200b", "\x00", "\n", "b"]


def _state(m: StreamMatcher) -> tuple:
    n = m.norm
    return ("".join(n.text), list(n.raw_start), list(n.raw_end), bytes(n.tags), n.space, n.hyphen,
            n.raw_len, n.decoded_len, n.pending, m.depth, sorted(m._in_making.items()), m.tokens,
            m.safe_point)


def _observed(m: StreamMatcher) -> tuple:
    safe = m.safe_point
    return ([(x.rule.id, x.start, x.end, x.norm_start, x.norm_end, x.text, x.timed_out)
             for x in m.matches], safe, m.render(0, safe), m.render(0, m.norm.raw_len),
            m.tokens, [_state(o) for o in m._others])


@st.composite
def scripts(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, int]]]:
    """A text, and what to do with it: ("feed", n bytes) or ("back", to token k of those fed)."""
    pieces = draw(st.sampled_from([PIECES, HYPHENS]))
    data = "".join(draw(st.lists(st.sampled_from(pieces), min_size=1, max_size=40))).encode()
    ops = draw(st.lists(st.one_of(st.tuples(st.just("feed"), st.integers(1, 12)),
                                  st.tuples(st.just("back"), st.integers(0, 1 << 16))),
                        min_size=1, max_size=80))
    return data, ops


def _run(cls: type[StreamMatcher], data: bytes, ops: list[tuple[str, int]]) -> list[tuple]:
    m, seen = cls(RULES), []
    for op, arg in ops:
        pos = m.norm.raw_len
        if op == "feed" and pos < len(data):
            found = m.feed(data[pos : pos + arg])
        elif op == "back" and m.tokens:
            m.rollback(arg % (m.tokens + 1))
            found = []
        else:
            continue
        seen.append(([(x.rule.id, x.start, x.end) for x in found], _observed(m)))
    if m.norm.raw_len < len(data):
        m.feed(data[m.norm.raw_len :])
    seen.append(([(x.rule.id, x.start, x.end) for x in m.finish()], _observed(m)))
    return seen


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts())
def test_a_reading_built_from_checkpoints_is_the_replayed_one(script):
    data, ops = script
    assert _run(StreamMatcher, data, ops) == _run(Replaying, data, ops)


def _long_answer(tokens: int) -> list[bytes]:
    words = [b" We", b" offer", b" a", b" well", b"-known", b" fund", b" with", b" low", b" fees", b"."]
    return [words[i % len(words)] for i in range(tokens)]


def test_starting_a_reading_feeds_no_earlier_token_again():
    for late in ("\u200b", "\x00", "-\n", "\u00ad"):
        m = StreamMatcher(RULES)
        for piece in _long_answer(500):
            m.feed(piece)
        assert m._others == []
        with other_feeds() as fed:
            m.feed(f" guar{late}anteed".encode())
        # This token, to each reading that runs now (the one heard, the one run unheard).
        assert len(m._others) == 1 and fed[0] <= 3, (late, fed)
        m.feed(b" returns.")
        m.finish()  # (a match that may still grow is held until the text settles it)
        assert [x.rule.id for x in m.matches] == [FAMILY], late
        # The control's readings (every invisible as nothing, as a space) in the same token.
        m = StreamMatcher(RULES)
        for piece in _long_answer(500):
            m.feed(piece)
        with other_feeds() as fed:
            m.feed("gua\u200bran\x00teed returns".encode())
        assert len(m._others) == 3 and fed[0] <= 3, fed
        # … and the old path, for contrast: every earlier token again, for each reading.
        r = Replaying(RULES)
        for piece in _long_answer(500):
            r.feed(piece)
        with other_feeds() as fed:
            r.feed("gua\u200bran\x00teed returns".encode())
        assert r.replayed == 3 * 500 and fed == [3 * 501]


@pytest.mark.parametrize(("early", "late"), [("\u200b", b" guar\x00anteed returns"),
                                             ("\x00", " guar\u200banteed returns".encode())])
def test_a_late_second_class_of_invisible_feeds_no_earlier_token_again(early, late):
    """A format character early, a control late: "spaced" has read everything as "swapped"
    did (no control yet), so it is a copy; "dropped" reads the format character otherwise:
    it has run unheard since the format character (and the other way round)."""
    m = StreamMatcher(RULES)
    for piece in _long_answer(100):
        m.feed(piece)
    m.feed(early.encode())
    assert len(m._others) == 1 and m._shadow is not None
    assert m._shadow._name == ("dropped" if early == "\u200b" else "spaced")
    for piece in _long_answer(50):
        m.feed(piece)
    with other_feeds() as fed:
        m.feed(late)
    assert len(m._others) == 3 and m._shadow is None and fed[0] <= 3
    # A rollback between the two keeps the one that ran unheard, for the next time.
    m.rollback(150)
    assert len(m._others) == 1 and m._shadow is not None
    with other_feeds() as fed:
        m.feed(late)
    assert len(m._others) == 3 and fed[0] <= 3
    m.finish()
    assert FAMILY in [x.rule.id for x in m.matches]


def test_a_hyphen_held_across_tokens_when_the_reading_starts():
    """The other readings hold a hyphen after a letter until a visible character comes;
    the reading built when an invisible arrives holds it too (whitespace and a mark in
    tokens after it), and joins the word across a later line break."""
    pieces = [b"We offer guaran", b"-", b" ", "\u0301".encode(), b" ", b"\n", "\u200b".encode(),
              b"teed returns."]
    m, r = StreamMatcher(RULES), Replaying(RULES)
    for piece in pieces:
        m.feed(piece)
        r.feed(piece)
        assert _observed(m) == _observed(r)
    m.finish()
    assert FAMILY in [x.rule.id for x in m.matches]


@pytest.mark.parametrize("text", [
    "We a-\u0301 b c\u200bx guaranteed returns. And more",  # a mark before the space
    "We a- \u0301\u20dd b c\x00x guar\u200banteed returns. And more",  # … after it
    "We offer guaran- \u0301 \n\u200bteed returns. And more",  # held across tokens
    "A well-known, well-\u0301\nrespected x-\u00ad\nteed \x00y\u200bz guaranteed returns.",
    "x- - y-\u2013z w\u2013 \u200b q-\u0301 \u3000r\u200b guaranteed returns.",
    "\u7a33\u8d5a- \u4e0d\u8d54 a-\u0301\u200b b guaranteed returns.",
])
def test_every_cut_gives_the_replayed_readings(text):
    """Each text fed in two tokens cut at every byte, and byte by byte."""
    data = text.encode()
    cuts = [[data[:i], data[i:]] for i in range(1, len(data))]
    cuts.append([data[i : i + 1] for i in range(len(data))])
    for chunks in cuts:
        m, r = StreamMatcher(RULES), Replaying(RULES)
        for chunk in chunks:
            m.feed(chunk)
            r.feed(chunk)
            assert _observed(m) == _observed(r), chunks
        m.finish()
        r.finish()
        assert _observed(m) == _observed(r), chunks
