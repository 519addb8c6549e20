"""gateway/spool.py: the local copy of acknowledged audit records. Private files, segments
deleted only once a check found them in Redis and keep_s passed, a bound that never drops
an unchecked record, a torn last line cut off after a crash."""

from __future__ import annotations

import os
import stat

import pytest

from gateway.spool import Spool, SpoolFull


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(spool: Spool) -> list[bytes]:
    return [line for path, size in spool.snapshot() for line in Spool.read(path, size)]


def test_records_are_written_to_private_segments_in_order(tmp_path):
    spool = Spool(tmp_path / "spool", max_records=16, max_bytes=1 << 20, keep_s=60)
    for i in range(5):
        spool.write(b'{"seq":%d}' % i)
    assert lines(spool) == [b'{"seq":%d}' % i for i in range(5)]
    assert len(spool.segments) == 3  # 16 records over 8 segments: 2 a segment
    assert spool.records == 5 and spool.size == sum(len(b'{"seq":0}\n') for _ in range(5))
    assert stat.S_IMODE((tmp_path / "spool").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p, _ in spool.snapshot())


def test_segments_go_once_a_check_keep_s_after_their_last_write_found_them(tmp_path):
    clock = Clock()
    spool = Spool(tmp_path, max_records=16, max_bytes=1 << 20, keep_s=60, clock=clock)
    for _ in range(4):
        spool.write(b"old")
    clock.now += 30
    spool.write(b"new")
    spool.confirmed(clock.now)  # found in Redis, but a failover could still lose them
    assert spool.records == 5
    clock.now += 40
    spool.confirmed(clock.now - 20)  # a check that began before keep_s had passed
    assert spool.records == 5
    spool.confirmed(clock.now)
    assert lines(spool) == [b"new"]  # the two full segments of "old" are gone
    clock.now += 600
    spool.confirmed(clock.now)
    assert lines(spool) == [b"new"]  # never the segment being written


def test_at_its_bound_the_spool_drops_only_checked_records_and_refuses_otherwise(tmp_path):
    clock = Clock()
    spool = Spool(tmp_path, max_records=8, max_bytes=1 << 20, keep_s=3600, clock=clock)
    for i in range(8):
        spool.write(b"%d" % i)
    with pytest.raises(SpoolFull, match="not yet found intact in Redis"):
        spool.write(b"8")
    spool.confirmed(clock.now)  # checked, though younger than keep_s
    spool.write(b"8")
    assert lines(spool) == [b"%d" % i for i in range(1, 9)]


def test_a_torn_last_line_is_cut_off_and_a_reopened_spool_goes_on(tmp_path):
    spool = Spool(tmp_path, max_records=100, max_bytes=1 << 20, keep_s=60)
    spool.write(b"one")
    spool.write(b"two")
    spool.close()
    segment = spool.snapshot()[-1][0]
    with segment.open("ab") as f:
        f.write(b'{"torn')  # a crash mid-write
    os.chmod(segment, 0o644)
    (tmp_path / "000000000099.jsonl").symlink_to(tmp_path / "elsewhere")  # never followed
    (tmp_path / "000000000098.jsonl").write_bytes(b"x" * (2 << 20))  # over the bound: not ours
    again = Spool(tmp_path, max_records=100, max_bytes=1 << 20, keep_s=60)
    again.write(b"three")
    assert lines(again) == [b"one", b"two", b"three"]
    assert stat.S_IMODE(segment.stat().st_mode) == 0o600
