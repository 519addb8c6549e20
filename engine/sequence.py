"""One request's decoding state, from admission to finish: bookkeeping only (no torch, no protobuf)."""

from __future__ import annotations

import enum
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

from finsieve.policy.guard import Guard, Intervention

from .tokens import IncrementalText, find_stop, stop_holdback

# Below this a temperature is greedy: dividing logits by less overflows float32.
MIN_TEMPERATURE = 1e-4


class Finish(enum.IntEnum):
    """Why an answer ended; the values are chat.proto's FinishReason."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    CONTENT_FILTER = 3
    CANCELLED = 4


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters with the server defaults filled in and every value made safe."""

    max_tokens: int
    temperature: float  # 0: greedy
    top_p: float  # 1: off
    top_k: int  # 0: off
    seed: int | None
    stop: tuple[str, ...]

    @classmethod
    def safe(cls, max_tokens: int, temperature: float, top_p: float, top_k: int,
             seed: int | None, stop: tuple[str, ...]) -> Sampling:
        """Whatever reaches the engine: NaN, negative or tiny temperatures are greedy, a top_p
        outside (0, 1) is off, a negative top_k is off. The gateway refuses such values first;
        this is the engine's own guard, so no request can make the batched sampler fail."""
        if not (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
            temperature = 0.0
        if not (math.isfinite(top_p) and 0.0 < top_p < 1.0):
            top_p = 1.0
        return cls(max_tokens, float(temperature), float(top_p), max(int(top_k), 0), seed, stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sink(Protocol):
    """Where a sequence's events go: one per gateway stream."""

    def deliver(self, step: Any) -> None:
        """step: an EngineStep, this sink's events of one engine step (the sink keeps it)."""


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
    text: IncrementalText = field(init=False)  # the raw answer, kept for stop strings only
    released_tokens: int = 0  # output tokens accounted for in deltas sent
    finish_reason: Finish = Finish.NONE
    # Scheduling state. The KV cache holds (or a launched step is writing) the first `kv_len`
    # positions of the context; `ahead` launched steps will each sample one more token
    # for it; `stale` launched steps computed from a token since taken back: their
    # results are dropped. Between steps: kv_len == context_len - 1 + ahead.
    kv_len: int = 0
    ahead: int = 0
    stale: int = 0
    pending_row: int = -1  # the row of the last launched step that samples its next token
    # Token ids the rules ban at the next position; None until a step needs the exact list
    # (an optimistic row runs under the policy's base bans and is checked after).
    bans: list[int] | None = None
    # `bans` is the exact mask; False: the base bans, where the exact one would cost more
    # than FINSIEVE_MASK_WORK_LIMIT (its token is checked exactly, as an optimistic row's)
    bans_exact: bool = True
    noise_seed: int = 0  # the per-request key of its sampling noise
    admitted_at: float = 0.0
    admitted_step: int = 0

    def __post_init__(self) -> None:
        self.text = IncrementalText(self.guard.token_table())
        seed = self.sampling.seed
        self.noise_seed = seed if seed is not None else secrets.randbits(63)

    @property
    def key(self) -> tuple[int, str]:
        return id(self.sink), self.request_id

    @property
    def policy_version(self) -> str:
        return self.guard.version()

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        return (self.prompt_ids[start:end] if end <= n
                else self.prompt_ids[start:] + self.output_ids[max(start - n, 0) : end - n])

    @property
    def done(self) -> bool:
        return self.finish_reason is not Finish.NONE

    def redo(self, valid: int | None = None) -> None:
        """Drop what launched steps will say about this sequence; its next step feeds what the
        cache lacks and samples after its last token (SAR, rewrite, resample, a stale mask).
        `valid`: positions whose KV still stands (a rollback changed the tokens after them)."""
        self.stale += self.ahead
        self.ahead = 0
        keep = self.context_len - 1 if valid is None else min(valid, self.context_len - 1)
        self.kv_len = min(self.kv_len, keep)

    def append(self, token_id: int, is_eos: bool) -> None:
        """Take one generated token the policy accepted; decide whether it ends the answer."""
        self.output_ids.append(token_id)
        if is_eos:
            self.finish_reason = Finish.STOP
            return
        if self.sampling.stop:
            before = len(self.text.text)
            self.text.add(token_id)
            longest = max(len(s) for s in self.sampling.stop)
            cut = find_stop(self.text.text, self.sampling.stop, max(0, before - longest + 1))
            if cut >= 0:
                self.text.cut(cut)
                self.finish_reason = Finish.STOP
                return
        if len(self.output_ids) >= self.sampling.max_tokens:
            self.finish_reason = Finish.LENGTH

    def extend(self, forced: list[int]) -> None:
        """Tokens a rewrite put into the answer."""
        for t in forced:
            self.output_ids.append(t)
            if self.sampling.stop:
                self.text.add(t)

    def truncate(self, keep: int) -> None:
        """Roll the answer back to its first `keep` tokens (SAR)."""
        del self.output_ids[keep:]
        self.text = IncrementalText(self.guard.token_table())
        if self.sampling.stop:
            for t in self.output_ids:
                self.text.add(t)
        self.finish_reason = Finish.NONE

    def take_delta(self) -> tuple[str, int] | None:
        """The text that became final since the last delta, and the tokens it accounts for."""
        final = self.done
        limit = None
        if self.sampling.stop:
            # Raw byte offsets, as the guard's: not the decoded text's encoded length, which
            # counts each U+FFFD as 3 bytes whatever it replaced.
            if final:
                limit = self.text.raw_len  # a stop string may have cut the text here
            elif held := stop_holdback(self.text.text, self.sampling.stop):
                limit = self.text.raw_offset(len(self.text.text) - held)
        text, released_tokens = self.guard.take(limit, final)
        tokens_now = len(self.output_ids) if final else released_tokens
        tokens = tokens_now - self.released_tokens
        if not text and not (final and tokens):
            return None
        self.released_tokens = tokens_now
        return text, tokens
