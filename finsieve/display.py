"""Client-supplied strings made safe to show in a terminal table or open in a spreadsheet.

Tenants, users, request ids, key names and rule ids come from clients and admins. In a
table, a control character or a bidi override could hide or reorder what an officer reads;
in a CSV opened in a spreadsheet, a cell starting with `=`, `+`, `-` or `@` is a formula.
"""

from __future__ import annotations

import unicodedata

FORMULA_STARTS = ("=", "+", "-", "@")
# Control, format (bidi overrides and isolates, zero-width characters), line and paragraph
# separators: shown as \uXXXX so the reader sees that something is there.
HIDDEN = ("Cc", "Cf", "Zl", "Zp")


def cell(value: object) -> str:
    text = "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) in HIDDEN else c
                   for c in str(value))
    return "'" + text if text.startswith(FORMULA_STARTS) else text
