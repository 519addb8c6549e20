"""The normalized view that rules match, built one character at a time.

Each raw character maps to its fold, whatever surrounds it:

  * whitespace and control characters (C0, C1) read as a space; runs of spaces collapse;
  * default-ignorable and format characters (zero-width joiner and space, soft hyphen,
    bidi overrides and isolates, variation selectors, tag characters, Hangul fillers) and
    decorating marks (nonspacing and enclosing: accents, strike-through, circles) vanish;
  * NFKC (full-width `１５％` → `15%`, `ﬁ` → `fi`), then case folding (`Straße` → `strasse`);
  * every dash reads as `-`;
  * a non-ASCII character that looks like a Latin letter or digit reads as it, per the
    UTS #39 confusables data (Cyrillic `е` → `e`, Greek `ο` → `o`, Cherokee `Ꭱ` → `r`).
    ASCII is never remapped: `1`, `0`, `m` and `|` stay what they are.

One rule looks at the neighbours: a space between two CJK characters (Han, kana,
bopomofo) vanishes, so `稳 赚 不 赔` reads `稳赚不赔`. A space after a CJK character is held
(pending, like an incomplete UTF-8 character) until the next character shows which it is.

Every normalized character keeps the raw byte span that produced it (holdback, rollback and
redaction act on raw text) and the script of its raw character (`scripts.py`): a match whose
letters are all of one script its pattern is not written in is not a match, so a Russian or
Greek sentence whose look-alike letters happen to spell an English rule does not trip it.

Dropping marks rather than composing them is what keeps the view streamable: NFKC would
compose `e` + U+0301 across a token boundary, after `e` was already matched.
"""

from __future__ import annotations

import codecs
import re
import unicodedata
from functools import lru_cache

import disarm
import regex

from .memo import remember
from .scripts import ALNUM, LATIN, script_tag
from .utf8 import replaced_in_step

# Bump when the view changes for the same Unicode data; the data versions are part of it.
VIEW_VERSION = f"2/unicode-{unicodedata.unidata_version}/confusables-{disarm.CONFUSABLES_VERSION}"

# Printable ASCII without a run of spaces: its normalized form is its lower case.
_PLAIN_ASCII = re.compile(rb"(?: ?[!-~])+ ?| ")
_ASCII_TAGS = bytes(LATIN if chr(b).isalpha() else ALNUM if chr(b).isdigit() else 0
                    for b in range(128)) + bytes(128)
_INVISIBLE = regex.compile(r"[\p{Default_Ignorable_Code_Point}\p{Mn}\p{Me}]")
_CJK = regex.compile(r"[\p{scx=Han}\p{scx=Hiragana}\p{scx=Katakana}\p{scx=Bopomofo}]")

# What a matcher's text ends in decides how the next token's first characters join it.
PLAIN, SPACE, CJK, CJK_SPACE = "plain", "space", "cjk", "cjk+space"


def plain_join(data: bytes, mode: str) -> tuple[str, bytes] | None:
    """The normalized characters and script tags `data` adds after text ending in `mode`,
    when that is its lower case (most tokens: printable ASCII, no run of spaces); else None."""
    # After a space or CJK a leading space joins a run or may vanish; after a held space
    # (CJK_SPACE) anything may decide its fate.
    if mode == CJK_SPACE or not _PLAIN_ASCII.fullmatch(data) or (mode != PLAIN and data[0] == 0x20):
        return None
    return data.decode().lower(), data.translate(_ASCII_TAGS)


# data -> plain_join(data, PLAIN) (None: not plain ASCII), for token-sized data. A plain dict:
# Normalizer.feed reads it once per token (a hit is one lookup); emptied when full.
_PLAIN_MEMO: dict[bytes, tuple[str, bytes] | None] = {}
_PLAIN_MEMO_SIZE = 1 << 16
_PLAIN_MEMO_BYTES = 64  # longer data (a whole text) is not kept


def _plain_missed(data: bytes) -> tuple[str, bytes] | None:
    """plain_join(data, PLAIN), kept in _PLAIN_MEMO when data is short."""
    found = plain_join(data, PLAIN)
    if len(data) <= _PLAIN_MEMO_BYTES:
        remember(_PLAIN_MEMO, data, found, _PLAIN_MEMO_SIZE)
    return found


@lru_cache(maxsize=65536)
def is_cjk(ch: str) -> bool:
    return _CJK.match(ch) is not None


def _base(text: str) -> str:
    """NFKC without the marks, case-folded, dashes as '-', spaces as ' '."""
    kept = _INVISIBLE.sub("", unicodedata.normalize("NFKD", text))
    out = unicodedata.normalize("NFC", kept).casefold()
    return "".join(" " if c.isspace() else "-" if unicodedata.category(c) == "Pd" else c
                   for c in out if not _INVISIBLE.match(c))


@lru_cache(maxsize=65536)
def fold_tagged(ch: str) -> tuple[str, int]:
    """The normalized form of one raw character ('' when it vanishes), and its script tag."""
    if ch.isspace() or unicodedata.category(ch) == "Cc":
        return " ", 0
    if _INVISIBLE.match(ch):
        return "", 0
    out = []
    for c in _base(ch):
        if not c.isascii():
            # The skeleton's case and marks are folded like everything else.
            c = _base(disarm.normalize_confusables(c))
        out.append(c)
    return "".join(out), script_tag(ch)


def fold(ch: str) -> str:
    return fold_tagged(ch)[0]


def normalize(text: str) -> str:
    """Whole-string normalized view (for patterns and tests)."""
    n = Normalizer()
    n.feed(text.encode())
    n.flush()
    return "".join(n.text)


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
        self.tags = bytearray()  # script tag of each one's raw character (scripts.py)
        self.space: tuple[int, int] | None = None  # raw span of a space held after a CJK char

    @property
    def pending(self) -> bytes:
        # Every byte fed but not decoded is pending (feed keeps the two counts so): with
        # none, the decoder's state need not be asked.
        return self._decoder.getstate()[0] if self.raw_len != self.decoded_len else b""

    @property
    def settled(self) -> int:
        """Raw bytes whose normalized form is final (a held space and pending bytes are not)."""
        return self.space[0] if self.space else self.decoded_len

    @property
    def mode(self) -> str:
        """How the next characters join the text: after a space, a CJK char, a held space."""
        if self.space:
            return CJK_SPACE
        if not self.text:
            return PLAIN
        last = self.text[-1]
        return SPACE if last == " " else CJK if is_cjk(last) else PLAIN

    def feed(self, data: bytes) -> str:
        """Feed raw bytes; return the normalized characters they appended."""
        before = len(self.text)
        held = self.raw_len - self.decoded_len  # pending bytes of a character begun earlier
        self.raw_len += len(data)
        # plain_join(data, self.mode), from a memo of plain_join(data, PLAIN): they differ
        # only after a held space (CJK_SPACE: never plain) and for a leading space after a
        # space or a CJK character (SPACE, CJK).
        plain = None
        if not held and self.space is None:
            try:
                plain = _PLAIN_MEMO[data]
            except KeyError:
                plain = _plain_missed(data)
            except TypeError:  # unhashable (a bytearray): not kept
                plain = plain_join(data, PLAIN)
            if plain is not None and data[0] == 0x20 and self.mode != PLAIN:
                plain = None
        if plain is not None:
            # Most tokens: one byte per character, nothing to fold but case.
            new, tags = plain
            d = self.decoded_len
            self.decoded_len += len(data)
            self.text.extend(new)
            self.raw_start.extend(range(d, self.decoded_len))
            self.raw_end.extend(range(d + 1, self.decoded_len + 1))
            self.tags += tags
            return new
        head = self.pending  # what `held` counts
        chars = self._decoder.decode(data)
        for ch, size in zip(chars, self._raw_sizes(chars, head, data), strict=True):
            start = self.decoded_len
            self.decoded_len += size
            folded, tag = fold_tagged(ch)
            for c in folded:
                self._emit(c, tag, start)
        return "".join(self.text[before:])

    def flush(self) -> str:
        """The text ended: a held space is a space after all."""
        if self.space is None:
            return ""
        self._append(" ", 0, *self.space)
        self.space = None
        return " "

    def _emit(self, c: str, tag: int, start: int) -> None:
        end = self.decoded_len
        if c == " ":
            if self.space is not None:
                self.space = (self.space[0], end)  # the held run grows
            elif self.text and self.text[-1] == " ":
                self.raw_end[-1] = end  # the run grows; no new character
            elif self.text and is_cjk(self.text[-1]):
                self.space = (start, end)  # vanishes if the next character is CJK too
            else:
                self._append(" ", 0, start, end)
            return
        if self.space is not None:
            if not is_cjk(c):
                self._append(" ", 0, *self.space)
            self.space = None
        self._append(c, tag, start, end)

    def _append(self, c: str, tag: int, start: int, end: int) -> None:
        self.text.append(c)
        self.tags.append(tag)
        self.raw_start.append(start)
        self.raw_end.append(end)

    def _raw_sizes(self, chars: str, head: bytes, data: bytes) -> list[int]:
        """Raw byte length of each character just decoded from `head` (bytes pending
        before) + `data`: its UTF-8 length, except a U+FFFD that stands for invalid bytes."""
        sizes = [len(c.encode()) for c in chars]
        if "\ufffd" in chars:  # rare: invalid bytes, or a U+FFFD the model wrote
            for i, size in replaced_in_step(head, data, self.pending):
                sizes[i] = size
        return sizes

    def truncate(self, raw_len: int, decoded_len: int, pending: bytes, n_norm: int,
                 last_end: int, space: tuple[int, int] | None) -> None:
        """Return to an earlier state (see Checkpoint in matcher.py)."""
        self.raw_len, self.decoded_len, self.space = raw_len, decoded_len, space
        self._decoder.setstate((pending, 0))
        del self.text[n_norm:], self.raw_start[n_norm:], self.raw_end[n_norm:], self.tags[n_norm:]
        if n_norm:
            self.raw_end[-1] = last_end
