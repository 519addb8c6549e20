"""Scripts: what keeps the look-alike mapping from matching text that is genuinely foreign.

The normalized view reads Cyrillic `в`, `о`, `т` as `b`, `o`, `t`, so that `guarantееd`
(two Cyrillic `е`) matches an English rule. A Russian word made only of such letters would
then spell English too (`вот`, "here is", reads `bot`). The rule: **a match counts unless
every letter and digit of its raw span is a letter of one script that its pattern is not
written in.** `guarantееd returns` mixes Latin and Cyrillic: it counts. `вот` against an
English pattern: it does not. `ВЕ68 5390 0754 7034` (an IBAN with a Cyrillic country code)
has digits: it counts. A pattern with no letters (a card number) accepts any span; a
Chinese pattern accepts Han text.

Each normalized character carries the tag of its raw character's script: a script, or
`ALNUM` for a digit (of any script: Arabic-Indic and Devanagari digits are numbers, not
words) or a letter of no particular script (mathematical letters, a script the data does
not resolve), or 0 (spaces, punctuation). A pattern's scripts are
those of its own letters.
"""

from __future__ import annotations

import re
import sys
import unicodedata
import warnings
from collections.abc import Iterable
from functools import lru_cache

import disarm

_IDS = {s: i + 1 for i, s in enumerate(disarm.Script)}
LATIN = _IDS[disarm.Script.LATIN]
ALNUM = 255
_LITERAL = re._constants.LITERAL  # type: ignore[attr-defined]
_RANGE = re._constants.RANGE  # type: ignore[attr-defined]


@lru_cache(maxsize=65536)
def script_tag(ch: str) -> int:
    """Small-integer tag of a character's script, ALNUM, or 0 (see above)."""
    if ch.isdecimal():  # a digit of any script is no script's letter: ٤١١١ is a number
        return ALNUM
    found = disarm.detect_scripts(ch)
    if found and found[0] in _IDS:
        return _IDS[found[0]]
    return ALNUM if ch.isalnum() else 0


def scripts_of(text: Iterable[str]) -> frozenset[int]:
    """The scripts of the letters in text."""
    return frozenset(script_tag(c) for c in text) - {0, ALNUM}


def regex_scripts(pattern: str) -> frozenset[int]:
    """Scripts of the letters a regex spells out (its literals and ranges, not its escapes,
    group names, property names or flags)."""
    try:
        with warnings.catch_warnings():  # "possible nested set" ([[:digit:]]): not ours to say
            warnings.simplefilter("ignore")
            parsed = re._parser.parse(pattern)  # type: ignore[attr-defined]
    except Exception:  # `regex`-only syntax (\p{..}, (?&name), ...): read it ourselves
        return scripts_of(_literal_chars(pattern))
    chars: list[str] = []
    stack: list = [parsed]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple) and len(item) == 2 and item[0] is _LITERAL:
            chars.append(chr(item[1]))
        elif isinstance(item, tuple) and len(item) == 2 and item[0] is _RANGE:
            chars += [chr(item[1][0]), chr(item[1][1])]
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif hasattr(item, "data"):  # a parsed sub-pattern
            stack.extend(item.data)
    return scripts_of(chars)


# Syntax of the `regex` module that spells letters which match nothing of their own: a
# property (\p{Sm}, \P{L}, \pN), a back or subroutine reference by name (\g<f>, (?P=f),
# (?P>f), (?&f), (?(f)...)), a group's name ((?P<f>, (?<f>), flags ((?i), (?i-x:), (?V1)),
# a comment, a POSIX class ([:alpha:]), a fuzzy constraint ({e<=1}), and the other escapes
# (\d, \b, \X, \m: classes and anchors). Read before a literal, so none of them is one.
_SYNTAX = re.compile(r"""
    \\[pP](?:\{[^}]*\}|\^?[A-Za-z])
  | \\g<[^>]*>
  | \(\?P?[=>&][^)]*\)
  | \(\?&[^)]*\)
  | \(\?\([^)]*\)
  | \(\?P?<(?![=!])[^>]*>
  | \(\?\#[^)]*\)
  | \(\?[A-Za-z0-9^-]*[:)]
  | \[:\^?[A-Za-z]+:\]
  | \{[^}]*[A-Za-z<][^}]*\}
""", re.VERBOSE)
# Escapes that do spell a character: \xhh, \x{h..}, \uhhhh, \Uhhhhhhhh, \N{NAME}.
_CHAR_ESCAPE = re.compile(r"\\(?:x\{([0-9A-Fa-f]+)\}|x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})"
                          r"|U([0-9A-Fa-f]{8})|N\{([^}]*)\})")


def _literal_chars(pattern: str) -> list[str]:
    """The characters a `regex` pattern spells as literals (see _SYNTAX), in one pass."""
    chars: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        m = _CHAR_ESCAPE.match(pattern, i)
        if m:
            chars.append(_escaped(m))
            i = m.end()
            continue
        m = _SYNTAX.match(pattern, i)
        if m:
            i = m.end()
            continue
        if pattern[i] == "\\":  # another escape: a class, an anchor, or escaped punctuation
            nxt = pattern[i + 1 : i + 2]
            if nxt and not nxt.isascii():  # an escaped non-ASCII character is itself
                chars.append(nxt)
            i += 2
            continue
        chars.append(pattern[i])
        i += 1
    return chars


def _escaped(m: re.Match[str]) -> str:
    hexa = m.group(1) or m.group(2) or m.group(3) or m.group(4)
    if hexa:
        code = int(hexa, 16)
        return chr(code) if code <= sys.maxunicode else ""
    try:
        return unicodedata.lookup(m.group(5))
    except KeyError:
        return ""


def accepts(scripts: frozenset[int], tags: bytes | bytearray) -> bool:
    """Does a match over characters with these tags count, for a pattern in these scripts?"""
    if not scripts:
        return True
    seen = set(tags)
    seen.discard(0)
    return len(seen) != 1 or ALNUM in seen or not seen.isdisjoint(scripts)
