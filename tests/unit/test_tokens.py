"""engine/tokens.py: text assembled from token bytes, and stop strings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tokens import IncrementalText, find_stop, stop_holdback


def test_incremental_text_keeps_half_characters_pending():
    table = [bytes([b]) for b in "年化15%".encode()]
    text = IncrementalText(table)
    pieces = [text.add(i) for i in range(len(table))]
    assert pieces == ["", "", "年", "", "", "化", "1", "5", "%"]
    assert text.text == "年化15%"


def test_incremental_text_replaces_invalid_bytes_instead_of_stalling():
    text = IncrementalText([b"\xff", b"ok"])
    assert text.add(0) + text.add(1) == "\ufffdok"


def test_incremental_text_knows_the_raw_offset_of_every_character():
    # U+FFFD for 1 byte, for 2 (an incomplete character cut short), and a genuine one (3)
    table = [b"\xff", b"ok", b"\xe4\xb8", b"\xef\xbf\xbd", b"!"]
    text = IncrementalText(table)
    for t in range(len(table)):
        text.add(t)
    assert text.text == "\ufffdok\ufffd\ufffd!"
    assert [text.raw_offset(i) for i in range(len(text.text) + 1)] == [0, 1, 2, 3, 5, 8, 9]
    text.cut(3)
    assert (text.text, text.raw_len) == ("\ufffdok", 3)


# Bytes that make every kind of invalid UTF-8: stray continuations, lone and cut-short
# leads, overlongs, surrogates, past U+10FFFF; and valid characters around them.
_UTF8_PIECES = st.lists(st.sampled_from(
    [bytes([b]) for b in (0x61, 0x80, 0xBF, 0xC0, 0xC3, 0xA9, 0xE0, 0xA0, 0xED, 0xE4, 0xB8,
                          0xAD, 0xF0, 0x90, 0x8D, 0xF4, 0x8F, 0xF5, 0xFF)]
    + [b"ok", b"\xef\xbf\xbd", "年".encode()]), max_size=12)


@settings(max_examples=500, deadline=None)
@given(pieces=st.lists(_UTF8_PIECES.map(b"".join), max_size=6))
def test_incremental_text_raw_offsets_split_the_bytes_where_the_text_splits(pieces):
    """The guard releases raw bytes: those up to a character's offset must be the text
    before it, however the bytes came in tokens."""
    text = IncrementalText(pieces)
    for t in range(len(pieces)):
        text.add(t)
    data = b"".join(pieces)[: text.raw_len]
    assert data.decode("utf-8", "replace") == text.text
    for i in range(len(text.text) + 1):
        offset = text.raw_offset(i)
        assert data[:offset].decode("utf-8", "replace") == text.text[:i]
        assert data[offset:].decode("utf-8", "replace") == text.text[i:]


@pytest.mark.parametrize(
    ("text", "stops", "held"),
    [("the end", ("END",), 0), ("the E", ("END",), 1), ("the EN", ("END",), 2),
     ("the EN", ("N!", "ENX"), 2), ("abc", (), 0), ("xEEN", ("EEND",), 3)],
)
def test_stop_holdback_holds_only_a_possible_stop_prefix(text, stops, held):
    assert stop_holdback(text, stops) == held


def test_find_stop_finds_the_earliest():
    assert find_stop("a STOP b END", ("END", "STOP"), 0) == 2
    assert find_stop("a STOP b", ("END",), 0) == -1
