"""The run's report: issue #10's targets (targets.toml beside this file) as measured, the
table printed at the end of a run, and the JSON file the results are written to."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from pathlib import Path

from provenance import provenance, with_provenance

from .phases import PHASES

TARGETS_FILE = Path(__file__).with_name("targets.toml")
PATHS = ("inprocess", "steady", "serve", "serve-st")  # what a target's `path` may name


def load_targets(path: Path = TARGETS_FILE) -> list[dict]:
    """The targets as the file lists them: target (its line in the table), metric, its
    arguments (path, streams, rules), phases, op (">=" or "<=") and goal."""
    return tomllib.loads(path.read_text())["targets"]


def tokens_per_s(r: dict) -> dict[tuple[str, int, str], float]:
    """tokens/s by (path, streams, rules), path one of PATHS: inprocess (every stream
    started at once), steady (each stream starts a new request as one ends), serve, serve-st."""
    rows = [("inprocess", row) for row in r.get("inprocess", {}).get("levels", [])]
    rows += [("steady", row) for row in r.get("inprocess", {}).get("steady", [])]
    rows += [("serve-st" if row.get("steady") else "serve", row)
             for row in r.get("serve", {}).get("levels", [])]
    return {(path, row["streams"], row["rules"]): row["tokens_per_s"] for path, row in rows
            if row.get("tokens_per_s")}


def floor_tps(r: dict) -> float | None:
    """The batch-1 floor in tokens/s: the copy rate over the weights' bytes a step."""
    bw = r.get("device", {}).get("copy_bandwidth_bytes_s")
    step_bytes = r.get("model", {}).get("weight_bytes_per_step")
    return bw / step_bytes if bw and step_bytes else None


def _level_tps(r: dict, t: dict) -> float | None:
    return tokens_per_s(r).get((t["path"], t["streams"], t.get("rules", "on")))


def _share_of_floor(r: dict, t: dict) -> float | None:
    tps, floor = _level_tps(r, t), floor_tps(r)
    return tps / floor if tps and floor else None


def _rules_on_over_off(r: dict, t: dict) -> float | None:
    """The lowest rules-on / rules-off ratio over the rows measured both ways."""
    tps = tokens_per_s(r)
    return min((on / tps[path, n, "off"] for (path, n, rules), on in tps.items()
                if rules == "on" and (path, n, "off") in tps), default=None)


def _burst_ttft_p50_ms(r: dict, t: dict) -> float | None:
    return r.get("inprocess", {}).get("burst", {}).get("ttft_p50_ms")


def _burst_prefill_share_of_peak(r: dict, t: dict) -> float | None:
    prefill = r.get("inprocess", {}).get("burst", {}).get("prefill_flops_per_s")
    peak = r.get("device", {}).get("bf16_matmul_flops")
    return prefill / peak if prefill and peak else None


def _serve_ready_s(r: dict, t: dict) -> float | None:
    return r.get("serve", {}).get("ready_s")


# A target's metric by name: (the run's results, the target's entry) -> the figure, or None
# when the run did not measure it.
METRICS: dict[str, Callable[[dict, dict], float | None]] = {
    "tokens_per_s": _level_tps,
    "share_of_floor": _share_of_floor,
    "rules_on_over_off": _rules_on_over_off,
    "burst_ttft_p50_ms": _burst_ttft_p50_ms,
    "burst_prefill_share_of_peak": _burst_prefill_share_of_peak,
    "serve_ready_s": _serve_ready_s,
}


def targets(r: dict, listed: list[dict] | None = None) -> list[dict]:
    """Issue #10's targets as measured in this run: what, the figure, the goal and whether
    it is met (None: not measured)."""
    out = []
    for t in load_targets() if listed is None else listed:
        value = METRICS[t["metric"]](r, t)
        met = None if value is None else value >= t["goal"] if t["op"] == ">=" else value <= t["goal"]
        out.append({"target": t["target"], "measured": value, "goal": t["goal"], "met": met})
    return out


def write_json(path: Path, results: dict) -> None:
    """The results with this call's provenance first (bench/provenance.py)."""
    path.write_text(json_text(results, provenance("bench_gpu", conditions(results), run_gpu(results))))


def json_text(results: dict, origin: dict[str, str | None]) -> str:
    return json.dumps(with_provenance(results, origin), indent=2)


def run_gpu(results: dict) -> str | None:
    """The GPU the run measured, from its device phase (the driver keeps CUDA uninitialised
    in its own process); None on the CPU or before that phase."""
    device = results.get("device", {}).get("device")
    return device if device != "cpu" else None


def conditions(results: dict) -> str:
    """What the run's figures were measured under, from its settings."""
    model = "the tiny random model (--tiny)" if results.get("tiny") else \
        "a Qwen2-7B-shaped model with random weights"
    return (f"{model}, the default model's tokenizer; levels {results.get('levels')} streams, "
            f"{results.get('rounds')} requests a stream, {results.get('max_tokens')} new tokens, "
            "greedy; rules on = the default packs plus 10,000 synthetic literals")


def table(r: dict) -> str:
    """The run's table: the device and the baselines, a line per level, the start-up and
    prefill figures, the targets, the phases' errors."""
    lines = [*_header(r), ""]
    lines += _level_lines(r)
    lines += _detail_lines(r)
    lines.append("\nissue #10's targets (for the H200; rules on unless said):")
    for t in targets(r):
        share = t["goal"] < 1  # a share of a floor or peak, else tokens/s, ms or s
        value = "not measured" if t["measured"] is None else \
            f"{t['measured']:.1%}" if share else f"{t['measured']:,.0f}"
        goal = f"{t['goal']:.0%}" if share else f"{t['goal']:,}"
        verdict = {True: "met", False: "MISSED", None: ""}[t["met"]]
        lines.append(f"  {t['target']:<56} {value:>12}  goal {goal:>7}  {verdict}")
    for name in PHASES:
        if isinstance(r.get(name), dict) and r[name].get("error"):
            lines.append(f"phase {name}: {r[name]['error'][-300:]}")
    return "\n".join(lines)


def _header(r: dict) -> list[str]:
    """The device, its floor, the host, and the transformers baselines."""
    lines = []
    dev, model = r.get("device", {}), r.get("model", {})
    bw = dev.get("copy_bandwidth_bytes_s")
    floor = floor_tps(r)
    if bw:
        at_floor = (f"; weights {model['weight_bytes_per_step'] / 1e9:.2f} GB/step -> batch-1 floor "
                    f"{1000 / floor:.2f} ms/step = {floor:.0f} tokens/s" if floor else "")
        lines.append(f"device {dev.get('device')}: copy {bw / 1e12:.2f} TB/s, bf16 matmul "
                     f"{dev['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s{at_floor}")
        lines.append(f"host: {dev.get('host_cpu')}")
    hf1 = r.get("hf_generate", {}).get("tokens_per_s")
    hfb = r.get("hf_batch", {}).get("tokens_per_s")
    compiled = r.get("hf_generate", {}).get("compile", "forward")  # older JSON: forward
    lines.append(f"transformers generate (static cache + compile, {compiled}, batch 1): "
                 f"{(hf1 and f'{hf1:.0f} tok/s') or r.get('hf_generate', {}).get('error', 'not run')}")
    lines.append(f"transformers generate_batch (64 requests): "
                 f"{(hfb and f'{hfb:.0f} tok/s') or r.get('hf_batch', {}).get('error', 'not run')}")
    return lines


# The table's rows: (phase, its list of rows, the label they are shown under)
LEVEL_ROWS = (("inprocess", "levels", "inprocess"), ("inprocess", "steady", "steady"),
              ("inprocess", "unmixed", "unmixed"), ("inprocess", "steady_unmixed", "steady-um"),
              ("inprocess", "steady_threads", "steady-th"),
              ("inprocess", "steady_untiled", "steady-ut"),
              ("inprocess", "mixed_sweep", "steady-mix"), ("inprocess", "tile_sweep", "steady-tile"),
              ("serve", "levels", "serve"))


def _level_lines(r: dict) -> list[str]:
    """A line per level: tokens/s against the floor and the baselines, TTFT, ITL (in-process:
    the engine's step time), late repairs."""
    floor = floor_tps(r)
    hf1 = r.get("hf_generate", {}).get("tokens_per_s")
    hfb = r.get("hf_batch", {}).get("tokens_per_s")
    lines = [f"{'path':<10} {'streams':>7} {'rules':>5} {'tok/s':>8} {'vs floor':>8} {'vs hf1':>7} "
             f"{'vs hfB':>7} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>16} {'repairs':>7}"]
    for phase, key, path in LEVEL_ROWS:
        for row in r.get(phase, {}).get(key, []):
            label = f"mix-{row['mixed_tokens']}" if "mixed_tokens" in row else \
                f"tile-{row['mixed_tile']}" if "mixed_tile" in row else \
                "serve-st" if row.get("steady") else path
            tps = row.get("tokens_per_s", 0)
            per_stream_floor = floor * row["streams"] if floor else None
            itl = (row.get("step_p50_ms"), row.get("step_p99_ms")) if phase == "inprocess" else (
                row.get("itl_p50_ms"), row.get("itl_p99_ms"))
            lines.append(
                f"{label:<10} {row['streams']:>7} {row['rules']:>5} {tps:>8.0f} "
                f"{(f'{tps / per_stream_floor:.0%}' if per_stream_floor and row['streams'] == 1 else ''):>8} "
                f"{(f'{tps / hf1:.1f}x' if hf1 else ''):>7} {(f'{tps / hfb:.1f}x' if hfb else ''):>7} "
                f"{row.get('ttft_p50_ms', 0):>8.0f}/{row.get('ttft_p99_ms', 0):<8.0f}"
                f"{itl[0] or 0:>7.2f}/{itl[1] or 0:<8.2f}{row.get('late_repairs', ''):>7}")
    return lines


def _detail_lines(r: dict) -> list[str]:
    """The burst of 64 requests, the decode graphs' replay, the bare prefill, start-up."""
    lines = []
    dev, ip, sv = r.get("device", {}), r.get("inprocess", {}), r.get("serve", {})
    b = ip.get("burst")
    if b:
        lines.append(f"\n{b['streams']} requests at once (rules on): TTFT p50 {b['ttft_p50_ms']:.0f} ms, "
                     f"p99 {b['ttft_p99_ms']:.0f} ms; all prefilled in {b['last_first_token_s']:.2f} s "
                     f"= {b['prefill_flops_per_s'] / 1e12:.0f} TFLOP/s incl. interleaved decode")
    gr = ip.get("graph_replay_ms")
    if gr:
        lines.append("decode graph replay alone (device time, its greedy sample included, "
                     "501 positions): " + ", ".join(
            f"batch {k}: {v:.2f} ms" for k, v in gr.items()))
    bp = ip.get("bare_prefill")
    if bp:
        peak = dev.get("bf16_matmul_flops")
        lines.append(f"bare prefill step ({bp['tokens']} tokens): {bp['flops_per_s'] / 1e12:.0f} TFLOP/s"
                     + (f" = {bp['flops_per_s'] / peak:.0%} of the measured matmul rate" if peak else ""))
        for name, w in bp.get("ways", {}).items():
            lines.append(f"  prefill {name:>11}: device {1000 * w['seconds']:6.2f} ms, host issues it in "
                         f"{w['issue_ms']:6.2f} ms")
    if "ready_s" in ip:
        lines.append(f"start-up in-process: load {ip['load_s']:.0f} s, ready (compiled, graphs "
                     f"captured: {ip['graphs_s']:.0f} s) {ip['ready_s']:.0f} s, mode {ip['mode']}, "
                     f"{ip['slots']} KV slots, peak GPU memory {ip.get('gpu_memory_gib', 0):.1f} GiB")
    if "ready_s" in sv:
        lines.append(f"start-up finsieve serve (engine SERVING): {sv['ready_s']:.0f} s; "
                     f"{sv['gateways']} gateway processes, {sv['client_procs']} client processes")
    return lines
