"""Which characters can begin a regex match: lets the matcher skip regexes that cannot start.

Read off Python's own regex parser. Anything it cannot read (a `regex`-only construct, a
negated class, `.`) answers None: "any character", and that regex always runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from re import _constants as c  # type: ignore[attr-defined]

_CATEGORIES = {
    c.CATEGORY_DIGIT: str.isdigit, c.CATEGORY_UNI_DIGIT: str.isdigit,
    c.CATEGORY_SPACE: str.isspace, c.CATEGORY_UNI_SPACE: str.isspace,
    c.CATEGORY_WORD: lambda ch: ch.isalnum() or ch == "_",
    c.CATEGORY_UNI_WORD: lambda ch: ch.isalnum() or ch == "_",
}


class _Any(Exception):
    """The first character can be anything (or we cannot tell)."""


@dataclass
class FirstChars:
    chars: set[str] = field(default_factory=set)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    tests: list = field(default_factory=list)
    word_start: bool = False  # the pattern begins with \b before a word character

    def __contains__(self, ch: str) -> bool:
        o = ord(ch)
        return (ch in self.chars or any(lo <= o <= hi for lo, hi in self.ranges)
                or any(t(ch) for t in self.tests))


def first_chars(pattern: str) -> FirstChars | None:
    try:
        parsed = re._parser.parse(pattern, re.IGNORECASE)  # type: ignore[attr-defined]
        out = FirstChars()
        if _seq(list(parsed), out):
            raise _Any  # the pattern can match the empty string
    except (_Any, re.error, Exception):
        return None
    for ch in list(out.chars):  # the text is case-folded; the pattern may not be
        out.chars |= {ch.lower(), ch.upper(), ch.casefold()}
    first = parsed[0] if len(parsed) else None
    word_chars = (all(ch.isalnum() for ch in out.chars)
                  and all(chr(lo).isalnum() and chr(hi).isalnum() for lo, hi in out.ranges)
                  and all(t is str.isdigit for t in out.tests))
    out.word_start = first == (c.AT, c.AT_BOUNDARY) and word_chars
    return out


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
