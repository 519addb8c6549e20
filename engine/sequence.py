"""One request's decoding state, from admission to finish."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from finsieve.v1 import chat_pb2

from .tokens import IncrementalText, find_stop, stop_holdback


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
    text: IncrementalText
    status: Status = Status.WAITING
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    released: int = 0  # characters of text.text delivered to the client
    unreleased_tokens: int = 0  # generated tokens not yet counted in a Delta
    cancelled: bool = False
    rng: Any = None  # torch.Generator of a sampled (non-greedy) sequence
    finish_reason: int = chat_pb2.FINISH_REASON_UNSPECIFIED

    @property
    def key(self) -> tuple[int, str]:
        return id(self.sink), self.request_id

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    def append(self, token_id: int, is_eos: bool) -> None:
        """Take one generated token; decide whether that finishes the sequence."""
        self.output_ids.append(token_id)
        self.unreleased_tokens += 1
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

    @property
    def done(self) -> bool:
        return self.finish_reason != chat_pb2.FINISH_REASON_UNSPECIFIED

    def releasable(self) -> str:
        """Text that is now final: everything unless it could still begin a stop string."""
        end = len(self.text.text)
        if not self.done:
            end -= stop_holdback(self.text.text, self.sampling.stop)
        return self.text.text[self.released : end]

    def take_delta(self) -> chat_pb2.ChatServerMessage | None:
        text = self.releasable()
        if not text and not (self.done and self.unreleased_tokens):
            return None
        self.released += len(text)
        tokens, self.unreleased_tokens = self.unreleased_tokens, 0
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
