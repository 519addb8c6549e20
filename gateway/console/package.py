"""The regulator package: a zip that lets an examiner verify a range of the trail offline.

    finsieve-package-<first>-<last>/
      README.txt            what is here and how to verify it
      manifest.json         the range, who made it and when, each file's SHA-256
      records.jsonl         every record from the first to the last of the range, as stored
                            (the chained bytes); another tenant's as {seq, prev, hmac, withheld}
      anchors.jsonl         the signed anchors within the range (kept outside Redis)
      head.json             the signed chain head when the package was made
      checkpoint.json       the signed retention checkpoint (null: nothing trimmed yet)
      rules/records.jsonl   the records that announced each rule pack in force in the range
      rules/<version>.json  each such pack's rules
      verify_package.py     the verification script (Python standard library only)

The records are contiguous by seq, so every link can be checked; the range is the records
written from `since` to `until`, first to last by seq. See docs/compliance.md for what an
examiner checks with and without the audit key.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from finsieve.auth import Principal

from ..audit import CHECKPOINT, TIME, AuditLog, parse, stored
from . import rulebook

FORMAT = "finsieve-regulator-package/1"
SCRIPT = Path(__file__).with_name("verify_package.py")
WRITE_LINES = 500  # records compressed into the zip at a time
MAX_ANCHOR_BYTES = 256 << 20  # anchor files read for one package
README = """A finsieve regulator package: records {first} to {last} of the audit trail.

Verify it (Python 3.8 or newer, nothing to install):

    python3 verify_package.py {name}.zip
    python3 verify_package.py {name}.zip --anchors ANCHORS_FROM_WRITE_ONCE_STORAGE.jsonl
    python3 verify_package.py {name}.zip --key-file AUDIT_KEY_FILE

Without the audit key the script checks the files' digests, that no record is missing,
every link and every anchor. With the key (on the bank's machine) it also recomputes every
record's HMAC and checks the anchors', head's and checkpoint's signatures.
"""


class PackageRefused(ValueError):
    """The range cannot be packaged; the message says why and what to do."""


@dataclass(frozen=True)
class Built:
    first: int
    last: int
    records: int
    withheld: int
    manifest_sha256: str


def visible(officer: Principal, rec: dict[str, Any]) -> bool:
    return officer.all_tenants or rec.get("tenant") == officer.tenant or rec.get("kind") == "rules"


async def seq_range(log: AuditLog, since_ms: int, until_ms: int) -> tuple[int, int]:
    """The seqs of the first and the last record written in the range (0, 0: none)."""
    until = until_ms or int(time.time() * 1000)
    low = cast("list[bytes]", await log.redis.zrangebyscore(TIME, since_ms, until, start=0, num=1))
    high = cast("list[bytes]", await log.redis.zrevrangebyscore(TIME, until, since_ms, start=0, num=1))
    if not low or not high or not low[0].isdigit() or not high[0].isdigit():
        return 0, 0
    return int(low[0]), int(high[0])


async def build(log: AuditLog, officer: Principal, since_ms: int, until_ms: int, anchor_dir: Path,
                max_records: int, deadline: float, out: IO[bytes]) -> Built:
    """Write the package to `out`. Raises PackageRefused, AuditError or RedisError."""
    first, last = await seq_range(log, since_ms, until_ms)
    if not first:
        raise PackageRefused("no record was written in this range")
    if last - first + 1 > max_records:
        raise PackageRefused(f"the range holds {last - first + 1} records, more than "
                             f"{max_records} (FINSIEVE_CONSOLE_EXPORT_MAX): choose a shorter range")
    head = await log.head()
    checkpoint = cast("bytes | None", await log.redis.get(CHECKPOINT))
    name = f"finsieve-package-{first}-{last}"
    digests: dict[str, str] = {}
    withheld, versions = 0, set()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:

        def put(path: str, data: bytes) -> None:
            digests[path] = hashlib.sha256(data).hexdigest()
            z.writestr(f"{name}/{path}", data)

        digest = hashlib.sha256()
        with z.open(f"{name}/records.jsonl", "w") as stream:
            lines: list[bytes] = []
            async for seq, raw in log.records(first, last):
                if time.monotonic() > deadline:
                    raise PackageRefused("the range took too long to read: choose a shorter range")
                rec = parse(raw)
                if rec is None:
                    lines.append(json.dumps({"seq": seq, "missing": True}).encode() + b"\n")
                elif visible(officer, rec):
                    lines.append(stored(rec).encode() + b"\n")
                    if isinstance(rec.get("policy_version"), str):
                        versions.add(rec["policy_version"])
                else:
                    withheld += 1
                    lines.append(json.dumps({"seq": rec.get("seq"), "prev": rec.get("prev"),
                                             "hmac": rec.get("hmac"), "withheld": True},
                                            sort_keys=True).encode() + b"\n")
                if len(lines) >= WRITE_LINES or seq == last:
                    data = b"".join(lines)
                    digest.update(data)
                    await asyncio.to_thread(stream.write, data)  # compressed off the event loop
                    lines = []
        digests["records.jsonl"] = digest.hexdigest()
        anchors = await asyncio.to_thread(_anchors, anchor_dir, first, last)
        await asyncio.to_thread(put, "anchors.jsonl", anchors)
        put("head.json", json.dumps({"seq": head.seq, "hmac": head.hmac, "sig": head.sig}).encode())
        put("checkpoint.json", checkpoint or b"null")
        await _rules(log, versions, put)
        put("verify_package.py", SCRIPT.read_bytes())
        put("README.txt", README.format(first=first, last=last, name=name).encode())
        manifest = json.dumps({
            "format": FORMAT, "generated_ms": int(time.time() * 1000), "generated_by": officer.key_id,
            "tenant": "" if officer.all_tenants else officer.tenant,
            "since_ms": since_ms, "until_ms": until_ms, "first_seq": first, "last_seq": last,
            "records": last - first + 1, "withheld": withheld, "files": digests,
        }, indent=1, sort_keys=True).encode()
        z.writestr(f"{name}/manifest.json", manifest)
    return Built(first, last, last - first + 1, withheld, hashlib.sha256(manifest).hexdigest())


async def _rules(log: AuditLog, versions: set[str], put: Callable[[str, bytes], None]) -> None:
    """The records that announced the versions the records name, and their snapshots."""
    records = [r for r in await rulebook.records(log) if r.get("policy_version") in versions]
    for version in sorted({r["policy_version"] for r in records}):
        data = cast("bytes | None", await log.redis.get(rulebook.snapshot_key(version)))
        if data is not None:
            put(f"rules/{version}.json", data)
    put("rules/records.jsonl", b"".join(stored(r).encode() + b"\n" for r in records))


def _anchors(directory: Path, first: int, last: int) -> bytes:
    """Every anchor line of the directory's files within first..last (each file read up to
    MAX_ANCHOR_BYTES from its end)."""
    out: list[bytes] = []
    for path in sorted(directory.glob("*.jsonl")) if directory.is_dir() else []:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - MAX_ANCHOR_BYTES))
            for line in f:
                try:
                    seq = json.loads(line).get("seq")
                except (ValueError, AttributeError):
                    continue  # a torn line, or the middle of one where the read began
                if isinstance(seq, int) and first <= seq <= last:
                    out.append(line.rstrip(b"\n") + b"\n")
    return b"".join(out)
