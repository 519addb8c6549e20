"""Anchors: the chain head as a writer last appended it, signed and kept outside Redis.

Someone who can write to Redis but does not hold the audit key cannot forge a record, but
could delete the newest records and rewind the head to an older, genuine one. Anchors
close that gap: at least once a second while a process appends (and when it stops) it
writes `{seq, record_hmac, ts_ms, writer, sig}` to an append-only, fsynced file in the
state directory and as a structured log line (`"event": "audit anchor"`), which a log
forwarder can ship to write-once storage. `audit verify` checks that the chain still
reaches the newest anchor, and every anchor an officer supplies (`--anchors FILE`).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from finsieve import supervise

from .audit import AuditLog, derive_key, now_ms, seal, sealed_ok

log = structlog.get_logger(__name__)

FIELDS = ("seq", "record_hmac", "ts_ms", "writer")
TAIL_BYTES = 64 * 1024  # the newest anchor of a file is in its last lines


class AnchorError(ValueError):
    """An anchor that is not signed with this audit key (forged, or another chain's)."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class Anchor:
    seq: int
    record_hmac: str
    ts_ms: int
    writer: str
    source: str = ""  # where it was read, for messages


def signed(key: bytes, seq: int, record_hmac: str, writer: str) -> dict[str, Any]:
    body: dict[str, Any] = {"seq": seq, "record_hmac": record_hmac, "ts_ms": now_ms(), "writer": writer}
    body["sig"] = seal(derive_key(key, "anchor"), body, "sig")
    return body


def read_anchor(key: bytes, obj: Any, source: str) -> Anchor:
    """An anchor from a parsed file or log line. Raises AnchorError if it is not signed."""
    if not isinstance(obj, dict):
        raise AnchorError(source, "not an anchor")
    body = {f: obj.get(f) for f in (*FIELDS, "sig")}
    if not (isinstance(body["seq"], int) and isinstance(body["record_hmac"], str)
            and isinstance(body["ts_ms"], int) and isinstance(body["writer"], str)
            and sealed_ok(derive_key(key, "anchor"), body, "sig")):
        raise AnchorError(source, "anchor not signed with this audit key")
    return Anchor(body["seq"], body["record_hmac"], body["ts_ms"], body["writer"], source)


class AnchorWriter:
    """Appends signed anchors to `<directory>/<name>.jsonl` and logs each one."""

    def __init__(self, directory: Path, name: str, key: bytes) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = directory / f"{name}.jsonl"
        self.key = key
        self.writer = f"{socket.gethostname()}/{name}"
        self.anchored: tuple[int, str] | None = None

    def write(self, seq: int, record_hmac: str) -> None:
        anchor = signed(self.key, seq, record_hmac, self.writer)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(anchor, sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.anchored = (seq, record_hmac)
        log.info("audit anchor", **anchor)

    async def anchor(self, last: tuple[int, str] | None) -> None:
        """Anchor `last` unless it already is (the fsync runs off the event loop)."""
        if last is not None and last != self.anchored:
            try:
                await asyncio.to_thread(self.write, *last)
            except OSError as e:
                log.error("audit anchor not written", path=str(self.path), error=str(e))


class Anchoring:
    """Keeps one process's appends anchored: every `interval_s`, and once more at stop()."""

    def __init__(self, audit: AuditLog, writer: AnchorWriter, interval_s: float) -> None:
        self.audit, self.writer, self.interval_s = audit, writer, interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        # Supervised: a failed anchor write (disk full, say) is logged, counted and retried.
        self._task = supervise.start("audit-anchor", self._run)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.writer.anchor(self.audit.last)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.writer.anchor(self.audit.last)


def newest(directory: Path, key: bytes) -> tuple[Anchor | None, list[str]]:
    """The newest signed anchor among the files of `directory`, and the problems found at
    the end of each file (a line whose signature does not match). A torn last line (a
    crash mid-write) is skipped."""
    best: Anchor | None = None
    problems: list[str] = []
    for path in sorted(directory.glob("*.jsonl")) if directory.is_dir() else []:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            lines = f.read().splitlines()
        for line in reversed(lines):
            try:
                anchor = read_anchor(key, json.loads(line), str(path))
            except ValueError as e:  # AnchorError, or not JSON (torn)
                if isinstance(e, AnchorError):
                    problems.append(str(e))
                continue
            if best is None or anchor.seq > best.seq:
                best = anchor
            break
    return best, problems
