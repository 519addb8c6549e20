"""The GPU benchmark's package without a GPU: its modules import, its targets file names
phases and metrics that exist, and its report turns a run's results into the table and
the JSON (a synthetic run whose figures are known)."""

from __future__ import annotations

import importlib
import json
import pkgutil
from types import ModuleType

import pytest

from support.paths import REPO


@pytest.fixture(scope="module")
def bench_gpu() -> ModuleType:
    """The package, imported as `python -m bench.bench_gpu` imports it (from the repository's
    root), every module of it loaded."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO))
        package = importlib.import_module("bench.bench_gpu")
        for module in pkgutil.iter_modules(package.__path__):
            if module.name != "__main__":
                importlib.import_module(f"bench.bench_gpu.{module.name}")
    return package


def _row(streams: int, rules: str, tps: float, **more: object) -> dict:
    return {"streams": streams, "rules": rules, "tokens_per_s": tps, "ttft_p50_ms": 40.0,
            "ttft_p99_ms": 90.0, "itl_p50_ms": 3.5, "itl_p99_ms": 7.0, "step_p50_ms": 3.4,
            "step_p99_ms": 6.0, "late_repairs": 0, **more}


def _run() -> dict:
    """A run's results in the shape the phases write them: a 4 TB/s device and 10 GB of
    weights a step (a floor of 400 tokens/s), every row each target reads."""
    return {
        "levels": [1, 64], "rounds": 2, "max_tokens": 256, "tiny": False,
        "device": {"device": "H200", "copy_bandwidth_bytes_s": 4e12, "bf16_matmul_flops": 8e14,
                   "host_cpu": "test CPU, 2 cores"},
        "model": {"weight_bytes_per_step": 10_000_000_000},
        "inprocess": {
            "levels": [_row(1, "off", 390), _row(1, "on", 380)],
            "steady": [_row(64, "off", 12_000), _row(64, "on", 11_000), _row(128, "on", 13_000)],
            "burst": {**_row(64, "on", 5_000), "ttft_p50_ms": 450.0, "last_first_token_s": 0.5,
                      "prefill_flops_per_s": 4.8e14},
            "load_s": 3.0, "ready_s": 30.0, "graphs_s": 20.0, "mode": "compiled", "slots": 129},
        "serve": {"levels": [_row(1, "on", 360, steady=False), _row(1, "off", 370, steady=False),
                             _row(64, "on", 7_000, steady=True)],
                  "ready_s": 120.0, "gateways": 2, "client_procs": 4},
        "hf_generate": {"tokens_per_s": 140.0, "compile": "transformers"},
        "hf_batch": {"error": "out of memory"},
    }


def test_every_target_names_a_phase_and_a_metric_that_exist(bench_gpu: ModuleType) -> None:
    from bench.bench_gpu.phases import PHASES
    from bench.bench_gpu.report import METRICS, PATHS, load_targets

    listed = load_targets()
    assert len(listed) == 9
    for t in listed:
        assert t["metric"] in METRICS, t
        assert t["phases"] and set(t["phases"]) <= set(PHASES), t
        assert t["op"] in (">=", "<="), t
        assert isinstance(t["goal"], int | float) and t["goal"] > 0, t
        if "path" in t:
            assert t["path"] in PATHS and isinstance(t["streams"], int), t
    assert len({t["target"] for t in listed}) == len(listed)


def test_targets_read_a_run_the_phases_wrote(bench_gpu: ModuleType) -> None:
    from bench.bench_gpu.report import targets

    measured = {t["target"]: t for t in targets(_run())}
    assert all(t["measured"] is not None for t in measured.values()), measured
    share = measured["1 stream through gRPC, share of the batch-1 floor"]
    assert share["measured"] == pytest.approx(360 / 400) and share["met"] is True
    assert measured["64 streams through gRPC, tokens/s"]["measured"] == 7_000
    assert measured["64 streams through gRPC, tokens/s"]["met"] is False
    assert measured["128 streams in-process, tokens/s"]["met"] is False
    # the worst of the rows measured both ways: in-process 64 steady, 11,000 / 12,000
    worst = measured["rules on / off, the worst row measured both ways"]
    assert worst["measured"] == pytest.approx(11_000 / 12_000) and worst["met"] is False
    assert measured["64 requests at once, TTFT p50 ms"]["met"] is True  # 450 <= 500
    assert measured["64 requests at once, prefill share of the matmul peak"]["measured"] == \
        pytest.approx(0.6)
    assert {t["met"] for t in targets({})} == {None}  # nothing run: nothing measured


def test_report_renders_the_table_and_the_json(bench_gpu: ModuleType) -> None:
    from bench.bench_gpu.report import conditions, json_text, run_gpu, table, targets

    results = {**_run(), "targets": targets(_run())}
    text = table(results)
    lines = text.splitlines()
    assert lines[0].startswith("device H200: copy 4.00 TB/s, bf16 matmul 800 TFLOP/s")
    assert "batch-1 floor 2.50 ms/step = 400 tokens/s" in lines[0]
    assert "transformers generate_batch (64 requests): out of memory" in text
    serve_steady = next(ln for ln in lines if ln.startswith("serve-st"))
    assert serve_steady.split()[:4] == ["serve-st", "64", "on", "7000"]
    one = next(ln for ln in lines if ln.startswith("serve ") and " off " not in ln)
    assert one.split()[4] == "90%"  # of the floor: shown for one stream only
    assert "start-up finsieve serve (engine SERVING): 120 s; 2 gateway processes" in text
    verdicts = [ln for ln in lines if ln.rstrip().endswith(("met", "MISSED"))]
    assert len(verdicts) == 9
    assert any("64 streams through gRPC, tokens/s" in ln and ln.endswith("MISSED") for ln in verdicts)
    origin = {"bench": "bench_gpu", "command": "python -m bench.bench_gpu"}
    written = json.loads(json_text(results, origin))
    assert next(iter(written)) == "provenance" and written["provenance"] == origin
    assert {k: v for k, v in written.items() if k != "provenance"} == json.loads(json.dumps(results))
    assert set(written["targets"][0]) == {"target", "measured", "goal", "met"}
    assert json.loads(json_text(written, {"bench": "later"}))["provenance"] == {"bench": "later"}
    assert "levels [1, 64] streams, 2 requests a stream, 256 new tokens" in conditions(results)
    assert run_gpu(results) == "H200" and run_gpu({"device": {"device": "cpu"}}) is None


def test_the_command_line_keeps_its_options_and_defaults(bench_gpu: ModuleType) -> None:
    from bench.bench_gpu.cli import parser

    args = parser().parse_args([])
    assert args.phases == ["device", "model", "inprocess", "hf_batch", "serve", "hf_generate"]
    assert (args.deadline, args.rounds, args.gateways, args.client_procs) == (570.0, 2, 2, 4)
    usage = parser().format_help()
    for option in ("--tiny", "--tokenizer", "--work", "--out", "--log-dir", "--levels",
                   "--max-context", "--sweeps", "--baselines", "--hf-compile", "--mixed-tokens",
                   "--mixed-sweep", "--tile-sweep", "--sweep-from", "--serve-steady",
                   "--steady-rounds", "--serve-rounds", "--tests-timeout", "--py-spy"):
        assert option in usage
