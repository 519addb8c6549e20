"""Enforcement carried out: what the engine does to a sequence for each action of its guard.

The guard (finsieve.policy.guard) judges every sampled token and answers with an action;
this module is the one place that acts on it, and the engine's only door to the policy
after sampling:

  Accept    the token joins the answer; the text now final goes out as a delta, with the
            redactions it releases; the answer may end here (EOS, stop string, length), and
            then the guard settles what was waiting for more text;
  Redo      the position is decoded again: the steps already launched for the sequence are
            dropped (late repairs) and its next row runs under its exact bans;
  Resample  the same, after the intervention is sent (the token is banned there now);
  RollBack  SAR or rewrite: the answer goes back to `keep` tokens, its KV length with it
            (the cache keeps what still stands), the rewrite's text is put into its context,
            and decoding goes on;
  Halt      the safe text, then the intervention; the answer ends CONTENT_FILTER.

Only that sequence is touched; the batch decodes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from finsieve.policy.guard import Accept, Action, Halt, Intervention, Redo, Resample, RollBack

from . import events
from .events import LATE_REPAIRS, ROLLBACKS, Outbox
from .scheduler import Scheduler
from .sequence import Finish, Sequence


class Enforcer:
    def __init__(self, scheduler: Scheduler, tokenize: Callable[[str], list[int]],
                 eos_ids: frozenset[int], max_context: int) -> None:
        self.scheduler = scheduler
        self.tokenize = tokenize  # a rewrite's text into token ids
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.accepted = 0  # tokens accepted, ever (the engine counts per step)

    def on_token(self, seq: Sequence, token: int, first: int, out: Outbox) -> None:
        """Act on the token sampled for this sequence (first: the model's choice before the
        mask) as its guard judges it."""
        eos = token in self.eos_ids  # (no text: never in a mask)
        action = seq.guard.judge(token, first, seq.bans, seq.bans_exact, eos)
        if type(action) is Accept:  # most tokens
            self._accept(seq, token, eos, action, out)
        else:
            self.carry_out(seq, action, out)

    def _accept(self, seq: Sequence, token: int, eos: bool, action: Accept, out: Outbox) -> None:
        if action.events:
            self._send(seq, action.events, out)  # the mask steered it
        seq.append(token, eos)
        self.accepted += 1
        if not seq.done and seq.context_len >= self.max_context:
            seq.finish_reason = Finish.LENGTH
        if seq.done and not eos:
            settled = seq.guard.settle()
            if type(settled) is not Accept:
                self.carry_out(seq, settled, out)
                return
        if seq.done:
            self.finish(seq, out)
            return
        self.deliver(seq, out)
        seq.bans = None  # the next position's: computed only if a step needs them

    def carry_out(self, seq: Sequence, action: Action, out: Outbox) -> None:
        """Any action but an accepted token's."""
        match action:
            case Redo(wasted=wasted):
                self.redo(seq, wasted=wasted)
            case Resample(events=sent):
                self._send(seq, sent, out)
                self.redo(seq)
            case RollBack():
                self._send(seq, action.events, out)
                self._roll_back(seq, action, out)
            case Halt():
                self._send(seq, action.events, out)
                self._end_filtered(seq, action.text, action.intervention, out)
            case Accept():
                raise ValueError("an accepted token is carried out by on_token")

    def redo(self, seq: Sequence, valid: int | None = None, wasted: int = 0) -> None:
        """The sequence's next step recomputes from its last token, under its exact bans;
        steps already launched for it are dropped (counted as late repairs)."""
        if wasted + seq.ahead:
            LATE_REPAIRS.inc(wasted + seq.ahead)
        seq.bans = None
        seq.redo(valid)

    def _roll_back(self, seq: Sequence, action: RollBack, out: Outbox) -> None:
        """SAR: the answer goes back to the span's start; the cache keeps what still stands."""
        ROLLBACKS.inc()
        seq.truncate(action.keep)
        valid = seq.context_len
        if action.forced is not None:  # a rewrite: its text is part of the answer now
            forced = self.tokenize(action.forced)
            seq.guard.force(forced)
            seq.extend(forced)
        self.redo(seq, valid)
        out.add(seq, events.policy(seq, action.intervention))
        self.deliver(seq, out)

    def _end_filtered(self, seq: Sequence, text: str, intervention: Intervention,
                      out: Outbox) -> None:
        """Deliver the safe text, then the intervention; the answer ends (CONTENT_FILTER)."""
        if text:
            out.delta(seq, text, 0)
        out.add(seq, events.policy(seq, intervention))
        seq.finish_reason = Finish.CONTENT_FILTER
        self.finish(seq, out)

    def deliver(self, seq: Sequence, out: Outbox) -> None:
        """The text now final, after the redactions it releases."""
        delta = seq.take_delta()
        for i in seq.guard.take_events():  # redactions just released
            out.add(seq, events.policy(seq, i))
        if delta is not None:
            out.delta(seq, *delta)

    def finish(self, seq: Sequence, out: Outbox) -> None:
        """Deliver what is left, then Finished; free the slot."""
        if seq.finish_reason not in (Finish.CANCELLED, Finish.CONTENT_FILTER):
            self.deliver(seq, out)
        out.add(seq, events.finished(seq))
        self.scheduler.release(seq)

    @staticmethod
    def _send(seq: Sequence, interventions: Iterable[Intervention], out: Outbox) -> None:
        for i in interventions:
            out.add(seq, events.policy(seq, i))
