"""What the token that starts another reading of the text costs (matcher.StreamMatcher).

An answer of N plain tokens, then one token holding the first invisible character: that
token's feed starts the other reading(s). Before: the reading was fed every earlier token
again (the replay, kept here as `Replaying`, the code as it was); after: built from the
first reading's checkpoints (`_derived`). Measured in the same run, each case `--repeat`
times on a fresh matcher (median and worst), beside a plain token's cost (median of the N
before it: after an early invisible, the readings that run then are in it; after the change
a third, unheard, runs from the first invisible on, so that the late second class costs no
replay).

Cases: a zero-width space (one other reading), a format character and a control in one
token (three readings), and a zero-width space at the start with a control N tokens later
(the late second class: one reading is a copy of "swapped", the other has run unheard since
the zero-width space). `Replaying` only starts readings the old way: its plain tokens run
today's code, the unheard reading included, so that column is not the old per-token cost
(measured without it, a plain token after an early invisible cost 0.038-0.054 ms; with it
0.061-0.075 ms, on this loaded 2-core box).

    .venv/bin/python bench/bench_readings.py [--tokens 250 1000 4000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from provenance import provenance, with_provenance

from finsieve.policy.matcher import StreamMatcher
from finsieve.policy.pack import Pack

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from support.readings import Replaying  # noqa: E402  (the old path: the tests' oracle)

WORDS = [b" We", b" offer", b" a", b" well", b"-known", b" fund", b" with", b" low", b" fees",
         b".", b" Returns", b" of", b" 4", b"%", b" are", b" possible", b",", b" not", b" certain"]




CASES = {
    "zwsp": ([], " guar\u200banteed".encode()),
    "format+control": ([], "gua\u200bran\x00teed".encode()),
    "zwsp early, control late": (["\u200b".encode()], b" guar\x00anteed"),
}


def one(cls: type[StreamMatcher], rules, tokens: int, case: str) -> tuple[float, float]:
    """(seconds of the token that starts the reading, median seconds of a plain token)."""
    early, late = CASES[case]
    m = cls(rules)
    for piece in early:
        m.feed(piece)
    plain = []
    for i in range(tokens):
        t = time.perf_counter()
        m.feed(WORDS[i % len(WORDS)])
        plain.append(time.perf_counter() - t)
    t = time.perf_counter()
    m.feed(late)
    spent = time.perf_counter() - t
    assert m._others, "the reading did not start"
    return spent, statistics.median(plain)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[250, 1000, 4000])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "readings.json")
    args = ap.parse_args()
    rules = Pack.load(REPO / "rules").output
    rows = []
    print(f"{'case':26} {'tokens':>6} {'before ms':>10} {'(worst)':>8} {'after ms':>9} "
          f"{'(worst)':>8} {'ratio':>7} {'plain token ms (replaying/built)':>33}")
    for case, tokens in itertools.product(CASES, args.tokens):
        before = [one(Replaying, rules, tokens, case) for _ in range(args.repeat)]
        after = [one(StreamMatcher, rules, tokens, case) for _ in range(args.repeat)]
        b = statistics.median(x for x, _ in before)
        a = statistics.median(x for x, _ in after)
        row = {"case": case, "tokens": tokens, "before_ms": b * 1e3,
               "before_worst_ms": max(x for x, _ in before) * 1e3, "after_ms": a * 1e3,
               "after_worst_ms": max(x for x, _ in after) * 1e3, "ratio": b / a,
               "plain_token_ms": statistics.median(p for _, p in after) * 1e3,
               "plain_token_before_ms": statistics.median(p for _, p in before) * 1e3}
        rows.append(row)
        print(f"{case:26} {tokens:>6} {row['before_ms']:>10.2f} {row['before_worst_ms']:>8.2f} "
              f"{row['after_ms']:>9.3f} {row['after_worst_ms']:>8.3f} {row['ratio']:>6.0f}x "
              f"{row['plain_token_before_ms']:>16.4f} {row['plain_token_ms']:>16.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"machine": platform.platform(), "repeat": args.repeat, "rows": rows}
    args.out.write_text(json.dumps(with_provenance(out, provenance("bench_readings")), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
