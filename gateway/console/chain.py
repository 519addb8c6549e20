"""One record's place in the chain, as the conversation page shows it: its own HMAC, its
link to the record before, the next record's link to it (or the signed head, for the
newest), and whether an anchor kept outside Redis already covers it. A whole-chain
verification is `finsieve audit verify` (and the regulator package's script); this is the
per-record badge."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finsieve.valkey import ERRORS
from gateway.anchors import newest
from gateway.audit import AuditError, AuditLog, head_sig, sealed_ok

TRAIL_DOWN: tuple[type[Exception], ...] = (AuditError, *ERRORS)


@dataclass(frozen=True)
class ChainStatus:
    ok: bool
    text: str  # what was checked, or the first broken link
    anchored: bool = False  # an anchor outside Redis is at or past the record


async def status_of(log: AuditLog, rec: dict[str, Any], anchor_dir: Path) -> ChainStatus:
    try:
        problem = await _problem(log, rec)
    except TRAIL_DOWN as e:
        return ChainStatus(False, f"not checked: {e}")
    if problem:
        return ChainStatus(False, problem)
    anchor, _ = await asyncio.to_thread(newest, anchor_dir, log.key)
    seq = rec["seq"]
    return ChainStatus(True, f"record {seq}'s HMAC, its link to record {seq - 1} and the "
                             "next record's link to it", anchor is not None and anchor.seq >= seq)


async def _problem(log: AuditLog, rec: dict[str, Any]) -> str:
    seq = rec["seq"]
    if not sealed_ok(log.key, rec):
        return f"record {seq} was altered: its HMAC does not match"
    cp = await log.checkpoint()
    first = cp.through + 1 if cp else 1
    if seq <= first:
        expected = cp.last_hmac if cp else ""
    else:
        before = await log.get(seq - 1)
        if before is None:
            return f"record {seq - 1}, before this one, is missing"
        if before.get("seq") != seq - 1 or not sealed_ok(log.key, before):
            return f"record {seq - 1}, before this one, was altered: its HMAC does not match"
        expected = before["hmac"]
    if rec.get("prev") != expected:
        return f"record {seq} does not link to record {seq - 1}: inserted, deleted or reordered"
    after = await log.get(seq + 1)
    if after is None:
        head = await log.head()
        if head.seq == seq:
            if head.hmac != rec["hmac"] or head.sig != head_sig(log.key, head.seq, head.hmac):
                return "the chain head does not match this record, the newest"
            return ""
        after = await log.get(seq + 1)  # appended since it was first read?
        if after is None:
            return f"record {seq + 1}, after this one, is missing"
    if after.get("seq") != seq + 1 or not sealed_ok(log.key, after):
        return f"record {seq + 1}, after this one, was altered: its HMAC does not match"
    if after.get("prev") != rec["hmac"]:
        return f"record {seq + 1} does not link to this record: inserted, deleted or reordered"
    return ""
