"""Client-supplied strings made safe to show in a terminal table or open in a spreadsheet.

Tenants, users, request ids, key names and rule ids come from clients and admins. In a
table, a control character or a bidi override could hide or reorder what an officer reads;
in a CSV opened in a spreadsheet, a cell starting with `=`, `+`, `-` or `@` is a formula.
"""

from __future__ import annotations

import csv
import unicodedata
from collections.abc import Iterable, Mapping
from typing import TextIO

# OWASP's CSV injection list: a cell that starts with one of these is read as a formula
# (tab and carriage return too, but those never survive `cell`: they are shown as \uXXXX).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
# Control, format (bidi overrides and isolates, zero-width characters), line and paragraph
# separators: shown as \uXXXX so the reader sees that something is there.
HIDDEN = ("Cc", "Cf", "Zl", "Zp")


def visible(value: object) -> str:
    """The value with hidden characters shown as \\uXXXX (a web page, a table)."""
    text = str(value)
    if text.isprintable():  # the common case, checked in C: no Cc, Cf, Zl or Zp character
        return text
    return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) in HIDDEN else c
                   for c in text)


def cell(value: object) -> str:
    """The value with hidden characters made visible, and `'` in front when a spreadsheet
    would take it for a formula."""
    text = visible(value)
    return "'" + text if _formula(text) else text


def _formula(text: str) -> bool:
    """Spreadsheets skip leading spaces (` =1+1` is a formula in Excel and LibreOffice) and
    take a full-width `＝` for `=`: the first character that is not whitespace, as NFKC
    reads it, decides."""
    rest = text.lstrip()
    return bool(rest) and unicodedata.normalize("NFKC", rest[0]).startswith(FORMULA_STARTS)


def write_csv(out: TextIO, columns: tuple[str, ...], rows: Iterable[Mapping[str, object]]) -> None:
    """A header and the rows, every cell neutralized and every field quoted: where a
    spreadsheet splits on `;` (its separator in many locales), `a;=cmd` unquoted would
    start a formula in a cell of its own, as OWASP warns."""
    writer = csv.DictWriter(out, fieldnames=columns, quoting=csv.QUOTE_ALL)
    writer.writeheader()
    writer.writerows({c: cell(r[c]) for c in columns} for r in rows)
