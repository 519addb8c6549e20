"""Rules-engine benchmark: matcher cost per token, mask cost, table builds, compile, reload.

    .venv/bin/python bench/bench_rules.py [--tokens 4000] [--baseline main]

Realistic text is the clean corpus plus forbidden phrases, tokenized by the default
model's tokenizer. Two baselines run side by side: the naive way (after every token,
normalize the whole text so far and search it with every pattern), and the policy package
and default packs of another git revision (`--baseline`, loaded from git into a temporary
package) on the same tokens: the normalized view's cost before and after, and the engine's
host path per sampled token with rules on (exact-mask check, guard, release). Prints tables
and writes bench/results/rules.json.

The exact mask's bound (issue #42): with 50,000 block literals under one 4-character prefix,
the worst cost of a row's exact mask over adversarial states (text ending in the prefix, a
pending UTF-8 lead byte after it, look-alike spellings of it), bounded by
FINSIEVE_MASK_WORK_LIMIT and unbounded (the former path) in the same run; and, with
`--streams N` (0: skipped), the in-process engine on the CPU with the default model: the
inter-token p99 of N normal streams alone, with one adversarial stream steering into such
states, and with that stream under unbounded masks.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import disarm
import prometheus_client
from provenance import provenance, with_provenance
from transformers import AutoTokenizer

from engine.tokens import token_byte_table
from finsieve.policy import guard as our_guard
from finsieve.policy import masks as our_masks
from finsieve.policy import matcher as our_matcher
from finsieve.policy import normalize as our_normalize
from finsieve.policy import pack as our_pack
from finsieve.policy import scripts as our_scripts
from finsieve.policy.masks import MaskTables, TokenTable
from finsieve.policy.matcher import StreamMatcher
from finsieve.policy.normalize import normalize
from finsieve.policy.pack import Pack
from finsieve.policy.reload import PolicyHolder, RulesWatcher
from finsieve.policy.schema import Rule
from finsieve.v1 import chat_pb2

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".finsieve" / "models" / "SmolLM2-135M-Instruct"
VIOLATIONS = [
    "We offer guaranteed returns on this fund.", "年化收益率超过15%，稳赚不赔。",
    "Pay with 4111 1111 1111 1111 today.", "Expect returns of 20% a year.",
]


def stats_us(samples_ns: list[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    return {"median_us": statistics.median(s) / 1000, "p99_us": s[int(len(s) * 0.99) - 1] / 1000,
            "mean_us": statistics.fmean(s) / 1000}


def realistic_ids(tokenizer, n: int) -> list[int]:
    lines = [ln for ln in (REPO / "tests/data/clean_corpus.txt").read_text().splitlines()
             if ln and not ln.startswith("#")]
    rng = random.Random(0)
    out: list[int] = []
    while len(out) < n:
        text = " ".join(rng.choice(lines) for _ in range(10)) + " " + rng.choice(VIOLATIONS)
        out += tokenizer(text, add_special_tokens=False)["input_ids"]
    return out[:n]


def synthetic_pack(directory: Path, n_literals: int = 10_000, n_regexes: int = 100) -> None:
    rng = random.Random(1)
    words = sorted({w.strip(".,;:!?()").lower() for ln in (REPO / "tests/data/clean_corpus.txt")
                    .read_text().split() for w in [ln] if w.isascii() and w.isalpha() and len(w) > 2})
    literals = sorted({" ".join(rng.choice(words) for _ in range(rng.randint(2, 4)))
                       for _ in range(n_literals * 2)})[:n_literals]
    lines = ["rules:"]
    for i in range(0, len(literals), 100):
        lines += [f"  - id: lit-{i}", "    description: synthetic", "    kind: literal",
                  "    action: block", "    patterns:"]
        lines += [f"      - {json.dumps(p)}" for p in literals[i : i + 100]]
    for i in range(n_regexes):
        w = rng.choice(words)
        lines += [f"  - id: re-{i}", "    description: synthetic", "    kind: regex",
                  "    action: redact", "    replacement: '[X]'", "    max_span: 40",
                  "    patterns:", f"      - '\\b{w} (?:of |at )?\\d{{2,6}}(?:\\.\\d+)? ?(?:%|percent)'"]
    (directory / "synthetic.yaml").write_text("\n".join(lines) + "\n")


def per_token(pack: Pack | None, tokens: list[bytes], matcher_cls: type = StreamMatcher) -> list[int]:
    """Nanoseconds to feed each token to a matcher (or a bare normalizer, given pack None)."""
    m = matcher_cls(pack.output) if pack is not None else matcher_cls()
    out = []
    for t in tokens:
        start = time.perf_counter_ns()
        m.feed(t)
        out.append(time.perf_counter_ns() - start)
    return out


def naive_per_token(pack: Pack, tokens: list[bytes], limit: int) -> list[int]:
    """Baseline: after each token, normalize everything and run every pattern again."""
    literals = [p for r in pack.output.rules if r.kind == "literal" for p in r.patterns]
    regexes = [r.pattern for r in pack.output.regexes]
    raw = b""
    out = []
    for t in tokens[:limit]:
        start = time.perf_counter_ns()
        raw += t
        text = normalize(raw.decode("utf-8", "ignore"))
        _ = [p for p in literals if p in text] + [r for r in regexes if r.search(text)]
        out.append(time.perf_counter_ns() - start)
    return out


def load_revision(ref: str, into: Path) -> SimpleNamespace:
    """The policy package and default packs of a git revision, importable beside ours."""
    def git(*args: str) -> bytes:
        return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True).stdout

    package = into / "baseline_policy"
    for folder, target in (("finsieve/policy", package), ("rules", into / "rules")):
        target.mkdir(parents=True)
        for name in git("ls-tree", "--name-only", f"{ref}:{folder}").decode().split():
            (target / name).write_bytes(git("show", f"{ref}:{folder}/{name}"))
    sys.path.insert(0, str(into))
    names = ("guard", "masks", "matcher", "normalize", "pack")
    # The baseline's metrics have our metrics' names: they stay out of the registry.
    with mock.patch.object(prometheus_client.REGISTRY, "register", lambda collector: None):
        mods = {m: importlib.import_module(f"baseline_policy.{m}") for m in names}
    return SimpleNamespace(**mods, memos=[mods["normalize"]], rules=into / "rules")


def clear_memos(modules: list) -> None:
    """Forget per-character memos, so a table build starts cold as in a fresh process."""
    for module in modules:
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


def engine_path(mods: SimpleNamespace, pack, table, vocab: list[bytes], ids: list[int],
                answer: int = 256) -> list[int]:
    """Nanoseconds per sampled token on the engine's host path with rules on: the exact-mask
    check of a token sampled under the base bans (`is_banned`), the guard's check and the
    release of final text. A refused token, or every `answer` tokens, starts a new answer."""
    masks = mods.masks.MaskTables(table, pack.output.literal_patterns(("block",)))
    policy = mods.guard.Policy(pack, masks, pack.version)
    guard, out = mods.guard.Guard(policy, vocab), []
    # Since the check asks the exact mask itself, and only when the token completed a block
    # match; before, the engine asked the mask first.
    asks_mask = "exact_mask" in inspect.signature(mods.guard.Guard.check).parameters
    for t in ids:
        start = time.perf_counter_ns()
        if asks_mask:
            decision = guard.check(t, exact_mask=True)
            verdict = None if decision is None else decision.verdict
        else:
            banned = masks.is_banned(guard.matcher, t, vocab[t])
            verdict = None if banned else guard.check(t).verdict
        if verdict is mods.guard.Verdict.ACCEPT:
            guard.release()
        out.append(time.perf_counter_ns() - start)
        if verdict is not mods.guard.Verdict.ACCEPT or len(guard.tokens) >= answer:
            guard = mods.guard.Guard(policy, vocab)
    return out


def before_after(base: SimpleNamespace, synthetic: Path, vocab: list[bytes],
                 ids: list[int]) -> dict:
    """The same measurements with the baseline revision's code and with ours, alternating."""
    ours = SimpleNamespace(guard=our_guard, masks=our_masks, matcher=our_matcher,
                           normalize=our_normalize, pack=our_pack, memos=[our_normalize, our_scripts])
    tokens = [vocab[i] for i in ids]
    sides = {"before": (base, base.rules), "after": (ours, REPO / "rules")}
    out: dict = {}
    for side, (mods, rules_dir) in sides.items():
        packs = {"default packs": mods.pack.Pack.load(rules_dir),
                 "10k literals + 100 regexes": mods.pack.Pack.load(synthetic)}
        for p in packs.values():  # warm-up: per-character memos fill once per pack
            per_token(p, tokens[:1000], mods.matcher.StreamMatcher)
        per_token(None, tokens, mods.normalize.Normalizer)
        row = {"normalizer": stats_us(per_token(None, tokens, mods.normalize.Normalizer))}
        for name, p in packs.items():
            row[name] = stats_us(per_token(p, tokens, mods.matcher.StreamMatcher))
        clear_memos(mods.memos)
        table, row["token_table_build_49k_s"] = timed(lambda m=mods: m.masks.TokenTable.build(vocab))
        if hasattr(mods.masks.MaskTables, "is_banned"):
            for name, p in packs.items():
                engine_path(mods, p, table, vocab, ids[:1000])  # warm-up, as above
                row[f"engine path {name}"] = stats_us(engine_path(mods, p, table, vocab, ids))
        for name, p in packs.items():
            _, row[f"mask_build {name}_s"] = timed(lambda m=mods, p=p, t=table: m.masks.MaskTables(
                t, p.output.literal_patterns(("block",))))
        out[side] = row
    return out


def confusable_sources(tokens: list[bytes]) -> dict[str, dict[str, float]]:
    """The look-alike data sources on the same text: µs per character applied one character
    at a time (what keeps raw offsets exact), and per whole string (no offsets). disarm is
    the one finsieve uses; the others are measured when importable (not dependencies)."""
    text = b"".join(tokens).decode("utf-8", "replace")
    sources = {"disarm (UTS #39, used)": disarm.normalize_confusables}
    try:
        import decancer_py
        sources["decancer-py"] = lambda s: str(decancer_py.parse(s))
    except ImportError:
        pass
    try:
        from confusable_homoglyphs import confusables
        sources["confusable-homoglyphs (lookup only)"] = lambda s: confusables.is_confusable(s)
    except ImportError:
        pass
    out = {}
    for name, fn in sources.items():
        _, per_char = timed(lambda fn=fn: [fn(c) for c in text])
        _, whole = timed(lambda fn=fn: fn(text))
        out[name] = {"per_char_us": per_char / len(text) * 1e6,
                     "whole_text_us_per_char": whole / len(text) * 1e6}
    return out


def mask_costs(tables: MaskTables, pack: Pack, tokens: list[bytes]) -> dict[str, dict[str, float]]:
    warm, cold = [], []
    m = StreamMatcher(pack.output)
    for t in tokens:
        m.feed(t)
        start = time.perf_counter_ns()
        tables.ban_set_for(m)
        warm.append(time.perf_counter_ns() - start)
    m = StreamMatcher(pack.output)
    for t in tokens[:1000]:
        m.feed(t)
        tables._cache.clear()
        start = time.perf_counter_ns()
        tables.ban_set_for(m)
        cold.append(time.perf_counter_ns() - start)
    return {"warm": stats_us(warm), "cold": stats_us(cold)}


ADVERSARIAL_PREFIX = "bloc"
# Texts whose exact mask enumerates the literals under the prefix: the prefix and its
# beginnings, a pending UTF-8 lead byte after it (the enumeration ran once per group of
# tokens that share their leading continuation bytes), look-alike spellings (each one
# another state: another cache entry).
ADVERSARIAL_STATES: list[tuple[str, bytes]] = [
    *[(f"prefix {ADVERSARIAL_PREFIX[:k]!r}", b"We " + ADVERSARIAL_PREFIX[:k].encode()) for k in range(1, 5)],
    *[(f"pending {lead!r}", b"We bloc" + lead)
      for lead in (b"\xd0", b"\xe4", b"\xf0", b"\xe4\xb8", b"\xf0\x9f")],
    *[(f"look-alike {text!r}", b"We " + text.encode()) for text in (
        "bl\u043ec", "b\u04cfoc", "blo\u0441", "\uff42\uff4c\uff4f\uff43", "b\u200bloc",
        "BLOC", "bl\u043e\u0441")],
    ("look-alike + pending", "bl\u043ec".encode() + b"\xe4"),
]


def prefix_literals(n: int = 50_000, prefix: str = ADVERSARIAL_PREFIX,
                    vocab: list[bytes] | None = None) -> list[str]:
    """n literals under the prefix: the prefix and each lowercase word-piece of the vocabulary,
    joined or after a space (so that after the prefix most words complete one, as a block
    list of names would), then random tails."""
    rng = random.Random(5)
    out: set[str] = set()
    for t in vocab or []:
        piece = t.decode("ascii", "ignore")
        if piece.isalpha() and piece.islower() and len(out) < n * 2 // 3:
            out.update((prefix + piece, f"{prefix} {piece}"))
    while len(out) < n:
        out.add(prefix + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)))
    return sorted(out)


def prefix_rules(literals: list[str]) -> str:
    lines = ["rules:", "  - id: listed-names", "    description: a long block list under one prefix",
             "    kind: literal", "    action: block", "    patterns:"]
    return "\n".join(lines + [f"      - {p}" for p in literals]) + "\n"


def mask_bound(table: TokenTable, vocab: list[bytes], repeats: int = 7) -> dict:
    """Each adversarial state's exact-mask cost, cold (the ban-set cache and the join memo
    emptied), bounded (FINSIEVE_MASK_WORK_LIMIT's default) and unbounded (work limit 0: the
    enumeration as it was), median of `repeats`; plus the one-token exact check (is_banned)
    that the bounded path adds per sampled token."""
    literals = prefix_literals(vocab=vocab)
    pack = Pack([Rule("listed", "d", "literal", tuple(literals), "output", "block", "", (), 20,
                      "high", (), "", "bench")])
    bounded = MaskTables(table, literals)
    unbounded = MaskTables(table, literals, bounded.always_banned, work_limit=0)
    single = {t: i for i, t in enumerate(vocab) if len(t) == 1}
    rows = []
    for label, text in ADVERSARIAL_STATES:
        m = StreamMatcher(pack.output)
        m.feed(text)
        row: dict = {"state": label, "live_depth": m.depth, "pending": len(m.norm.pending)}
        for name, tables in (("bounded", bounded), ("unbounded", unbounded)):
            samples = []
            for _ in range(repeats):
                tables._cache.clear()
                tables._pieces.clear()
                work = tables.bounded_work
                start = time.perf_counter_ns()
                got = tables.bounded_ban_set_for(m)
                samples.append(time.perf_counter_ns() - start)
            row[f"{name}_units"] = tables.bounded_work - work  # machine-independent
            row[f"{name}_ms"] = statistics.median(samples) / 1e6
            row[f"{name}_max_ms"] = max(samples) / 1e6
            row[f"{name}_exact"] = got is not None
        checks = []
        for t in [single[b"k"], single[b"a"], *range(300, 332)]:
            start = time.perf_counter_ns()
            bounded.is_banned(m, t, vocab[t])
            checks.append(time.perf_counter_ns() - start)
        row["is_banned_us"] = statistics.median(checks) / 1000
        rows.append(row)
    return {"literals": len(literals), "prefix": ADVERSARIAL_PREFIX, "work_limit": bounded.work_limit,
            "repeats": repeats, "states": rows,
            "worst_bounded_ms": max(r["bounded_ms"] for r in rows),
            "worst_bounded_sample_ms": max(r["bounded_max_ms"] for r in rows),
            "worst_unbounded_ms": max(r["unbounded_ms"] for r in rows)}


NORMAL_PROMPTS = ["What is an index fund?", "Explain what a bond is.", "How does compound interest work?",
                  "What is a savings account?", "What does diversification mean?", "What is an ETF?"]
# Look-alike spellings of listed words for the model to copy: a listed word is refused
# after the prefix, so that position is decoded again under its exact mask; each spelling
# is another mask state (another cache entry). The stream asks again when it ends.
ADVERSARY_PROMPTS = [f"Repeat this word ten times: {w} {w} {w} {w}" for w in (
    f"{b}{el}{o}{c}" for c in "cсϲ" for o in "oоο" for el in "lӏІ" for b in "bBЬ")]


class TimedSink:
    """A stream's events, and when the engine handed over each of its deltas."""

    def __init__(self) -> None:
        self.events: list = []
        self.delta_at: list[float] = []

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].WhichOneof("event") in ("finished", "error")

    def deliver(self, step) -> None:
        now = time.perf_counter()
        for e in step.events:
            if e.WhichOneof("event") == "delta":
                self.delta_at.append(now)
        self.events.extend(step.events)


def p99_ms(gaps: list[float]) -> float:
    s = sorted(gaps)
    return s[max(int(len(s) * 0.99) - 1, 0)] * 1000 if s else 0.0


def run_streams(engine, policy, n_streams: int, adversary: bool, max_tokens: int) -> dict:
    """N normal greedy streams (and the adversarial one) to the end, in one batch; the normal
    streams' gaps between deltas."""
    from finsieve.app.client import chat_request

    engine.policy = lambda: policy
    sinks = []
    prompts = [NORMAL_PROMPTS[i % len(NORMAL_PROMPTS)] for i in range(n_streams)]
    for i, prompt in enumerate(prompts):
        sinks.append(TimedSink())
        engine.submit(engine.prepare(chat_request(f"s{i}", prompt, max_tokens=max_tokens), sinks[-1]))
    attacks: list[TimedSink] = []

    def attack() -> None:  # one more adversarial request, as soon as the last one ended
        attacks.append(TimedSink())
        prompt = ADVERSARY_PROMPTS[len(attacks) % len(ADVERSARY_PROMPTS)]
        engine.submit(engine.prepare(chat_request(f"a{len(attacks)}", prompt, max_tokens=8),
                                     attacks[-1]))

    if adversary:
        attack()
    masks = policy.masks
    before = (masks.over_limit, masks.bounded_work)
    start = time.perf_counter()
    while not all(s.finished for s in sinks) and time.perf_counter() - start < 1200:
        engine.step()
        if adversary and attacks[-1].finished:
            attack()
    while attacks and not attacks[-1].finished:
        engine.step()
    gaps = [b - a for s in sinks for a, b in itertools.pairwise(s.delta_at)]
    out = {"normal_gaps": len(gaps), "normal_p50_ms": statistics.median(gaps) * 1000,
           "normal_p99_ms": p99_ms(gaps), "normal_max_ms": max(gaps) * 1000,
           "wall_s": time.perf_counter() - start,
           "masks_over_limit": masks.over_limit - before[0],
           "mask_work_units": masks.bounded_work - before[1]}
    if adversary:
        events = [e for a in attacks for e in a.events]
        out["adversary_requests"] = len(attacks)
        out["adversary_text"] = "".join(e.delta.text for e in attacks[0].events
                                        if e.WhichOneof("event") == "delta")
        out["adversary_interventions"] = sum(e.WhichOneof("event") == "policy_event" for e in events)
        out["adversary_halted"] = sum(e.WhichOneof("event") == "finished" and e.finished.finish_reason
                                      == chat_pb2.FINISH_REASON_CONTENT_FILTER for e in events)
    return out


def engine_streams(n_streams: int, max_tokens: int, table: TokenTable) -> dict:
    """The in-process engine on the CPU, default model, default packs plus 50,000 block
    literals under one prefix: the normal streams' inter-token p99 alone (baseline), with
    an adversarial stream under bounded exact masks, and with it under unbounded ones (the
    former path). Each run gets fresh mask tables (a cold ban-set cache)."""
    import torch

    from engine.engine import EngineLimits, LLMEngine
    from engine.loader import load_model
    from finsieve.policy.guard import Policy, compile_policy

    device = torch.device("cpu")
    engine = LLMEngine(load_model(str(MODEL), REPO / ".finsieve", device),
                       EngineLimits(max_batch=8, max_context=2048, default_max_tokens=max_tokens,
                                    prepare_workers=0), device)
    with tempfile.TemporaryDirectory() as tmp:
        rules = Path(tmp)
        for f in (REPO / "rules").glob("*.yaml"):
            (rules / f.name).write_text(f.read_text())
        (rules / "listed.yaml").write_text(prefix_rules(prefix_literals(vocab=engine.token_bytes)))
        base = compile_policy(rules, table, None)[0]
    assert base.masks is not None
    patterns = base.pack.output.literal_patterns(("block",))

    def policy(work_limit: int) -> Policy:
        return Policy(base.pack, MaskTables(table, patterns, base.masks.always_banned,
                                            work_limit=work_limit), base.version)

    run_streams(engine, policy(base.masks.work_limit), 1, False, 8)  # warm-up
    out = {"streams": n_streams, "max_tokens": max_tokens, "work_limit": base.masks.work_limit,
           "literals": len(patterns), "adversary_prompts": ADVERSARY_PROMPTS}
    out["baseline"] = run_streams(engine, policy(base.masks.work_limit), n_streams, False, max_tokens)
    out["adversary_bounded"] = run_streams(engine, policy(base.masks.work_limit), n_streams, True,
                                           max_tokens)
    out["adversary_unbounded"] = run_streams(engine, policy(0), n_streams, True, max_tokens)
    engine.stop()
    p99 = out["baseline"]["normal_p99_ms"]
    out["p99_ratio_bounded"] = out["adversary_bounded"]["normal_p99_ms"] / p99
    out["p99_ratio_unbounded"] = out["adversary_unbounded"]["normal_p99_ms"] / p99
    return out


def mask_bound_phase(table: TokenTable, vocab: list[bytes], args: argparse.Namespace) -> dict:
    """The exact mask's bound: its worst cost over adversarial states, and the engine phase;
    printed, and returned for the JSON file (exact_mask_bound, adversarial_streams)."""
    out: dict = {"exact_mask_bound": mask_bound(table, vocab)}
    b = out["exact_mask_bound"]
    print(f"\nexact mask, {b['literals']:,} block literals under {b['prefix']!r}, cold, median of "
          f"{b['repeats']} (FINSIEVE_MASK_WORK_LIMIT {b['work_limit']})")
    print(f"{'state':28} {'depth':>5} {'bounded ms':>10} {'units':>6} {'exact?':>6} "
          f"{'unbounded ms':>12} {'units':>7} {'unb/bnd':>8} {'is_banned us':>12}")
    for r in b["states"]:
        print(f"{r['state']:28} {r['live_depth']:5} {r['bounded_ms']:10.3f} {r['bounded_units']:6} "
              f"{'yes' if r['bounded_exact'] else 'no':>6} {r['unbounded_ms']:12.2f} "
              f"{r['unbounded_units']:7} {r['unbounded_ms'] / r['bounded_ms']:7.0f}x "
              f"{r['is_banned_us']:12.1f}")
    print(f"worst: bounded {b['worst_bounded_ms']:.3f} ms (slowest single sample "
          f"{b['worst_bounded_sample_ms']:.3f} ms), unbounded {b['worst_unbounded_ms']:.1f} ms")
    if args.streams:
        e = out["adversarial_streams"] = engine_streams(args.streams, args.stream_tokens, table)
        print(f"\nengine on the CPU, {e['streams']} normal streams x {e['max_tokens']} tokens, "
              f"{e['literals']:,} block literals; normal streams' gaps between deltas")
        print(f"{'run':22} {'gaps':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99 / base':>10} "
              f"{'over limit':>10} {'mask units':>10}")
        for name in ("baseline", "adversary_bounded", "adversary_unbounded"):
            r = e[name]
            print(f"{name:22} {r['normal_gaps']:5} {r['normal_p50_ms']:8.1f} {r['normal_p99_ms']:8.1f} "
                  f"{r['normal_max_ms']:8.1f} {r['normal_p99_ms'] / e['baseline']['normal_p99_ms']:9.2f}x "
                  f"{r['masks_over_limit']:10} {r['mask_work_units']:10}")
    return out


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def reload_latency(vocab_table: TokenTable, trials: int = 5) -> list[float]:
    """Seconds from a rule file written to the new version in force (compile + mask tables)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "a.yaml").write_text((REPO / "rules/promissory.yaml").read_text())

        def compile_(directory: Path):
            pack = Pack.load(directory)
            tables = MaskTables(vocab_table, pack.output.literal_patterns(("block",)))
            return (pack, tables), pack.version

        policy, version = compile_(d)
        holder = PolicyHolder(policy, version)
        watcher = RulesWatcher(d, holder, compile_)
        watcher.start()
        time.sleep(0.5)
        out = []
        for i in range(trials):
            before = holder.version
            start = time.perf_counter()
            (d / "b.yaml").write_text(f"rules:\n  - id: extra\n    description: d\n    kind: literal\n"
                                      f"    action: block\n    patterns: [phrase number {i}]\n")
            while holder.version == before and time.perf_counter() - start < 10:
                time.sleep(0.002)
            out.append(time.perf_counter() - start)
            time.sleep(0.3)
        watcher.stop()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--baseline", default="main", help="git revision to compare with (before/after)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rules.json")
    ap.add_argument("--streams", type=int, default=3,
                    help="normal streams beside the adversarial one in the engine phase (0: skip it)")
    ap.add_argument("--stream-tokens", type=int, default=48, help="tokens per normal stream")
    ap.add_argument("--only-mask-bound", action="store_true",
                    help="only the exact mask's bound: its worst cost, and the engine phase")
    args = ap.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    vocab = token_byte_table(tokenizer.get_vocab(), special)
    ids = realistic_ids(tokenizer, args.tokens)
    tokens = [vocab[i] for i in ids]
    default = Pack.load(REPO / "rules")
    result: dict = {"tokens": len(tokens)}
    if args.only_mask_bound:
        previous = json.loads(args.out.read_text()) if args.out.exists() else {}
        result = {**previous, **mask_bound_phase(TokenTable.build(vocab), vocab, args)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(with_provenance(result, provenance("bench_rules")), indent=2))
        return

    with tempfile.TemporaryDirectory() as tmp:
        synthetic_pack(Path(tmp))
        big, compile_s = timed(lambda: Pack.load(Path(tmp)))
        result["before_after"] = before_after(load_revision(args.baseline, Path(tmp) / "base"),
                                              Path(tmp), vocab, ids)
        result["before_after"]["baseline"] = args.baseline
    result["synthetic_pack"] = {"literals": sum(len(r.patterns) for r in big.rules if r.kind == "literal"),
                                "regexes": len(big.output.regexes), "compile_s": compile_s}

    rows = []
    for name, p in (("default packs", default), ("10k literals + 100 regexes", big)):
        per_token(p, tokens[:1000])  # warm-up: per-character memos fill once per pack
        ours = stats_us(per_token(p, tokens))
        naive = stats_us(naive_per_token(p, tokens, 600 if p is big else 2000))
        rows.append({"pack": name, "ours": ours, "naive_rescan": naive,
                     "speedup_median": naive["median_us"] / ours["median_us"]})
    result["matcher"] = rows

    table49, build49 = timed(lambda: TokenTable.build(vocab))
    rng = random.Random(2)
    big_vocab = vocab + [vocab[rng.randrange(len(vocab))] + vocab[rng.randrange(len(vocab))]
                         for _ in range(152_064 - len(vocab))]
    _, build152 = timed(lambda: TokenTable.build(big_vocab))
    with tempfile.TemporaryDirectory() as luts:
        _, cached49 = timed(lambda: TokenTable.load_or_build(vocab, Path(luts)))
        _, cached49 = timed(lambda: TokenTable.load_or_build(vocab, Path(luts)))
    masks_default, mask_build_default = timed(
        lambda: MaskTables(table49, default.output.literal_patterns(("block",))))
    masks_big, mask_build_big = timed(
        lambda: MaskTables(table49, big.output.literal_patterns(("block",))))
    result["tables"] = {
        "token_table_build_49k_s": build49, "token_table_build_152k_s": build152,
        "token_table_load_cached_49k_s": cached49,
        "mask_build_default_s": mask_build_default, "mask_build_10k_literals_s": mask_build_big,
        "compile_plus_mask_10k_literals_s": compile_s + mask_build_big,
    }
    result["mask"] = {"default packs": mask_costs(masks_default, default, tokens),
                      "10k literals": mask_costs(masks_big, big, tokens)}
    result["reload_to_enforcement_s"] = reload_latency(table49)
    result.update(mask_bound_phase(table49, vocab, args))
    result["confusable_sources"] = confusable_sources(tokens)

    ba = result["before_after"]
    print(f"before ({args.baseline}) / after (this tree), same tokens, same run: µs/token")
    print(f"{'':30} {'before mean':>11} {'after mean':>11} {'before med':>11} {'after med':>10} "
          f"{'after/before':>12}")
    for key in ("normalizer", "default packs", "10k literals + 100 regexes",
                "engine path default packs", "engine path 10k literals + 100 regexes"):
        if key in ba["before"]:  # an older baseline has no one-token mask check
            b, a = ba["before"][key], ba["after"][key]
            print(f"{key:30} {b['mean_us']:11.1f} {a['mean_us']:11.1f} {b['median_us']:11.1f} "
                  f"{a['median_us']:10.1f} {a['mean_us'] / b['mean_us']:11.2f}x")
    for key in ("default packs", "10k literals + 100 regexes"):
        share = ba["after"]["normalizer"]["mean_us"] / ba["after"][key]["mean_us"]
        ba["after"][f"normalizer_share {key}"] = share
        print(f"normalization's share of the matcher's time ({key}): {share:.0%}")
    for key in ("token_table_build_49k_s", "mask_build default packs_s",
                "mask_build 10k literals + 100 regexes_s"):
        b, a = ba["before"][key], ba["after"][key]
        print(f"{key.removesuffix('_s'):40} before {b:6.2f} s   after {a:6.2f} s   ({a / b:.2f}x)")
    print()
    print(f"{'matcher µs/token':30} {'median':>8} {'p99':>8} {'naive median':>13} "
          f"{'naive p99':>10} {'speedup':>8}")
    for r in rows:
        print(f"{r['pack']:30} {r['ours']['median_us']:8.1f} {r['ours']['p99_us']:8.1f} "
              f"{r['naive_rescan']['median_us']:13.1f} {r['naive_rescan']['p99_us']:10.1f} "
              f"{r['speedup_median']:7.1f}x")
    print(f"\n{'exact mask µs/token':30} {'warm med':>8} {'warm p99':>8} {'cold med':>9} {'cold p99':>9}")
    for name, m in result["mask"].items():
        print(f"{name:30} {m['warm']['median_us']:8.1f} {m['warm']['p99_us']:8.1f} "
              f"{m['cold']['median_us']:9.1f} {m['cold']['p99_us']:9.1f}")
    t = result["tables"]
    print(f"\ntoken table build: 49k vocab {t['token_table_build_49k_s']:.2f} s, "
          f"152k vocab {t['token_table_build_152k_s']:.2f} s, "
          f"49k from luts/ {t['token_table_load_cached_49k_s']:.2f} s")
    print(f"compile 10k literals + 100 regexes {compile_s:.2f} s + mask tables {mask_build_big:.2f} s "
          f"= {t['compile_plus_mask_10k_literals_s']:.2f} s")
    lat = result["reload_to_enforcement_s"]
    print(f"reload to enforcement: median {statistics.median(lat):.3f} s, max {max(lat):.3f} s "
          f"({len(lat)} trials)")
    print(f"\n{'look-alike data source':40} {'µs/char, one at a time':>23} {'µs/char, whole text':>20}")
    for name, c in result["confusable_sources"].items():
        print(f"{name:40} {c['per_char_us']:23.2f} {c['whole_text_us_per_char']:20.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_provenance(result, provenance("bench_rules")), indent=2))


if __name__ == "__main__":
    main()
