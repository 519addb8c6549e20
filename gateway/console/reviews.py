"""Evidence of review (FINRA Rule 3110.07: reviewer, item, date, action): each decision an
officer takes on a conversation is a `review` record appended to the chain, never edited;
the newest one is the conversation's status. Reviews are indexed by `subject` (the
conversation's audit id), so a page of 10,000 rows finds its statuses in one round trip.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from finsieve.auth import Principal

from ..access import stamped
from ..audit import AuditLog
from .trail import all_of, newest_of

DECISIONS = ("reviewed", "escalated", "closed")
OPEN = ("", "escalated")  # statuses that keep a flagged conversation in the review queue
MAX_COMMENT = 2000
MAX_HISTORY = 1000  # reviews shown for one conversation (the newest)

Protect = Callable[[str, set[str]], str]  # masks what the rules say to mask (trace.py)


def problems(decision: str, comment: str) -> dict[str, str]:
    errors = {}
    if decision not in DECISIONS:
        errors["decision"] = f"one of {', '.join(DECISIONS)}"
    if len(comment) > MAX_COMMENT:
        errors["comment"] = f"at most {MAX_COMMENT} characters"
    return errors


async def decide(log: AuditLog, officer: Principal, conversation: dict[str, Any], audit_id: int,
                 decision: str, comment: str, protect: Protect) -> int:
    """Append the decision; its seq. Raises AuditError (nothing was decided)."""
    hashes: set[str] = set()
    body = {"kind": "review", "subject": str(audit_id), "record_seq": conversation["seq"],
            "tenant": conversation.get("tenant", ""), "decision": decision,
            "comment": protect(comment, hashes), "reviewer": officer.name}
    if hashes:
        body["match_hashes"] = sorted(hashes)
    return await log.append("review", stamped("review", officer, body))


async def statuses(log: AuditLog, audit_ids: list[int]) -> list[dict[str, Any] | None]:
    """The newest review of each conversation, or None."""
    return await newest_of(log, "subject", [str(a) for a in audit_ids])


async def history(log: AuditLog, audit_id: int) -> list[dict[str, Any]]:
    return await all_of(log, "subject", str(audit_id), MAX_HISTORY)
