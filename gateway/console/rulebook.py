"""Rules over time: which rule pack was in force when, what its rules said, what changed
between two versions, and how often each rule fired.

A policy version is a hash of the rules a pack enforces (`finsieve.policy.pack`); the trail
names it in every answer's record. The officers' process keeps the rules directory it
shares with the gateway and its engines archived: each version it sees in force is stored
once (`{finsieve-audit}:rules:<version>`, the rules as JSON) and announced by an admin
record (`kind` rules) holding the snapshot's SHA-256, so a snapshot is checked against the
chain before it is shown, and the versions' times come from the chain.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, cast

from finsieve.auth import Principal
from finsieve.policy.pack import Pack
from finsieve.policy.reload import PolicyHolder

from ..access import AdminTrail
from ..audit import TAG, AuditLog, index_key, parse, record_key
from ..rules import GatewayPolicy
from .trail import BATCH, all_of, newest_of

MAX_VERSIONS = 10_000  # rules records read for a timeline (the newest)
ARCHIVE_POLL_S = 2.0  # how soon a reloaded pack is archived
COUNT_READS = 20_000  # records read to count one rule's hits for one tenant
COMPARED = ("description", "kind", "patterns", "scope", "action", "replacement", "validators",
            "max_span", "severity", "locales", "message", "audit")


def snapshot_key(version: str) -> str:
    return f"{TAG}:rules:{version}"


def snapshot(pack: Pack) -> bytes:
    rules = [asdict(r) for r in sorted(pack.rules, key=lambda r: r.id)]
    return json.dumps({"version": pack.version, "rules": rules}, sort_keys=True,
                      ensure_ascii=False).encode()


async def archive(log: AuditLog, trail: AdminTrail, pack: Pack) -> None:
    """Store the pack's snapshot (once) and, unless the newest rules record names this
    version already, record it in force."""
    data = snapshot(pack)
    await log.redis.set(snapshot_key(pack.version), data, nx=True)
    (newest,) = await newest_of(log, "kind", ["rules"])
    if newest is None or newest.get("policy_version") != pack.version:
        await trail.record({"event": "rules_in_force", "kind": "rules", "policy_version": pack.version,
                            "sha256": hashlib.sha256(data).hexdigest(), "rules": len(pack.rules)})


async def keep_archived(log: AuditLog, trail: AdminTrail, holder: PolicyHolder[GatewayPolicy]) -> None:
    """Archive each pack the rules directory brings in force (a supervised task)."""
    archived = ""
    while True:
        policy = holder.current
        if policy.version != archived:
            await archive(log, trail, policy.pack)
            archived = policy.version
        await asyncio.sleep(ARCHIVE_POLL_S)


@dataclass(frozen=True)
class InForce:
    version: str
    from_ms: int
    until_ms: int  # 0: still in force
    sha256: str
    rules: int


async def records(log: AuditLog) -> list[dict[str, Any]]:
    """The rules records (sealed), oldest first."""
    return [r for r in await all_of(log, "kind", "rules", MAX_VERSIONS)
            if isinstance(r.get("policy_version"), str)]


async def timeline(log: AuditLog) -> list[InForce]:
    """The versions in force, oldest first, each from its rules record until the next."""
    out: list[InForce] = []
    for rec in await records(log):
        if out and out[-1].version == rec["policy_version"]:
            continue  # announced again (a restart): still the one in force
        if out:
            out[-1] = replace(out[-1], until_ms=rec["ts_ms"])
        out.append(InForce(rec["policy_version"], rec["ts_ms"], 0, str(rec.get("sha256", "")),
                           int(rec.get("rules", 0))))
    return out


def in_force(versions: list[InForce], since_ms: int, until_ms: int) -> list[InForce]:
    until = until_ms or int(time.time() * 1000)
    return [v for v in versions if v.from_ms <= until and (not v.until_ms or v.until_ms > since_ms)]


def at(versions: list[InForce], when_ms: int) -> InForce | None:
    found = [v for v in versions if v.from_ms <= when_ms]
    return found[-1] if found else None


async def rules_of(log: AuditLog, entry: InForce) -> tuple[list[dict[str, Any]], str]:
    """A version's rules, checked against the SHA-256 its rules record holds; or a problem."""
    data = cast("bytes | None", await log.redis.get(snapshot_key(entry.version)))
    if data is None:
        return [], "its rules were not archived"
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        return [], "its archived rules were altered: their SHA-256 does not match the rules record"
    body = json.loads(data)
    return list(body.get("rules", [])), ""


@dataclass(frozen=True)
class Change:
    rule_id: str
    fields: list[tuple[str, Any, Any]]  # (field, before, after)


@dataclass(frozen=True)
class Diff:
    added: list[dict[str, Any]]
    removed: list[dict[str, Any]]
    changed: list[Change]


def diff(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> Diff:
    old, new = {r["id"]: r for r in before}, {r["id"]: r for r in after}
    changed = []
    for rule_id in sorted(old.keys() & new.keys()):
        fields = [(f, old[rule_id].get(f), new[rule_id].get(f)) for f in COMPARED
                  if old[rule_id].get(f) != new[rule_id].get(f)]
        if fields:
            changed.append(Change(rule_id, fields))
    return Diff([new[i] for i in sorted(new.keys() - old.keys())],
                [old[i] for i in sorted(old.keys() - new.keys())], changed)


@dataclass(frozen=True)
class Count:
    rule_id: str
    records: int
    exact: bool  # False: at least this many (the count read its bound)


async def fired(log: AuditLog, rule_ids: list[str], since_ms: int, until_ms: int,
                officer: Principal, deadline: float) -> list[Count]:
    """How many records each rule acted in. Across tenants an index count; for one tenant
    the rule's records are read (at most COUNT_READS a rule, and until the deadline)."""
    until = until_ms or int(time.time() * 1000)
    if officer.all_tenants:
        async with log.redis.pipeline(transaction=False) as pipe:
            for rule_id in rule_ids:
                pipe.zcount(index_key("rule_id", rule_id), since_ms, until)
            counts = await pipe.execute()
        return [Count(r, int(c), True) for r, c in zip(rule_ids, counts, strict=True)]
    out = []
    for rule_id in rule_ids:
        members = cast("list[bytes]", await log.redis.zrangebyscore(
            index_key("rule_id", rule_id), since_ms, until, start=0, num=COUNT_READS))
        seqs = [int(m) for m in members if m.isdigit()]
        count, exact = 0, len(members) < COUNT_READS
        for start in range(0, len(seqs), BATCH):
            if time.monotonic() > deadline:
                exact = False
                break
            raws = await log.redis.mget([record_key(s) for s in seqs[start:start + BATCH]])
            count += sum(1 for raw in raws if (rec := parse(raw)) and rec.get("tenant") == officer.tenant)
        out.append(Count(rule_id, count, exact))
    return out
