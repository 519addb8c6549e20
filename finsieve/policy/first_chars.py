"""Where a regex match can begin: lets the matcher skip regexes that cannot start.

Read off Python's own regex parser: the first characters, the first five or three
(`prefixes`), and the characters a leading negative lookbehind rules out before a match
(`not_after`).
In `prefixes` every decimal digit (a `\\d`, or a digit written out) is one symbol, DIGIT,
and the text's are read as it: `(?:gb|de)\\d{2}` begins with "gb" or "de" and a digit, so
" gbp" or " the" rule it out (before, the class ended its prefixes at "gb" and "de", and
every word beginning with a country code searched the IBAN rule: two thirds of a
streaming answer's regex searches with the default packs).
Lookbehinds are zero-width, so each is replaced by an empty group first (Python's parser
refuses the variable-width ones that `regex` accepts, and the phrase families use them for
negations), and `regex`-only property classes read as "any character". Case and classes
are the regex engine's own (its case equivalences, its word characters). Anything it cannot read, or
reads otherwise than `regex` (fuzzy matching, POSIX classes), a negated class or `.`:
"anything", and that regex always runs. Every answer may be larger than the truth, never
smaller: a filter that skipped a possible match would let a violation through.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from re import _constants as c  # type: ignore[attr-defined]  # private: not in typeshed

import regex
from regex import _regex

from .schema import REGEX_FLAGS

# The regex engine's own case equivalences (i ~ I ~ İ, s ~ ſ, k ~ K, σ ~ ς, …): a private
# function, absent from regex's stubs. Without them no filter is sound: every regex runs.
_all_cases: Callable[[int, int], list[int]] | None = getattr(_regex, "get_all_cases", None)


def _engine_class(pattern: str) -> Callable[[str], bool]:
    """Membership in a class as the regex engine has it (str.isalnum is not `\\w`)."""
    match = regex.compile(pattern, REGEX_FLAGS).fullmatch
    return lambda ch: match(ch) is not None


_DIGIT, _SPACE = _engine_class(r"\d"), _engine_class(r"\s")
is_word = _engine_class(r"\w")  # a word character, as \w and \b see it ("": none)
_CATEGORIES = {
    c.CATEGORY_DIGIT: _DIGIT, c.CATEGORY_UNI_DIGIT: _DIGIT,
    c.CATEGORY_SPACE: _SPACE, c.CATEGORY_UNI_SPACE: _SPACE,
    c.CATEGORY_WORD: is_word, c.CATEGORY_UNI_WORD: is_word,
}


class _Any(Exception):
    """The first character can be anything (or we cannot tell)."""


@dataclass
class FirstChars:
    chars: set[str] = field(default_factory=set)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    tests: list = field(default_factory=list)
    word_start: bool = False  # the pattern begins with \b before a word character
    not_after: Callable[[str], object] | None = None  # a character no match can follow
    # Every match begins with one of these (its first _chars characters, or all of a
    # shorter match); None: too many or unknown. `_heads`: every prefix of each of them.
    prefixes: frozenset[str] | None = None
    _heads: frozenset[str] = frozenset()
    _lengths: tuple[int, ...] = ()
    _chars: int = 0  # the prefixes' length (shorter ones are whole matches)

    def can_follow(self, prev: str) -> bool:
        return self.not_after is None or not self.not_after(prev)

    def can_begin(self, text: str) -> bool:
        """Can a match (or the beginning of one still in the making) begin `text`?"""
        if self.prefixes is None:
            return True
        head = _digits_as_one(text[: self._chars])
        return head in self._heads or any(head[:n] in self.prefixes for n in self._lengths)

    def __contains__(self, ch: str) -> bool:
        """Can a match begin with the text character ch (case-insensitively, as the engine
        matches: ch or any character it takes for ch)?"""
        return any(self._holds(x) for x in _cases(ch))

    def _holds(self, ch: str) -> bool:
        o = ord(ch)
        return (ch in self.chars or any(lo <= o <= hi for lo, hi in self.ranges)
                or any(t(ch) for t in self.tests))


# Comments and verbose mode: Python's parser reads them otherwise than `regex` (which ignores
# more whitespace in verbose mode, e.g. U+2028 or U+00A0), and `_units` does not know a `[`
# or `(?<!` in a comment is text. Such a pattern gets no filter (found in review: each let a
# match through a streaming answer).
_UNREADABLE = re.compile(r"\(\?#|\(\?[\^a-zA-Z-]*x[\^a-zA-Z-]*[:)]")


def first_chars(pattern: str) -> FirstChars | None:
    if _all_cases is None or _UNREADABLE.search(pattern) \
            or regex.compile(pattern, REGEX_FLAGS).flags & regex.VERBOSE:
        return None
    try:
        parsed = re._parser.parse(for_python(pattern), re.IGNORECASE)  # type: ignore[attr-defined]  # private
        out = FirstChars()
        if _seq(list(parsed), out):
            raise _Any  # the pattern can match the empty string
    except (_Any, re.error, Exception):
        return None
    # The first element that consumes or asserts something (a lookbehind leaves "()").
    first = next((item for item in parsed if not _is_placeholder(item)), None)
    word_chars = (all(is_word(ch) for ch in out.chars)
                  and all(hi - lo < 4096 and all(is_word(chr(o)) for o in range(lo, hi + 1))
                          for lo, hi in out.ranges)
                  and all(t in (_DIGIT, is_word) for t in out.tests))
    out.word_start = first == (c.AT, c.AT_BOUNDARY) and word_chars
    out.not_after = _not_after(pattern, list(parsed))
    for chars in PREFIX_CHARS:  # the longest prefixes that stay few
        try:
            prefixes = {p.rstrip(_OPEN) for p in _seq_strings(list(parsed), chars)}
        except _Any:
            continue
        if "" in prefixes:
            break
        out.prefixes = frozenset(prefixes)
        out._heads = frozenset(p[:n] for p in out.prefixes for n in range(1, len(p) + 1))
        out._lengths = tuple(sorted({len(p) for p in out.prefixes}))
        out._chars = chars
        break
    return out


# Prefix lengths tried, longest first: five letters tell "profit" from "project", three do
# not (a third of the default packs' streaming searches, after the digits, were such words);
# a family of thousands of five-letter beginnings (an IBAN's country, digits and first
# letter) keeps three.
PREFIX_CHARS = (5, 3)
_MAX_PREFIXES = 1024
_OPEN = "\x00"
# Any decimal digit, as the engine's \d has them (a private-use character: one in the text
# reads as a digit too, which only searches more).
DIGIT = "\ue000"
_ASCII_DIGITS = str.maketrans({str(d): DIGIT for d in range(10)})


def _digits_as_one(head: str) -> str:
    """The text's characters as `prefixes` hold them: every digit DIGIT."""
    head = head.translate(_ASCII_DIGITS)
    if head.isascii():
        return head
    return "".join(DIGIT if _DIGIT(ch) else ch for ch in head)


def _seq_strings(items: list, k: int) -> set[str]:
    """The first k characters of every string a sequence matches (all of a shorter one).
    Zero-width items (anchors, lookarounds) are skipped: the set may be larger, not smaller.
    A string ending in _OPEN is a beginning followed by what could not be read (anything)."""
    out = {""}
    for op, av in items:
        if op in (c.AT, c.ASSERT, c.ASSERT_NOT):
            continue
        if all(_done(s, k) for s in out):
            break
        try:
            tails = _item_strings(op, av, k)
        except _Any:
            if "" in out:
                raise
            tails = {_OPEN}
        out = {_join(s, t, k) for s in out for t in tails}
        if len(out) > _MAX_PREFIXES:
            raise _Any
    return out


def _done(s: str, k: int) -> bool:
    return len(s) >= k or s.endswith(_OPEN)


def _join(s: str, t: str, k: int) -> str:
    return s if _done(s, k) else (s + t)[:k]


def _item_strings(op, av, k: int) -> set[str]:
    if op is c.LITERAL:
        return _text_chars(chr(av))
    if op is c.IN:
        chars: set[str] = set()
        for kind, value in av:
            if kind is c.LITERAL:
                chars |= _text_chars(chr(value))
            elif kind is c.RANGE and value[1] - value[0] < 64:
                for o in range(value[0], value[1] + 1):
                    chars |= _text_chars(chr(o))
            elif kind is c.CATEGORY and value in (c.CATEGORY_DIGIT, c.CATEGORY_UNI_DIGIT):
                chars.add(DIGIT)
            else:
                raise _Any  # another category, a negation, a wide range
        return chars
    if op is c.SUBPATTERN:
        return _seq_strings(list(av[-1]), k)
    if op is c.BRANCH:
        return set().union(*(_seq_strings(list(branch), k) for branch in av[1]))
    if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
        low, high, item = av
        one = _seq_strings(list(item), k)
        if "" in one or _OPEN in one:
            raise _Any  # a repeat of something that can be empty: not worth the care
        # Each repeat adds a character at least: k repeats or more all begin like k repeats.
        out, strings = set(), {""}
        for count in range(min(high, k) + 1):
            if count >= min(low, k):
                out |= strings
            strings = {_join(s, t, k) for s in strings for t in one}
            if len(strings) > _MAX_PREFIXES:
                raise _Any
        return out
    if op is c.ATOMIC_GROUP:
        return _seq_strings(list(av), k)
    raise _Any


def _text_chars(ch: str) -> set[str]:
    """The characters of the normalized text (case-folded) that the pattern's ch matches:
    those the engine takes for ch, case-insensitively, that case folding leaves as they are."""
    found = {DIGIT if _DIGIT(x) else x for x in _cases(ch) if x.casefold() == x}
    if not found:
        raise _Any  # e.g. ß, which the text holds as "ss": not worth the care
    return found


@lru_cache(maxsize=1 << 14)
def _cases(ch: str) -> frozenset[str]:
    """ch and every character the engine takes for it when matching case-insensitively."""
    all_cases = _all_cases
    assert all_cases is not None  # without them first_chars makes no filter that asks
    return frozenset({ch, *(chr(o) for o in all_cases(REGEX_FLAGS, ord(ch)))})


_ONE_CHAR = re.compile(r"\\[dwsDWS]|\[(?:\\.|[^\]\\])+\]|[^\\()[\]|.*+?{}^$]")


def _not_after(pattern: str, parsed: list) -> Callable[[str], object] | None:
    """The pattern begins with a negative lookbehind (`(?<![a-z0-9])`, `(?<!\\d|\\d ?-)`)
    that every match must pass: the characters that one of its one-character alternatives
    matches. After one of them no match can begin, whatever came before (longer
    alternatives need more text: ignored). Every match passes it when the parse begins
    with its placeholder (`for_python`) as such: not quantified, not in an alternation."""
    start = next((n for n in ("(?<!", "(?:(?<!") if pattern.startswith(n)), None)
    if start is None or not parsed or not _is_placeholder(parsed[0]):
        return None
    alternatives: list[str] = []
    current: list[str] = []
    depth = 0
    for _, unit, in_class in _units(pattern[len(start):]):
        if not in_class and unit in ("(", ")"):
            depth += 1 if unit == "(" else -1
            if depth < 0:
                break
        if not in_class and unit == "|" and depth == 0:
            alternatives.append("".join(current))
            current = []
        else:
            current.append(unit)
    else:
        return None  # unbalanced
    alternatives.append("".join(current))
    one_char = [a for a in alternatives if _ONE_CHAR.fullmatch(a)]
    if not one_char:
        return None
    return regex.compile("|".join(one_char), REGEX_FLAGS).fullmatch


def _is_placeholder(item: tuple) -> bool:
    return item[0] is c.SUBPATTERN and not list(item[1][-1])


def _seq(items: list, out: FirstChars) -> bool:
    """Add the first characters of a sequence; True if it can match the empty string."""
    for op, av in items:
        if op in (c.AT, c.ASSERT, c.ASSERT_NOT):
            continue  # zero-width
        if not _item(op, av, out):
            return False
    return True


def _item(op, av, out: FirstChars) -> bool:
    """Add one element's first characters; True if it can match the empty string."""
    if op is c.LITERAL:
        out.chars.add(chr(av))
        return False
    if op is c.IN:
        for kind, value in av:
            if kind is c.LITERAL:
                out.chars.add(chr(value))
            elif kind is c.RANGE:
                out.ranges.append(value)
            elif kind is c.CATEGORY and value in _CATEGORIES:
                out.tests.append(_CATEGORIES[value])
            else:
                raise _Any
        return False
    if op is c.SUBPATTERN:
        return _seq(list(av[-1]), out)
    if op is c.BRANCH:
        return any([_seq(list(branch), out) for branch in av[1]])
    if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
        low, _, item = av
        return _seq(list(item), out) or low == 0
    if op is c.ATOMIC_GROUP:
        return _seq(list(av), out)
    raise _Any


_PROPERTY = re.compile(r"\\[pP](?:\{[^}]*\}|[A-Za-z])")
_QUANTIFIER = re.compile(r"\{\d*(?:,\d*)?\}")


def for_python(pattern: str) -> str:
    """The pattern as Python's parser can read it, with the same first characters: every
    `(?<=…)` and `(?<!…)` group made an empty group (zero-width), every `regex`-only class
    (`\\p{Han}`) made "any character" (escapes and character classes respected)."""
    out: list[str] = []
    dropping = 0  # parentheses open in a lookbehind being removed
    was_in_class = False
    for i, unit, in_class in _units(pattern):
        # Read by Python as literal characters, by `regex` as fuzzy matching or a POSIX class
        # (`[[:alpha:]]`: a "[:" inside a class).
        if (unit == "{" and not in_class and not _QUANTIFIER.match(pattern, i)) or (
                unit == "[" and was_in_class and pattern.startswith(":", i + 1)):
            raise re.error("regex-only syntax")
        was_in_class = in_class
        if not in_class and unit in ("(", ")") and (
                dropping or pattern.startswith(("(?<=", "(?<!"), i)):
            if not dropping:
                # An empty group holds its place: a quantifier after it stays its own, and
                # _not_after sees whether every match passes the lookbehind.
                out.append("()")
            dropping += 1 if unit == "(" else -1
            continue
        if dropping:
            continue
        if _PROPERTY.fullmatch(unit):
            unit = r"\s\S" if in_class else r"[\s\S]"
        out.append(unit)
    if dropping:
        raise re.error("unbalanced parenthesis")
    return "".join(out)


def _units(pattern: str) -> Iterator[tuple[int, str, bool]]:
    """(index, unit, inside a character class) for each unit of the pattern: an escape (a
    property class whole) or one character."""
    i, class_from = 0, -1  # inside a class: where its members begin ("]" first is one)
    while i < len(pattern):
        prop = _PROPERTY.match(pattern, i)
        unit = prop[0] if prop else pattern[i : i + 2] if pattern[i] == "\\" else pattern[i]
        if class_from < 0 and unit == "[":
            class_from = i + 1 + pattern.startswith("^", i + 1)
        elif class_from >= 0 and unit == "]" and i > class_from:
            class_from = -1
        yield i, unit, class_from >= 0
        i += len(unit)
