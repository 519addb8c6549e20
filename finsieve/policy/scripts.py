"""Scripts: what keeps the look-alike mapping from matching text that is genuinely foreign.

The normalized view reads Cyrillic `р`, `а`, `у` as `p`, `a`, `y`, so that `guarantееd`
(two Cyrillic `е`) matches an English rule. A Russian word made only of such letters would
then spell English too. The rule: **a match counts unless every letter of its raw span is
of one script that its pattern is not written in.** `guarantееd returns` mixes Latin and
Cyrillic: it counts. `рау` (all Cyrillic) against an English pattern: it does not. A pattern
with no letters (a card number) accepts any span; a Chinese pattern accepts Han text.

Each normalized character carries the tag of its raw character's script (0 for none:
Common and Inherited characters such as digits, punctuation, mathematical letters, or a
script the data does not resolve). A pattern's scripts are those of its own letters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

import disarm

_IDS = {s: i + 1 for i, s in enumerate(disarm.Script)}
LATIN = _IDS[disarm.Script.LATIN]
_LITERAL = re._constants.LITERAL  # type: ignore[attr-defined]
_RANGE = re._constants.RANGE  # type: ignore[attr-defined]


@lru_cache(maxsize=65536)
def script_tag(ch: str) -> int:
    """Small-integer tag of a character's script (0 when it has none)."""
    found = disarm.detect_scripts(ch)
    return _IDS.get(found[0], 0) if found else 0


def scripts_of(text: Iterable[str]) -> frozenset[int]:
    return frozenset(script_tag(c) for c in text) - {0}


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
    return len(seen) != 1 or not seen.isdisjoint(scripts)
