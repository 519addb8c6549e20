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
`ALNUM` for a letter or digit of no particular script (digits, mathematical letters, a
script the data does not resolve), or 0 (spaces, punctuation). A pattern's scripts are
those of its own letters.
"""

from __future__ import annotations

import re
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
    found = disarm.detect_scripts(ch)
    if found and found[0] in _IDS:
        return _IDS[found[0]]
    return ALNUM if ch.isalnum() else 0


def scripts_of(text: Iterable[str]) -> frozenset[int]:
    """The scripts of the letters in text."""
    return frozenset(script_tag(c) for c in text) - {0, ALNUM}


def regex_scripts(pattern: str) -> frozenset[int]:
    """Scripts of the letters a regex spells out (its literals and ranges, not its escapes)."""
    try:
        parsed = re._parser.parse(pattern)  # type: ignore[attr-defined]
    except Exception:  # `regex`-only syntax: every letter of the source counts
        return scripts_of(pattern)
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


def accepts(scripts: frozenset[int], tags: bytes | bytearray) -> bool:
    """Does a match over characters with these tags count, for a pattern in these scripts?"""
    if not scripts:
        return True
    seen = set(tags)
    seen.discard(0)
    return len(seen) != 1 or ALNUM in seen or not seen.isdisjoint(scripts)
