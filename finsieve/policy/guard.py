"""Enforcement for one sequence: what to do with each sampled token, and what may be released.

The engine asks, per step: which tokens are banned at this position (`banned`), then,
for the token it sampled, what to do (`check`). The ban list is the exact mask unless
building it would cost more than the tables' work limit (masks.py): then it is the base
bans (`mask_exact` False), and `check(token, exact_mask=True)` refuses a token the exact
mask would ban; the engine bans it at this position (`refuse`) and samples again:

  accept    the token stands;
  resample  a `block` span lies inside this very token: ban it here and sample again;
  rollback  a `block` span began in earlier tokens (SAR): keep the first `keep` tokens,
            ban the span's first token at that position, decode again from there;
  rewrite   a `rewrite` span: keep `keep` tokens and force `text` into the context;
  halt      a `halt` span, or too many rollbacks: stop, deliver what was safe.

Text is released only up to a token boundary at or before the matcher's safe point, and
only where no UTF-8 character is split. Every rollback goes back to such a boundary at or
before the span's start, so nothing released is ever taken back.

The engine asks one question per sampled token, `judge`, and gets back a complete action
(`Action`): `Accept` (the token stands; the engine records it, then takes the text now
final with `take` and the redactions released with `take_events`), `Redo` (decode the
position again: the token was banned here since its row launched, or the exact mask
refuses it), `Resample` (a block span inside the token: banned here, decoded again),
`RollBack` (SAR or rewrite: the guard has already gone back to `keep` tokens; the engine
sets the sequence back and forces `forced` text in, if any) or `Halt` (deliver `text`, then
the intervention; the answer ends). When the answer ends for another reason (stop, length)
`settle` says whether it stands. The engine never reads the guard's fields.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .masks import MaskTables, TokenTable
from .matcher import Match, StreamMatcher
from .pack import Pack
from .sources import DEFAULT_LIMITS, PackLimits

# Which action wins when one token completes several matches.
_PRIORITY = {"halt": 0, "block": 1, "rewrite": 2, "redact": 3}
MAX_RESAMPLES = 32  # tokens refused at one position; then the sequence halts
MAX_REDRAWS = 32  # tokens the exact mask refuses at one position (not built); then it halts


@dataclass(frozen=True)
class Policy:
    """A compiled pack and its mask tables: what a request runs under, start to finish."""

    pack: Pack
    masks: MaskTables | None
    version: str


def compile_policy(directory: Path, tokens: TokenTable, luts: Path | None,
                   limits: PackLimits = DEFAULT_LIMITS) -> tuple[Policy, str]:
    """Load a rules directory and build its mask tables; raises schema.PackError."""
    pack = Pack.load(directory, limits)
    masks = MaskTables.load_or_build(
        tokens, pack.output.literal_patterns(("block",)), pack.version, luts,
        limits.mask_work_limit)
    return Policy(pack, masks, pack.version), pack.version


class Verdict(enum.Enum):
    ACCEPT = "accept"
    RESAMPLE = "resample"
    ROLLBACK = "rollback"
    REWRITE = "rewrite"
    HALT = "halt"


@dataclass(frozen=True)
class Intervention:
    """What the client (and the audit trail) is told about one policy action."""

    rule_id: str
    action: str
    start: int  # characters of the delivered text
    end: int
    rolled_back: bool = False
    tokens_recomputed: int = 0
    message: str = ""
    suppressed: str = ""  # the text that was not delivered (for the audit trail only)


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    keep: int = 0  # ROLLBACK/REWRITE: output tokens that stand
    text: str = ""  # REWRITE: text forced after them
    match: Match | None = None
    cut: int = 0  # HALT: raw bytes that may still be delivered (none of a span that acts)


ACCEPT = Decision(Verdict.ACCEPT)


# -- what the engine does with a sampled token (judge's answer) ------------------------------
# Tuples: one is returned per token. `events` are sent before anything else the action does.


class Accept(NamedTuple):
    """The token stands."""

    events: tuple[Intervention, ...] = ()  # the mask steered the model off its first choice


class Redo(NamedTuple):
    """Decode this position again, under its exact bans; `wasted` rows were computed for it
    in vain (late repairs)."""

    wasted: int = 0


class Resample(NamedTuple):
    """A block span lies inside the token just sampled: it is banned here; decode again."""

    events: tuple[Intervention, ...]


class RollBack(NamedTuple):
    """SAR or rewrite: the guard now stands at `keep` output tokens; the sequence goes back
    there, the text `forced` (a rewrite; None for a rollback) is put into its context, and
    decoding goes on. `intervention` follows `events`, before any text now released."""

    keep: int
    forced: str | None
    intervention: Intervention
    events: tuple[Intervention, ...] = ()


class Halt(NamedTuple):
    """Deliver `text` (what was safe), then `intervention`; the answer ends CONTENT_FILTER."""

    text: str
    intervention: Intervention
    events: tuple[Intervention, ...] = ()


Action = Accept | Redo | Resample | RollBack | Halt
ACCEPTED = Accept()  # most tokens: nothing to say
REDO_WASTED = Redo(1)


@dataclass
class Guard:
    policy: Policy
    token_bytes: list[bytes]
    max_rollbacks: int = 8
    max_resamples: int = MAX_RESAMPLES
    max_redraws: int = MAX_REDRAWS
    matcher: StreamMatcher = field(init=False)
    tokens: list[int] = field(default_factory=list)  # output tokens fed, in order
    bans: dict[int, set[int]] = field(default_factory=dict)  # position -> banned token ids
    rollbacks: int = 0
    released: int = 0  # raw bytes delivered
    released_tokens: int = 0  # output tokens wholly inside them
    delivered_chars: int = 0
    events: list[Intervention] = field(default_factory=list)  # not yet sent
    mask_exact: bool = True  # the last banned() list is the exact mask (else the base bans)
    attempts: int = 0  # tokens refused at the current position (resamples)
    redraws: int = 0  # tokens sampled under the base bans that the exact mask refused here

    def __post_init__(self) -> None:
        self.matcher = StreamMatcher(self.policy.pack.output)

    # -- before sampling ------------------------------------------------------------------

    def version(self) -> str:
        """The policy version this guard enforces."""
        return self.policy.version

    def token_table(self) -> list[bytes]:
        """Each token id's bytes, as the guard reads them."""
        return self.token_bytes

    def next_bans(self) -> tuple[list[int], bool]:
        """The sorted token ids that may not be sampled next, and whether they are the exact
        mask: where it would cost more than the work limit, they are the base bans, and the
        token sampled must be judged with exact=False. Both with this position's own bans."""
        position = len(self.tokens)
        masks = self.policy.masks
        ids: list[int] = []
        self.mask_exact = True
        if masks is not None:
            exact = masks.bounded_ban_set_for(self.matcher)
            self.mask_exact = exact is not None
            ids = exact if exact is not None else masks.always_banned
        extra = self.bans.get(position)
        return (sorted(set(ids) | extra) if extra else ids), self.mask_exact

    def banned(self) -> list[int]:
        """next_bans' ids (mask_exact says which list they are)."""
        return self.next_bans()[0]

    def base_bans(self) -> list[int]:
        """What the policy bans whatever the text: the mask of a row whose text is not known
        yet (an optimistic row, decoded before its previous token was judged)."""
        masks = self.policy.masks
        return masks.always_banned if masks is not None else []

    def refuse(self, token: int) -> None:
        """The exact mask bans `token` at this position (check said None): ban it here."""
        self.bans.setdefault(len(self.tokens), set()).add(token)

    def masked(self, token: int) -> Intervention | None:
        """If `token` (the model's first choice) was masked: the rule it would have broken."""
        found = self.matcher.feed(self._bytes(token))
        self.matcher.rollback(len(self.tokens))
        m = next((m for m in found if m.rule.action == "block"), None)
        if m is None:
            return None
        at = self.delivered_chars + len(self.matcher.render(self.released, self.matcher.norm.raw_len))
        return Intervention(m.rule.id, "block", at, at, suppressed=m.text)

    # -- after sampling -------------------------------------------------------------------

    def judge(self, token: int, first: int, row_bans: list[int] | None, exact: bool,
              eos: bool) -> Action:
        """What to do with `token`, sampled under `row_bans` (None: an optimistic row, under
        the base bans; exact: they were the exact mask); `first`: the model's choice before
        the mask; eos: the token ends the answer (it has no text)."""
        if token < 0:  # every token banned: nothing left to say that the rules allow
            return self._nothing_allowed()
        optimistic = row_bans is None
        if row_bans is None:
            if token in self.bans.get(len(self.tokens), ()):
                return REDO_WASTED  # banned here since its row launched: decode it again
            masks = self.policy.masks  # base_bans(), inlined: asked for most tokens
            row_bans = masks.always_banned if masks is not None else []
        steered = None
        if self.attempts == 0 and first != token:
            i = bisect.bisect_left(row_bans, first)
            if i < len(row_bans) and row_bans[i] == first:
                steered = self.masked(first)
        # Sampled without the exact mask (optimistic, or it was over the work limit): the
        # check asks the exact mask about this one token.
        decision = self.finish() if eos else self.check(token, exact_mask=optimistic or not exact)
        if decision is None:
            return self._refused(token)  # the exact mask bans it
        events: tuple[Intervention, ...] = (steered,) if steered is not None else ()
        verdict = decision.verdict
        if verdict is Verdict.ACCEPT:
            self.attempts = self.redraws = 0
            return Accept(events) if events else ACCEPTED
        if verdict is Verdict.RESAMPLE:
            events += (self.blocked_here(decision),)
            self.attempts += 1
            if self.attempts >= self.max_resamples:
                return self._halted(decision, events)
            return Resample(events)
        return self._acted(decision, events)

    def settle(self) -> Action:
        """The answer ends here, not by EOS (a stop string, its length): a regex waiting for
        more text is settled now. Accept, RollBack or Halt."""
        decision = self.finish()
        if decision.verdict is Verdict.ACCEPT:
            return ACCEPTED
        return self._acted(decision, ())

    def _acted(self, decision: Decision, events: tuple[Intervention, ...]) -> Action:
        """A HALT, ROLLBACK or REWRITE decision carried out on the guard's own state."""
        if decision.verdict is Verdict.HALT:
            return self._halted(decision, events)
        forced = decision.text if decision.verdict is Verdict.REWRITE else None
        return RollBack(decision.keep, forced, self.rollback(decision), events)

    def _halted(self, decision: Decision, events: tuple[Intervention, ...]) -> Halt:
        text, intervention = self.halt(decision)
        return Halt(text, intervention, events)

    def _nothing_allowed(self) -> Halt:
        at = self.delivered_chars
        return Halt("", Intervention("", "halt", at, at, message="no allowed continuation"))

    def _refused(self, token: int) -> Action:
        """The exact mask bans the token sampled: ban it at this position and decode the
        position again; past max_redraws refusals here the answer halts (fail closed)."""
        self.refuse(token)
        self.redraws += 1
        if self.redraws > self.max_redraws:
            text, intervention = self.give_up(
                "too many tokens refused at one position (FINSIEVE_MASK_WORK_LIMIT)")
            return Halt(text, intervention)
        return REDO_WASTED

    def blocked_here(self, decision: Decision) -> Intervention:
        """A span inside the token just sampled: masked and resampled, nothing recomputed."""
        m = decision.match
        assert m is not None
        at = self.delivered_chars + len(self.matcher.render(self.released, self.matcher.norm.raw_len))
        return Intervention(m.rule.id, m.rule.action, at, at, suppressed=m.text)

    def check(self, token: int, exact_mask: bool = False) -> Decision | None:
        """Feed a sampled token; decide what happens to it. exact_mask: it was sampled under
        the policy's base bans only (see masks.py): None, and nothing fed, if this position's
        exact mask bans it. The mask bans only tokens that complete a block literal, so it
        is asked only when feeding the token completed one."""
        matcher = self.matcher
        before = matcher.norm.raw_len
        data = self.token_bytes[token] if token < len(self.token_bytes) else b""  # _bytes(token)
        found = matcher.feed(data)
        if not found:  # most tokens: accepted (as _decide would say)
            self.tokens.append(token)
            return ACCEPT
        if exact_mask and any(m.rule.action == "block" and m.rule.kind == "literal"
                              for m in found):
            self.matcher.rollback(len(self.tokens))
            masks = self.policy.masks
            if masks is not None and masks.is_banned(self.matcher, token, data):
                return None
            found = self.matcher.feed(data)
        self.tokens.append(token)
        decision = self._decide(found, before, resample_ok=True)
        if decision.verdict is Verdict.RESAMPLE:
            self._undo_last()
            self.bans.setdefault(len(self.tokens), set()).add(token)
        return decision

    def finish(self) -> Decision:
        """The answer ends here (EOS, stop, length): settle what was waiting for more text."""
        found = self.matcher.finish()
        return self._decide(found, self.matcher.norm.raw_len, resample_ok=False)

    def force(self, tokens: list[int]) -> None:
        """Tokens put into the context by a rewrite: they are part of the answer."""
        for t in tokens:
            self.matcher.feed(self._bytes(t))
            self.tokens.append(t)

    def _bytes(self, token: int) -> bytes:
        # Models often pad their logits past the tokenizer's vocabulary: no text there.
        return self.token_bytes[token] if token < len(self.token_bytes) else b""

    def _decide(self, found: list[Match], before: int, resample_ok: bool) -> Decision:
        if not found:  # most tokens
            return ACCEPT
        acting = [m for m in found if m.rule.action != "redact" or m.timed_out]
        if not acting:
            return ACCEPT
        # A halt delivers nothing of any span that acts, whichever rule it halts on: a block
        # span completed by the token that completes a later halt span was delivered.
        cut = min(m.start for m in acting)
        late = min((m for m in acting if m.timed_out), key=lambda m: m.start, default=None)
        if late is not None and late.start == cut:
            # Fail closed, and once: searched on, it would time out at each token. A span that
            # begins before it acts first (a rollback drops this match too).
            return Decision(Verdict.HALT, match=late, cut=cut)
        m = min((m for m in acting if not m.timed_out),
                key=lambda m: (_PRIORITY[m.rule.action], m.start))
        if m.rule.action == "halt":
            return Decision(Verdict.HALT, match=m, cut=cut)
        if m.rule.action == "block" and resample_ok and m.start >= before:
            return Decision(Verdict.RESAMPLE, match=m)
        if self.rollbacks >= self.max_rollbacks:
            return Decision(Verdict.HALT, match=m, cut=cut)
        keep = self.matcher.clean_boundary_before(m.start)
        if m.rule.action == "rewrite":
            prefix = bytes(self.matcher.raw[self.matcher.checkpoint_raw(keep) : m.start])
            return Decision(Verdict.REWRITE, keep, prefix.decode("utf-8", "replace")
                            + m.rule.replacement, m)
        return Decision(Verdict.ROLLBACK, keep, match=m)

    def rollback(self, decision: Decision) -> Intervention:
        """Apply a ROLLBACK or REWRITE decision to the guard's own state."""
        m = decision.match
        assert m is not None
        keep = decision.keep
        recomputed = len(self.tokens) - keep
        if decision.verdict is Verdict.ROLLBACK:
            self.bans.setdefault(keep, set()).add(self.tokens[keep])
        for position in [p for p in self.bans if p > keep]:
            del self.bans[position]  # they were bans after another prefix
        suppressed = bytes(self.matcher.raw[m.start : m.end]).decode("utf-8", "replace")
        # Where the span would have been in the delivered text: after what stays.
        at = self.delivered_chars + len(
            self.matcher.render(self.released, self.matcher.checkpoint_raw(keep)))
        end = at
        if decision.verdict is Verdict.REWRITE:
            at += len(decision.text) - len(m.rule.replacement)
            end = at + len(m.rule.replacement)
        self.matcher.rollback(keep)
        del self.tokens[keep:]
        self.rollbacks += 1
        self.attempts = self.redraws = 0  # a new position
        return Intervention(m.rule.id, m.rule.action, at, end, rolled_back=True,
                            tokens_recomputed=recomputed, suppressed=suppressed)

    def give_up(self, message: str) -> tuple[str, Intervention]:
        """Halt with no span to blame (e.g. too many tokens refused at one position):
        deliver what was safe; the answer ends."""
        text = self._take(self._release_point())
        return text, Intervention("", "halt", self.delivered_chars, self.delivered_chars,
                                  message=message)

    def halt(self, decision: Decision) -> tuple[str, Intervention]:
        """Deliver what was safe, never the halting span; the answer ends."""
        m = decision.match
        assert m is not None
        end = min(self._release_point(), decision.cut)
        text = self._take(end)
        suppressed = bytes(self.matcher.raw[m.start : m.end]).decode("utf-8", "replace")
        if m.timed_out:
            action, reason = "halt", "a search of this rule ran out of time (FINSIEVE_REGEX_TIMEOUT_MS)"
        else:
            action = m.rule.action
            reason = m.rule.message if action == "halt" else "too many rollbacks"
        return text, Intervention(m.rule.id, action, self.delivered_chars,
                                  self.delivered_chars, message=reason, suppressed=suppressed)

    # -- releasing text -------------------------------------------------------------------

    def take(self, limit: int | None, final: bool) -> tuple[str, int]:
        """release(limit, final), and the output tokens wholly inside the text released so
        far (the text may end inside a token; final: that does not matter, the caller
        counts every token)."""
        return self.release(limit, final), self.released_tokens

    def take_events(self) -> list[Intervention]:
        """The redactions released since the last call, in order (the caller sends them)."""
        events = self.events
        if not events:
            return events  # (most tokens: no new list)
        self.events = []
        return events

    def release(self, limit: int | None = None, final: bool = False) -> str:
        """Text that is now final (redactions applied), up to `limit` raw bytes if given."""
        m = self.matcher
        # _release_point(), inlined: asked after every token.
        end = m.norm.decoded_len if final else m.checkpoint_raw(m.clean_boundary_before(m.safe_point))
        if limit is not None and limit < end:
            end = limit
        return self._take(end) if end > self.released else ""

    def _take(self, end: int) -> str:
        # A redaction is delivered whole and once: never cut by the end of a release (a match
        # still growing over its end may hold it back).
        while cut := self.matcher.edits_across(end):
            end = self._at_most(min(m.start for m in cut))
        if end <= self.released:
            return ""
        text = self.matcher.render(self.released, end)
        # Redactions now delivered: tell the client where they sit in the delivered text.
        delivered = [m for m in self.matcher.edits_starting(self.released, end)
                     if m.rule.action == "redact" and m.end <= end]
        for m in delivered:
            at = self.delivered_chars + len(self.matcher.render(self.released, m.start))
            self.events.append(Intervention(
                m.rule.id, "redact", at, at + len(m.rule.replacement),
                suppressed=bytes(self.matcher.raw[m.start : m.end]).decode("utf-8", "replace"),
            ))
        self.released = end
        self.released_tokens = self.matcher.clean_boundary_before(end)
        self.delivered_chars += len(text)
        return text

    def _release_point(self) -> int:
        return self._at_most(self.matcher.safe_point)

    def _at_most(self, offset: int) -> int:
        """The last clean token boundary (no split character) at or before offset."""
        return self.matcher.checkpoint_raw(self.matcher.clean_boundary_before(offset))

    def _undo_last(self) -> None:
        self.matcher.rollback(len(self.tokens) - 1)
        self.tokens.pop()
