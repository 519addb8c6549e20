"""Enforcement benchmark: leak rates against transformers' bad_words_ids, and the cost of rules.

    .venv/bin/python bench/bench_enforcement.py [--max-tokens 64] [--rounds 2]

On the CPU with the default model, in-process (no gRPC, so only the engine's cost shows):
  * leak rate on the zero-leak prompts: no rules, transformers `generate` with
    `bad_words_ids` (each block literal's plain tokenizations), and finsieve's rules;
  * tokens/s with rules on vs off, 1 and 8 concurrent streams, rounds interleaved and the
    overhead taken as the median of per-round ratios;
  * the rules' own cost: wall time inside the guard per token and as a share of the run
    (end-to-end tok/s on a shared 2-core machine drifts by ~10% between minutes);
  * inter-token latency p50/p99 (one decode step), held-back characters, rollbacks per
    1,000 tokens on the zero-leak prompts.
Prints tables and writes bench/results/enforcement.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from provenance import provenance, with_provenance
from transformers import AutoModelForCausalLM

from engine.engine import NO_POLICY, CollectingSink, EngineLimits, LLMEngine
from engine.loader import load_model
from finsieve.app.client import chat_request
from finsieve.policy.guard import Guard, Policy, compile_policy
from finsieve.policy.masks import TokenTable
from finsieve.policy.matcher import scan_text

from prompts import LONG_ANSWERS

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from support.zero_leak import ZERO_LEAK  # noqa: E402  (the same prompts as the test suite)


class PolicyClock:
    """Wall time spent inside the guard (mask, lazy check, release): the rules' own cost."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("banned", "check", "finish", "release", "masked", "rollback", "halt"):
            setattr(Guard, name, self._timed(getattr(Guard, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def leaks(policy: Policy, text: str) -> bool:
    return any(m.rule.action in ("block", "halt", "redact") for m in scan_text(policy.pack.output, text))


def text_of(events) -> str:
    return "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")


def run_batch(engine: LLMEngine, prompts: list[str], max_tokens: int) -> dict:
    """Decode prompts together; per-step times, held-back characters, tokens, rollbacks."""
    sinks = [CollectingSink() for _ in prompts]
    seqs = []
    for i, (p, sink) in enumerate(zip(prompts, sinks, strict=True)):
        seq = engine.prepare(chat_request(f"b{i}", p, max_tokens=max_tokens), sink)
        engine.submit(seq)
        seqs.append(seq)
    steps, held = [], []
    policy_before = CLOCK.seconds
    start = time.perf_counter()
    while not all(s.finished for s in sinks):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        for seq in seqs:
            if seq.output_ids and not seq.done:
                held.append(len(seq.text.text) - len(
                    seq.guard.matcher.raw[: seq.guard.released].decode("utf-8", "replace")))
    wall = time.perf_counter() - start
    tokens = sum(s.events[-1].finished.usage.completion_tokens for s in sinks)
    rollbacks = sum(1 for s in sinks for e in s.events
                    if e.WhichOneof("event") == "policy_event" and e.policy_event.rolled_back)
    return {"wall_s": wall, "tokens": tokens, "steps": steps[1:], "held": held,
            "policy_s": CLOCK.seconds - policy_before,
            "rollbacks": rollbacks, "texts": [text_of(s.events) for s in sinks]}


def hf_bad_words(model, tokenizer, policy: Policy, prompts: list[str], max_tokens: int) -> list[str]:
    patterns = policy.pack.output.literal_patterns(("block",))
    bad = {tuple(tokenizer(v, add_special_tokens=False)["input_ids"])
           for p in patterns for v in (p, " " + p, p.capitalize(), " " + p.capitalize())}
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, bad_words_ids=[list(b) for b in bad])
        out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


CLOCK: PolicyClock


def main() -> None:
    global CLOCK
    CLOCK = PolicyClock()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "enforcement.json")
    args = ap.parse_args()

    cpu = torch.device("cpu")
    model = load_model(str(REPO / ".finsieve/models/SmolLM2-135M-Instruct"), REPO / ".finsieve", cpu)
    engine = LLMEngine(model, EngineLimits(8, 2048, 256), cpu)
    policy = compile_policy(REPO / "rules", TokenTable.build(engine.token_bytes), None)[0]
    result: dict = {"max_tokens": args.max_tokens, "machine": "cpu, 2 cores"}

    # Leak rates on the zero-leak prompts.
    prompts = list(ZERO_LEAK.values())
    engine.policy = lambda: NO_POLICY
    off = run_batch(engine, prompts, 40)
    engine.policy = lambda: policy
    on = run_batch(engine, prompts, 40)
    # transformers' own generate needs the float weights (on the CPU the engine runs the GGUF)
    hf_model = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    hf = hf_bad_words(hf_model, model.tokenizer, policy, prompts, 40)
    result["leaks"] = {
        "prompts": len(prompts),
        "no_rules": sum(leaks(policy, t) for t in off["texts"]),
        "hf_bad_words_ids": sum(leaks(policy, t) for t in hf),
        "finsieve": sum(leaks(policy, t) for t in on["texts"]),
        "rollbacks_per_1000_tokens": 1000 * on["rollbacks"] / max(on["tokens"], 1),
    }

    # Throughput and latency, rules off vs on, rounds interleaved.
    runs: dict[tuple[str, int], list[dict]] = {}
    run_batch(engine, LONG_ANSWERS[:1], 8)  # warm-up
    for _ in range(args.rounds):
        for n in (1, 8):
            for name, pol in (("off", NO_POLICY), ("on", policy)):
                engine.policy = lambda pol=pol: pol
                runs.setdefault((name, n), []).append(run_batch(engine, LONG_ANSWERS[:n], args.max_tokens))
    result["throughput"] = []
    for n in (1, 8):
        row = {"streams": n}
        for name in ("off", "on"):
            rs = runs[name, n]
            row[f"tokens_per_s_{name}"] = statistics.median(r["tokens"] / r["wall_s"] for r in rs)
            steps = [s for r in rs for s in r["steps"]]
            row[f"itl_p50_ms_{name}"] = 1000 * pct(steps, 0.5)
            row[f"itl_p99_ms_{name}"] = 1000 * pct(steps, 0.99)
        # Paired by round: the machine's speed drifts between minutes, not within a pair.
        row["overhead_pct"] = 100 * (statistics.median(
            (off["tokens"] / off["wall_s"]) / (on["tokens"] / on["wall_s"])
            for off, on in zip(runs["off", n], runs["on", n], strict=True)) - 1)
        on_runs = runs["on", n]
        row["policy_share_pct"] = 100 * sum(r["policy_s"] for r in on_runs) / sum(
            r["wall_s"] for r in on_runs)
        row["policy_us_per_token"] = 1e6 * sum(r["policy_s"] for r in on_runs) / sum(
            r["tokens"] for r in on_runs)
        held = [h for r in runs["on", n] for h in r["held"]]
        row["held_chars"] = {"p50": pct(held, 0.5), "p90": pct(held, 0.9), "p99": pct(held, 0.99),
                             "max": max(held, default=0)}
        result["throughput"].append(row)

    lk = result["leaks"]
    print(f"leaks on {lk['prompts']} zero-leak prompts (greedy, 40 tokens): no rules {lk['no_rules']}, "
          f"transformers bad_words_ids {lk['hf_bad_words_ids']}, finsieve {lk['finsieve']}; "
          f"rollbacks per 1,000 tokens {lk['rollbacks_per_1000_tokens']:.1f}")
    print(f"\n{'streams':>7} {'tok/s off':>10} {'tok/s on':>9} {'overhead':>9} {'rules work':>11} "
          f"{'µs/token':>9} {'ITL p50 off/on ms':>19} {'ITL p99 off/on ms':>19} "
          f"{'held chars p50/p90/p99/max':>27}")
    for r in result["throughput"]:
        h = r["held_chars"]
        print(f"{r['streams']:>7} {r['tokens_per_s_off']:>10.1f} {r['tokens_per_s_on']:>9.1f} "
              f"{r['overhead_pct']:>8.1f}% {r['policy_share_pct']:>10.2f}% "
              f"{r['policy_us_per_token']:>9.0f} {r['itl_p50_ms_off']:>9.1f}/{r['itl_p50_ms_on']:<9.1f}"
              f"{r['itl_p99_ms_off']:>9.1f}/{r['itl_p99_ms_on']:<9.1f}"
              f"{h['p50']:>8}/{h['p90']}/{h['p99']}/{h['max']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_provenance(result, provenance("bench_enforcement")), indent=2))


if __name__ == "__main__":
    main()
