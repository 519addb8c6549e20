"""One row's decode step on CUDA, as a single stream's tokens cost, against the floor.

    python3 bench/bench_one_row.py [--rounds 5] [--out FILE]      # on a GPU (Hopper+)

A Qwen2-7B-shaped model with random bf16 weights (built on the device, no files), one row
decoding at position 400-700 of its slot through the GEMV kernels (engine/gemv.py), against
the copy-bandwidth floor (weight bytes read a step / device-to-device copy rate) measured
in the same run. Three measures, each one CUDA graph a step as the engine replays them:

  forward      the model's decode alone
  graph        the engine's decode graph: the optimistic row's token taken from the last
               step, the forward, the greedy sample
  runner       the model runner's loop as the engine drives it: launch step N+1, then
               read step N's token (inputs staged, the graph, the copy of the token back)

for the tree and for what it replaced, in the same run, round-robin (the median of
`--rounds`): `ops`, the graph's head as torch ops (the optimistic row's token gathered,
clamped and selected, its embedding, its length: six kernels) and the greedy sample's token
copied into the next step's feed by a kernel of its own; `tree`, both done in the graph's
kernels (model_runner.embed_rows, sampler.sample_greedy with `prev`). Columns `repeats`: a
variant's runner loop gives the same 300 tokens in every round; `= previous`: the same as
the variant above it (they must be: the same values reach the same kernels). Then, once,
the tree's runner loop with a ban list on the row (the rules' exact mask: the sample then
runs after the graph), and the greedy kernel against the torch ops it replaced at 1-256
rows (it serves every decode and mixed graph), with other blocks and warps than
GREEDY_BLOCK and GREEDY_WARPS. The vocabulary is the issue's (49,152: the default model's
tokenizer); a larger one makes the head and the sample weigh more. Prints tables and writes
JSON (default bench/results/one_row.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_gpu.device import measure_device
from bench_gpu.workload import random_model, step_bytes
from provenance import provenance, with_provenance

from engine import sampler
from engine.cuda_graphs import DecodeGraphs, capture, replay_ms
from engine.embed import embed_rows, optimistic_ids
from engine.model import CompactLM
from engine.model_runner import ModelRunner, StepRow
from engine.sampler import sample, sample_greedy

ROOT = Path(__file__).resolve().parent.parent


def ops_embed_rows(inputs, prev, embed):
    """The graph's head before embed_rows: six torch kernels."""
    return embed[optimistic_ids(inputs, prev)], inputs[1] + 1


def copied_greedy(logits, prev):
    """The greedy kernel, then its tokens copied into prev by a kernel of their own."""
    out = sample_greedy(logits)
    prev[: out.shape[1]].copy_(out[0])
    return out


VARIANTS = {  # label -> (the graph's head, the greedy sample it captures)
    "ops": (ops_embed_rows, copied_greedy),
    "tree": (embed_rows, sample_greedy),
}
GREEDY_LAUNCHES = [(sampler.GREEDY_BLOCK, sampler.GREEDY_WARPS), (4096, 8), (8192, 8), (4096, 16)]
START = 400  # the row's first position


def build(max_len: int = 1024, n_slots: int = 2) -> tuple[CompactLM, int]:
    """The compact model over random weights (its cache random too), and the bytes a
    one-row step reads."""
    hf = random_model("cuda")
    weights = step_bytes(hf)  # before CompactLM frees the unfused copies
    model = CompactLM(hf, n_slots=n_slots, max_len=max_len, own_weights=True)
    for layer in range(len(model.layers)):
        model.cache.k[layer].normal_()
        model.cache.v[layer].normal_()
    return model, weights


def runner_loop(runner: ModelRunner, bans: int = 0, steps: int = 300) -> tuple[float, list[int]]:
    """ms a step of the runner's loop as the engine drives it (one optimistic row, `bans`
    token ids banned: one sorted list, as the rules hand out), and the tokens."""
    banned = sorted(range(7, 7 + 97 * bans, 97))
    flight = runner.launch([StepRow(0, START, [1000], bans=banned)])
    times, tokens = [], []
    for i in range(1, steps):
        t = time.perf_counter()
        launched = runner.launch([StepRow(0, START + i, [], prev=0, bans=banned)])
        tokens.append(flight.tokens()[0][0])
        flight = launched
        times.append(time.perf_counter() - t)
    tokens.append(flight.tokens()[0][0])
    return 1000 * statistics.median(times[20:]), tokens


def measure(model: CompactLM, head, greedy) -> dict:
    """The three measures of one variant."""
    ids, positions, slots = (torch.tensor([v], device="cuda") for v in (1000, 500, 0))
    forward = capture(lambda: model.decode(ids, positions, slots), None)[0]
    runner = ModelRunner(model, torch.device("cuda"), graphs=False)
    runner.graphs = graphs = _graphs(model, head, greedy)
    inputs = torch.tensor([[1000], [500], [0], [1], [0]], device="cuda")  # optimistic
    loop_ms, tokens = runner_loop(runner)
    return {"forward": replay_ms(forward.replay), "graph": replay_ms(lambda: graphs.run(inputs, 1)),
            "runner": loop_ms, "tokens": tokens}


def _graphs(model: CompactLM, head, greedy):
    graphs = DecodeGraphs(model, 1)
    graphs.embed_rows, graphs.greedy = head, greedy
    graphs.capture()
    return graphs


def greedy_us(rows: int) -> dict[str, float]:
    """Microseconds of the greedy sample of `rows` rows of logits, each way, from a graph:
    the torch ops, and the kernel per (block, warps) of GREEDY_LAUNCHES."""
    x = torch.randn(rows, 49152, device="cuda", dtype=torch.bfloat16)
    ways = {"torch ops": lambda: sample(x, None, None)}
    for block, warps in GREEDY_LAUNCHES:
        def kernel(block=block, warps=warps):
            out = torch.empty(2, rows, dtype=torch.long, device="cuda")
            sampler._greedy_kernel[(rows,)](x, out, out, x.stride(0), x.shape[1], PREV=False,
                                            BLOCK=block, num_warps=warps, PDL=False)
            return out
        ways[f"{block}/{warps}"] = kernel
    expected = ways["torch ops"]()
    assert all(torch.equal(fn(), expected) for fn in ways.values())
    return {way: 1000 * replay_ms(capture(fn, None)[0].replay) for way, fn in ways.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "one_row.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_one_row: needs a CUDA device")
    bandwidth = measure_device()["copy_bandwidth_bytes_s"]
    model, weight_bytes = build()
    assert model.gemv, "the GEMV kernels do not take this shape here"
    floor_ms = 1000 * weight_bytes / bandwidth
    runs: dict[str, list[dict]] = {label: [] for label in VARIANTS}
    for _ in range(args.rounds):
        for label, (head, greedy) in VARIANTS.items():
            runs[label].append(measure(model, head, greedy))
    print(f"copy {bandwidth / 1e12:.2f} TB/s, weights {weight_bytes / 1e9:.2f} GB: floor "
          f"{floor_ms:.3f} ms/step, {1000 / floor_ms:.0f} tokens/s")
    print(f"{'variant':<8} {'forward ms':>10} {'graph ms':>9} {'runner ms':>10} {'of floor':>9} "
          f"{'tok/s':>6} {'vs ops':>10} repeats = previous")
    rows, base, previous = [], None, None
    for label, results in runs.items():
        ms = {k: statistics.median(r[k] for r in results) for k in ("forward", "graph", "runner")}
        base = base or ms["runner"]
        repeats = all(r["tokens"] == results[0]["tokens"] for r in results)
        as_previous = previous is None or results[0]["tokens"] == runs[previous][0]["tokens"]
        previous = label
        rows.append({"variant": label, **ms, "of_floor": floor_ms / ms["runner"],
                     "repeats": repeats, "tokens_as_previous": as_previous,
                     "runner_ms_each": [r["runner"] for r in results]})
        print(f"{label:<8} {ms['forward']:>10.3f} {ms['graph']:>9.3f} {ms['runner']:>10.3f} "
              f"{floor_ms / ms['runner']:>9.1%} {1000 / ms['runner']:>6.0f} "
              f"{ms['runner'] / base - 1:>+10.1%} {repeats!s:>7} {as_previous}", flush=True)
    runner = ModelRunner(model, torch.device("cuda"), graphs=True)
    banned = {n: runner_loop(runner, n)[0] for n in (64, 512)}
    for n, ms in banned.items():
        print(f"tree, runner loop with {n} bans: {ms:.3f} ms ({floor_ms / ms:.1%} of floor)")
    greedy = {n: greedy_us(n) for n in (1, 16, 64, 128, 256)}
    print("greedy sample, us from a graph: rows, torch ops, kernel by block/warps")
    print(f"{'rows':<6}" + "".join(f"{way:>11}" for way in greedy[1]))
    for n, us in greedy.items():
        print(f"{n:<6}" + "".join(f"{t:>11.1f}" for t in us.values()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"device": torch.cuda.get_device_name(), "copy_bandwidth_bytes_s": bandwidth,
           "weight_bytes": weight_bytes, "floor_ms": floor_ms, "variants": rows,
           "banned_runner_ms": banned, "greedy_us": greedy}
    args.out.write_text(json.dumps(with_provenance(out, provenance("bench_one_row")), indent=1))


if __name__ == "__main__":
    main()
