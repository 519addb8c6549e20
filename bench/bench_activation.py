"""The batched layers' MLP activation: silu_mul's kernel against torch.compile's fused
`F.silu(gate) * up`, alone and in whole decode steps, in one run.

    python3 bench/bench_activation.py [--rounds 3] [--out FILE]      # on a GPU

A Qwen2-7B-shaped model with random bf16 weights (built on the device, no files), 129 KV
slots of 1,024 positions. Steps as the engine runs them from a CUDA graph: 64 and 128
decode rows (each in its own slot, at positions 128-768) and a mixed step of 128 decode
rows and a 160-token prompt chunk (positions 160-319 of slot 128). `kernel` is the tree
(engine/activation.py); `compiled` is the layer's MLP half as it was before, the
activation left to torch.compile (dynamic shapes). The variants alternate, `--rounds`
times each; the median is reported. Also the activation alone at 128-384 rows. Prints a
table and writes JSON (default bench/results/activation.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_one_row import build
from provenance import provenance, with_provenance

from engine.activation import silu_mul
from engine.attention import chunk_groups
from engine.cuda_graphs import call_ms
from engine.model import CompactLM, _rms_norm

ROOT = Path(__file__).resolve().parent.parent
SLOTS, MAX_LEN = 129, 1024


def compiled_attn_out(eps: float):
    """The layer's MLP half as it was before silu_mul (model._layer_parts' attn_out)."""
    def attn_out(x, attn, wo, norm, w_gate_up, w_down):
        x = x + F.linear(attn, wo)
        gate, up = F.linear(_rms_norm(x, norm, eps), w_gate_up).chunk(2, -1)
        return x, F.linear(F.silu(gate) * up, w_down)

    return torch.compile(attn_out, dynamic=True)


def decode_positions(rows: int) -> torch.Tensor:
    """Each decode row's position, 128-768 (as bench_attention.py's rows)."""
    return torch.tensor([128 + (i * 37) % 641 for i in range(rows)], device="cuda")


def steps(model: CompactLM) -> dict:
    """label -> a decode step's call (inputs on the device)."""
    out = {}
    for rows in (64, 128):
        ids = torch.full((rows,), 1000, device="cuda")
        positions, slots = decode_positions(rows), torch.arange(rows, device="cuda")
        out[f"{rows} rows"] = lambda ids=ids, p=positions, s=slots: model.decode(ids, p, s)
    rows, chunk = 128, 160
    n = rows + chunk
    ids = torch.full((n,), 1000, device="cuda")
    positions = torch.cat([decode_positions(rows), torch.arange(160, 160 + chunk, device="cuda")])
    slots = torch.cat([torch.arange(rows), torch.full((chunk,), rows)]).cuda()
    heads = torch.cat([torch.arange(rows), torch.tensor([n - 1])]).cuda()
    groups = torch.from_numpy(chunk_groups(rows, [chunk], model.chunk_tokens, n)).cuda()
    out["128 rows + 160 chunk"] = lambda: model.decode(ids, positions, slots, heads, groups)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "activation.json")
    args = ap.parse_args()
    model = build(MAX_LEN, SLOTS)[0]
    model.set_compiled(True)
    variants = {"kernel": model._decode_out, "compiled": compiled_attn_out(model.eps)}
    calls = steps(model)
    times: dict = {(v, c): [] for v in variants for c in calls}
    for _ in range(args.rounds):
        for variant, attn_out in variants.items():
            model._decode_out = attn_out
            for label, call in calls.items():
                times[variant, label].append(call_ms(call, reps=4))
    model._decode_out = variants["kernel"]
    result: dict = {"steps": {}, "alone": {}}
    print(f"{'step (ms, CUDA graph)':>24} | {'compiled':>8} | {'kernel':>8} | change")
    for label in calls:
        a, b = (statistics.median(times[v, label]) for v in ("compiled", "kernel"))
        result["steps"][label] = {"compiled_ms": a, "kernel_ms": b, "rounds": args.rounds}
        print(f"{label:>24} | {a:8.3f} | {b:8.3f} | {b / a - 1:+.1%}", flush=True)
    fused = torch.compile(lambda t: F.silu(t.chunk(2, -1)[0]) * t.chunk(2, -1)[1], dynamic=True)
    width = model.layers[0].w_down.shape[1]
    print(f"{'activation alone (us)':>24} | {'compiled':>8} | {'kernel':>8} | kernel TB/s")
    for rows in (128, 256, 288, 384):
        x = torch.randn(rows, 2 * width, device="cuda", dtype=model.dtype)
        a, b = (1000 * call_ms(lambda f=f, x=x: f(x)) for f in (fused, silu_mul))
        rate = 3 * x.numel() // 2 * x.element_size() / b / 1e6
        result["alone"][rows] = {"compiled_us": a, "kernel_us": b, "kernel_tb_s": rate}
        print(f"{f'{rows} rows':>24} | {a:8.1f} | {b:8.1f} | {rate:.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_provenance(result, provenance("bench_activation")), indent=1))


if __name__ == "__main__":
    main()
