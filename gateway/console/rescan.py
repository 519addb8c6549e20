"""What a draft rule pack would have flagged: the conversations of a range scanned again
under rules not yet in force.

Read-only: the draft is compiled by `finsieve.policy` (no model, no torch) in a temporary
directory, under the same bounds as a pack in force (size, regex time), and applied to the
stored text (the user's messages under its input rules, the delivered answer under its
output rules). Nothing is changed and the draft is kept nowhere; the run itself is an
access record naming the draft's policy version and SHA-256. The stored text is what the
trail holds: identifiers the pack in force masked stay masked.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finsieve.policy.inputs import conversation_matches
from finsieve.policy.matcher import scan_text
from finsieve.policy.pack import Pack
from finsieve.policy.schema import PackError
from finsieve.policy.sources import PackLimits

DRAFT_NAME = "draft.yaml"
MAX_PROBLEMS = 50
MAX_RECORDS = 5000  # conversations one re-scan reads


@dataclass(frozen=True)
class Hit:
    rule_id: str
    action: str
    where: str  # "answer" or "message N"
    text: str


@dataclass(frozen=True)
class Rescanned:
    rec: dict[str, Any]
    hits: list[Hit]
    fired: list[str]  # rule ids of the interventions recorded then


def draft_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def load_draft(text: str, limits: PackLimits) -> tuple[Pack | None, list[str]]:
    """The compiled draft, or its problems as `draft.yaml:line: rule: field: reason`."""
    if len(text.encode()) > limits.max_bytes:
        return None, [f"{DRAFT_NAME}: larger than {limits.max_bytes} bytes (FINSIEVE_RULES_MAX_BYTES)"]
    with tempfile.TemporaryDirectory(prefix="finsieve-draft-") as directory:
        (Path(directory) / DRAFT_NAME).write_text(text, encoding="utf-8")
        try:
            return Pack.load(Path(directory), limits), []
        except PackError as e:
            return None, [str(p).replace(str(Path(directory) / DRAFT_NAME), DRAFT_NAME)
                          for p in e.problems[:MAX_PROBLEMS]]


def scan(pack: Pack, records: list[dict[str, Any]], deadline: float) -> tuple[list[Rescanned], int]:
    """The records the draft flags, and how many were scanned before the deadline."""
    flagged: list[Rescanned] = []
    scanned = 0
    for rec in records:
        if time.monotonic() > deadline:
            break
        scanned += 1
        hits = _hits(pack, rec)
        if hits:
            fired = sorted({str(i.get("rule_id", "")) for i in rec.get("interventions") or []
                            if isinstance(i, dict)})
            flagged.append(Rescanned(rec, hits, fired))
    return flagged, scanned


def _hits(pack: Pack, rec: dict[str, Any]) -> list[Hit]:
    messages = [m for m in rec.get("messages") or [] if isinstance(m, dict)]
    contents = [str(m.get("content", "")) for m in messages]
    hits = []
    if pack.input and contents:
        for m in conversation_matches(pack.input, contents, [str(m.get("role", "")) for m in messages]):
            hits.append(Hit(m.rule.id, m.rule.action, f"message {m.parts[0].message + 1}", m.text))
    delivered = str(rec.get("delivered", ""))
    if pack.output and delivered:
        raw = delivered.encode()
        for found in scan_text(pack.output, delivered):
            hits.append(Hit(found.rule.id, found.rule.action, "answer",
                            raw[found.start:found.end].decode(errors="replace")))
    return hits
