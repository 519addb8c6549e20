"""The engine: continuous batching of every live sequence, one decode step at a time.

Requests are tokenized by the caller's thread (`prepare`), queued (`submit`), and joined
to the running batch between steps. Each step: admit and prefill new sequences, decode
one token for every running sequence, and hand each sink all of its events at once.

Every sampled token passes the sequence's guard (finsieve.policy.guard): banned tokens
are masked before sampling; after it, the token is accepted, resampled, or the sequence
is rolled back (SAR: its KV length is set back), rewritten or halted. Only that sequence
is touched; the rest of the batch decodes on.
"""

from __future__ import annotations

import bisect
import queue
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog
import torch
from prometheus_client import Counter, Histogram

from finsieve.errors import RequestError, invalid
from finsieve.policy.guard import Decision, Guard, Intervention, Policy, Verdict
from finsieve.policy.matcher import scan_text
from finsieve.policy.pack import Pack
from finsieve.v1 import chat_pb2

from .hf_runner import HFRunner
from .loader import LoadedModel
from .model import SUPPORTED_ARCHITECTURES, CompactLM
from .sampler import make_generator, sample
from .sequence import Sampling, Sequence, Sink, Status
from .tokens import token_byte_table

log = structlog.get_logger(__name__)

STEP_SECONDS = Histogram("finsieve_decode_step_seconds",
                         "One decode step for the whole batch (the inter-token latency)",
                         buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2))
TOKENS = Counter("finsieve_generated_tokens", "Tokens generated (accepted by the rules)")
ROLLBACKS = Counter("finsieve_rollbacks", "Sequences rolled back (SAR)")

NO_POLICY = Policy(Pack([]), None, "none")
MAX_RESAMPLES = 32  # per position; then the sequence halts


@dataclass(frozen=True)
class EngineLimits:
    max_batch: int
    max_context: int
    default_max_tokens: int
    batch_invariant: bool = True
    max_rollbacks: int = 8


@dataclass(frozen=True)
class _Cancel:
    sink: Sink
    request_id: str | None  # None: every request of the sink


Events = dict[Sink, list[chat_pb2.ChatServerMessage]]


class LLMEngine:
    def __init__(self, model: LoadedModel, limits: EngineLimits, device: torch.device,
                 policy: Callable[[], Policy] = lambda: NO_POLICY) -> None:
        self.model_name = model.name
        self.tokenizer = model.tokenizer
        self.eos_ids = model.eos_token_ids
        self.device = device
        self.max_context = min(limits.max_context, model.max_position_embeddings)
        self.max_batch = limits.max_batch
        self.default_max_tokens = limits.default_max_tokens
        self.max_rollbacks = limits.max_rollbacks
        self.policy = policy  # the policy in force now; a request keeps the one it started with
        self.runner: CompactLM | HFRunner
        if model.hf_model.config.model_type in SUPPORTED_ARCHITECTURES:
            # On the CPU, fixed matmul tiles make decoding independent of the batch (model.py).
            row_tile = 8 if device.type == "cpu" and limits.batch_invariant else 0
            self.runner = CompactLM(model.hf_model, limits.max_batch, self.max_context, row_tile)
        else:
            log.warning("no compact forward for this architecture; using transformers' forward",
                        architecture=model.hf_model.config.model_type)
            self.runner = HFRunner(model.hf_model, limits.max_batch)
        special = {i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        self.token_bytes = token_byte_table(self.tokenizer.get_vocab(), special)
        self._inbox: queue.SimpleQueue[Sequence | _Cancel] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._live: dict[tuple[int, str], Sequence] = {}

    # -- any thread -------------------------------------------------------------------

    def prepare(self, request: chat_pb2.ChatRequest, sink: Sink) -> Sequence:
        """Apply input rules, tokenize and check a request (off the decode loop)."""
        policy = self.policy()
        messages, input_events, halted = _apply_input_rules(policy, request.messages)
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # a template may reject e.g. a misplaced system message
            raise invalid("messages", f"the model's chat template rejected them: {e}") from None
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if len(ids) >= self.max_context:
            raise invalid(
                "messages",
                f"the prompt is {len(ids)} tokens; the context holds {self.max_context} "
                "tokens for prompt and answer together",
            )
        p = request.params
        sampling = Sampling(
            max_tokens=min(p.max_tokens or self.default_max_tokens, self.max_context - len(ids)),
            temperature=p.temperature,
            top_p=p.top_p or 1.0,
            top_k=p.top_k,
            seed=p.seed if p.HasField("seed") else None,
            stop=tuple(s for s in p.stop if s),
        )
        guard = Guard(policy, self.token_bytes, self.max_rollbacks)
        seq = Sequence(request.request_id, sink, ids, sampling, guard,
                       input_events=input_events, halted_by_input=halted)
        seq.rng = make_generator(sampling, self.device)
        return seq

    def submit(self, seq: Sequence) -> None:
        self._inbox.put(seq)
        self._wake.set()

    def cancel(self, sink: Sink, request_id: str | None = None) -> None:
        self._inbox.put(_Cancel(sink, request_id))
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------

    def run(self) -> None:
        while not self._stopping:
            if not self.step():
                self._wake.wait()
                self._wake.clear()

    def step(self) -> bool:
        """One scheduling round; returns False when there was nothing to do."""
        events: Events = defaultdict(list)
        self._take_inbox(events)
        try:
            self._admit(events)
            if self.running:
                self._decode(events)
        except Exception:
            log.exception("engine step failed; failing its sequences")
            for seq in list(self.running):
                self._fail(seq, events, grpc.StatusCode.INTERNAL, "the engine failed this request")
        for sink, batch in events.items():
            sink.deliver(batch)
        return bool(events or self.running or self.waiting)

    def _take_inbox(self, events: Events) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Sequence):
                if item.key in self._live:
                    events[item.sink].append(
                        invalid("request_id", "a request with this id is in flight").to_event(
                            item.request_id
                        )
                    )
                else:
                    self._live[item.key] = item
                    self.waiting.append(item)
            else:
                for seq in list(self._live.values()):
                    if seq.sink is item.sink and item.request_id in (None, seq.request_id):
                        seq.finish_reason = chat_pb2.FINISH_REASON_CANCELLED
                        self._finish(seq, events)

    def _admit(self, events: Events) -> None:
        while self.waiting and self.runner.cache.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.runner.cache.allocate()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out = events[seq.sink]
            out.append(chat_pb2.ChatServerMessage(
                request_id=seq.request_id,
                started=chat_pb2.Started(model=self.model_name, policy_version=seq.policy_version),
            ))
            out.extend(seq.policy_event(i, "input") for i in seq.input_events)
            if seq.halted_by_input:  # an input rule halted it: nothing is decoded
                seq.finish_reason = chat_pb2.FINISH_REASON_CONTENT_FILTER
                self._finish(seq, events)
                continue
            logits = self.runner.prefill(seq.prompt_ids, seq.slot)
            self._advance(seq, logits, events)

    def _decode(self, events: Events) -> None:
        batch = list(self.running)
        with STEP_SECONDS.time():
            logits = self.runner.decode([s.last_token for s in batch], [s.slot for s in batch])
            for row, seq in enumerate(batch):
                self._advance(seq, logits[row], events)

    # -- one sequence, one step ---------------------------------------------------------

    def _advance(self, seq: Sequence, logits: torch.Tensor, events: Events) -> None:
        """Sample this sequence's next token under its policy and act on the verdict."""
        guard = seq.guard
        # Halts unless a token is accepted within MAX_RESAMPLES tries.
        decision, token, eos = Decision(Verdict.HALT), -1, False
        for attempt in range(MAX_RESAMPLES):
            row = logits
            banned = guard.banned()
            if banned:
                top = int(torch.argmax(logits))
                if attempt == 0 and _contains(banned, top) and (stopped := guard.masked(top)):
                    events[seq.sink].append(seq.policy_event(stopped))  # the mask steered it
                row = logits.clone()
                row[torch.tensor(banned, device=logits.device)] = float("-inf")
                if torch.isinf(row).all():  # nothing left to say that the rules allow
                    decision = Decision(Verdict.HALT, match=decision.match)
                    break
            token = sample(row, seq.sampling, seq.rng)
            eos = token in self.eos_ids
            decision = guard.finish() if eos else guard.check(token)
            if decision.verdict is not Verdict.RESAMPLE:
                break
            events[seq.sink].append(seq.policy_event(_blocked_here(guard, decision)))
        if decision.verdict in (Verdict.HALT, Verdict.RESAMPLE):
            self._halt(seq, decision, events)
            return
        if decision.verdict is not Verdict.ACCEPT:
            self._roll_back(seq, decision, events)
            return
        seq.append(token, eos)
        TOKENS.inc()
        if not seq.done and seq.context_len >= self.max_context:
            seq.finish_reason = chat_pb2.FINISH_REASON_LENGTH
        if seq.done and not eos:
            # The answer ends here: a regex waiting for more text is settled now.
            decision = guard.finish()
            if decision.verdict is Verdict.HALT:
                self._halt(seq, decision, events)
                return
            if decision.verdict is not Verdict.ACCEPT:
                self._roll_back(seq, decision, events)
                return
        if seq.done:
            self._finish(seq, events)
        else:
            self._deliver(seq, events)

    def _roll_back(self, seq: Sequence, decision: Decision, events: Events) -> None:
        """SAR: set this sequence's KV length back to the span's start and decode again."""
        intervention = seq.guard.rollback(decision)
        ROLLBACKS.inc()
        seq.truncate(decision.keep)
        self.runner.cache.truncate(seq.slot, seq.context_len - 1)
        if decision.verdict is Verdict.REWRITE:
            forced = self.tokenizer(decision.text, add_special_tokens=False)["input_ids"]
            seq.guard.force(forced)
            self.runner.prefill([seq.last_token, *forced[:-1]], seq.slot)
            seq.extend(forced)
        events[seq.sink].append(seq.policy_event(intervention))
        self._deliver(seq, events)

    def _halt(self, seq: Sequence, decision: Decision, events: Events) -> None:
        if decision.match is None:  # every token banned: nothing allowed to say
            text, intervention = "", Intervention("", "halt", seq.guard.delivered_chars,
                                                  seq.guard.delivered_chars,
                                                  message="no allowed continuation")
        else:
            text, intervention = seq.guard.halt(decision)
        out = events[seq.sink]
        if text:
            out.append(chat_pb2.ChatServerMessage(
                request_id=seq.request_id, delta=chat_pb2.Delta(text=text, tokens=0)))
        out.append(seq.policy_event(intervention))
        seq.finish_reason = chat_pb2.FINISH_REASON_CONTENT_FILTER
        self._finish(seq, events)

    def _deliver(self, seq: Sequence, events: Events) -> None:
        delta = seq.take_delta()
        out = events[seq.sink]
        out.extend(seq.policy_event(i) for i in seq.guard.events)  # redactions just released
        seq.guard.events.clear()
        if delta is not None:
            out.append(delta)

    def _finish(self, seq: Sequence, events: Events) -> None:
        """Deliver what is left, then Finished; free the slot."""
        if seq.finish_reason not in (chat_pb2.FINISH_REASON_CANCELLED,
                                     chat_pb2.FINISH_REASON_CONTENT_FILTER):
            self._deliver(seq, events)
        events[seq.sink].append(seq.finished_event())
        self._release(seq)

    def _fail(self, seq: Sequence, events: Events, code: grpc.StatusCode, message: str) -> None:
        events[seq.sink].append(RequestError(code, message).to_event(seq.request_id))
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self._live.pop(seq.key, None)
        if seq.status is Status.RUNNING:
            self.runner.cache.release(seq.slot)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    # -- synchronous use (tests, benchmarks) ------------------------------------------

    def generate(self, request: chat_pb2.ChatRequest) -> list[chat_pb2.ChatServerMessage]:
        """Run one request to completion on the calling thread; returns its events."""
        sink = CollectingSink()
        self.submit(self.prepare(request, sink))
        while not sink.finished:
            self.step()
        return sink.events


def _contains(sorted_ids: list[int], token: int) -> bool:
    i = bisect.bisect_left(sorted_ids, token)
    return i < len(sorted_ids) and sorted_ids[i] == token


def _blocked_here(guard: Guard, decision: Decision) -> Intervention:
    """A span inside the token just sampled: masked and resampled, nothing recomputed."""
    m = decision.match
    assert m is not None
    at = guard.delivered_chars + len(guard.matcher.render(guard.released, guard.matcher.norm.raw_len))
    return Intervention(m.rule.id, m.rule.action, at, at, suppressed=m.text)


def _apply_input_rules(policy: Policy, messages) -> tuple[list[dict[str, str]], list[Intervention], bool]:
    """Input-scope rules on every message: spans redacted before the model sees them;
    a halting (or blocking) rule means the request is not decoded at all."""
    out, events, halted = [], [], False
    rules = policy.pack.input
    for m in messages:
        content = m.content
        if rules:
            raw = content.encode()
            found = sorted(scan_text(rules, content), key=lambda x: x.start)
            parts, pos = [], 0
            for x in found:
                suppressed = raw[x.start : x.end].decode("utf-8", "replace")
                if x.rule.action in ("halt", "block"):
                    halted = True
                    events.append(Intervention(x.rule.id, x.rule.action, 0, 0,
                                               message=x.rule.message, suppressed=suppressed))
                elif x.start >= pos:  # redact / rewrite: the model never sees the span
                    parts.append(raw[pos : x.start].decode("utf-8", "replace"))
                    at = sum(len(p) for p in parts)
                    parts.append(x.rule.replacement)
                    events.append(Intervention(x.rule.id, x.rule.action, at,
                                               at + len(x.rule.replacement), suppressed=suppressed))
                    pos = x.end
            parts.append(raw[pos:].decode("utf-8", "replace"))
            content = "".join(parts)
        out.append({"role": m.role, "content": content})
    return out, events, halted


class CollectingSink:
    def __init__(self) -> None:
        self.events: list[chat_pb2.ChatServerMessage] = []

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].WhichOneof("event") in ("finished", "error")

    def deliver(self, events: list[chat_pb2.ChatServerMessage]) -> None:
        self.events.extend(events)
