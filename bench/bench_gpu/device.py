"""Phase `device`: the GPU's copy bandwidth and bf16 matmul rate, the bars the engine's
figures are read against (the batch-1 floor = weight bytes a step / copy bandwidth)."""

from __future__ import annotations

import statistics
from argparse import Namespace

from .harness import host_cpu


def phase_device(args: Namespace) -> dict:
    return measure_device()


def measure_device() -> dict:
    """Copy bandwidth (device to device, bytes read + written), bf16 matmul FLOP/s, the
    device's and torch's names and the host's CPU; {"device": "cpu"} without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu"}
    n = 2 * 1024**3 // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    # ~1 s of copies first: coming out of idle, the clocks take a while to rise, and copies
    # timed right away read up to 2% lower (an H200 read 4.13-4.21 TB/s after 2 s idle,
    # 4.225-4.231 after 2 s of copies, in one process), which lowered the floor's bar.
    for _ in range(1000):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1000)
    bandwidth = 2 * a.nbytes / statistics.median(times)
    del a, b
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    times = []
    for i in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        m @ m
        e.record()
        e.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e) / 1000)
    return {"device": torch.cuda.get_device_name(), "copy_bandwidth_bytes_s": bandwidth,
            "bf16_matmul_flops": 2 * 8192**3 / statistics.median(times),
            "torch": torch.__version__, "host_cpu": host_cpu()}
