"""The command line and the driver: each phase in its own process (harness.run_phase) under
the run's deadline, the JSON written after every phase, the table printed at the end; with
--phase (internal), this process is one phase's."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import __doc__ as OVERVIEW
from .harness import REPO, run_phase
from .phases import DEFAULT_PHASES, PHASES
from .report import table, targets, write_json
from .workload import DEFAULT_TOKENIZER


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_gpu",
                                 description=(OVERVIEW or "").splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU dry run with a tiny random model")
    ap.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "finsieve-bench-gpu"))
    ap.add_argument("--out", default=str(REPO / "bench/results/gpu.json"))
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--phases", nargs="*", default=DEFAULT_PHASES,
                    help="phases to run (tests, profile: only when named)")
    ap.add_argument("--deadline", type=float, default=570.0, help="seconds for the whole run")
    ap.add_argument("--levels", type=int, nargs="*")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--sweeps", nargs="*", default=["attention", "gemv"],
                    help="profile: the sweeps to run (attention: programs and stages; "
                         "tiles: attention's tiles too; gemv)")
    ap.add_argument("--baselines", action="store_true",
                    help="in-process: also the engine's own baselines at 64+ streams, rules on "
                         "(mixed steps off, tile cut off, preparation on threads; ~70 s more)")
    ap.add_argument("--hf-compile", choices=["transformers", "forward"], default="transformers",
                    help="hf_generate: compiled only as transformers' generate compiles its "
                         "decode step on a static cache (CUDA graphs; the stronger baseline), or "
                         "by our torch.compile of the model's forward (inductor, as measured "
                         "before 2026-12-02)")
    ap.add_argument("--mixed-tokens", type=int, default=0,
                    help="in-process: the engine's mixed-step budget (0: the served default)")
    ap.add_argument("--mixed-sweep", type=int, nargs="*", default=[],
                    help="in-process: steady rows, rules on, at --sweep-from streams and more "
                         "with these budgets (each at most --mixed-tokens)")
    ap.add_argument("--tile-sweep", type=int, nargs="*", default=[],
                    help="in-process: steady rows, rules on, at --sweep-from streams and more "
                         "with mixed steps cut to these matmul tiles (multiples of 32, as the "
                         "mixed graphs' buckets) instead of MIXED_TILE")
    ap.add_argument("--sweep-from", type=int, default=64,
                    help="in-process: the fewest streams --mixed-sweep and --tile-sweep run at")
    ap.add_argument("--serve-steady", type=float, metavar="SECONDS",
                    help="serve: levels of more than one stream run --serve-rounds requests a "
                         "stream, the streams starting over SECONDS (about one answer's time), "
                         "and count the tokens of the window in which every stream runs (0: "
                         "every stream started at once, --rounds requests each); default 2.5, "
                         "with --tiny 0 (its answers are shorter than any spread)")
    ap.add_argument("--steady-rounds", type=int, default=4,
                    help="requests per stream in an in-process steady row (its window is "
                         "~rounds - 1 answers)")
    ap.add_argument("--serve-rounds", type=int, default=8,
                    help="requests per stream in a served steady row: the window of four (~5 s at "
                         "128 streams) read rules on / off 3.6%% apart where the engine's steps "
                         "(7.38 / 7.39 ms, 1,425 / 1,420 of them) said they ran alike")
    ap.add_argument("--gateways", type=int, default=2,
                    help="serve: gateway processes on one SO_REUSEPORT port (docs/operations.md, "
                         "\"Processes and roles\": each costs the engine a message a step)")
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--tests-timeout", type=float, default=240)
    ap.add_argument("--py-spy", action="store_true",
                    help="serve: py-spy the engine and one gateway at each level (into --log-dir)")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--until", type=float, default=0.0, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    args.levels = args.levels or ([1, 4] if args.tiny else [1, 16, 64, 128])
    args.max_tokens = args.max_tokens or (16 if args.tiny else 256)
    if args.serve_steady is None:
        args.serve_steady = 0.0 if args.tiny else 2.5
    args.model_dir = str(Path(args.work) / "model")
    if args.phase:
        run_child(args)
        return
    args.passthrough = list(argv)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"levels": args.levels, "rounds": args.rounds, "max_tokens": args.max_tokens,
                     "tiny": args.tiny}
    if out.exists() and set(args.phases) != set(PHASES):
        results = {**json.loads(out.read_text()), **results}  # a later call adds to an earlier one
    start = time.perf_counter()
    for name in args.phases:
        left = args.deadline - (time.perf_counter() - start)
        if left < 20:
            results[name] = {"error": "skipped: no time left in this run"}
            continue
        print(f"== {name} ({left:.0f} s left)", flush=True)
        results[name] = run_phase(name, args, left - 5)
        write_json(out, results)
    results["targets"] = targets(results)
    print(table(results))
    write_json(out, results)


def run_child(args: argparse.Namespace) -> None:
    """One phase in this process, its result to --result (what it measured and saved before
    it failed is kept, with the error)."""
    result: dict = {}
    try:
        result = PHASES[args.phase](args)
    except Exception:
        saved = Path(args.result).read_text() if Path(args.result).exists() else ""
        result = {**json.loads(saved or "{}"), "error": traceback.format_exc()[-3000:]}
        print(result["error"], flush=True)
    Path(args.result).write_text(json.dumps(result))
