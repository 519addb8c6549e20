"""One request's decoding state, from admission to finish."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import Counter

from finsieve.policy.guard import Guard, Intervention
from finsieve.v1 import chat_pb2

from .tokens import IncrementalText, find_stop, stop_holdback

# Counted where every intervention becomes an event.
INTERVENTIONS = Counter("finsieve_interventions", "Policy interventions", ["rule_id", "action"])


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters with the server defaults filled in."""

    max_tokens: int
    temperature: float  # 0: greedy
    top_p: float  # 1: off
    top_k: int  # 0: off
    seed: int | None
    stop: tuple[str, ...]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sink(Protocol):
    """Where a sequence's events go: one per gateway stream."""

    def deliver(self, events: list[chat_pb2.ChatServerMessage]) -> None: ...


class Status(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    request_id: str
    sink: Sink
    prompt_ids: list[int]
    sampling: Sampling
    guard: Guard  # the output policy this request runs under, to the end
    input_events: list[Intervention] = field(default_factory=list)
    halted_by_input: bool = False
    status: Status = Status.WAITING
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    text: IncrementalText = field(init=False)  # the raw answer, for stop strings
    released_tokens: int = 0  # output tokens accounted for in Deltas sent
    finish_reason: int = chat_pb2.FINISH_REASON_UNSPECIFIED
    rng: Any = None  # torch.Generator of a sampled (non-greedy) sequence

    def __post_init__(self) -> None:
        self.text = IncrementalText(self.guard.token_bytes)

    @property
    def key(self) -> tuple[int, str]:
        return id(self.sink), self.request_id

    @property
    def policy_version(self) -> str:
        return self.guard.policy.version

    @property
    def last_token(self) -> int:
        """The token the next forward pass feeds: the KV cache holds everything before it."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason != chat_pb2.FINISH_REASON_UNSPECIFIED

    def append(self, token_id: int, is_eos: bool) -> None:
        """Take one generated token the policy accepted; decide whether it ends the answer."""
        self.output_ids.append(token_id)
        if is_eos:
            self.finish_reason = chat_pb2.FINISH_REASON_STOP
            return
        before = len(self.text.text)
        self.text.add(token_id)
        if self.sampling.stop:
            longest = max(len(s) for s in self.sampling.stop)
            cut = find_stop(self.text.text, self.sampling.stop, max(0, before - longest + 1))
            if cut >= 0:
                self.text.text = self.text.text[:cut]
                self.finish_reason = chat_pb2.FINISH_REASON_STOP
                return
        if len(self.output_ids) >= self.sampling.max_tokens:
            self.finish_reason = chat_pb2.FINISH_REASON_LENGTH

    def extend(self, forced: list[int]) -> None:
        """Tokens a rewrite put into the answer."""
        for t in forced:
            self.output_ids.append(t)
            self.text.add(t)

    def truncate(self, keep: int) -> None:
        """Roll the answer back to its first `keep` tokens (SAR)."""
        del self.output_ids[keep:]
        self.text = IncrementalText(self.guard.token_bytes)
        for t in self.output_ids:
            self.text.add(t)
        self.finish_reason = chat_pb2.FINISH_REASON_UNSPECIFIED

    def take_delta(self) -> chat_pb2.ChatServerMessage | None:
        """The text that became final since the last Delta, if any."""
        final = self.done
        limit = None
        if final:
            limit = len(self.text.text.encode())  # a stop string cut the text here
        elif held := stop_holdback(self.text.text, self.sampling.stop):
            limit = self.guard.matcher.norm.decoded_len - len(self.text.text[-held:].encode())
        text = self.guard.release(limit, final=final)
        tokens_now = len(self.output_ids) if final else self.guard.released_tokens
        tokens = tokens_now - self.released_tokens
        if not text and not (final and tokens):
            return None
        self.released_tokens = tokens_now
        return chat_pb2.ChatServerMessage(
            request_id=self.request_id, delta=chat_pb2.Delta(text=text, tokens=tokens)
        )

    def finished_event(self) -> chat_pb2.ChatServerMessage:
        usage = chat_pb2.Usage(
            prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.output_ids)
        )
        return chat_pb2.ChatServerMessage(
            request_id=self.request_id,
            finished=chat_pb2.Finished(finish_reason=self.finish_reason, usage=usage),
        )

    def policy_event(self, i: Intervention, scope: str = "output") -> chat_pb2.ChatServerMessage:
        INTERVENTIONS.labels(i.rule_id, i.action).inc()
        return chat_pb2.ChatServerMessage(
            request_id=self.request_id,
            policy_event=chat_pb2.PolicyEvent(
                rule_id=i.rule_id, action=i.action, start=i.start, end=i.end,
                rolled_back=i.rolled_back, tokens_recomputed=i.tokens_recomputed,
                message=i.message, scope=scope, suppressed=i.suppressed,
            ),
        )
