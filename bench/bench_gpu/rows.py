"""A level's row: its requests' timings (in-process or through gRPC) summed up into tokens/s,
TTFT and inter-token percentiles, and the engine's own step and loop counters over it."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile, interpolated between the nearest two samples: the median of two
    requests (one stream's default) is their mean, where the nearest rank took the larger."""
    if not values:
        return None
    s = sorted(values)
    k = q * (len(s) - 1)
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


class TimingSink:
    """Collects one request's events with their arrival times."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.done = False
        self.error = ""
        self.finish = ""

    def deliver(self, step: Any) -> None:
        now = time.perf_counter()
        for e in step.events:
            kind = e.WhichOneof("event")
            if kind == "delta" and (e.delta.tokens or e.delta.text):
                self.times.append(now)
                self.tokens.append(e.delta.tokens)
            elif kind == "finished":
                self.done, self.finish = True, finish_name(e.finished.finish_reason)
            elif kind == "error":
                self.done, self.error = True, e.error.message


def finish_name(reason: int) -> str:
    from finsieve.v1 import chat_pb2

    return chat_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def summarize(reqs: list[dict], wall: float, steps: list[float] | None = None) -> dict:
    tokens = sum(r["tokens"] for r in reqs)
    ttft = [r["ttft"] for r in reqs if r["ttft"] is not None]
    gaps = [g for r in reqs for g in r["gaps"]]
    row = {"requests": len(reqs), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
           "ttft_p50_ms": 1000 * (pct(ttft, 0.5) or 0), "ttft_p99_ms": 1000 * (pct(ttft, 0.99) or 0),
           "itl_p50_ms": 1000 * (pct(gaps, 0.5) or 0), "itl_p99_ms": 1000 * (pct(gaps, 0.99) or 0),
           "errors": sum(1 for r in reqs if r["error"]),
           "error_examples": sorted({r["error"][:200] for r in reqs if r["error"]})[:3],
           # how the requests ended: a level whose answers end early (a refusal, a halt)
           # has fewer tokens, and a shorter wall, than its neighbours
           "finishes": dict(Counter(r.get("finish") or "none" for r in reqs))}
    if steps:
        row["step_p50_ms"] = 1000 * pct(steps, 0.5)
        row["step_p99_ms"] = 1000 * pct(steps, 0.99)
    return row


def no_row(error: str, **more: Any) -> dict:
    """A level's row when it measured nothing: the reason, and zeros where the figures go."""
    return {"error": error, "tokens_per_s": 0, "ttft_p50_ms": 0, "ttft_p99_ms": 0,
            "itl_p50_ms": 0, "itl_p99_ms": 0, **more}


def step_metrics(text: str) -> dict[str, float]:
    """The engine's own finsieve_decode_step_seconds (count, sum, and the cumulative buckets
    by their bound: "le=0.01"), finsieve_engine_loop_seconds by part ("loop:host") and the
    tokens generated, from a Prometheus exposition (a served engine's /metrics, or this
    process's registry for the in-process rows)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "finsieve_decode_step_seconds":
            for sample in family.samples:
                kind = sample.name.removeprefix(family.name + "_")
                out[f"le={sample.labels['le']}" if kind == "bucket" else kind] = sample.value
        elif family.name == "finsieve_engine_loop_seconds":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[f"loop:{sample.labels['part']}"] = sample.value
        elif family.name == "finsieve_generated_tokens":
            out["tokens"] = sum(x.value for x in family.samples if x.name.endswith("_total"))
    return out


def step_stats(before: dict[str, float], after: dict[str, float]) -> dict:
    """A level's engine steps (its own clock, launch to launch): how many, the mean, the
    share longer than 10 ms, the tokens the rules accepted per step, and the loop's
    milliseconds per step by part (device: waiting for the tokens; host: its own work;
    *_cpu: of those, on its thread's CPU clock)."""
    count = after.get("count", 0) - before.get("count", 0)
    if count <= 0:
        return {}
    under_10ms = after.get("le=0.01", 0) - before.get("le=0.01", 0)
    loop = {k.removeprefix("loop:"): round(1000 * (v - before.get(k, 0)) / count, 2)
            for k, v in after.items() if k.startswith("loop:")}
    return {"steps": int(count),
            "mean_ms": round(1000 * (after["sum"] - before.get("sum", 0)) / count, 2),
            "over_10ms": round(1 - under_10ms / count, 3),
            "tokens_per_step": round((after.get("tokens", 0) - before.get("tokens", 0)) / count, 1),
            "loop_ms_per_step": loop}
