"""The engine: continuous batching of every live sequence, one decode step at a time.

Requests are tokenized by the caller's thread (`prepare`), queued (`submit`), and joined
to the running batch between steps. Each step: admit and prefill new sequences, decode
one token for every running sequence, and hand each sink all of its events at once.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict, deque
from dataclasses import dataclass

import grpc
import structlog
import torch

from finsieve.errors import RequestError, invalid
from finsieve.v1 import chat_pb2

from .hf_runner import HFRunner
from .loader import LoadedModel
from .model import SUPPORTED_ARCHITECTURES, CompactLM
from .sampler import make_generator, sample
from .sequence import Sampling, Sequence, Sink, Status
from .tokens import IncrementalText, token_byte_table

log = structlog.get_logger(__name__)

NO_POLICY = "none"


@dataclass(frozen=True)
class EngineLimits:
    max_batch: int
    max_context: int
    default_max_tokens: int
    batch_invariant: bool = True


@dataclass(frozen=True)
class _Cancel:
    sink: Sink
    request_id: str | None  # None: every request of the sink


class LLMEngine:
    def __init__(self, model: LoadedModel, limits: EngineLimits, device: torch.device) -> None:
        self.model_name = model.name
        self.tokenizer = model.tokenizer
        self.eos_ids = model.eos_token_ids
        self.device = device
        self.max_context = min(limits.max_context, model.max_position_embeddings)
        self.max_batch = limits.max_batch
        self.default_max_tokens = limits.default_max_tokens
        self.policy_version = NO_POLICY
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
        """Tokenize and check a request (off the decode loop); raises RequestError."""
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
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
        seq = Sequence(request.request_id, sink, ids, sampling, IncrementalText(self.token_bytes))
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
        events: dict[Sink, list[chat_pb2.ChatServerMessage]] = defaultdict(list)
        self._take_inbox(events)
        try:
            self._admit(events)
            if self.running:
                self._decode(events)
        except Exception:
            log.exception("engine step failed; failing its sequences")
            for seq in self.running:
                self._fail(seq, events, grpc.StatusCode.INTERNAL, "the engine failed this request")
        for sink, batch in events.items():
            sink.deliver(batch)
        return bool(events or self.running or self.waiting)

    def _take_inbox(self, events: dict) -> None:
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

    def _admit(self, events: dict) -> None:
        while self.waiting and self.runner.cache.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.runner.cache.allocate()
            seq.status = Status.RUNNING
            self.running.append(seq)
            events[seq.sink].append(
                chat_pb2.ChatServerMessage(
                    request_id=seq.request_id,
                    started=chat_pb2.Started(
                        model=self.model_name, policy_version=self.policy_version
                    ),
                )
            )
            logits = self.runner.prefill(seq.prompt_ids, seq.slot)
            self._advance(seq, logits, events)

    def _decode(self, events: dict) -> None:
        batch = list(self.running)
        logits = self.runner.decode([s.last_token for s in batch], [s.slot for s in batch])
        for row, seq in enumerate(batch):
            self._advance(seq, logits[row], events)

    def _advance(self, seq: Sequence, logits: torch.Tensor, events: dict) -> None:
        token = sample(logits, seq.sampling, seq.rng)
        seq.append(token, token in self.eos_ids)
        if not seq.done and len(seq.prompt_ids) + len(seq.output_ids) >= self.max_context:
            seq.finish_reason = chat_pb2.FINISH_REASON_LENGTH
        if seq.done:
            self._finish(seq, events)
        elif delta := seq.take_delta():
            events[seq.sink].append(delta)

    def _finish(self, seq: Sequence, events: dict) -> None:
        """Deliver what is left, then Finished; free the slot."""
        if seq.finish_reason != chat_pb2.FINISH_REASON_CANCELLED and (delta := seq.take_delta()):
            events[seq.sink].append(delta)
        events[seq.sink].append(seq.finished_event())
        self._release(seq)

    def _fail(self, seq: Sequence, events: dict, code: grpc.StatusCode, message: str) -> None:
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
        sink = _CollectingSink()
        self.submit(self.prepare(request, sink))
        while not sink.finished:
            self.step()
        return sink.events


class _CollectingSink:
    def __init__(self) -> None:
        self.events: list[chat_pb2.ChatServerMessage] = []

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].WhichOneof("event") in ("finished", "error")

    def deliver(self, events: list[chat_pb2.ChatServerMessage]) -> None:
        self.events.extend(events)
