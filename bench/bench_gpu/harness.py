"""What every phase stands on: a phase in its own process under a time limit, the run's
clock, loopback ports and health checks, and the facts of the machine a row ran on."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

from provenance import cpu

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
PACKAGE = __package__ or "bench.bench_gpu"  # what a phase's process runs with -m


def time_left(args: Namespace) -> float:
    """Seconds until this phase's limit (--until; none: a phase run by hand)."""
    return args.until - time.time() if args.until else 1e9


def run_phase(name: str, args: Namespace, budget: float) -> dict:
    """A phase in its own process, with a time limit; its result or its error."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, "-m", PACKAGE, "--phase", name, "--result", result_path,
           "--until", str(time.time() + budget - 10), *args.passthrough]
    t = time.perf_counter()
    error = ""
    try:
        proc = subprocess.run(cmd, timeout=budget, env=_importable_env())
        if proc.returncode:
            error = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {budget:.0f} s"
    try:
        data = json.loads(Path(result_path).read_text() or "{}")  # what it measured, even if cut
    except json.JSONDecodeError:
        data = {}
    if error and "error" not in data:
        data["error"] = error
    data["phase_s"] = time.perf_counter() - t
    return data


def _importable_env() -> dict[str, str]:
    """This environment, with the repository on PYTHONPATH: the phase's process runs in
    the caller's working directory (relative --work, --out and --tokenizer stay as given),
    which need not be the repository's root that `-m bench.bench_gpu` imports from."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in paths:
        paths.append(str(REPO))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def children(pid: int) -> list[int]:
    """A process's child processes (those of all its threads)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(target: str) -> bool:
    """Whether a gRPC server at target answers SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def host_cpu() -> str:
    """The host's CPU model and core count: at 128 streams with the rules on the engine's
    loop (one Python thread) is what sets the pace, so a row's host matters."""
    return cpu()


def gpu_used_gib() -> float | None:
    """GPU memory in use on the device, by every process (a served engine's included)."""
    try:
        import torch

        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30
    except Exception:
        return None
