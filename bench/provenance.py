"""Where a bench's JSON came from, written first in every bench's output: a run kept in
bench/results/ states its bench, date, commit, machine, command and conditions
(tests/unit/test_bench_results.py checks every file there for them)."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def provenance(bench: str, conditions: str | None = None, gpu: str | None = None) -> dict[str, str | None]:
    """This run's provenance. gpu: the device the run measured, where the caller knows it
    without touching CUDA (bench_gpu's driver reads it from its device phase: the driver
    itself keeps CUDA uninitialised); else the CUDA device's name when this process has
    torch imported and a device."""
    return {"bench": bench,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
            "commit": _commit(),
            "machine": _machine(gpu),
            "command": shlex.join(["python", *sys.orig_argv[1:]]),
            "conditions": conditions,
            "source": "the bench's own output"}


def with_provenance(result: dict, origin: dict[str, str | None]) -> dict:
    """result with origin (provenance()) first; an earlier call's, in a result that adds to
    an earlier file, replaced."""
    return {"provenance": origin, **{k: v for k, v in result.items() if k != "provenance"}}


def _commit() -> str | None:
    """HEAD's short hash, "-dirty" when tracked files differ from it; None outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head


def _machine(gpu: str | None) -> str:
    parts = [platform.platform(), cpu()]
    if gpu is None and "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    if gpu:
        parts.append(gpu)
    return "; ".join(parts)


def cpu() -> str:
    """The host's CPU model and core count."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"unknown, {os.cpu_count()} cores"
