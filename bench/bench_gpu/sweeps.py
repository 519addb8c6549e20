"""The profile phase's tile sweeps (--sweeps): each GEMV kernel of a layer per tile at one
row, and the decode attention kernel's tiles, stages and programs a row at 1, 64 and 128
rows and in a mixed step; each timed from a CUDA graph (engine.cuda_graphs.call_ms)."""

from __future__ import annotations

import functools
import itertools
from typing import Any


def gemv_tiles(m: Any, bandwidth: float | None) -> dict:
    """Each GEMV kernel of a layer over its weight at one row, per tile: microseconds and
    share of the copy rate; the current tiles and the best five."""
    import torch

    from engine import gemv
    from engine.cuda_graphs import call_ms

    layer, hd = m.layers[0], m.head_dim
    hidden = layer.wo.shape[0]
    x = torch.randn(hidden, device="cuda", dtype=m.dtype)
    position = torch.tensor([500], device="cuda")
    rope_rows = (m.n_heads + m.n_kv_heads) * hd
    calls = {
        "qkv": (layer.wqkv, lambda t: gemv.norm_qkv_rope(x, layer.attn_norm, m.eps, layer.wqkv,
                                                         layer.bqkv, m.cos, m.sin, position,
                                                         rope_rows, t)),
        "o": (layer.wo, lambda t: gemv.add_matmul(x[: layer.wo.shape[1]], layer.wo, x.clone(), t,
                                                  counters)),
        "gate_up": (layer.w_gate_up, lambda t: gemv.norm_gate_up_silu(x, layer.mlp_norm, m.eps,
                                                                      layer.w_gate_up, t)),
        "down": (layer.w_down, lambda t: gemv.add_matmul(h, layer.w_down, x.clone(), t, counters)),
    }
    h = torch.randn(layer.w_down.shape[1], device="cuda", dtype=m.dtype)
    counters = torch.zeros(hidden, dtype=torch.int32, device="cuda")
    results: dict = {}
    for name, (w, call) in calls.items():
        timings = []
        for block_n, block_k, warps, splits in itertools.product(
                (2, 4, 8, 16), (256, 512, 1024), (4, 8),
                {"down": (2, 3, 4, 8), "o": (1, 2, 4)}.get(name, (1,))):
            tile = gemv.Tile(block_n, block_k, warps, splits=splits)
            if not gemv.fits(hidden, layer.w_down.shape[1], m.n_heads, hd,
                             {**gemv.TILES, name: tile}):
                continue
            try:
                us = 1000 * call_ms(functools.partial(call, tile))
            except Exception as e:  # a tile the compiler refuses: skip it
                print(f"  gemv {name} {tile}: {e!r:.120}", flush=True)
                continue
            rate = w.numel() * w.element_size() / (us / 1e6)
            timings.append({"tile": [block_n, block_k, warps, splits], "us": us,
                            "of_copy": rate / bandwidth if bandwidth else None})
        timings.sort(key=lambda t: t["us"])
        now = gemv.TILES[name]
        current = next((t for t in timings if t["tile"] == [now.block_n, now.block_k, now.warps,
                                                            now.splits]), None)
        results[name] = {"best": timings[:5], "current": current}
        for label, t in [("current", current), *(("best", t) for t in timings[:3])]:
            if t:
                print(f"  gemv {name:>7} {label:>7}: tile {t['tile']}: {t['us']:6.1f} us"
                      + (f" ({t['of_copy']:.0%} of copy)" if t["of_copy"] else ""), flush=True)
    return results


def attention_configs(m: Any, bandwidth: float | None, tiles: bool) -> dict:
    """The decode attention kernel's choices, timed over one layer's cache (lengths 128-768)
    at 1, 64 and 128 rows: as launched, and by tile (positions an iteration), pipeline
    stages and programs a row (`--sweeps tiles`: every tile and stage count); a mixed step's
    (64 rows and a fresh 256-token chunk) with the chunk's rows alone and grouped.
    Microseconds per layer, share of the copy rate."""
    import torch

    from engine import attention
    from engine.cuda_graphs import call_ms

    cache_k, cache_v = m.cache.k[0], m.cache.v[0]
    dev = cache_k.device
    rows_max = min(128, cache_k.shape[0] - 1)  # the last slot is the scratch
    heads, kv_heads, dim = m.n_heads, m.n_kv_heads, m.head_dim
    sweep = [dict(block_n=bn, stages=st, programs=p) for bn, st, p in itertools.product(
        (32, 64), (1, 2, 3) if tiles else (2,), (1, 2, 3, 4, 8, 32))]

    def timed(label: str, configs: list[dict], kv_bytes: int, call: Any) -> dict:
        timings = []
        for config in configs:
            try:
                us = 1000 * call_ms(functools.partial(call, **config))
            except Exception as e:  # a tile the compiler refuses: skip it
                print(f"  attention {label} {config}: {e!r:.120}", flush=True)
                continue
            shown = {k: v for k, v in config.items() if not isinstance(v, torch.Tensor)}
            timings.append({**shown, "us": us,
                            "of_copy": kv_bytes / (us / 1e6) / bandwidth if bandwidth else None})
        timings.sort(key=lambda t: t["us"])
        for t in [*timings[:3], *(t for t in timings[3:] if not t.get("programs"))]:
            print(f"  attention {label:>20}: {t}", flush=True)  # the best, and as launched
        return {"best": timings[:5], "all": timings}

    results: dict = {}
    for rows in sorted({1, min(64, rows_max), rows_max}):
        lengths = torch.tensor([500] if rows == 1 else [128 + (i * 37) % 641 for i in range(rows)],
                               device=dev)
        slots = torch.arange(rows, device=dev)
        q = torch.randn(rows, heads, dim, device=dev, dtype=cache_k.dtype)
        k = torch.randn(rows, kv_heads, dim, device=dev, dtype=cache_k.dtype)
        v = torch.randn_like(k)
        kv_bytes = 2 * int(lengths.sum()) * kv_heads * dim * cache_k.element_size()

        def call(q: Any = q, k: Any = k, v: Any = v, slots: Any = slots, lengths: Any = lengths,
                 **config: Any) -> Any:
            return attention._triton_decode(q, k, v, cache_k, cache_v, slots, lengths,
                                            rope=(m.cos, m.sin), **config)

        results[f"{rows} rows"] = timed(f"{rows} rows", [{}, *sweep], kv_bytes, call)
    chunk = 256
    if cache_k.shape[0] <= 64 or cache_k.shape[2] < 768:
        return results  # no room for the mixed step's 64 rows of up to 768 positions and a chunk
    slots = torch.tensor([*range(64), *[64] * chunk], device=dev)
    lengths = torch.tensor([128 + (i * 37) % 641 for i in range(64)] + list(range(1, chunk + 1)),
                           device=dev)
    n = slots.numel()
    q = torch.randn(n, heads, dim, device=dev, dtype=cache_k.dtype)
    k = torch.randn(n, kv_heads, dim, device=dev, dtype=cache_k.dtype)
    v = torch.randn_like(k)
    kv_bytes = 2 * int(lengths.sum()) * kv_heads * dim * cache_k.element_size()
    configs = []
    for tokens in sorted({2, m.chunk_tokens}):
        groups = torch.from_numpy(attention.chunk_groups(64, [chunk], tokens, n)).to(dev)
        configs += [{"tokens": tokens, "groups": groups},
                    *({"tokens": tokens, "groups": groups, **c} for c in sweep)]

    def mixed(tokens: int, **config: Any) -> Any:
        return attention._triton_decode(q, k, v, cache_k, cache_v, slots, lengths,
                                        rope=(m.cos, m.sin), shared=True, tokens=tokens, **config)

    results["mixed"] = timed("64 rows + 256 chunk", configs, kv_bytes, mixed)
    return results


