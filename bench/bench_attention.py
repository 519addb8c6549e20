"""The decode attention kernel against another revision's, in one run, on one layer's cache.

    python3 bench/bench_attention.py --baseline-file OLD_attention.py [--out FILE]
    TRITON_INTERPRET=1 python3 bench/bench_attention.py --check     # CPU: correctness only

OLD_attention.py is engine/attention.py of the baseline revision, e.g.
`git show REV:engine/attention.py > .base/attention.py`. Qwen2-7B's attention shape (28
query heads, 4 kv heads, head_dim 128, bf16), a cache of 129 slots of 1,024 positions, rows
of 128-768 positions (one row: 500); each kernel timed from a CUDA graph of 28 launches
(one per layer), the mean of ten replays. Also mixed steps (64 decode rows and a fresh
256-token chunk; 128 rows and 160 tokens at positions 160-319), and the new kernel's tiles,
programs a row (`--tiles`) and a chunk's tokens a program (`--chunk-tokens`). Prints a table and
writes JSON (default bench/results/attention.json).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from provenance import provenance, with_provenance

from engine.cuda_graphs import call_ms

ROOT = Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, DIM, MAX_LEN = 28, 4, 128, 1024


def load(path: Path, name: str):
    """attention.py as a module of its own (it imports only numpy, torch and triton)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def launch(module, q, k, v, k_cache, v_cache, slots, lengths, rope, **kw):
    """module's CUDA decode attention as the engine launches it (older revisions took a
    split length per cache)."""
    if hasattr(module, "split_len_for"):
        return module._triton_decode(q, k, v, k_cache, v_cache, slots, lengths,
                                     module.split_len_for(k_cache.shape[2]), rope=rope, **kw)
    return module._triton_decode(q, k, v, k_cache, v_cache, slots, lengths, rope=rope, **kw)


def case(rows: int, device, dtype, max_len: int = MAX_LEN, n_slots: int = 129, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(n_slots, KV_HEADS, max_len, DIM, generator=g).to(device, dtype)
                        for _ in range(2))
    lengths = torch.tensor([min(500, max_len)] if rows == 1 else
                           [min(128 + (i * 37) % 641, max_len) for i in range(rows)], device=device)
    q = torch.randn(rows, HEADS, DIM, generator=g).to(device, dtype)
    k, v = (torch.randn(rows, KV_HEADS, DIM, generator=g).to(device, dtype) for _ in range(2))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32),
                        1.0 / 10000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    rope = tuple(f(torch.cat([freqs, freqs], -1)).to(device, dtype).contiguous()
                 for f in (torch.cos, torch.sin))
    return q, k, v, k_cache, v_cache, torch.arange(rows, device=device), lengths, rope


def reference(module, q, k, v, k_cache, v_cache, slots, lengths, rope):
    """Per-row SDPA in float32 on copies of the cache, the new keys written first."""
    kc, vc = k_cache.float().clone(), v_cache.float().clone()
    pos = lengths - 1
    cos, sin = (t.float()[pos][:, None] for t in rope)
    qr, kr = module.apply_rope(q.float(), cos, sin), module.apply_rope(k.float(), cos, sin)
    kc[slots, :, pos], vc[slots, :, pos] = kr, v.float()
    return torch.stack([
        F.scaled_dot_product_attention(qr[i, :, None], kc[slots[i], :, :n], vc[slots[i], :, :n],
                                       enable_gqa=True)[:, 0]
        for i, n in enumerate(lengths.tolist())])


def check(new) -> None:
    """The kernel against per-row SDPA (float32), as tuned and at every tile and a few
    programs a row, decode rows and a mixed step's rows sharing a slot."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    q, k, v, kc, vc, _, _, rope = case(12, device, dtype, max_len=256, n_slots=6, seed=1)
    decode = (torch.tensor([3, 0, 5, 1], device=device), torch.tensor([1, 64, 65, 256], device=device))
    mixed = (torch.tensor([3, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], device=device),
             torch.tensor([100, 256, *range(121, 131)], device=device))
    for (slots, lengths), kw in itertools.product((decode, mixed), (
            {}, {"programs": 1}, {"programs": 3, "block_n": 32}, {"programs": 8, "block_n": 64},
            {"programs": 16, "block_n": 32, "stages": 3}, {"tokens": 4}, {"tokens": 8, "programs": 3})):
        rows = slots.numel()
        shared = rows > 4
        if shared:
            tokens = kw.get("tokens", 2)
            kw = {**kw, "shared": True,
                  "groups": torch.from_numpy(new.chunk_groups(2, [10], tokens, rows)).to(device)}
        args = (q[:rows], k[:rows], v[:rows])
        ref = reference(new, *args, kc, vc, slots, lengths, rope)
        out = launch(new, *args, kc.clone(), vc.clone(), slots, lengths, rope, **kw)
        err = float((out.float() - ref).norm() / ref.norm())
        print(f"{'mixed' if shared else 'decode'} {_label(kw)}: relative error {err:.1e}", flush=True)
        assert err < tolerance, err


def _label(variant: dict) -> dict:
    """A variant's keywords as printed: its groups tensor left out."""
    return {a: b for a, b in variant.items() if a != "groups"}


def run(new, old, out: Path, tiles: bool, chunk_sweep: list[int]) -> None:
    device, dtype = torch.device("cuda"), torch.bfloat16
    sweep = [dict(block_n=bn, stages=st, programs=p)
             for bn, st, p in itertools.product((32, 64), (2, 3), (1, 2, 3, 8, 32))] if tiles else []
    rows_out = []
    cases = [(f"{n} rows", n, None, 0) for n in (1, 4, 16, 64, 128)] + [
        ("64 rows + 256 chunk", 64, 256, 0), ("128 rows + 160 at 160", 128, 160, 160)]
    for label, rows, chunk, at in cases:
        q, k, v, kc, vc, slots, lengths, rope = case(rows + (chunk or 0), device, dtype)
        kw, variants = {}, sweep
        if chunk:  # the chunk's tokens in slot `rows`, at positions at..at + chunk - 1
            slots = torch.tensor([*range(rows), *[rows] * chunk], device=device)
            lengths = torch.cat([lengths[:rows], torch.arange(at + 1, at + chunk + 1, device=device)])
            def groups(tokens: int, rows=rows, chunk=chunk) -> torch.Tensor:
                return torch.from_numpy(new.chunk_groups(rows, [chunk], tokens, rows + chunk)).to(device)

            tokens = new.chunk_tokens(HEADS // KV_HEADS)
            kw = {"shared": True, "groups": groups(tokens)}
            variants = sweep + [{"tokens": t, "groups": groups(t)}  # a chunk's tokens a program
                                for t in chunk_sweep if t != tokens]
        kv_bytes = 2 * int(lengths[:rows].sum() + (chunk or 0) + at) * KV_HEADS * DIM * dtype.itemsize
        ref = reference(new, q, k, v, kc, vc, slots, lengths, rope)
        timed = {}
        for name, module, extra in [("baseline", old, {}), ("new", new, {}),
                                    *((f"new {_label(c)}", new, c) for c in variants)]:
            if module is None:
                continue
            call = functools.partial(launch, module, q, k, v, kc, vc, slots, lengths, rope, **{**kw, **extra})
            try:
                err = float((call().float() - ref).norm() / ref.norm())
                us = 1000 * call_ms(call)
            except Exception as e:  # a tile the compiler refuses
                print(f"  {label} {name}: {e!r:.160}", flush=True)
                continue
            timed[name] = dict(case=label, kernel=name, us=us, tb_s=kv_bytes / us / 1e6, rel_err=err)
        rows_out.extend(timed.values())
        best = min((t for n, t in timed.items() if n.startswith("new")), key=lambda t: t["us"])
        base = timed.get("baseline")
        print(f"{label:>20} | baseline {base['us'] if base else float('nan'):6.1f} us | "
              f"new {timed['new']['us']:6.1f} us ({timed['new']['tb_s']:.2f} TB/s"
              + (f", {timed['new']['us'] / base['us']:.2f}x" if base else "")
              + f") | best {best['us']:6.1f} us {best['kernel']}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(with_provenance({"cases": rows_out}, provenance("bench_attention")), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-file", type=Path, help="the baseline revision's engine/attention.py")
    ap.add_argument("--check", action="store_true", help="correctness only (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--tiles", action="store_true",
                    help="also the new kernel at each tile, stage count and programs a row")
    ap.add_argument("--chunk-tokens", type=int, nargs="*", default=[],
                    help="mixed steps: also these many tokens of a chunk a program")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "attention.json")
    args = ap.parse_args()
    new = load(ROOT / "engine" / "attention.py", "attention_new")
    if args.check:
        check(new)
        return
    old = load(args.baseline_file, "attention_old") if args.baseline_file else None
    run(new, old, args.out, args.tiles, args.chunk_tokens)


if __name__ == "__main__":
    main()
