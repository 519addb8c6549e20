"""A conversation as the console shows it: the delivered answer cut into pieces, each
intervention marked where it happened.

An output intervention carries character offsets into the delivered text. A `redact` or
`rewrite` covers the replacement the client received (`start`..`end`): shown highlighted and
labelled. A `block` that rolled the model back, or a `halt`, happened at a point (`start`):
a numbered marker stands there in the text, and beside it the note says what the model
tried to say (the suppressed text, never delivered), by which rule, and how far into the
answer. Offsets are clamped to the stored text: a `hash` audit mode stores a value as
`[hash:…]`, which can be longer or shorter than what was delivered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finsieve.policy.schema import EDITS


@dataclass(frozen=True)
class Note:
    number: int
    rule_id: str
    action: str
    scope: str
    start: int
    end: int
    suppressed: str  # what was never delivered ("" for an edit that replaced nothing)
    rolled_back: bool
    tokens_recomputed: int
    message: str

    @property
    def is_edit(self) -> bool:
        return self.action in EDITS and self.end > self.start

    def where(self, length: int) -> str:
        share = f" ({100 * self.start // length}% of the answer)" if length else ""
        return f"at character {self.start} of {length}{share}"


@dataclass(frozen=True)
class Piece:
    text: str
    note: Note | None = None  # an edit's span, or (text "") a point where a note cut in


def notes_of(interventions: list[Any], scope: str) -> list[Note]:
    notes: list[Note] = []
    for i in interventions:
        if not isinstance(i, dict) or i.get("scope", "output") != scope:
            continue
        notes.append(Note(len(notes) + 1, str(i.get("rule_id", "")), str(i.get("action", "")),
                          scope, _int(i.get("start")), _int(i.get("end")),
                          str(i.get("suppressed", "")), bool(i.get("rolled_back")),
                          _int(i.get("tokens_recomputed")), str(i.get("message", ""))))
    return notes


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def pieces(delivered: str, notes: list[Note]) -> list[Piece]:
    """The delivered text in order, each edit's span and each cut point its own piece."""
    out: list[Piece] = []
    at = 0
    for note in sorted(notes, key=lambda n: (min(n.start, len(delivered)), n.number)):
        start = max(at, min(note.start, len(delivered)))
        if start > at:
            out.append(Piece(delivered[at:start]))
        if note.is_edit:
            end = max(start, min(note.end, len(delivered)))
            out.append(Piece(delivered[start:end], note))
            at = end
        else:
            out.append(Piece("", note))
            at = start
    if at < len(delivered):
        out.append(Piece(delivered[at:]))
    return out
