"""The normalized view that rules match, built one character at a time.

Each raw character maps to its fold: NFKC (full-width `１５％` → `15%`), case-folded,
combining marks dropped, every whitespace character as a space, format characters
(zero-width joiner and space, soft hyphen, bidi controls) as nothing. Runs of spaces
collapse into one. Dropping combining marks is what makes the view streamable: NFKC
would compose `e` + U+0301 across a token boundary, after `e` was already matched; with
marks dropped, `é`, `e\u0301` and `e` all read `e`, whichever token carried them.

The normalizer keeps, for every normalized character, the raw byte span that produced
it, because holdback, rollback and redaction act on raw text.
"""

from __future__ import annotations

import codecs
import re
import unicodedata
from functools import lru_cache

# Printable ASCII without a run of spaces: its normalized form is its lower case.
_PLAIN_ASCII = re.compile(rb"(?: ?[!-~])+ ?| ")


@lru_cache(maxsize=65536)
def fold(ch: str) -> str:
    """The normalized form of one raw character ('' when it vanishes)."""
    if ch.isspace():
        return " "
    category = unicodedata.category(ch)
    if category == "Cf":
        return ""
    decomposed = unicodedata.normalize("NFKD", ch)
    kept = "".join(c for c in decomposed if not unicodedata.combining(c))
    out = unicodedata.normalize("NFC", kept).casefold()
    return "".join(" " if c.isspace() else c for c in out if unicodedata.category(c) != "Cf")


def normalize(text: str) -> str:
    """Whole-string normalized view (for patterns and tests)."""
    out: list[str] = []
    for ch in text:
        for c in fold(ch):
            if c == " " and (not out or out[-1] == " "):
                continue
            out.append(c)
    return "".join(out)


def normalize_pattern(text: str) -> str:
    return normalize(text).strip()


class Normalizer:
    """Streaming normalizer over raw bytes, with maps from normalized chars to raw bytes.

    Leading spaces are kept (a token often starts with one); only runs collapse.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.raw_len = 0  # bytes fed, pending ones included
        self.decoded_len = 0  # bytes that formed complete characters
        self.text: list[str] = []  # normalized characters
        self.raw_start: list[int] = []  # raw byte offset where each one's source starts
        self.raw_end: list[int] = []  # … and ends

    @property
    def pending(self) -> bytes:
        return self._decoder.getstate()[0]

    def feed(self, data: bytes) -> str:
        """Feed raw bytes; return the normalized characters they appended."""
        before = len(self.text)
        pending = self.raw_len != self.decoded_len
        self.raw_len += len(data)
        if not pending and _PLAIN_ASCII.fullmatch(data) and not (
            data[0] == 0x20 and self.text and self.text[-1] == " "
        ):
            # Most tokens: one byte per character, nothing to fold but case.
            d = self.decoded_len
            self.decoded_len += len(data)
            new = data.decode().lower()
            self.text.extend(new)
            self.raw_start.extend(range(d, self.decoded_len))
            self.raw_end.extend(range(d + 1, self.decoded_len + 1))
            return new
        chars = self._decoder.decode(data)
        for ch, size in zip(chars, self._raw_sizes(chars), strict=True):
            start = self.decoded_len
            self.decoded_len += size
            for c in fold(ch):
                if c == " " and self.text and self.text[-1] == " ":
                    self.raw_end[-1] = self.decoded_len  # the run grows; no new character
                    continue
                self.text.append(c)
                self.raw_start.append(start)
                self.raw_end.append(self.decoded_len)
        return "".join(self.text[before:])

    def _raw_sizes(self, chars: str) -> list[int]:
        """Raw byte length of each decoded character.

        A U+FFFD may stand for one or more invalid bytes: those share what the valid
        characters leave of the bytes just decoded.
        """
        sizes = [len(c.encode()) for c in chars]
        bad = [i for i, c in enumerate(chars) if c == "\ufffd"]
        if bad:
            total = self.raw_len - len(self.pending) - self.decoded_len
            left = total - sum(s for i, s in enumerate(sizes) if chars[i] != "\ufffd")
            for n, i in enumerate(bad):
                sizes[i] = left // len(bad) + (left % len(bad) if n == 0 else 0)
        return sizes

    def truncate(self, raw_len: int, decoded_len: int, pending: bytes, n_norm: int,
                 last_end: int) -> None:
        """Return to an earlier state (see Checkpoint in matcher.py)."""
        self.raw_len, self.decoded_len = raw_len, decoded_len
        self._decoder.setstate((pending, 0))
        del self.text[n_norm:], self.raw_start[n_norm:], self.raw_end[n_norm:]
        if n_norm:
            self.raw_end[-1] = last_end
