"""What the next step computes: admission into KV slots, decode rows and chunked prefill.

No torch here: the scheduler decides which tokens of which sequences are fed at which KV
positions; the model runner feeds them. Every running sequence is in one of three states:

  * it has tokens the cache does not hold yet (a prompt, or text a rewrite forced in):
    they are fed in chunks that start at multiples of `prefill_chunk` positions, at most
    `prefill_chunk` tokens of prefill per step, so a burst of long prompts never holds
    the running streams back for more than one chunk (chunk boundaries depend on the
    sequence alone, so an answer never depends on what else arrived);
  * the cache holds all but its last token: one decode row feeds it (exact: the host
    knows the token and the rules' ban list for the next position);
  * a launched step is sampling its next token: one decode row feeds that token straight
    from the device (optimistic: the rules check it while this step runs; if they refuse
    it, this row's result is dropped and the position decoded again).

While streams decode, a fresh prompt may wait a few steps for others to share its prefill
forward (`prompt_batch`, `prompt_wait_steps`; TGI's max_waiting_tokens does the same): a
larger prefill uses the device better (an H200 spends ~34 us a token on one 320-token
prompt, ~25 us in a step of 2,048 tokens), and every prefill step holds the running streams
back for its length. (Before the prefill ran in CUDA graphs, issuing one cost the host ~20 ms
whatever its size, and prompts prefilled one a step cost a third of the throughput.)

Mixed steps (`mixed_tokens`, CUDA): a step with decode rows feeds at most `mixed_tokens`
prompt tokens as rows of the decode forward (Sarathi-Serve's piggybacking, as vLLM and
SGLang batch chunked prefill with decodes): decoding reads every weight once a step for a
few dozen rows, and a prefill forward of its own read them all again. Chunks then fill the
step's budget wherever they end (on a GPU an answer depends on the batch's shapes anyway),
the budget cut back to whole matmul tiles of rows (MIXED_TILE), and prompt batching is off.
Two cases still get prefill steps of their own beside the decode rows: a burst of prompts
(`prefill_chunk` tokens or more waiting), whose last prompt, and so the burst's answers,
start sooner in big steps than in chunks that each cost a decode step; and a prompt longer
than MIXED_MAX_POSITION, since a prompt token in a mixed step reads its slot's keys on its
own (the decode kernel), where a prefill forward's attention reads them once per chunk. On
the CPU mixed steps stay off: a prompt's chunks would then depend on what else runs, and
the CPU promises batch invariance.

A rollback (SAR), resample or rewrite is not special work: the sequence's tokens change and
`Sequence.redo` sets its KV length back; the next `schedule` feeds what the cache lacks.
Cancel and finish free the slot at once. Requests are indexed by (sink, request id), so a
cancel costs a dict lookup whatever the number of live requests.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

import grpc

from finsieve.errors import RequestError, invalid

from .sequence import Sequence, Sink, Status

# Past this many positions a prompt is prefilled in steps of its own, not in mixed steps. On
# an H200 a mixed step's 256 prompt tokens at positions below 512 cost 58 us a layer of
# attention (~6 us a token over 28 layers: one program per token re-reading its prefix);
# growing with the prefix, at ~1,000 positions that alone would pass (estimated, not
# measured) the ~25 us a token of a whole 2,048-token prefill step.
MIXED_MAX_POSITION = 1024

# A mixed step's rows (decode rows + prompt tokens) are the M of every weight's matmul, and
# cuBLAS computes M in tiles of 128 rows: one layer's matmuls on an H200 (Qwen2-7B shape,
# bf16, CUDA graphs) take 131 us at 64 rows, 135 at 128, 189 at 256, then 215 at 272 and
# 231 at 288 (a third tile started), 267 at 384. A prompt token costs ~0.4-0.6 us a layer
# in a tile that is filled and up to ~1.6 in one just started: a mixed step's prompt tokens
# stop at a tile's end when little of the next would be filled (Scheduler._mixed_budget).
# Another GPU or GEMM library may tile otherwise: bench/bench_matmul.py measures it. A
# multiple of 32, as the mixed steps' graph buckets are (DecodeGraphs), or a cut step would
# be padded into the next tile.
MIXED_TILE = 128


class Row(NamedTuple):
    """One sequence's share of a step (a tuple: one is built per row and step)."""

    seq: Sequence
    start: int  # KV position of the first token fed
    tokens: list[int]  # fed from the host; empty: the token the sequence's pending row samples
    sample: bool  # sample a token after the last one fed

    @property
    def optimistic(self) -> bool:
        return not self.tokens


class Scheduler:
    def __init__(self, n_slots: int, max_waiting: int, prefill_chunk: int, max_context: int,
                 prompt_batch: int = 0, prompt_wait_steps: int = 0, mixed_tokens: int = 0,
                 mixed_tile: int = MIXED_TILE) -> None:
        self.n_slots = n_slots
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.mixed_tokens = mixed_tokens  # 0: prefill beside decode rows in chunks of prefill_chunk
        self.mixed_tile = mixed_tile
        self.max_context = max_context
        self.prompt_batch = prompt_batch  # 0: a prompt is prefilled in the step after it arrives
        self.prompt_wait_steps = prompt_wait_steps
        self._steps = 0
        self._released_through = -1  # prompts admitted by this step are not held again
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free = list(range(n_slots - 1, -1, -1))
        self._live: dict[tuple[Sink, str], Sequence] = {}
        self._by_sink: dict[Sink, dict[str, Sequence]] = {}
        self._seconds_per_request = 0.0  # moving average, for the retry hint

    # -- requests in and out ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a request; raises RequestError when its id is in flight or the queue is full."""
        if (seq.sink, seq.request_id) in self._live:
            raise invalid("request_id", "a request with this id is in flight")
        if len(self.waiting) >= self.max_waiting:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the engine's queue is full ({self.max_waiting} requests wait for a slot); retry later",
                retry_after_ms=self.retry_after_ms(),
            )
        self._live[seq.sink, seq.request_id] = seq
        self._by_sink.setdefault(seq.sink, {})[seq.request_id] = seq
        self.waiting.append(seq)

    def find(self, sink: Sink, request_id: str) -> Sequence | None:
        return self._live.get((sink, request_id))

    def of_sink(self, sink: Sink) -> list[Sequence]:
        return list(self._by_sink.get(sink, {}).values())

    def release(self, seq: Sequence) -> None:
        """The sequence is over: its slot is free for the next step."""
        if self._live.pop((seq.sink, seq.request_id), None) is None:
            return
        of_sink = self._by_sink[seq.sink]
        del of_sink[seq.request_id]
        if not of_sink:
            del self._by_sink[seq.sink]
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._free.append(seq.slot)
            took = time.monotonic() - seq.admitted_at
            self._seconds_per_request += 0.1 * (took - self._seconds_per_request)
        else:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def retry_after_ms(self) -> int:
        """When a slot is likely free for one more request: the queue ahead of it, drained
        n_slots at a time at the recent pace."""
        per_request = self._seconds_per_request or 1.0
        rounds = (len(self.waiting) + 1) / self.n_slots
        return int(min(max(per_request * rounds, 0.1), 60.0) * 1000)

    def __len__(self) -> int:
        return len(self._live)

    # -- one step -----------------------------------------------------------------------

    def admit(self) -> list[Sequence]:
        """Waiting requests that take a free slot now, first come first served."""
        admitted = []
        while self.waiting and self._free:
            seq = self.waiting.popleft()
            seq.slot = self._free.pop()
            seq.status = Status.RUNNING
            seq.kv_len = seq.ahead = seq.stale = 0
            seq.admitted_at = time.monotonic()
            seq.admitted_step = self._steps
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def schedule(self) -> list[Row]:
        """The rows of the next step, decode rows first; marks what they will write and sample."""
        rows: list[Row] = []
        fresh: list[Sequence] = []  # the cache lacks more than their last token
        self._steps += 1
        hold = self._hold_prompts()
        for seq in self.running:
            if seq.ahead:
                if self._may_run_ahead(seq):
                    rows.append(Row(seq, seq.kv_len, [], True))
                    seq.kv_len += 1
                    seq.ahead += 1
            elif seq.context_len - seq.kv_len == 1:
                rows.append(Row(seq, seq.kv_len, [seq.token_at(seq.kv_len)], True))
                seq.kv_len += 1
                seq.ahead += 1
            elif not (hold and seq.kv_len == 0):  # a fresh prompt may wait for company
                fresh.append(seq)
        # Beside decode rows, prefill rides in their forward (a mixed step) in smaller chunks;
        # not a burst of prompts, nor a long one (see the module's notes).
        waiting = sum(seq.context_len - seq.kv_len for seq in fresh)
        mixed = bool(rows and self.mixed_tokens and waiting < self.prefill_chunk
                     and all(seq.context_len <= MIXED_MAX_POSITION for seq in fresh))
        chunk = self.prefill_chunk
        budget = self._mixed_budget(len(rows), waiting) if mixed else chunk
        for seq in fresh:
            feed = seq.context_len - seq.kv_len
            if self.mixed_tokens:  # a chunk may end anywhere: the budget is filled
                n = min(feed, budget)
                if not n:
                    break
            else:
                n = min(feed, chunk - seq.kv_len % chunk)
                if n > budget and budget < chunk:
                    continue  # the next step has room for it; one whole chunk always fits
            budget -= n
            last = n == feed
            rows.append(Row(seq, seq.kv_len, seq.tokens(seq.kv_len, seq.kv_len + n), last))
            seq.kv_len += n
            seq.ahead += last
        return rows

    def _mixed_budget(self, decode_rows: int, waiting: int) -> int:
        """A mixed step's prompt tokens: up to mixed_tokens, cut back to the last whole tile
        of rows when the rows past it would fill at most three quarters of a tile (a tile
        just started costs a prompt token two or three times what a full one does). What is
        cut rides in the next step. No cut when it keeps fewer tokens than it drops (at 127
        decode rows a cut would take one token a step), nor when a whole budget would still
        wait after it: prompts then arrive faster than cut steps take them, and the backlog
        must not grow into a burst. waiting: the prompt tokens the cache lacks."""
        take = min(waiting, self.mixed_tokens)
        part = (decode_rows + take) % self.mixed_tile  # rows past the last whole tile
        cut = take - part
        if 4 * part <= 3 * self.mixed_tile and cut >= part and waiting - cut < self.mixed_tokens:
            return cut
        return take

    def _hold_prompts(self) -> bool:
        """Do the fresh prompts wait this step? Only while other sequences decode, and until
        together they fill `prompt_batch` tokens (at most a chunk) or the oldest has waited
        `prompt_wait_steps` steps; prompts once released (some may not fit the step's chunk)
        never wait again. Text a rewrite forces in, and a prompt already started, never
        wait: a stream's answer would stall."""
        if not self.prompt_batch:
            return False
        tokens, oldest, decoding = 0, self._steps, False
        for seq in self.running:
            feed = seq.context_len - seq.kv_len
            if seq.kv_len == 0 and feed > 1:
                if seq.admitted_step <= self._released_through:
                    return False
                tokens += feed
                oldest = min(oldest, seq.admitted_step)
            elif (seq.ahead and self._may_run_ahead(seq)) or (not seq.ahead and feed == 1):
                decoding = True  # a decode row in this step
            elif not seq.ahead:
                return False  # prefill runs this step anyway: the prompts join it
        if not tokens:
            return False
        waited = self._steps - 1 - oldest  # steps held so far
        if decoding and tokens < min(self.prompt_batch, self.prefill_chunk) \
                and waited < self.prompt_wait_steps:
            return True
        self._released_through = self._steps - 1  # every prompt admitted before this step
        return False

    def _may_run_ahead(self, seq: Sequence) -> bool:
        """Decode the token a launched step is sampling before the host has seen it, unless
        that token will end the answer anyway."""
        return (seq.ahead == 1 and seq.kv_len < self.max_context
                and len(seq.output_ids) + 1 < seq.sampling.max_tokens)
