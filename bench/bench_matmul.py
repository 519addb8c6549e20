"""One layer's matmuls by rows (M): where a mixed step's prompt tokens should end.

    python3 bench/bench_matmul.py [--rows 64 128 ...] [--out FILE]      # on a GPU

A mixed step's rows (decode rows + prompt tokens) are the M of every weight's matmul. This
times the four weight matmuls of a Qwen2-7B layer (fused QKV 4608 x 3584, output 3584 x
3584, fused gate/up 37888 x 3584, down 3584 x 18944; bf16, random) through `F.linear`, as
the compiled layers call cuBLAS, each from a CUDA graph (no launch overhead), at each M.
The cost of each row past the first M (the fourth column), and the step in it where a new
tile of rows starts, is what the scheduler's MIXED_TILE follows (engine/scheduler.py).
Prints a table and writes JSON (default bench/results/matmul.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from provenance import provenance, with_provenance

from engine.cuda_graphs import call_ms

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
ROWS = (64, 96, 128, 144, 160, 176, 192, 208, 224, 240, 256, 272, 288, 304, 320, 352, 384,
        416, 448, 512, 1024, 2048)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "matmul.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_matmul: needs a CUDA device (it times cuBLAS)")
    weights = {name: torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02
               for name, shape in WEIGHTS.items()}
    params = sum(w.numel() for w in weights.values())
    print(f"{'M':>5} {'us/layer':>9} {'TFLOP/s':>8} {'TB/s':>6} {'us/row past first':>18}  "
          + " ".join(f"{name:>8}" for name in weights))
    rows_out, first = [], None
    for m in sorted(args.rows):
        us = {}
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
            us[name] = 1000 * call_ms(lambda x=x, w=w: F.linear(x, w))
        total = sum(us.values())
        first = first or (m, total)
        marginal = (total - first[1]) / (m - first[0]) if m > first[0] else float("nan")
        rows_out.append({"rows": m, "us": total, "by_weight_us": us,
                         "flops_per_s": 2 * m * params / (total / 1e6),
                         "bytes_per_s": 2 * params / (total / 1e6)})
        print(f"{m:>5} {total:>9.1f} {rows_out[-1]['flops_per_s'] / 1e12:>8.0f} "
              f"{rows_out[-1]['bytes_per_s'] / 1e12:>6.2f} {marginal:>18.2f}  "
              + " ".join(f"{v:>8.1f}" for v in us.values()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"device": torch.cuda.get_device_name(), "rows": rows_out}
    args.out.write_text(json.dumps(with_provenance(out, provenance("bench_matmul")), indent=1))


if __name__ == "__main__":
    main()
