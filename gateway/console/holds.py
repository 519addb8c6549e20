"""Legal holds: a case's records are kept whatever the retention period says.

Placing and releasing a hold are `hold` records in the chain (who, when, why, which
records: a time range and search filters). Retention deletes the oldest records as one
prefix of the chain behind a signed checkpoint (`AuditLog.trim`), so it cannot skip a
held record: it stops before the oldest record any active hold covers (`retention_cut`),
and everything after it waits too until the hold is released. Over-keeping is the safe
side of a hold. A hold record that does not verify stops retention altogether (fail
closed), as does a hold list that cannot be read.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from finsieve.auth import Principal

from ..access import stamped
from ..audit import AuditError, AuditLog, Filters, index_key
from .trail import all_of

MAX_HOLDS = 10_000  # hold records read (placements and releases together)
MAX_CASE = 100
MAX_REASON = 2000


@dataclass(frozen=True)
class Hold:
    seq: int
    case: str
    reason: str
    since_ms: int
    until_ms: int
    tenant: str
    filters: dict[str, Any]
    placed_ms: int
    by: str
    released: dict[str, Any] | None = None  # the release record

    @property
    def keeps_from_ms(self) -> int:
        """Retention keeps every record from here on while the hold is active."""
        return min(self.since_ms, self.placed_ms)

    def covers(self, rec: dict[str, Any]) -> bool:
        ts = rec.get("ts_ms", 0)
        filters = Filters(**{k: v for k, v in self.filters.items() if k in Filters.__dataclass_fields__})
        return self.since_ms <= ts <= (self.until_ms or self.placed_ms) and filters.accepts(rec)


def problems(case: str, reason: str, since_ms: int) -> dict[str, str]:
    errors = {}
    if not case or len(case) > MAX_CASE:
        errors["case"] = f"a case name of 1 to {MAX_CASE} characters"
    if not reason or len(reason) > MAX_REASON:
        errors["reason"] = f"a reason of 1 to {MAX_REASON} characters"
    if since_ms <= 0:
        errors["since"] = "a hold needs the start of its range"
    elif since_ms > time.time() * 1000:
        errors["since"] = "must not be in the future: a hold keeps records already written"
    return errors


async def place(log: AuditLog, officer: Principal, case: str, reason: str, filters: Filters) -> int:
    body = {"kind": "hold", "event": "hold_placed", "case": case, "reason": reason,
            "since_ms": filters.since_ms, "until_ms": filters.until_ms, "tenant": filters.tenant,
            "filters": asdict(filters)}
    return await log.append("hold", stamped("hold", officer, body))


async def release(log: AuditLog, officer: Principal, hold: Hold, reason: str) -> int:
    body = {"kind": "hold", "event": "hold_released", "hold": hold.seq, "case": hold.case,
            "reason": reason, "tenant": hold.tenant}
    return await log.append("hold", stamped("hold", officer, body))


async def holds(log: AuditLog) -> list[Hold]:
    """Every hold, oldest first, each with its release if released. Raises AuditError when
    a hold record is missing from its index or does not verify: retention must then stop."""
    indexed = await log.redis.zcard(index_key("kind", "hold"))
    if indexed > MAX_HOLDS:
        raise AuditError(f"more than {MAX_HOLDS} hold records: not all can be read")
    records = await all_of(log, "kind", "hold", MAX_HOLDS)
    if len(records) < indexed:  # (one appended since is no fault)
        raise AuditError("a hold record does not verify (run `finsieve audit verify`)")
    placed: dict[int, Hold] = {}
    for rec in records:
        if rec.get("event") == "hold_placed":
            placed[rec["seq"]] = Hold(rec["seq"], str(rec.get("case", "")), str(rec.get("reason", "")),
                                      int(rec.get("since_ms", 0)), int(rec.get("until_ms", 0)),
                                      str(rec.get("tenant", "")), dict(rec.get("filters") or {}),
                                      int(rec["ts_ms"]), str(rec.get("by", "")))
        elif rec.get("event") == "hold_released" and rec.get("hold") in placed:
            hold = placed[rec["hold"]]
            placed[hold.seq] = Hold(**{**asdict(hold), "released": rec})
    return list(placed.values())


async def retention_cut(log: AuditLog, before_ms: int) -> int:
    """The time retention may trim up to: `before_ms`, or earlier where an active hold
    keeps records. Raises AuditError (then nothing is trimmed)."""
    active = [h.keeps_from_ms for h in await holds(log) if h.released is None]
    return min([before_ms, *active])
