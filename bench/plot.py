"""The plots of docs/benchmarks.md, drawn from the run histories in bench/results/.

    .venv/bin/python bench/plot.py [--results bench/results] [--out docs/img]

Writes SVG files whose bytes depend only on the JSON and on matplotlib's version: matplotlib's
own defaults (not the reader's matplotlibrc), text kept as text with a named font, a fixed
salt for the SVG's ids and no date in its metadata. tests/unit/test_bench_results.py draws
them again into a temporary folder and compares the bytes with the files in docs/img/.

Which runs are "current" is written below (CURRENT_GPU, CURRENT_MASK_BOUND, GPU_HISTORY): when a
new run is recorded in bench/results/, point these at it, run `make plots`, and update the
figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display; the same backend wherever it runs

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

REPO = Path(__file__).resolve().parents[1]

# The latest full run of the default phases (devices, baselines, in-process and served levels)
# and the latest run of the served levels (run L: runs K's engine, eight requests a stream).
CURRENT_GPU = {"full": "gpu/2026-12-03-run-K.json", "serve": "gpu/2026-12-03-run-L.json"}
CURRENT_MASK_BOUND = "rules/2026-12-04-mask-bound.json"
# The runs of the default phases in the order they were made, for the history plot.
GPU_HISTORY = [
    "gpu/2026-12-02-run-A.json", "gpu/2026-12-02-run-B.json", "gpu/2026-12-02-run-C.json",
    "gpu/2026-12-03-run-D.json", "gpu/2026-12-03-run-E.json", "gpu/2026-12-03-run-F.json",
    "gpu/2026-12-03-run-G.json", "gpu/2026-12-03-run-H.json", "gpu/2026-12-03-run-I.json",
    "gpu/2026-12-03-run-J.json", "gpu/2026-12-03-run-K.json", "gpu/2026-12-03-run-L.json",
]

STREAMS = [1, 16, 64, 128]

# Everything that decides the bytes of an SVG, applied over matplotlib's defaults.
STYLE: dict[str, Any] = {
    "svg.hashsalt": "finsieve",  # the ids of clip paths and glyphs, otherwise random
    "svg.fonttype": "none",  # text as <text> in a named font: no glyph outlines of whatever font is found
    "font.family": "DejaVu Sans",  # shipped with matplotlib
    "font.size": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "figure.dpi": 100,
    "savefig.bbox": None,  # "tight" measures text with the installed fonts
}
METADATA = {"Date": None}  # no time stamp in the file


def load(results: Path, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((results / name).read_text())
    return doc


def rows(run: dict[str, Any], path: str, rules: str, mode: str | None = None) -> list[dict[str, Any]]:
    """A run's rows of one path (serve, inprocess) and rules setting, by streams."""
    found = [r for r in run["rows"] if r["path"] == path and r["rules"] == rules
             and (mode is None or r.get("mode") == mode) and r.get("variant") is None]
    return sorted(found, key=lambda r: r["streams"])


def series(found: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """The (streams, value) pairs of the rows that carry `key`."""
    pairs = [(r["streams"], r[key]) for r in found if r.get(key) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def run_label(run: dict[str, Any]) -> str:
    p = run["provenance"]
    return f"run {p['run']} ({p['commit']})"


@contextmanager
def style() -> Iterator[None]:
    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        matplotlib.rcParams.update(STYLE)
        yield


def streams_axis(ax: Axes) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(STREAMS, [str(s) for s in STREAMS])
    ax.minorticks_off()
    ax.set_xlabel("concurrent streams")


def save(fig: Figure, out: Path, name: str) -> Path:
    path = out / name
    fig.savefig(path, format="svg", metadata=METADATA)
    plt.close(fig)
    return path


def tokens_per_s(results: Path, out: Path) -> Path:
    """Tokens/s against streams: through gRPC and in-process, rules on and off, and
    transformers' baselines, all from the current runs."""
    full, serve = load(results, CURRENT_GPU["full"]), load(results, CURRENT_GPU["serve"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for run, path, mode, rules, fmt in [
            (full, "serve", None, "on", "o-"), (full, "serve", None, "off", "o--"),
            (full, "inprocess", "steady", "on", "s-"), (serve, "serve", "steady", "on", "^-"),
            (serve, "serve", "steady", "off", "^--")]:
        where = "through gRPC" if path == "serve" else f"in-process, {mode}"
        ax.plot(*series(rows(run, path, rules, mode), "tokens_per_s"), fmt,
                label=f"{run_label(run)}, {where}, rules {rules}")
    base = full["baselines"]
    ax.plot([1], [base["hf_generate_tokens_per_s"]], "kx", markersize=8,
            label=f"transformers generate, batch 1 ({run_label(full)})")
    ax.plot([64], [base["hf_batch_tokens_per_s"]], "k+", markersize=10,
            label=f"transformers generate_batch, 64 requests ({run_label(full)})")
    streams_axis(ax)
    ax.set_yscale("log")  # one stream's 271 and 128 streams' 14,000 on one axis
    ax.set_ylim(100, 200_000)  # room above the lines for the legend
    ax.set_ylabel("tokens/s, all streams (log scale)")
    ax.set_title("Throughput on one H200, Qwen2-7B shape")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return save(fig, out, "gpu_tokens_per_s.svg")


def latency(results: Path, out: Path) -> Path:
    """TTFT p50 against streams through gRPC (rules on and off), and the percentiles the
    current runs measured at one level: 64 requests at once, ITL at 128 streams."""
    full, serve = load(results, CURRENT_GPU["full"]), load(results, CURRENT_GPU["serve"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.0, 3.6))
    for run, rules, fmt in [(full, "on", "o-"), (full, "off", "o--"), (serve, "on", "^-"),
                            (serve, "off", "^--")]:
        left.plot(*series(rows(run, "serve", rules), "ttft_p50_ms"), fmt,
                  label=f"{run_label(run)}, rules {rules}")
    streams_axis(left)
    left.set_ylabel("ms")
    left.set_title("Time to first token, p50, through gRPC")
    left.legend(fontsize=7)

    burst = full["burst"]
    at_128 = {r["rules"]: r for r in rows(serve, "serve", "on") + rows(serve, "serve", "off")
              if r["streams"] == 128}
    bars = [(f"TTFT p50\n{burst['streams']} at once", burst["ttft_p50_ms"]),
            (f"TTFT p99\n{burst['streams']} at once", burst["ttft_p99_ms"]),
            ("ITL p50\n128, rules on", at_128["on"]["itl_p50_ms"]),
            ("ITL p50\n128, rules off", at_128["off"]["itl_p50_ms"])]
    positions = list(range(len(bars)))
    right.bar(positions, [v for _, v in bars], color=["C0", "C0", "C1", "C1"])
    right.set_xticks(positions, [name for name, _ in bars], fontsize=7)
    right.set_yscale("log")
    right.set_ylabel("ms (log scale)")
    right.set_title(f"TTFT: {run_label(full)}; ITL: {run_label(serve)}", fontsize=8)
    for x, (_, v) in zip(positions, bars, strict=True):
        right.annotate(f"{v:g}", (x, v), ha="center", va="bottom", fontsize=7)
    fig.tight_layout()
    return save(fig, out, "gpu_latency.svg")


def history(results: Path, out: Path) -> Path:
    """128 streams through gRPC, rules on and off, run by run: how much leases differ."""
    runs = [load(results, name) for name in GPU_HISTORY]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    x = list(range(len(runs)))
    for rules, fmt in [("on", "o-"), ("off", "s--")]:
        values = [next((r["tokens_per_s"] for r in rows(run, "serve", rules) if r["streams"] == 128), None)
                  for run in runs]
        ax.plot([i for i, v in zip(x, values, strict=True) if v is not None],
                [v for v in values if v is not None], fmt, label=f"through gRPC, rules {rules}")
    ax.set_xticks(x, [run["provenance"]["run"] for run in runs])
    ax.set_xlabel("run (2026-12-02 A-C, 2026-12-03 D-L; each on the H200 of its own lease; J under py-spy)")
    ax.set_ylabel("tokens/s at 128 streams")
    ax.set_title("Run history: 128 streams through gRPC")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, out, "gpu_history.svg")


def mask_bound(results: Path, out: Path) -> Path:
    """The CPU bench's normal streams' gaps between deltas, p50 and p99, as ratios to the same
    run's baseline (no adversary): ratios, since absolute times on a shared CPU say little."""
    streams = load(results, CURRENT_MASK_BOUND)["adversarial_streams"]
    cases = [("baseline", "no adversary"), ("adversary_bounded", "adversary,\nbounded masks"),
             ("adversary_unbounded", "adversary,\nunbounded masks")]
    fig, ax = plt.subplots(figsize=(5.6, 3.4))
    width = 0.38
    for offset, pct in [(-width / 2, "p50"), (width / 2, "p99")]:
        ratios = [streams[key][f"normal_{pct}_ms"] / streams["baseline"][f"normal_{pct}_ms"]
                  for key, _ in cases]
        bars = ax.bar([i + offset for i in range(len(cases))], ratios, width, label=f"gap {pct}")
        ax.bar_label(bars, labels=[f"{r:.2f}x" for r in ratios], fontsize=7)
    ax.axhline(2.0, color="k", linewidth=0.8, linestyle=":", label="target: p99 within 2x")
    ax.set_xticks(range(len(cases)), [name for _, name in cases])
    ax.set_ylabel("ratio to the baseline, same run")
    ax.set_title(f"{streams['streams']} normal streams beside an adversary (CPU)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return save(fig, out, "cpu_mask_bound.svg")


PLOTS = [tokens_per_s, latency, history, mask_bound]


def draw(results: Path, out: Path) -> list[Path]:
    """Every plot, from `results` into `out`; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    with style():
        return [plot(results, out) for plot in PLOTS]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = ap.parse_args()
    for path in draw(args.results, args.out):
        print(path)


if __name__ == "__main__":
    main()
