"""The spool: a local, fsynced, append-only copy of every audit record this process had
acknowledged, so that records a Redis failover loses can be appended again (audit_recovery).

One line per record (its stored JSON), in segment files `<n>.jsonl` of a private directory
(0700, files 0600; card numbers are already masked in records). A record is written and
fsynced before its append is acknowledged. A segment is deleted once a check of Redis that
started at least `keep_s` after the segment's last write found everything before the check
intact: by then a failover can no longer lose its records (replication lags by far less).
The spool is bounded by records and bytes: past the bound, segments that a check found
intact go even if younger than keep_s (counted), and if that is not enough the write fails
(SpoolFull), so the append is refused: an acknowledged record is never left unspooled.

A spool line is not trusted: whoever reads it back verifies the record's HMAC.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
from prometheus_client import Counter, Gauge

from finsieve.secretfiles import private_dir

log = structlog.get_logger(__name__)

RECORDS = Gauge("finsieve_audit_spool_records", "Audit records in the local spool")
BYTES = Gauge("finsieve_audit_spool_bytes", "Bytes of the local audit spool")
DROPPED_EARLY = Counter("finsieve_audit_spool_dropped_early",
                        "Spooled records deleted before FINSIEVE_AUDIT_SPOOL_KEEP_S to stay within "
                        "the spool's bound (a check had found them in Redis)")
SEGMENTS = 8  # the bound is spread over this many files, the oldest deleted whole


class SpoolFull(OSError):
    """The spool is at its bound and holds no record a check found in Redis."""


@dataclass
class Segment:
    path: Path
    records: int
    bytes: int
    written_at: float  # wall-clock time of its last write


class Spool:
    def __init__(self, directory: Path, max_records: int, max_bytes: int, keep_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory = private_dir(directory)
        self.max_records, self.max_bytes, self.keep_s = max_records, max_bytes, keep_s
        self.clock = clock
        self.checked_at = 0.0  # start of the last check that found the spooled records intact
        self.segments = [self._open(p) for p in sorted(self.directory.glob("*.jsonl"), key=_number)
                         if self._ours(p)]
        self._fd: int | None = None
        self._gauges()

    def _ours(self, path: Path) -> bool:
        """A segment file as this class writes them: a number, a plain file within the bound."""
        if _number(path) < 0 or path.is_symlink() or not path.is_file():
            return False
        if path.stat().st_size > self.max_bytes:
            log.error("audit spool file ignored: larger than FINSIEVE_AUDIT_SPOOL_MAX_BYTES",
                      path=str(path))
            return False
        return True

    @staticmethod
    def _open(path: Path) -> Segment:
        """A segment as found (made private), a torn last line (a crash mid-write) cut off."""
        os.chmod(path, 0o600)
        data = path.read_bytes()
        whole = data[:data.rfind(b"\n") + 1]
        if len(whole) != len(data):
            os.truncate(path, len(whole))
        return Segment(path, whole.count(b"\n"), len(whole), path.stat().st_mtime)

    @property
    def records(self) -> int:
        return sum(s.records for s in self.segments)

    @property
    def size(self) -> int:
        return sum(s.bytes for s in self.segments)

    def write(self, line: bytes) -> None:
        """Append one record and fsync it. Raises SpoolFull or OSError."""
        data = line + b"\n"
        self._make_room(len(data))
        current = self._current(len(data))
        if self._fd is None:
            self._fd = os.open(current.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                               0o600)
        os.write(self._fd, data)
        os.fdatasync(self._fd)
        current.records += 1
        current.bytes += len(data)
        current.written_at = self.clock()
        self._gauges()

    def _current(self, size: int) -> Segment:
        """The segment to write to: the newest, or a new one once it holds its share."""
        last = self.segments[-1] if self.segments else None
        if last is None or last.records >= max(1, self.max_records // SEGMENTS) \
                or last.bytes + size > max(4096, self.max_bytes // SEGMENTS):
            self.close()
            # Past every numbered file, an ignored one included: never append to a stranger.
            number = max((_number(p) for p in self.directory.glob("*.jsonl")), default=-1) + 1
            last = Segment(self.directory / f"{number:012d}.jsonl", 0, 0, self.clock())
            self.segments.append(last)
        return last

    def _make_room(self, size: int) -> None:
        while self.records + 1 > self.max_records or self.size + size > self.max_bytes:
            oldest = self.segments[0] if len(self.segments) > 1 else None
            if oldest is None or oldest.written_at > self.checked_at:
                raise SpoolFull(f"the audit spool is full ({self.records} records, {self.size} "
                                "bytes) of records not yet found intact in Redis")
            DROPPED_EARLY.inc(oldest.records)
            log.warning("audit spool over its bound: deleting records younger than "
                        "FINSIEVE_AUDIT_SPOOL_KEEP_S", records=oldest.records, keep_s=self.keep_s)
            self._delete(oldest)

    def confirmed(self, checked_at: float) -> None:
        """A check that started at `checked_at` found every record spooled before it in
        Redis: delete the segments written keep_s or more before it (never the newest)."""
        self.checked_at = max(self.checked_at, checked_at)
        while len(self.segments) > 1 and self.segments[0].written_at + self.keep_s <= self.checked_at:
            self._delete(self.segments[0])

    def _delete(self, segment: Segment) -> None:
        segment.path.unlink(missing_ok=True)
        self.segments.remove(segment)
        self._gauges()

    def snapshot(self) -> list[tuple[Path, int]]:
        """(file, bytes) of every segment as it is now, oldest first: what read() reads,
        not what is written after."""
        return [(s.path, s.bytes) for s in self.segments]

    @staticmethod
    def read(path: Path, size: int) -> list[bytes]:
        """The record lines of a segment's first `size` bytes (none if it was deleted
        meanwhile: its records had been found in Redis)."""
        try:
            with path.open("rb") as f:
                data = f.read(size)
        except FileNotFoundError:
            return []
        return [line for line in data.split(b"\n") if line]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _gauges(self) -> None:
        RECORDS.set(self.records)
        BYTES.set(self.size)


def _number(path: Path) -> int:
    return int(path.stem) if path.stem.isdigit() else -1
