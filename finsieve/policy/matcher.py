"""The streaming matcher: one per sequence, fed the bytes of each token.

After every token it knows the matches completed so far and the **safe point**: the raw
byte offset before which no match can start any more. Everything before it may be
released to the client; the rest is held back. It keeps a checkpoint per token, so a
rollback (SAR) to an earlier token is cheap.

Literals: the matches ending in the new normalized characters and the depth of the longest
live suffix (the longest suffix of the text that still begins a pattern). Those within the
new characters alone come from pyahocorasick, memoized by those characters; those that begin
before them begin in the live suffix, and a walk of the trie from each of its characters
finds them (Literals.scan). So a rollback only restores that tail.
Regexes: searched with partial matching over a bounded window; a complete match that
could still grow into a longer one (the rest of the text is a prefix of a match from the
same start) is held until it is settled.

Invisible characters have two readings (normalize.py): the matcher reads the text the first
way, and from the first character where the other reading can differ (an invisible, a line
break after a hyphen) also the other way, with a second matcher fed the same tokens (built
when it starts from this one's checkpoints, not fed the text so far again: see _derived); once
the text holds both kinds of invisible, two more (every invisible as nothing, as a space).
Their matches count as this matcher's (once: the same rule over the same span is one
match), and the safe point is the earliest of them all. While the text ends in a hyphen
after a letter, a line break may still come and join the words around it in the other
readings: the safe point stays before every match that could then span the join.
"""

from __future__ import annotations

import bisect
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from prometheus_client import Counter

from .normalize import Hold, Normalizer, OtherNormalizer, fold_kind
from .pack import RuleSet
from .schema import EDITS, Rule
from .scripts import accepts
from .validators import VALIDATORS

REGEX_TIMEOUTS = Counter("finsieve_regex_timeouts", "Regex searches past the rules' timeout "
                         "(each counted as a match: fail closed)", ["rule_id"])
# How long a whole-text scan may retry searches that timed out on other threads' work.
MAX_WAIT_S = 1.0
# A whole-text scan's search of a text up to HELD_CHARS long first runs holding the GIL, for
# HELD_S of CPU at most (see within_cpu_budget).
HELD_CHARS = 4096
HELD_S = 0.002

T = TypeVar("T")


def within_cpu_budget(search: Callable[..., T], timeout: float, deadline: float, text: str,
                      *args: Any, **kwargs: Any) -> T:
    """search(text, *args, timeout=..., concurrent=..., **kwargs), failing closed
    (TimeoutError) once the search has used `timeout` of its own thread's CPU time, summed
    over attempts, or at `deadline` (perf_counter).

    `regex` counts its timeout on the process's CPU clock, every thread's work included:
    beside the engine's busy decode loop, a whole prompt's input scan (~2 ms of its own
    work) went past 20 ms, and benign prompts were refused (56 of 868 requests through gRPC
    on an H200 at 64 and 128 streams). A search that timed out having used less than its
    timeout is tried again with a larger budget.

    `regex` releases the GIL while it searches a str and takes it back at every check of
    its timeout, each time waiting for the holder's switch interval: released, a prompt's
    input scan (~1.5 ms alone) took ~20 ms beside one busy thread and ~200 ms beside three,
    and the engine loop lost the GIL at each of those checks (through gRPC at 128 streams the
    input scans' searches were a third of the engine process's samples). So the first
    attempt on a text up to HELD_CHARS long holds the GIL, for HELD_S at most: `regex`
    checks its timeout every 256 steps and a step can cross the whole text, so the text's
    length bounds how far past HELD_S it runs. A longer text, or a search that needs
    longer, releases it."""
    held = len(text) <= HELD_CHARS
    budget, used = (min(timeout, HELD_S) if held else timeout), 0.0
    while True:
        cpu = time.thread_time()
        try:
            return search(text, *args, timeout=budget, concurrent=not held, **kwargs)
        except TimeoutError:
            used += time.thread_time() - cpu
            left = deadline - time.perf_counter()
            if used >= timeout or left <= 0:
                raise
            budget = min(timeout if held else 4 * budget, left)
            held = False


@dataclass(frozen=True)
class Match:
    rule: Rule
    start: int  # raw byte offsets of the matched text
    end: int
    norm_start: int  # … and normalized character offsets
    norm_end: int
    text: str  # the normalized text that matched
    # A regex search past the rules' timeout: counted as a match from where it began to the
    # end of the text (fail closed); the guard halts the stream on it, whatever the action.
    timed_out: bool = False


class _Checkpoint(NamedTuple):
    raw_len: int
    decoded_len: int
    pending: bytes
    n_norm: int
    last_end: int
    space: tuple[int, int] | None
    hyphen: Hold | None
    depth: int
    in_making: tuple[tuple[int, int], ...]
    n_matches: int


_new_checkpoint = tuple.__new__
_raw_len = operator.attrgetter("raw_len")  # sort keys: checkpoints by raw length, matches by start
_n_norm = operator.attrgetter("n_norm")
_start = operator.attrgetter("start")
WALK_BACK = 4  # checkpoints clean_boundary_before steps back over before it searches
_READINGS = ("swapped", "dropped", "spaced")  # the other readings, in the order they start


class StreamMatcher:
    def __init__(self, rules: RuleSet, deadline: float | None = None, other: str | None = None,
                 second_reading: bool = True) -> None:
        """deadline (perf_counter): a whole-text scan, off the decode loop, whose searches
        may be retried until then (within_cpu_budget); None: the plain timeout.
        other: read the text another way (OtherNormalizer's readings), as a second reading.
        second_reading: False reads the first way only (what token masks are exact for)."""
        self.rules = rules
        self._deadline = deadline
        self._is_other = other is not None or not second_reading  # never starts another
        self.norm = OtherNormalizer(other) if other is not None else Normalizer()
        # The other readings, from where they can differ (see above): "swapped", then, once
        # the text holds both kinds of invisible, "dropped" and "spaced".
        self._others: list[StreamMatcher] = []
        # How far before a trailing hyphen a match that it may join can begin.
        self._join_span = max(rules.max_regex_span + 1, rules.literals.max_len)
        self.raw = bytearray()
        self.matches: list[Match] = []
        # The redact and rewrite matches by start (found order among equal starts), and the
        # longest one's raw bytes: render() reads only those that can overlap its range,
        # not every match of the answer at every release.
        self.edits: list[Match] = []
        self._longest_edit = 0
        self.depth = 0  # length of the longest live literal suffix
        self._tail = ""  # the live suffix of the normalized text: its last `depth` characters
        self._window = ""  # … and enough of them for every regex (see _regexes)
        self._window_len = rules.max_regex_span + 16
        # Regex index -> where its earliest match still in the making starts. A regex that
        # is not here has no match starting before the end of the text.
        self._in_making: dict[int, int] = {}
        self._checkpoints = [self._snapshot()]
        self._born = 0  # an other reading: the token count it started from
        self._name = other  # … and which one it is
        # The reading run unheard from the first invisible until the text holds both classes
        # (see _other_readings).
        self._shadow: StreamMatcher | None = None

    # -- feeding ----------------------------------------------------------------------

    def feed(self, data: bytes) -> list[Match]:
        """Feed one token's bytes; return the matches it completed."""
        self.raw += data
        new = self.norm.feed(data)
        found: list[Match] = []
        if new:
            self._window = (self._window + new)[-self._window_len :]
            self._literals(new, found)
            self._regexes(found, new, final=False)
        if self._others or self.norm.diverged_at is not None:  # most texts: neither
            self._other_readings(data, found)
        self._checkpoints.append(self._snapshot())
        return found

    def _other_readings(self, data: bytes, found: list[Match]) -> None:
        """Feed the other readings; start those the text now needs (in their state before
        this token, so before the others are fed it)."""
        others, norm = self._others, self.norm
        started = []
        if norm.diverged_at is not None and not self._is_other and len(others) < (
                1 if norm.mixed_at is None else len(_READINGS)):
            started = [self._reading(reading) for reading in
                       _READINGS[len(others) : 1 if norm.mixed_at is None else None]]
        if self._shadow is None and norm.mixed_at is None and not self._is_other and (
                norm._format_at is not None or norm._control_at is not None):
            # The first invisible: the reading that reads its class otherwise than "swapped"
            # does ("dropped" a format character, "spaced" a control) runs from here on
            # unheard (its matches and safe point unused), so that it is ready if the other
            # class comes: built then, it would be fed every token since again.
            reading = "dropped" if norm._control_at is None else "spaced"
            self._shadow = (others[0]._copy(reading) if others else
                            self._derived(reading, len(self._checkpoints) - 1))
        for other in others:
            self._adopt(other.feed(data), found)
        for other in started:
            self._adopt(other.feed(data), found)
            others.append(other)
        if self._shadow is not None:
            self._shadow.feed(data)

    def _reading(self, reading: str) -> StreamMatcher:
        """A matcher reading the text another way, in the state the tokens before this one
        leave it in (their matches are this one's: the readings differ only from here on).
        Built, not fed: replaying every earlier token cost as much as all of them had (72 ms
        at 1,000 tokens, on the decode loop, every stream waiting), once per stream."""
        tokens = len(self._checkpoints) - 1  # this token is being fed
        if not self._others:  # nothing read otherwise yet: the first way, but for hyphens
            return self._derived(reading, tokens)
        swapped, norm = self._others[0], self.norm
        decoded = self._checkpoints[tokens].decoded_len
        # Which invisibles came before this token: a reading that reads them as "swapped"
        # does has read the whole text as it did.
        seen = {"dropped": norm._format_at, "spaced": norm._control_at}[reading]
        if seen is None or seen >= decoded:
            return swapped._copy(reading)
        shadow, self._shadow = self._shadow, None
        if shadow is None or shadow._name != reading:  # never: the one run unheard is it
            raise RuntimeError(f"no reading {reading!r} to hand over")
        return shadow

    def _derived(self, reading: str, tokens: int) -> StreamMatcher:
        """Another reading's matcher in its state after the first `tokens` tokens, from this
        one's checkpoints, where nothing before them reads otherwise (no invisible, no line
        break after a letter and a hyphen). Its normalized text is then this one's, but for a
        hyphen after a letter, which the other reading holds until the next visible character
        (see OtherNormalizer): a hold still open drops the hyphen and the space after it from
        the text, and a hold released with a space maps that space from the hyphen's end to
        the next character (where a mark stood beside the space, this one maps it otherwise:
        Normalizer.marked_hyphens). The matcher's state is a function of the normalized text
        (the depth of its live literal suffix, where its regex matches in the making begin),
        so it is this one's at the last checkpoint within the other's text, fed the rest (a
        part of one token). List copies only; no token fed again."""
        checkpoints = self._checkpoints
        cp = checkpoints[tokens]
        other = StreamMatcher(self.rules, self._deadline, other=reading)
        other._born = tokens
        other.raw = self.raw[: cp.raw_len]
        src, dst = self.norm, other.norm
        n = cp.n_norm
        dst.text, dst.raw_start, dst.raw_end = src.text[:n], src.raw_start[:n], src.raw_end[:n]
        dst.tags = src.tags[:n]
        if n:
            dst.raw_end[-1] = cp.last_end
        dst.raw_len, dst.decoded_len, dst.space = cp.raw_len, cp.decoded_len, cp.space
        dst._decoder.setstate((cp.pending, 0))
        for k in src.marked_hyphens:
            if k + 2 < n and dst.text[k + 1] == " " and self._holds(k):
                dst.raw_start[k + 1], dst.raw_end[k + 1] = dst.raw_end[k], dst.raw_start[k + 2]
        seen, depth, in_making = n, cp.depth, cp.in_making
        h = dst.hyphen_at()
        if h is not None and self._holds(h):
            dst.hyphen = Hold(dst.raw_start[h], dst.raw_end[h], cp.decoded_len, "-", h + 1 < n, False)
            del dst.text[h:], dst.raw_start[h:], dst.raw_end[h:], dst.tags[h:]
            at = checkpoints[bisect.bisect_right(checkpoints, h, hi=tokens + 1, key=_n_norm) - 1]
            seen, depth, in_making = at.n_norm, at.depth, at.in_making
        text = dst.text
        other.depth, other._in_making = depth, dict(in_making)
        other._tail = "".join(text[seen - depth : seen]) if depth else ""
        other._window = "".join(text[max(seen - other._window_len, 0) : seen])
        if seen < len(text):  # before the held hyphen, in its token: what that token added
            new = "".join(text[seen:])
            other._window = (other._window + new)[-other._window_len :]
            other._literals(new, [])
            other._regexes([], new, final=False)
            # Found before this token: this reading's matches there are this one's.
            other.matches.clear()
            other.edits.clear()
            other._longest_edit = 0
        # Checkpoints before `tokens` are never restored: a rollback to before the token that
        # started this reading drops it (rollback).
        other._checkpoints = [*checkpoints[:tokens], other._snapshot()]
        return other

    def _holds(self, k: int) -> bool:
        """Whether the other readings hold the hyphen at normalized index k (one raw character
        read as '-'; hyphen_at says a letter is before it)."""
        norm = self.norm
        ch = bytes(self.raw[norm.raw_start[k] : norm.raw_end[k]]).decode("utf-8", "replace")
        return len(ch) == 1 and fold_kind(ch)[0] == "-"

    def _copy(self, reading: str) -> StreamMatcher:
        """This (other) reading's matcher, as another reading that has read the text as it did."""
        other = StreamMatcher(self.rules, self._deadline, other=reading)
        other._born = self._born
        other.raw = self.raw[:]  # (no shadow: only the first reading has one)
        src, dst = self.norm, other.norm
        dst.text, dst.raw_start, dst.raw_end = src.text[:], src.raw_start[:], src.raw_end[:]
        dst.tags = src.tags[:]
        dst.raw_len, dst.decoded_len, dst.space, dst.hyphen = (src.raw_len, src.decoded_len,
                                                              src.space, src.hyphen)
        dst._decoder.setstate(src._decoder.getstate())
        other.matches, other.edits = self.matches[:], self.edits[:]
        other._longest_edit, other.depth, other._tail = self._longest_edit, self.depth, self._tail
        other._window, other._in_making = self._window, dict(self._in_making)
        other._checkpoints = self._checkpoints[:]
        return other

    def _adopt(self, matches: list[Match], found: list[Match]) -> None:
        """The other reading's new matches, but those already found (the same rule over the
        same raw span: text that reads the same both ways). Each reading's matches do not
        depend on how the text was cut into tokens, so neither does their union."""
        for m in matches:
            if any(x.rule is m.rule and x.start == m.start and x.end == m.end
                   for x in self.matches[-32:]):
                continue
            self.matches.append(m)
            if m.rule.action in EDITS:
                bisect.insort(self.edits, m, key=_start)
                self._longest_edit = max(self._longest_edit, m.end - m.start)
            found.append(m)

    def finish(self) -> list[Match]:
        """The stream ended: settle the held space and regex matches waiting for more text."""
        found: list[Match] = []
        new = self.norm.flush()
        if new:
            self._window = (self._window + new)[-self._window_len :]
            self._literals(new, found)
        self._regexes(found, new, final=True)
        self.depth, self._tail = 0, ""
        for other in self._others:
            self._adopt(other.finish(), found)
        return found

    @property
    def text(self) -> str:
        return "".join(self.norm.text)

    # -- what may be released -----------------------------------------------------------

    @property
    def safe_point(self) -> int:
        """Raw byte offset before which text is final; pending UTF-8 bytes and a held space
        count as held back."""
        norm = self.norm
        n = len(norm.text)
        first_unsafe = n - self.depth
        if self._in_making:
            first_unsafe = min(first_unsafe, *self._in_making.values())
        if self._others:
            own = norm.raw_start[first_unsafe] if first_unsafe < n else norm.settled
            return min(own, *(other.safe_point for other in self._others))
        if n and norm.text[-1] in "- " and not self._is_other:
            hyphen = norm.hyphen_at()  # a line break may yet join the words around it
            if hyphen is not None:
                first_unsafe = min(first_unsafe, max(hyphen - self._join_span, 0))
        if first_unsafe < n:
            return norm.raw_start[first_unsafe]
        # norm.settled
        return norm.space[0] if norm.space else norm.hyphen[0] if norm.hyphen else norm.decoded_len

    @property
    def tokens(self) -> int:
        return len(self._checkpoints) - 1

    def checkpoint_raw(self, tokens: int) -> int:
        """Raw bytes fed by the first `tokens` tokens."""
        return self._checkpoints[tokens].raw_len

    def clean_boundary_before(self, offset: int) -> int:
        """The last token count whose boundary is at or before raw `offset` and splits no
        UTF-8 character: where text may be released up to, or decoding rolled back to."""
        checkpoints = self._checkpoints
        k = len(checkpoints) - 1
        if checkpoints[max(k - WALK_BACK, 0)].raw_len <= offset:  # most calls: a few steps back
            while checkpoints[k].raw_len > offset:
                k -= 1
        else:  # raw lengths never decrease: a search (a run of spaces held after a CJK
            # character had each release walk back over all of it)
            k = bisect.bisect_right(checkpoints, offset, key=_raw_len) - 1
        while k > 0 and checkpoints[k].pending:  # inside a character: a few bytes at most
            k -= 1
        return max(k, 0)

    def rollback(self, tokens: int) -> None:
        """Return to the state after the first `tokens` tokens (drops later matches too)."""
        if not 0 <= tokens <= self.tokens:
            raise ValueError(f"cannot roll back to token {tokens} of {self.tokens}")
        cp = self._checkpoints[tokens]
        del self._checkpoints[tokens + 1 :]
        del self.raw[cp.raw_len :]
        self.norm.truncate(cp.raw_len, cp.decoded_len, cp.pending, cp.n_norm, cp.last_end,
                           cp.space, cp.hyphen)
        if self._others or self._shadow is not None:
            self._rollback_readings(tokens)
        for m in self.matches[cp.n_matches :]:
            if m.rule.action in EDITS:
                i = bisect.bisect_left(self.edits, m.start, key=_start)
                while self.edits[i] is not m:
                    i += 1
                del self.edits[i]
        del self.matches[cp.n_matches :]
        self.depth = cp.depth
        self._in_making = dict(cp.in_making)
        self._tail = "".join(self.norm.text[len(self.norm.text) - self.depth :]) if self.depth else ""
        self._window = "".join(self.norm.text[-self._window_len :])

    def _rollback_readings(self, tokens: int) -> None:
        """Keep the other readings that something left reads otherwise (and the shadow, if an
        invisible is left but not both classes: the one dropped with the mixed readings)."""
        norm, others = self.norm, self._others
        keep = 0 if norm.diverged_at is None else 1 if norm.mixed_at is None else len(_READINGS)
        dropped = others[keep:]
        del others[keep:]
        shadow = None
        if keep == 1 and (norm._format_at is not None or norm._control_at is not None):
            name = "dropped" if norm._control_at is None else "spaced"
            shadow = self._shadow if self._shadow is not None else next(
                (o for o in dropped if o._name == name), None)
        self._shadow = shadow
        for other in others if shadow is None else [*others, shadow]:
            other.rollback(tokens)

    def render(self, start: int, end: int) -> str:
        """Raw text between byte offsets, with every redact/rewrite match replaced."""
        if not self.edits:  # most answers
            return self.raw[start:end].decode("utf-8", "replace") if start < end else ""
        out, pos = [], start
        for m in self.edits_starting(start - self._longest_edit, end):
            if m.end <= pos:
                continue
            out.append(self.raw[pos : max(pos, m.start)].decode("utf-8", "replace"))
            out.append(m.rule.replacement)
            pos = max(pos, m.end)
        out.append(self.raw[pos:end].decode("utf-8", "replace") if pos < end else "")
        return "".join(out)

    def edits_across(self, offset: int) -> list[Match]:
        """The redact and rewrite matches that begin before raw offset and end after it."""
        if not self.edits:  # most answers
            return []
        return [m for m in self.edits_starting(offset - self._longest_edit, offset) if m.end > offset]

    def edits_starting(self, lo: int, hi: int) -> list[Match]:
        """The redact and rewrite matches that start in raw [lo, hi), by start."""
        edits = self.edits
        return edits[bisect.bisect_left(edits, lo, key=_start) : bisect.bisect_left(edits, hi, key=_start)]

    # -- literals -----------------------------------------------------------------------

    def _literals(self, new: str, found: list[Match]) -> None:
        literals = self.rules.literals
        if literals.automaton is None:
            return
        # A match that ends in the new text and begins before it begins with a live suffix
        # of the text before it: no longer than `depth`. So each feed scans that suffix + new.
        hits, self._tail = literals.scan(self._tail, new)
        if hits:
            end_base = len(self.norm.text) - len(new) + 1
            scripts = literals.scripts
            for end, pattern, owners in hits:
                end_excl = end_base + end
                start = end_excl - len(pattern)
                if not accepts(scripts[pattern], self.norm.tags[start:end_excl]):
                    continue  # genuinely foreign text that happens to look like the pattern
                for rule in owners:
                    found.append(self._match(rule, start, end_excl))
        self.depth = len(self._tail)

    # -- regexes ------------------------------------------------------------------------

    def _regexes(self, found: list[Match], new: str, final: bool) -> None:
        if not self.rules.regexes:
            return
        n = len(self.norm.text)
        before = n - len(new)
        # Only regexes with a match in the making, or whose match can begin with one of
        # the new characters, can change; a new match can only begin in the new text.
        # The dict itself (no copy): nothing else holds it, checkpoints keep its items.
        active, self._in_making = self._in_making, {}
        prev = self.norm.text[before - 1] if before else ""  # "" at the start: nothing
        for i in self.rules.regexes_starting_in(new, prev):
            active.setdefault(i, before)
        if not active:
            return
        # The window holds every match in the making (none is longer than max_span + 1) and
        # a little context before it, for lookbehinds and \b.
        window = self._window
        base = n - len(window)
        if min(active.values()) < base + 8:  # a whole text fed at once
            base = max(0, min(active.values()) - 8)
            window = "".join(self.norm.text[base:])
        # `regex` releases the GIL for every search of a str, and takes it back at every
        # check of its timeout and every allocation, each time waiting for the holder's
        # switch interval. A streaming search (the short window, a few microseconds) keeps
        # it: the engine loop would otherwise wait for the GIL after each one while a gRPC
        # or executor thread runs (measured beside a busy thread: 1,500 searches/s instead
        # of 90,000). A whole text, off the loop: see within_cpu_budget.
        concurrent = None if len(window) > self._window_len else False
        streaming, late = self._deadline is None, False
        for i, pos in active.items():
            if late:  # streaming, the stream halts: not searched, still held from where it was
                self._in_making[i] = pos
                continue
            late = not self._search(i, pos, window, base, final, found, concurrent) and streaming

    def _budgeted(self, call: Callable[..., T]) -> Callable[..., T]:
        """call, for a whole text: retried within its CPU budget until the deadline (see
        within_cpu_budget, which decides whether it holds the GIL)."""
        deadline = self._deadline
        assert deadline is not None

        def search(window: str, timeout: float, concurrent: bool | None, **kwargs: Any) -> T:
            return within_cpu_budget(call, timeout, deadline, window, **kwargs)
        return search

    def _search(self, i: int, pos: int, window: str, base: int, final: bool,
                found: list[Match], concurrent: bool | None) -> bool:
        """Report regex i's settled matches from pos on; remember one still in the making.
        False: a search timed out."""
        r = self.rules.regexes[i]
        # Every search has the rules' timeout (TimeoutError: fail closed). Streaming, on the
        # decode loop, a search is called directly (never retried): one call per search.
        timeout = self.rules.regex_timeout_s
        search, fullmatch = r.pattern.search, r.pattern.fullmatch
        whole = self._deadline is not None  # a whole text
        if whole:
            search, fullmatch = self._budgeted(search), self._budgeted(fullmatch)
        n = base + len(window)
        # A match still growing that begins before this is longer than the rule allows (below).
        kept_from = n - r.max_span - 1 - base
        while pos < n:
            try:
                # At the end of the stream a match is what it is: no more partials.
                if whole and not final:
                    m = _first_match(search, window, pos - base, kept_from, timeout, concurrent)
                else:
                    m = search(window, pos=pos - base, partial=not final, timeout=timeout,
                               concurrent=concurrent)
                if m is None:
                    return True
                s, e = m.start() + base, m.end() + base
                # `regex` prefers a complete match to a partial one: "15%" is complete in
                # "15% and", but "gb82 west 1234 " may still become a longer IBAN.
                growing = not final and (m.partial or fullmatch(
                    window, pos=s - base, partial=True, timeout=timeout,
                    concurrent=concurrent) is not None)
            except TimeoutError:  # a pattern that backtracks: fail closed, as a match of the rest
                REGEX_TIMEOUTS.labels(r.rule.id).inc()
                found.append(self._match(r.rule, pos, n, timed_out=True))
                return False
            if growing and n - s > r.max_span + 1:
                # Longer than the rule allows (plus one character that a lookahead or \b
                # may need to settle it): nothing longer can match from s. A partial match
                # never will; a complete one is settled as it is. (`regex`'s partial
                # fullmatch calls some complete matches still growing, e.g. after a
                # lookbehind holding an optional letter: skipping them would leak.)
                if m.partial:
                    pos = s + 1
                    continue
                growing = False
            if growing:
                if s < n:
                    self._in_making[i] = s
                return True
            if e == s:  # an empty match says nothing
                pos = s + 1
                continue
            text = window[s - base : e - base]
            if accepts(r.scripts, self.norm.tags[s:e]) and all(
                    VALIDATORS[v](text) for v in r.rule.validators):
                found.append(self._match(r.rule, s, e))
                pos = e
            else:
                pos = s + 1  # not a real identifier, or foreign text; one may start later
        return True

    # -- bookkeeping --------------------------------------------------------------------

    def _match(self, rule: Rule, start: int, end: int, timed_out: bool = False) -> Match:
        m = Match(
            rule=rule,
            start=self.norm.raw_start[start],
            end=self.norm.raw_end[end - 1],
            norm_start=start,
            norm_end=end,
            text="".join(self.norm.text[start:end]),
            timed_out=timed_out,
        )
        self.matches.append(m)
        if rule.action in EDITS:
            bisect.insort(self.edits, m, key=_start)
            self._longest_edit = max(self._longest_edit, m.end - m.start)
        return m

    def _snapshot(self) -> _Checkpoint:
        # One per token: built in C (tuple.__new__ skips the NamedTuple's Python __new__),
        # no decoder state asked when no byte is pending (see Normalizer.pending), and no
        # tuple built for the (usually) empty dict.
        norm = self.norm
        return _new_checkpoint(_Checkpoint, (
            norm.raw_len, norm.decoded_len,
            norm.pending if norm.raw_len != norm.decoded_len else b"", len(norm.text),
            norm.raw_end[-1] if norm.raw_end else 0, norm.space, norm.hyphen, self.depth,
            tuple(self._in_making.items()) if self._in_making else (), len(self.matches)))


def _first_match(search: Callable[..., Any], window: str, pos: int, kept_from: int,
                 timeout: float, concurrent: bool | None) -> Any:
    """search(window, pos=pos, partial=True) as _search acts on it, for a whole text, in about
    half the time. `regex` answers a partial search with the first complete match if there is
    one, else with the first partial match (one that runs to the end of the text): two passes
    over the whole text. A partial match that begins before `kept_from` is longer than its rule
    allows, and _search skips it, so the second pass need only begin there. On the benchmark's
    prompts (128-512 tokens) the IBAN pattern took ~0.55 ms a search partial, ~0.2 ms not:
    most of a prompt's input scan, and of the gateway's masking of it for the audit trail."""
    cpu = time.thread_time()
    m = search(window, pos=pos, partial=False, timeout=timeout, concurrent=concurrent)
    if m is not None:
        return m
    # One search's timeout for both passes, as for the one search they replace.
    left = timeout - (time.thread_time() - cpu)
    if left <= 0:
        raise TimeoutError("a whole-text search used its timeout on its first pass")
    return search(window, pos=max(pos, kept_from), partial=True, timeout=left,
                  concurrent=concurrent)


def scan_text(rules: RuleSet, text: str) -> list[Match]:
    """All matches in a whole text (input rules, tests)."""
    matcher = StreamMatcher(rules, deadline=time.perf_counter() + MAX_WAIT_S)
    matcher.feed(text.encode())
    matcher.finish()
    return matcher.matches
