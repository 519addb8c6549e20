"""The engine: continuous batching of every live sequence, rules inside the decoder loop.

`prepare` (called on the gRPC server's executor threads) has a request tokenized, its length
checked against the context and only then the input rules applied, in worker processes
(preparer.py); `submit` and `cancel` reach the engine thread through its inbox. The engine
thread runs `step` in a loop:

  1. take the inbox: queue new requests (a bounded queue), cancel by (sink, request id);
  2. admit waiting requests into free KV slots; the scheduler picks this step's rows;
  3. launch the step on the device (on CUDA this returns at once; model_runner.py);
  4. meanwhile, on the CPU, postprocess the previous step's tokens: each sequence's guard
     (finsieve.policy.guard) judges its token and enforce.py carries the action out;
  5. hand each sink (gateway stream) all of its events at once.

Optimistic decoding: step N+1 is launched before step N's tokens are checked; each of its
decode rows is fed the token step N sampled for it, on the device, with the policy's base
mask. When the host has checked the token the row followed, it knows the exact ban list
for the row's position: a result outside it is exactly what the exact mask would have
given (greedy: the argmax; sampled: the Gumbel-max draw of the same noise). A result inside
it, or a refused token before it, throws that row away (`finsieve_late_repairs_total`) and
the position is decoded again: a violation found one step late is repaired by rollback,
never by a retraction.

Bounded exact masks: a row that is not optimistic (after a resample, rollback or redo)
runs under its exact ban list, unless building it would cost more than the policy's mask
work limit (FINSIEVE_MASK_WORK_LIMIT: a huge pack, many patterns under the text's live
suffix). Then it too runs under the base bans and its token is checked exactly; a refused
token is banned at that position and the position decoded again, under the same noise, so
the draw is still the best allowed token. At most MAX_REDRAWS refusals at one position,
then the sequence halts (CONTENT_FILTER): fail closed, and the decode thread never builds
an unbounded mask, which every stream in the batch would wait for.

Every sampled token passes its sequence's guard: accepted, resampled (banned at that
position and decoded again), rolled back (SAR: the sequence's KV length is set back),
rewritten or halted (enforce.py). Only that sequence is touched; the batch decodes on. The
forward and its runner are built, with their fallbacks, by build.py. An exception
while handling one sequence fails that sequence alone; a device that no longer computes
stops the engine (`EngineFailed`), and the server exits so its supervisor restarts it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog
import torch

from finsieve.errors import RequestError
from finsieve.policy.guard import MAX_REDRAWS, MAX_RESAMPLES, Guard, Policy
from finsieve.policy.pack import Pack
from finsieve.v1 import chat_pb2, engine_pb2

from . import events
from .build import build
from .enforce import Enforcer
from .events import LATE_REPAIRS, LOOP_SECONDS, STEP_ROWS, STEP_SECONDS, TOKENS, Outbox
from .limits import EngineLimits
from .loader import LoadedModel
from .model_runner import Launch, StepRow
from .preparer import Message, Preparer
from .sampler import noise_key
from .scheduler import Row, Scheduler
from .sequence import Finish, Sampling, Sequence, Sink, Status
from .tokens import token_byte_table

log = structlog.get_logger(__name__)

NO_POLICY = Policy(Pack([]), None, "none")
STATS_EVERY_S = 10.0


class EngineFailed(RuntimeError):
    """The device no longer computes (e.g. a CUDA error lost the context)."""


@dataclass(frozen=True)
class _Cancel:
    sink: Sink
    request_id: str | None  # None: every request of the sink


@dataclass
class _InFlight:
    launch: Launch
    seqs: list[Sequence]  # per sampled row


class LLMEngine:
    def __init__(self, model: LoadedModel, limits: EngineLimits, device: torch.device,
                 policy: Callable[[], Policy] = lambda: NO_POLICY) -> None:
        self.model_name = model.name
        self.tokenizer = model.tokenizer
        self.eos_ids = model.eos_token_ids
        self.device = device
        self.max_context = min(limits.max_context, model.max_position_embeddings)
        self.default_max_tokens = limits.default_max_tokens
        self.max_rollbacks = limits.max_rollbacks
        self.policy = policy  # the policy in force now; a request keeps the one it started with
        # Its workers start while the model is built and its graphs captured.
        self.preparer = Preparer(self.tokenizer, self.max_context, limits.prepare_workers)
        try:
            self.model, self.runner, self.mode = build(model, limits, device, self.max_context)
        except BaseException:
            self.preparer.close()
            raise
        self.preparer.wait_ready()
        self.max_batch = self.model.n_slots
        mixed = self.runner.mixed_tokens
        # one forward for every chunk, and prompts beside decode rows not in a mixed step
        batching = getattr(self.model, "batch_prefill", False) and not mixed
        chunk = limits.prefill_chunk if device.type == "cuda" else \
            min(limits.prefill_chunk, limits.cpu_prefill_chunk)
        self.scheduler = Scheduler(self.max_batch, limits.max_waiting, chunk,
                                   self.max_context, limits.prompt_batch_tokens if batching else 0,
                                   limits.prompt_wait_steps, mixed)
        self.enforcer = Enforcer(self.scheduler, self._tokenize, self.eos_ids, self.max_context)
        special = {i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        self.token_bytes = token_byte_table(self.tokenizer.get_vocab(), special)
        self._inbox: queue.SimpleQueue[Sequence | _Cancel] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._in_flight: _InFlight | None = None
        self._last_launch = 0.0
        self._counts: list = [0, 0, 0.0]  # steps, tokens, seconds since the last report
        self._loop_time = {part: LOOP_SECONDS.labels(part)
                           for part in ("device", "device_cpu", "host", "host_cpu", "idle",
                                        "launch", "tokens")}
        self.failed = threading.Event()

    # -- any thread -------------------------------------------------------------------

    def prepare(self, request: chat_pb2.ChatRequest, sink: Sink) -> Sequence:
        """Tokenize, check the length, apply input rules (off the decode loop; preparer.py)."""
        policy = self.policy()
        messages = [Message(m.role, m.content) for m in request.messages]
        prepared = self.preparer.prepare(messages, policy.pack.input, policy.version)
        ids, verdict = prepared.ids, prepared.verdict
        p = request.params
        sampling = Sampling.safe(
            max_tokens=max(min(p.max_tokens or self.default_max_tokens, self.max_context - len(ids)), 1),
            temperature=p.temperature, top_p=p.top_p or 1.0, top_k=p.top_k,
            seed=p.seed if p.HasField("seed") else None, stop=tuple(s for s in p.stop if s),
        )
        guard = Guard(policy, self.token_bytes, self.max_rollbacks, MAX_RESAMPLES, MAX_REDRAWS)
        return Sequence(request.request_id, sink, ids, sampling, guard,
                        input_events=verdict.events, halted_by_input=verdict.halted)

    def submit(self, seq: Sequence) -> None:
        self._inbox.put(seq)
        self._wake.set()

    def cancel(self, sink: Sink, request_id: str | None = None) -> None:
        self._inbox.put(_Cancel(sink, request_id))
        self._wake.set()

    def handed_over(self) -> int:
        """Requests and cancels submitted that the engine thread has not taken yet."""
        return self._inbox.qsize()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self.preparer.close()

    # -- the engine thread ------------------------------------------------------------

    def run(self) -> None:
        report = time.monotonic() + STATS_EVERY_S
        try:
            while not self._stopping:
                if not self.step():
                    idle = time.perf_counter()
                    self._wake.wait(STATS_EVERY_S)
                    self._wake.clear()
                    self._loop_time["idle"].inc(time.perf_counter() - idle)
                if time.monotonic() >= report:
                    self._report()
                    report = time.monotonic() + STATS_EVERY_S
        except EngineFailed:
            self.failed.set()

    def step(self) -> bool:
        """One round: schedule, launch (run), postprocess the previous step's tokens.
        Returns False when there was nothing to do."""
        out = Outbox()
        wall, cpu = time.perf_counter(), time.thread_time()
        waited = (0.0, 0.0)  # for the device: wall and CPU seconds
        try:
            self._take_inbox(out)
            self._admit(out)
            launched = self._run(self.scheduler.schedule(), out)
            if self._in_flight is not None:
                waited = self._postprocess(self._in_flight, out)
            self._in_flight = launched
        finally:
            out.deliver()
            events.WAITING.set(len(self.scheduler.waiting))
            events.RUNNING.set(len(self.scheduler.running))
            self._count_loop_time(wall, cpu, waited)
        return bool(out or self._in_flight or len(self.scheduler))

    # -- schedule ---------------------------------------------------------------------

    def _take_inbox(self, out: Outbox) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Cancel):
                seqs = (self.scheduler.of_sink(item.sink) if item.request_id is None
                        else [s] if (s := self.scheduler.find(item.sink, item.request_id)) else [])
                for seq in seqs:
                    seq.finish_reason = Finish.CANCELLED
                    self.enforcer.finish(seq, out)
            elif item.halted_by_input:  # an input rule halted it: nothing is decoded
                self._started(item, out)
                item.finish_reason = Finish.CONTENT_FILTER
                out.add(item, events.finished(item))
            else:
                try:
                    self.scheduler.add(item)
                except RequestError as e:
                    out.add(item, e.to_event(item.request_id))

    def _admit(self, out: Outbox) -> None:
        for seq in self.scheduler.admit():
            self._started(seq, out)

    def _started(self, seq: Sequence, out: Outbox) -> None:
        out.add(seq, events.started(seq, self.model_name))
        for i in seq.input_events:
            out.add(seq, events.policy(seq, i, "input"))

    # -- run --------------------------------------------------------------------------

    def _run(self, rows: list[Row], out: Outbox) -> _InFlight | None:
        """Launch the step's rows (on CUDA this returns at once)."""
        if not rows:
            return None
        t = time.perf_counter()
        launched = self._launch(rows, out)
        self._loop_time["launch"].inc(time.perf_counter() - t)
        return launched

    def _launch(self, rows: list[Row], out: Outbox) -> _InFlight | None:
        now = time.perf_counter()
        if self._in_flight is not None:
            STEP_SECONDS.observe(now - self._last_launch)
            self._counts[0] += 1
            self._counts[2] += now - self._last_launch
        self._last_launch = now
        try:
            launch = self.runner.launch([self._step_row(r) for r in rows])
        except Exception as e:
            self._step_failed(e, [r.seq for r in rows], out)
            return None
        STEP_ROWS.observe(sum(len(r.tokens) or 1 for r in rows))
        seqs = [rows[i].seq for i in launch.order]
        for j, seq in enumerate(seqs):
            seq.pending_row = j
        return _InFlight(launch, seqs)

    def _step_row(self, row: Row) -> StepRow:
        seq, s = row.seq, row.seq.sampling
        position = row.start + max(len(row.tokens), 1)  # of the token this row samples
        if row.optimistic:
            # Its exact bans depend on the token it follows, not checked yet: it runs under
            # the policy's base bans, and its token is checked against the exact ones after.
            bans = seq.guard.base_bans()
        else:
            if seq.bans is None:
                seq.bans, seq.bans_exact = seq.guard.next_bans()
            bans = seq.bans
        return StepRow(seq.slot, row.start, row.tokens, seq.pending_row, row.sample,
                       s.temperature, s.top_k, s.top_p,
                       0 if s.greedy else noise_key(seq.noise_seed, position), bans)

    # -- postprocess ------------------------------------------------------------------

    def _postprocess(self, flight: _InFlight, out: Outbox) -> tuple[float, float]:
        """Act on a finished step's tokens, sequence by sequence; returns the wall and CPU
        seconds it waited for them."""
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            results = flight.launch.tokens()
        except Exception as e:
            self._step_failed(e, flight.seqs, out)
            return 0.0, 0.0
        waited = time.perf_counter() - wall, time.thread_time() - cpu
        acting = time.perf_counter()
        enforcer = self.enforcer
        accepted = enforcer.accepted
        for seq, (token, first) in zip(flight.seqs, results, strict=True):
            if seq.status is not Status.RUNNING:
                continue  # cancelled or finished while this step ran
            if seq.stale:
                seq.stale -= 1  # computed from a token since taken back
                continue
            seq.ahead -= 1
            try:
                enforcer.on_token(seq, token, first, out)
            except Exception:
                log.exception("request failed in the engine", request_id=seq.request_id)
                self._fail(seq, out, grpc.StatusCode.INTERNAL, "the engine failed this request")
        accepted = enforcer.accepted - accepted
        self._counts[1] += accepted
        TOKENS.inc(accepted)  # once per step: a metric per token costs
        self._loop_time["tokens"].inc(time.perf_counter() - acting)
        return waited

    # -- failures ---------------------------------------------------------------------

    def _step_failed(self, error: Exception, seqs: list[Sequence], out: Outbox) -> None:
        if not self.runner.healthy():
            log.error("the device failed; the engine stops", error=repr(error))
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                self._fail(seq, out, grpc.StatusCode.UNAVAILABLE,
                           "the engine's device failed; retry the request")
            raise EngineFailed(repr(error)) from error
        log.exception("a step failed; failing its requests", requests=len(seqs))
        for seq in dict.fromkeys(seqs):
            if seq.status is Status.RUNNING:
                self._fail(seq, out, grpc.StatusCode.INTERNAL, "the engine failed this request")

    def _fail(self, seq: Sequence, out: Outbox, code: grpc.StatusCode, message: str) -> None:
        out.add(seq, events.error(seq.request_id, code, message))
        self.scheduler.release(seq)

    # -- bookkeeping ------------------------------------------------------------------

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _count_loop_time(self, wall: float, cpu: float, waited: tuple[float, float]) -> None:
        """A step's wall and CPU time split into its wait for the device and the rest (host):
        wall well above CPU says the loop waited for the GIL or for a core."""
        wait_wall, wait_cpu = waited
        loop = self._loop_time
        loop["device"].inc(wait_wall)
        loop["device_cpu"].inc(wait_cpu)
        loop["host"].inc(time.perf_counter() - wall - wait_wall)
        loop["host_cpu"].inc(max(time.thread_time() - cpu - wait_cpu, 0.0))

    def _report(self) -> None:
        """What the loop did lately, for operators: counts only, never text."""
        steps, tokens, busy = self._counts
        if steps:
            log.info("engine stats", steps=steps, tokens=tokens,
                     ms_per_step=round(1000 * busy / steps, 2),
                     running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                     late_repairs=int(LATE_REPAIRS._value.get()))
        self._counts = [0, 0, 0.0]

    # -- synchronous use (tests, benchmarks) ------------------------------------------

    def generate(self, request: chat_pb2.ChatRequest) -> list[chat_pb2.ChatServerMessage]:
        """Run one request to completion on the calling thread; returns its events."""
        sink = CollectingSink()
        self.submit(self.prepare(request, sink))
        while not sink.finished:
            self.step()
        return sink.events


class CollectingSink:
    def __init__(self) -> None:
        self.events: list[chat_pb2.ChatServerMessage] = []

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].WhichOneof("event") in ("finished", "error")

    def deliver(self, step: engine_pb2.EngineStep) -> None:
        self.events.extend(step.events)
