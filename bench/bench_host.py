"""The engine loop's host work per token, without a device.

    .venv/bin/python bench/bench_host.py [--streams 128] [--steps 300] [--baseline REV]

On a GPU at 64 streams and more, the decode loop's own work (scheduling, the rules, the
release of final text, the events) is what sets the pace with rules on (bench_gpu's
`loop_ms_per_step`). This measures that work alone: the engine with a runner that answers
each step at once with uniformly random tokens (as bench_gpu's random model samples),
`--streams` closed-loop streams of 256-token answers, for three policies: none, an empty
pack (the guard runs, nothing matches), and the default packs plus 10,000 synthetic
literals (bench_gpu's "rules on"). Each is timed `--repeats` times, on new tokens each
time; the best counts (the machine's other work only adds). Request preparation is not
counted. `--baseline REV` runs the same measurement on another revision (a git worktree) in
the same run, the two trees in turn `--rounds` times. Prints a table and writes JSON.

`--device-ms MS`: each step's tokens are ready MS milliseconds after the previous step's
(a device queue; the wait spins, as a CUDA event's does), so the loop's work overlaps a
device step as on a GPU: the figure is then the wall time per token, and on / none the
throughput the rules cost. Uniformly random tokens are the rules' worst case (their memos
of a token's text rarely hit), as the GPU benchmark's random model is; `--text`: each
stream's tokens are the clean corpus's (tests/data/clean_corpus.txt) from an offset of its
own, text whose words recur (a token rejected by the bans is replaced by a random one).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from provenance import provenance, with_provenance

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / ".finsieve/models/SmolLM2-135M-Instruct"
CORPUS = REPO / "tests/data/clean_corpus.txt"
POLICIES = ("none", "empty pack", "rules on")


def measure(args) -> dict[str, float]:
    """Microseconds of host work per accepted token, per policy (the best of the repeats)."""
    import torch
    from bench_gpu.workload import prompts, rules_dir, save_model

    from engine.engine import NO_POLICY, CollectingSink, EngineLimits, LLMEngine
    from engine.loader import load_model
    from engine.model_runner import Launch
    from finsieve.app.client import chat_request
    from finsieve.app.serve import settle_heap
    from finsieve.policy.guard import compile_policy
    from finsieve.policy.masks import TokenTable

    work = Path(args.work)
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        save_model(model_dir, TOKENIZER, tiny=True)
    cpu = torch.device("cpu")
    engine = LLMEngine(load_model(str(model_dir), work, cpu),
                       EngineLimits(max_batch=args.streams, max_context=1024, default_max_tokens=256,
                                    max_waiting=1024, prepare_workers=0), cpu)
    rng = random.Random(0)
    vocab = len(engine.token_bytes)
    # --text: each stream's tokens are the clean corpus's, from an offset of its own.
    corpus = engine.tokenizer(CORPUS.read_text(), add_special_tokens=False)["input_ids"] \
        if args.text else []

    device_s, last_due = args.device_ms / 1000, 0.0

    @dataclass
    class Queued(Launch):
        """Its tokens are ready at `due` (perf_counter), waited for by spinning."""

        due: float = 0.0

        def tokens(self) -> list[tuple[int, int]]:
            while time.perf_counter() < self.due:
                pass
            return super().tokens()

    def launch(rows) -> Launch:
        nonlocal last_due
        order = [i for i, r in enumerate(rows) if r.sample]
        tokens = []
        for i in order:
            row = rows[i]
            banned = set(row.bans)
            token = (corpus[(7919 * row.slot + row.start + len(row.tokens)) % len(corpus)]
                     if corpus else rng.randrange(vocab))
            while token in banned:
                token = rng.randrange(vocab)
            tokens.append(token)
        if not device_s:
            return Launch(order, torch.tensor([tokens, tokens]))
        last_due = max(time.perf_counter(), last_due) + device_s  # after the step before
        return Queued(order, torch.tensor([tokens, tokens]), due=last_due)

    engine.runner.launch = launch
    table = TokenTable.build(engine.token_bytes)
    empty = work / "empty"
    empty.mkdir(exist_ok=True)
    policies = {"none": NO_POLICY, "empty pack": compile_policy(empty, table, None)[0],
                "rules on": compile_policy(rules_dir(work, str(TOKENIZER)), table, None)[0]}
    texts = prompts(str(TOKENIZER), 128, True)
    settle_heap()  # as a serving engine does

    def run(policy, seed: int) -> float:
        engine.policy = lambda: policy
        rng.seed(seed)  # new tokens each repeat: the same ones again would hit the memos
        live: dict[int, CollectingSink] = {}
        prepared = 0.0

        def submit(stream: int, n: int) -> None:
            nonlocal prepared
            live[stream] = CollectingSink()
            t = time.perf_counter()
            seq = engine.prepare(chat_request(f"r{n}", texts[n % len(texts)], max_tokens=256),
                                 live[stream])
            prepared += time.perf_counter() - t
            engine.submit(seq)

        for s in range(args.streams):
            submit(s, s)
        for _ in range(20):  # prefill
            engine.step()
        submitted, accepted = args.streams, engine._counts[1]
        start, prepared = time.perf_counter(), 0.0
        for _ in range(args.steps):
            engine.step()
            for s, sink in list(live.items()):
                if sink.finished:
                    submit(s, submitted)
                    submitted += 1
        tokens = engine._counts[1] - accepted
        return 1e6 * (time.perf_counter() - start - prepared) / tokens

    return {name: min(run(policy, seed) for seed in range(args.repeats))
            for name, policy in policies.items()}


def baseline_tree(rev: str, into: Path) -> Path:
    """A worktree of `rev` importable as `finsieve` (engine and gateway linked in as the
    editable install maps them, the protos generated)."""
    tree = into / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev],
                   check=True, capture_output=True)
    for part in ("engine", "gateway"):
        (tree / "finsieve" / part).symlink_to(tree / part)
    protos = sorted(str(p.relative_to(tree)) for p in (tree / "proto/finsieve/v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iproto", "--python_out=.",
                    "--grpc_python_out=.", *protos], cwd=tree, check=True)
    return tree


def alternating(trees: dict[str, Path], args) -> dict[str, dict[str, float]]:
    """Each tree measured once a round, in turn, `--rounds` times; the best of each. On a
    machine whose speed drifts during a run (a shared cloud CPU: the same tree measured
    minutes apart differed by a third here), the trees then see the same drift."""
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            row = measure_in(tree, args)
            best[name] = {p: min(v, best.get(name, row)[p]) for p, v in row.items()}
    return best


def measure_in(tree: Path, args) -> dict[str, float]:
    """This script's measurement with `tree`'s finsieve imported first."""
    cmd = [sys.executable, __file__, "--measure", "--streams", str(args.streams), "--steps",
           str(args.steps), "--repeats", str(args.repeats), "--work", args.work,
           "--device-ms", str(args.device_ms), *(["--text"] if args.text else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": f"{tree}:{REPO}"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="a step's device time: the loop overlaps it (0: tokens at once)")
    ap.add_argument("--text", action="store_true",
                    help="tokens from the clean corpus instead of uniformly random ones")
    ap.add_argument("--baseline", help="git revision to measure beside this tree")
    ap.add_argument("--rounds", type=int, default=3,
                    help="with --baseline: the trees measured in turn this many times")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "finsieve-bench-host"))
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/host.json")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.measure:
        print(json.dumps(measure(args)))
        return
    if not args.baseline:
        results = {"this tree": measure(args)}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tree = baseline_tree(args.baseline, Path(tmp))
            try:
                results = alternating({"this tree": REPO, args.baseline: tree}, args)
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    rounds = f" x {args.rounds} rounds" if args.baseline else ""
    what = (f"wall us per token with a {args.device_ms:g} ms device step" if args.device_ms
            else "engine host work, us per token") + (", the corpus's tokens" if args.text else "")
    print(f"\n{what}, {args.streams} streams (best of {args.repeats}{rounds})")
    print(f"{'':12}" + "".join(f"{p:>12}" for p in POLICIES) + f"{'on / none':>12}")
    for name, row in results.items():
        print(f"{name:12}" + "".join(f"{row[p]:12.1f}" for p in POLICIES)
              + f"{row['rules on'] / row['none']:11.2f}x")
    if args.baseline:
        base, ours = results[args.baseline], results["this tree"]
        print(f"{'ratio':12}" + "".join(f"{ours[p] / base[p]:11.2f}x" for p in POLICIES))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"streams": args.streams, "steps": args.steps, "device_ms": args.device_ms,
           "text": args.text, "repeats": args.repeats,
           "rounds": args.rounds if args.baseline else 1, "results": results}
    args.out.write_text(json.dumps(with_provenance(out, provenance("bench_host")), indent=1))


if __name__ == "__main__":
    main()
