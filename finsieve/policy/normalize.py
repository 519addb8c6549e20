"""The normalized view that rules match, built one character at a time.

Each raw character maps to its fold, whatever surrounds it:

  * whitespace (Unicode's White_Space: spaces, tabs, line breaks, NEL) and the other
    control characters (C0, C1) read as a space; runs of spaces collapse;
  * every other *invisible* character vanishes: Default_Ignorable_Code_Point and general
    category Cf, from Unicode's data as the `regex` module has it (zero-width joiner and
    space, soft hyphen, bidi marks, overrides and isolates, variation selectors, tag
    characters, Hangul fillers, U+FFF9-FFFB, the Arabic and Syriac number and abbreviation
    marks U+0600-0605, U+070F, U+08E2, the hieroglyph format controls U+13430-1343F), and so
    do decorating marks (nonspacing and enclosing: accents, strike-through, circles);
  * NFKC (full-width `１５％` → `15%`, `ﬁ` → `fi`), then case folding (`Straße` → `strasse`);
  * every dash reads as `-`; a decimal digit of any script reads as its value (`৪` is `4`);
  * a non-ASCII character that looks like a Latin letter or digit reads as it, per the
    UTS #39 confusables data (Cyrillic `е` → `e`, Greek `ο` → `o`, Cherokee `Ꭱ` → `r`).
    ASCII is never remapped: `1`, `0`, `m` and `|` stay what they are.

One rule looks at the neighbours: a space between two CJK characters (Han, kana,
bopomofo) vanishes, so `稳 赚 不 赔` reads `稳赚不赔`. A space after a CJK character is held
(pending, like an incomplete UTF-8 character) until the next character shows which it is.

**Two readings of an invisible.** Inside a word an invisible character vanishes
(`guar\u200banteed` is `guaranteed`, and so is `guar\x00anteed`); standing as the only
separator between two words it is a space (`guaranteed\u200breturns` is `guaranteed
returns`, and so is `guaranteed\x00returns`). The two look the same (a letter, an invisible,
a letter) and no rule without a dictionary tells them apart, so rules match both readings:

  * the *first* reading (`Normalizer`, `normalize`) is the one above: each invisible as it
    most often stands (a format character inside a word, a control character between words,
    as the whitespace controls are). Token masks and patterns are computed over it;
  * the *other* reading (`OtherNormalizer`, `normalize_other`) reads each invisible the other
    way (a format character as a space, a control character as nothing), and a hyphen (any
    dash, or a soft hyphen) after a letter, followed by whitespace that holds a line break,
    then a letter, vanishes with that whitespace (`guaran-\r\nteed` is `guaranteed`;
    `well-known`, `a - b`, `5-\nyear` and `end-\n- item` stay as they are). Such a hyphen
    is held (pending) until the next visible character decides it.

The matcher (matcher.py) runs the other reading beside the first from the first character
where they can differ (an invisible, or a line break after such a hyphen) and reports the
matches of both; a text with neither is read once. Once the text holds invisibles of both
classes, two more readings run, each with the other reading's hyphens: every invisible as
nothing (`gua\u200bran\x00teed`), every invisible as a space (`guaranteed\u200bfinancial\x00
returns`). A phrase that needs invisibles of one class read both ways at once
(`guar\u200banteed\u200breturns`) is not caught: a reader sees `guaranteedreturns` there,
words run together as in plain text, which no reading splits.

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
from typing import NamedTuple

import disarm
import regex

from .memo import remember
from .scripts import ALNUM, LATIN, script_tag
from .utf8 import replaced_in_step

# Bump when the view changes for the same Unicode data; the data versions are part of it
# (the `regex` module's version stands for its Unicode data: it classes the invisibles).
VIEW_VERSION = (f"4/unicode-{unicodedata.unidata_version}/regex-{regex.__version__}"
                f"/confusables-{disarm.CONFUSABLES_VERSION}")

# Printable ASCII without a run of spaces: its normalized form is its lower case.
_PLAIN_ASCII = re.compile(rb"(?: ?[!-~])+ ?| ")
_ASCII_TAGS = bytes(LATIN if chr(b).isalpha() else ALNUM if chr(b).isdigit() else 0
                    for b in range(128)) + bytes(128)
# Invisible characters (see above): those that vanish, and all of them with the decorating
# marks (what never stays in a fold).
_IGNORED = regex.compile(r"[\p{Default_Ignorable_Code_Point}\p{Cf}]")
_INVISIBLE = regex.compile(r"[\p{Default_Ignorable_Code_Point}\p{Cf}\p{Cc}\p{Mn}\p{Me}]")
_WHITE_SPACE = regex.compile(r"\p{White_Space}")
_CONTROL = regex.compile(r"\p{Cc}")
_LINE_BREAKS = frozenset("\n\v\f\r\x85\u2028\u2029")  # White_Space that ends a line
# Line breaks that many renderers (a web page, a chat bubble) show as nothing: read both
# ways, like a control (`gua\x85ranteed` is `guaranteed` in the other reading).
_UNSEEN_BREAKS = frozenset("\v\f\x85\u2028\u2029")
_SOFT_HYPHEN = "\u00ad"
# What a raw character is besides its fold (fold_kind): most are neither.
INVISIBLE, LINE_BREAK = 1, 2
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


def is_letter(ch: str) -> bool:
    """A letter that a line-break hyphen may join (CJK text is not hyphenated)."""
    return ch.isalpha() and not is_cjk(ch)


@lru_cache(maxsize=65536)
def fold_kind(ch: str) -> tuple[str, int, int]:
    """The normalized form of one raw character in the first reading ('' when it
    vanishes), its script tag, and its kind: flags INVISIBLE (the other reading swaps '' and
    ' ') and LINE_BREAK, or 0."""
    if _WHITE_SPACE.match(ch):
        if ch in _UNSEEN_BREAKS:
            return " ", 0, INVISIBLE | LINE_BREAK
        return " ", 0, LINE_BREAK if ch in _LINE_BREAKS else 0
    if _CONTROL.match(ch):
        return " ", 0, INVISIBLE
    if _IGNORED.match(ch):
        return "", 0, INVISIBLE
    if _INVISIBLE.match(ch):
        return "", 0, 0
    out = []
    for c in _base(ch):
        if c.isdecimal() and not c.isascii():
            # A digit of any script reads as its value (Bengali ৪ is 4, though it looks
            # like an 8): card numbers are checked by value (Luhn).
            c = str(unicodedata.decimal(c))
        elif not c.isascii():
            # The skeleton's case and marks are folded like everything else.
            c = _base(disarm.normalize_confusables(c))
        out.append(c)
    return "".join(out), script_tag(ch), 0


@lru_cache(maxsize=65536)
def fold_tagged(ch: str) -> tuple[str, int]:
    """The normalized form of one raw character ('' when it vanishes), and its script tag."""
    return fold_kind(ch)[:2]


def fold(ch: str) -> str:
    return fold_tagged(ch)[0]


def normalize(text: str) -> str:
    """Whole-string normalized view, first reading (for patterns and tests)."""
    n = Normalizer()
    n.feed(text.encode())
    n.flush()
    return "".join(n.text)


def normalize_other(text: str, reading: str = "swapped") -> str:
    """Whole-string normalized view, another reading (see above)."""
    n = OtherNormalizer(reading)
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
        # A line-break hyphen held (the other reading only): see OtherNormalizer.
        self.hyphen: Hold | None = None
        # Raw offset of the first character the other reading may read otherwise (an
        # invisible, a line break after a hyphen after a letter); None: there is none.
        self.diverged_at: int | None = None
        # … where the text first holds both a control and a format character (then two more
        # readings, see the module's docstring), and the first of each.
        self.mixed_at: int | None = None
        self._control_at: int | None = None
        self._format_at: int | None = None
        # Indices of hyphens after a letter that a mark (or another character read as
        # nothing) followed: where the other reading, which holds such a hyphen, maps the
        # space after it to other raw bytes than this one (see matcher.StreamMatcher._derived).
        self.marked_hyphens: list[int] = []

    @property
    def pending(self) -> bytes:
        # Every byte fed but not decoded is pending (feed keeps the two counts so): with
        # none, the decoder's state need not be asked.
        return self._decoder.getstate()[0] if self.raw_len != self.decoded_len else b""

    @property
    def settled(self) -> int:
        """Raw bytes whose normalized form is final (a held space or hyphen and pending bytes
        are not)."""
        return self.space[0] if self.space else self.hyphen[0] if self.hyphen else self.decoded_len

    def hyphen_at(self) -> int | None:
        """Index of a hyphen after a letter that ends the text (a space may follow it): the
        other reading may still join the letters around it, if a line break comes."""
        t = self.text
        k = len(t) - 1
        if k > 0 and t[k] == " ":
            k -= 1
        return k if k > 0 and t[k] == "-" and is_letter(t[k - 1]) else None

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
        return self._decode(data)

    def _decode(self, data: bytes) -> str:
        """feed, one character at a time (raw_len already counts data)."""
        before = len(self.text)
        head = self.pending  # bytes pending before data
        chars = self._decoder.decode(data)
        self._fold_chars(chars, self._raw_sizes(chars, head, data))
        return "".join(self.text[before:])

    def _fold_chars(self, chars: str, sizes: list[int]) -> None:
        """Append the normalized form of decoded characters, `sizes` their raw lengths."""
        for ch, size in zip(chars, sizes, strict=True):
            start = self.decoded_len
            self.decoded_len += size
            folded, tag, kind = fold_kind(ch)
            if kind & INVISIBLE:
                self._invisible(start, bool(folded))
            elif kind and self.diverged_at is None and self.hyphen_at() is not None:
                self.diverged_at = start
            if not folded and self.text and self.text[-1] in "- ":  # rare: a mark after one
                k = self.hyphen_at()
                if k is not None and (not self.marked_hyphens or self.marked_hyphens[-1] != k):
                    self.marked_hyphens.append(k)
            for c in folded:
                self._emit(c, tag, start)

    def _invisible(self, start: int, control: bool) -> None:
        """Note where the readings part: an invisible at raw offset start."""
        if self.diverged_at is None:
            self.diverged_at = start
        if control:
            if self._control_at is None:
                self._control_at = start
                if self._format_at is not None:
                    self.mixed_at = start
        elif self._format_at is None:
            self._format_at = start
            if self._control_at is not None:
                self.mixed_at = start

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
                 last_end: int, space: tuple[int, int] | None, hyphen: Hold | None = None) -> None:
        """Return to an earlier state (see Checkpoint in matcher.py)."""
        self.raw_len, self.decoded_len, self.space, self.hyphen = raw_len, decoded_len, space, hyphen
        if self.diverged_at is not None and self.diverged_at >= decoded_len:
            self.diverged_at = None
        if self._control_at is not None and self._control_at >= decoded_len:
            self._control_at = None
        if self._format_at is not None and self._format_at >= decoded_len:
            self._format_at = None
        if self.mixed_at is not None and self.mixed_at >= decoded_len:
            self.mixed_at = None
        self._decoder.setstate((pending, 0))
        marked = self.marked_hyphens
        while marked and marked[-1] >= n_norm:
            marked.pop()
        del self.text[n_norm:], self.raw_start[n_norm:], self.raw_end[n_norm:], self.tags[n_norm:]
        if n_norm:
            self.raw_end[-1] = last_end


class Hold(NamedTuple):
    """A hyphen held after a letter (the other reading), and the whitespace after it."""

    start: int  # raw span of the hyphen
    hyphen_end: int
    end: int  # … and of the whitespace (and invisibles) after it
    form: str  # what the hyphen reads as if it stays: "-", or " " for a soft hyphen
    spaced: bool  # whitespace or an invisible followed it
    broken: bool  # … a line break among them


# What a control and a format character read as in each other reading (OtherNormalizer).
READINGS = {"swapped": ("", " "), "dropped": ("", ""), "spaced": (" ", " ")}


class OtherNormalizer(Normalizer):
    """Another reading (see the module's docstring): a hyphen + line break between two letters
    vanishes, and invisibles read as READINGS says, (control, format) characters: "swapped"
    (each the other way), "dropped" or "spaced"."""

    def __init__(self, reading: str = "swapped") -> None:
        super().__init__()
        self._control_as, self._format_as = READINGS[reading]

    def feed(self, data: bytes) -> str:
        if self.hyphen is None and 0x2D not in data:
            return super().feed(data)
        # A held hyphen, or a hyphen that may be held: each character on its own.
        self.raw_len += len(data)
        return self._decode(data)

    def _fold_chars(self, chars: str, sizes: list[int]) -> None:
        for ch, size in zip(chars, sizes, strict=True):
            start = self.decoded_len
            self.decoded_len += size
            folded, tag, kind = fold_kind(ch)
            if kind & INVISIBLE:
                folded = self._control_as if folded else self._format_as
            held = self.hyphen
            if held is not None:
                if folded in (" ", ""):  # the whitespace after the hyphen goes on
                    self.hyphen = held._replace(end=self.decoded_len,
                                                spaced=held.spaced or folded == " ",
                                                broken=held.broken or bool(kind & LINE_BREAK))
                    continue
                self.hyphen = None
                if not (held.broken and is_letter(folded[0])):
                    self._release(held)
                # else: a word broken across lines; the hyphen and the line break vanish
            elif ((folded == "-" or ch == _SOFT_HYPHEN) and self.space is None and self.text
                  and is_letter(self.text[-1])):
                self.hyphen = Hold(start, self.decoded_len, self.decoded_len,
                                   "-" if folded == "-" else " ", False, False)
                continue
            for c in folded:
                self._emit(c, tag, start)

    def flush(self) -> str:
        before = len(self.text)
        if self.hyphen is not None:
            self._release(self.hyphen)
            self.hyphen = None
        super().flush()
        return "".join(self.text[before:])

    def _release(self, held: Hold) -> None:
        """The held hyphen stays: as it reads, then the whitespace after it as one space."""
        self._append(held.form, 0, held.start, held.hyphen_end)
        if held.spaced:
            if held.form == " ":
                self.raw_end[-1] = held.end
            else:
                self._append(" ", 0, held.hyphen_end, held.end)
