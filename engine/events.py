"""The engine's output: the only place where protobuf messages and metrics are built.

The decode loop deals in token ids and Sequences; each step it collects, per sink (gateway
stream), the events these functions build, and hands each sink all of them in one EngineStep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from prometheus_client import Counter, Gauge, Histogram

from finsieve.errors import RequestError
from finsieve.policy.guard import Intervention
from finsieve.v1 import chat_pb2, engine_pb2

from .sequence import Finish, Sequence, Sink

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

Event = chat_pb2.ChatServerMessage
# Why an answer ended, as the wire says it (Finish's values are FinishReason's).
FINISH_REASONS: dict[Finish, chat_pb2.FinishReason] = {
    Finish.NONE: chat_pb2.FINISH_REASON_UNSPECIFIED,
    Finish.STOP: chat_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: chat_pb2.FINISH_REASON_LENGTH,
    Finish.CONTENT_FILTER: chat_pb2.FINISH_REASON_CONTENT_FILTER,
    Finish.CANCELLED: chat_pb2.FINISH_REASON_CANCELLED,
}

STEP_SECONDS = Histogram("finsieve_decode_step_seconds",
                         "One decode step for the whole batch (the inter-token latency)",
                         buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2))
STEP_ROWS = Histogram("finsieve_engine_step_rows",
                      "Rows a step feeds the model: decode rows plus prompt tokens (in a mixed step "
                      "or a decode step, its matmuls' M before its graph's padding)",
                      buckets=(1, 16, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 384, 512,
                               1024, 2048))
TOKENS = Counter("finsieve_generated_tokens", "Tokens generated (accepted by the rules)")
ROLLBACKS = Counter("finsieve_rollbacks", "Sequences rolled back (SAR)")
LATE_REPAIRS = Counter(
    "finsieve_late_repairs",
    "Steps of a sequence thrown away because the token they followed was refused a step late "
    "(optimistic decoding: the rules check step N while the device computes step N+1)")
INTERVENTIONS = Counter("finsieve_interventions", "Policy interventions", ["rule_id", "action"])
LOOP_SECONDS = Counter(
    "finsieve_engine_loop_seconds",
    "Where the engine loop's time goes: device (waiting for a step's tokens), host (its own "
    "work), idle (nothing to do); device_cpu and host_cpu: the loop thread's CPU clock in the "
    "first two (a wait for the device spins), the rest of them spent waiting for the GIL or a "
    "core. On the CPU the forward runs in the loop's own work (host), not in device. Of host: "
    "launch (the next step's rows, their bans, handing them to the device; on the CPU the "
    "forward too) and tokens (acting on a step's tokens: the rules, the events)", ["part"])
WAITING = Gauge("finsieve_engine_waiting", "Requests waiting for a KV slot")
RUNNING = Gauge("finsieve_engine_running", "Requests holding a KV slot")


class Outbox:
    """One step's events, per sink, in order, in the EngineStep each sink is handed. A delta
    (one per stream and step) is built in place there: a message built apart is copied into
    its step, which cost the loop ~1.3 us a delta (~0.16 ms a step at 128 streams)."""

    def __init__(self) -> None:
        self.by_sink: dict[Sink, engine_pb2.EngineStep] = {}

    def _events(self, seq: Sequence) -> RepeatedCompositeFieldContainer[Event]:
        step = self.by_sink.get(seq.sink)
        if step is None:
            step = self.by_sink[seq.sink] = engine_pb2.EngineStep()
        return step.events

    def add(self, seq: Sequence, event: Event) -> None:
        self._events(seq).append(event)

    def delta(self, seq: Sequence, text: str, tokens: int) -> None:
        delta = self._events(seq).add(request_id=seq.request_id).delta
        delta.text, delta.tokens = text, tokens

    def __bool__(self) -> bool:
        return bool(self.by_sink)

    def deliver(self) -> None:
        for sink, step in self.by_sink.items():
            sink.deliver(step)


def started(seq: Sequence, model: str) -> Event:
    return Event(request_id=seq.request_id,
                 started=chat_pb2.Started(model=model, policy_version=seq.policy_version))


def policy(seq: Sequence, i: Intervention, scope: str = "output") -> Event:
    INTERVENTIONS.labels(i.rule_id, i.action).inc()
    return Event(
        request_id=seq.request_id,
        policy_event=chat_pb2.PolicyEvent(
            rule_id=i.rule_id, action=i.action, start=i.start, end=i.end,
            rolled_back=i.rolled_back, tokens_recomputed=i.tokens_recomputed,
            message=i.message, scope=scope, suppressed=i.suppressed,
        ),
    )


def finished(seq: Sequence) -> Event:
    usage = chat_pb2.Usage(prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids))
    return Event(request_id=seq.request_id,
                 finished=chat_pb2.Finished(finish_reason=FINISH_REASONS[seq.finish_reason], usage=usage))


def error(request_id: str, code: grpc.StatusCode, message: str, retry_after_ms: int = 0) -> Event:
    return RequestError(code, message, retry_after_ms=retry_after_ms).to_event(request_id)
