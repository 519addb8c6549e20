"""Token-mask tables: which tokens would complete a literal pattern, given the text so far.

A pattern has thousands of tokenizations (casing, spacing, full-width forms, look-alike
letters, invisible characters, split characters), so bans are computed over the
*normalized contribution* of each token, not over token-id sequences. The normalized view
maps each raw character on its own (normalize.py), so a token's contribution is the same
wherever it stands, except at its start. For a matcher state the exact ban set is:

  * tokens whose contribution contains a whole pattern (the always-banned set), and
  * for every live suffix `u` of the text that begins a pattern `u·v`, the tokens whose
    contribution, joined to the text, starts with `v` — a binary search in the sorted
    contributions for each way the join can go.

What the text ends in decides the join (`normalize.PLAIN`, `SPACE`, `CJK`, `CJK_SPACE`): after
a space, the token's leading space collapses; after a CJK character, a leading space
vanishes when a CJK character follows it; after a held space (CJK, then a space), a token
starting with a CJK character swallows it and any other token starts with it. Pending
bytes of an incomplete UTF-8 character are completed by the token's leading continuation
bytes: those are handled per group of tokens sharing them (a few dozen groups in a
byte-level vocabulary), by feeding the completed character to a normalizer in the same state.

A match counts only if its letters are not all of one script foreign to its pattern
(scripts.py), so each contribution carries its characters' script tags, and a ban whose
live suffix has no letter of the pattern's scripts keeps only the tokens that make it count.

The continuation work of one ban set grows with the patterns under the live suffix, times
the lead-byte groups when a character is pending: 30,000 patterns under one short prefix
took ~60 ms, ~400 ms with a pending byte, on the decode thread, where every stream waits;
and a client can steer to many distinct states. So the engine asks `bounded_ban_set_for`,
which gives up past `work_limit` units of work (FINSIEVE_MASK_WORK_LIMIT; `Budget`) and
says None: the row is then sampled under the base bans and its token checked exactly with
`is_banned` (guard.py). `ban_set` stays the exact reference, unbounded.

Tables are keyed by tokenizer fingerprint, normalized view and policy version, and persisted
under `luts/`.
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import json
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

from .matcher import StreamMatcher
from .memo import memoized, remember
from .normalize import CJK, CJK_SPACE, PLAIN, SPACE, VIEW_VERSION, Normalizer, is_cjk, plain_join
from .pack import MEMO_CHARS, Literals
from .scripts import ALNUM, accepts, script_tag

FORMAT = 2
# Units of continuation work (Budget) one bounded ban set may spend: about 0.4 ms on a
# 2-core laptop CPU (bench/bench_rules.py measures it). FINSIEVE_MASK_WORK_LIMIT.
DEFAULT_WORK_LIMIT = 250
# A pattern under the live suffix costs one unit (its one or two prefix lookups, ~2 us);
# each id they yield 1/IDS_PER_UNIT (copied, filtered, unioned and sorted); a lead-byte
# group GROUP_UNITS (its joined text searched), and its join of the pending bytes
# JOIN_UNITS more (a normalizer run, ~30 us), one unit when that is memoized.
IDS_PER_UNIT = 24
GROUP_UNITS = 2
JOIN_UNITS = 20
_CONT = range(0x80, 0xC0)
# Bytes that put a fresh normalizer in each state (a group's head is fed after them).
_SEED = {PLAIN: b"", SPACE: b" ", CJK: "一".encode(), CJK_SPACE: "一 ".encode()}


def fingerprint(token_bytes: list[bytes]) -> str:
    h = hashlib.sha256()
    for b in token_bytes:
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return h.hexdigest()[:16]


def _contribution(data: bytes) -> tuple[str, bytes, bytes]:
    """Normalized text and script tags of bytes fed to a fresh normalizer, and the bytes
    left pending. A space held at the end (after a CJK character) is not part of it."""
    n = Normalizer()
    n.feed(data)
    return "".join(n.text), bytes(n.tags), n.pending


def _lead(data: bytes) -> int:
    k = 0
    while k < len(data) and data[k] in _CONT:
        k += 1
    return k


def _mode_of(text: str) -> str:
    if not text:
        return PLAIN
    return SPACE if text[-1] == " " else CJK if is_cjk(text[-1]) else PLAIN


def _forms(v: str, mode: str) -> list[tuple[str, int]]:
    """How a token's contribution can start so that, joined after text in this mode, it
    starts with v: (prefix, k), where prefix[k:] are the characters of v the token gives
    (k = 1 when the join drops the prefix's leading space)."""
    if mode == PLAIN:
        return [(v, 0)]
    if mode == SPACE or is_cjk(v[0]):
        return [(v, 0), (" " + v, 1)]
    if mode == CJK:
        return [(v, 0)]
    # CJK_SPACE: the held space is emitted before anything but a CJK character.
    return [(v, 0), (v[1:], 0)] if v[0] == " " and len(v) > 1 else []


class OverBudget(Exception):
    """A bounded ban set ran out of work units: the exact mask is not built."""


class Budget:
    """Work units left for one ban set; spend() raises OverBudget past the end."""

    __slots__ = ("left", "spent")

    def __init__(self, limit: float) -> None:
        self.left = limit
        self.spent = 0

    def spend(self, units: int) -> None:
        self.spent += units
        self.left -= units
        if self.left < 0:
            raise OverBudget


_UNBOUNDED = float("inf")
_MISSING = object()


class _Sorted:
    """Token ids sorted by a string, answering "every id whose string starts with v"."""

    def __init__(self, strings: list[str], ids: list[int]) -> None:
        pairs = sorted(zip(strings, ids, strict=True))
        self.keys = [s for s, _ in pairs]
        self.ids = [i for _, i in pairs]

    def starting_with(self, prefix: str) -> list[int]:
        lo = bisect.bisect_left(self.keys, prefix)
        hi = bisect.bisect_left(self.keys, prefix + "\U0010ffff")
        return self.ids[lo:hi]


class TokenTable:
    """Per tokenizer: each token's normalized contribution and its script tags, indexed for
    prefix queries; and, for tokens that begin with UTF-8 continuation bytes, those bytes
    and the contribution of the rest."""

    def __init__(self, fp: str, contrib: list[str], tags: list[bytes], lead: list[bytes],
                 rest: list[str], rest_tags: list[bytes]) -> None:
        self.fingerprint = fp
        self.contrib = contrib
        self.tags = tags
        self.index = _Sorted(contrib, list(range(len(contrib))))
        groups: dict[bytes, list[int]] = {}
        for i, b in enumerate(lead):
            if b:
                groups.setdefault(b, []).append(i)
        self.lead = lead
        self.rest = rest
        self.rest_tags = rest_tags
        self.groups = {b: _Sorted([rest[i] for i in ids], ids) for b, ids in groups.items()}

    @classmethod
    def build(cls, token_bytes: list[bytes]) -> TokenTable:
        contrib, tags, lead, rest, rest_tags = [], [], [], [], []
        for data in token_bytes:
            text, t, _ = _contribution(data)
            contrib.append(text)
            tags.append(t)
            k = _lead(data)
            lead.append(data[:k])
            text, t, _ = _contribution(data[k:]) if k else ("", b"", b"")
            rest.append(text)
            rest_tags.append(t)
        return cls(fingerprint(token_bytes), contrib, tags, lead, rest, rest_tags)

    @classmethod
    def load_or_build(cls, token_bytes: list[bytes], luts: Path | None) -> TokenTable:
        fp = fingerprint(token_bytes)
        path = luts / fp / "tokens.json.gz" if luts else None
        if path is not None and path.exists():
            try:
                data = json.loads(gzip.decompress(path.read_bytes()))
                if (data["format"], data["fingerprint"], data["view"]) == (FORMAT, fp, VIEW_VERSION):
                    hexes = [[bytes.fromhex(h) for h in data[k]] for k in ("tags", "lead", "rest_tags")]
                    return cls(fp, data["contrib"], hexes[0], hexes[1], data["rest"], hexes[2])
            except (OSError, ValueError, KeyError):
                pass  # stale or damaged: rebuilt below
        table = cls.build(token_bytes)
        if path is not None:
            _write(path, gzip.compress(json.dumps({
                "format": FORMAT, "fingerprint": fp, "view": VIEW_VERSION,
                "contrib": table.contrib, "tags": [b.hex() for b in table.tags],
                "lead": [b.hex() for b in table.lead], "rest": table.rest,
                "rest_tags": [b.hex() for b in table.rest_tags],
            }, ensure_ascii=False).encode(), mtime=0))
        return table


class MaskTables:
    """Ban sets for one set of literal patterns over one tokenizer."""

    def __init__(self, tokens: TokenTable, patterns: list[str], always_banned: list[int] | None = None,
                 cache_size: int = 4096, work_limit: int = DEFAULT_WORK_LIMIT) -> None:
        self.tokens = tokens
        self.work_limit = work_limit  # per bounded ban set; 0: unbounded (the exact mask always)
        self.patterns = Literals({p: p for p in patterns})
        if always_banned is None:
            always_banned = [i for i, c in enumerate(tokens.contrib)
                             if self._completes(c, tokens.tags[i], 0)]
        if not self.patterns.keys:
            always_banned = []
        self.always_banned = sorted(always_banned)
        # A state's ban set, or None: past the work limit (asked again, it is not retried).
        self._cache: OrderedDict[tuple[str, bytes, bytes, str], list[int] | None] = OrderedDict()
        self._cache_size = cache_size
        # One token after a live suffix: the engine asks this for most sampled tokens, and
        # the same (suffix, token) pairs come back again and again.
        self._completed_by = memoized(self._joined_completes, 1 << 16)
        # Counts for tests and benchmarks: units spent by bounded ban sets, and how many
        # gave up.
        self.bounded_work = 0
        self.over_limit = 0
        # (mode, pending + lead bytes) -> what they add after text in that mode (_piece)
        self._pieces: dict[tuple[str, bytes], tuple[str, bytes, str, bool]] = {}

    @classmethod
    def load_or_build(cls, tokens: TokenTable, patterns: list[str], policy_version: str,
                      luts: Path | None, work_limit: int = DEFAULT_WORK_LIMIT) -> MaskTables:
        listed = "\n".join([VIEW_VERSION, *sorted(set(patterns))])
        digest = hashlib.sha256(listed.encode()).hexdigest()[:16]
        path = luts / tokens.fingerprint / f"{policy_version}.banned.json" if luts else None
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text())
                if (data["format"], data["fingerprint"], data["patterns"]) == (
                    FORMAT, tokens.fingerprint, digest,
                ):
                    return cls(tokens, patterns, data["always_banned"], work_limit=work_limit)
            except (OSError, ValueError, KeyError):
                pass  # stale or damaged: rebuilt below
        tables = cls(tokens, patterns, work_limit=work_limit)
        if path is not None:
            _write(path, json.dumps({
                "format": FORMAT, "fingerprint": tokens.fingerprint,
                "policy_version": policy_version, "patterns": digest,
                "always_banned": tables.always_banned,
            }).encode())
        return tables

    # -- queries ------------------------------------------------------------------------

    @property
    def max_tail(self) -> int:
        """How many trailing normalized characters decide a ban set."""
        return max(self.patterns.max_len - 1, 0)

    def ban_set_for(self, matcher: StreamMatcher) -> list[int]:
        """The ban set for a matcher's current state (its text, pending bytes, held space)."""
        tail, tags = self._tail_of(matcher)
        banned = self.ban_set(tail, matcher.norm.pending, matcher.norm.mode, tags)
        assert banned is not None  # (unbounded)
        return banned

    def bounded_ban_set_for(self, matcher: StreamMatcher) -> list[int] | None:
        """ban_set_for, unless building it takes more than `work_limit` units: then None (the
        caller samples under the base bans and checks the token with is_banned)."""
        tail, tags = self._tail_of(matcher)
        limit = self.work_limit if self.work_limit > 0 else _UNBOUNDED
        budget = Budget(limit)
        try:
            return self.ban_set(tail, matcher.norm.pending, matcher.norm.mode, tags, budget)
        finally:
            self.bounded_work += budget.spent

    def is_banned(self, matcher: StreamMatcher, token: int, data: bytes) -> bool:
        """Is `token` (its bytes: `data`) in the exact ban set of the matcher's state? For the
        engine's check of a token sampled under the base bans only: the join of this one
        token is computed (as for a group's head in ban_set), not the whole ban set, whose
        continuations can take milliseconds with thousands of patterns."""
        if not self.patterns.keys:
            return False
        i = bisect.bisect_left(self.always_banned, token)
        if i < len(self.always_banned) and self.always_banned[i] == token:
            return True
        live, live_tags = self._live(*self._tail_of(matcher))
        pending = matcher.norm.pending
        if not live and not pending:
            return False  # the ban set is the always-banned set
        if len(live) > MEMO_CHARS:  # a long pattern's live part: not kept
            return self._joined_completes(live, live_tags, matcher.norm.mode, pending + data)
        return self._completed_by(live, live_tags, matcher.norm.mode, pending + data)

    def _joined_completes(self, live: str, live_tags: bytes, mode: str, data: bytes) -> bool:
        plain = plain_join(data, mode)
        if plain is not None:
            text, tags = live + plain[0], live_tags + plain[1]
        else:
            text, tags, _ = _join(live, live_tags, mode, data)
        return self._completes(text, tags, len(live))

    def _tail_of(self, matcher: StreamMatcher) -> tuple[str, bytes]:
        """The last characters of the matcher's normalized text that decide a ban, and their
        script tags. The mask's patterns are among the matcher's literals, so no more than the
        matcher's live depth can be live for them: looking no further saves the longest part
        of the search for a live suffix."""
        keep = min(self.max_tail, matcher.depth)
        if not keep:
            return "", b""
        return "".join(matcher.norm.text[-keep:]), bytes(matcher.norm.tags[-keep:])

    def ban_set(self, tail: str, pending: bytes = b"", mode: str | None = None,
                tags: bytes | None = None, budget: Budget | None = None) -> list[int] | None:
        """Sorted ids of the tokens that would complete a pattern after `tail` (+ pending
        bytes), the text ending in `mode`, its characters' raw scripts `tags`. With a
        budget: None where building them would spend more than it has (without one, never)."""
        if not self.patterns.keys:
            return []
        mode = mode or _mode_of(tail)
        if tags is None:
            tags = bytes(script_tag(c) for c in tail)
        live, live_tags = self._live(tail, tags)
        if not live and not pending:
            return self.always_banned
        key = (live, live_tags, pending, mode)
        hit = self._cache.get(key, _MISSING)
        if hit is None and budget is None:
            del self._cache[key]  # given up by a bounded ask: built now, unbounded
        elif hit is not _MISSING:
            self._cache.move_to_end(key)
            return hit  # type: ignore[return-value]
        if budget is None:
            budget = Budget(_UNBOUNDED)
        try:
            result: list[int] | None = self._build(live, live_tags, pending, mode, budget)
        except OverBudget:
            self.over_limit += 1
            result = None
        self._cache[key] = result
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return result

    def _build(self, live: str, live_tags: bytes, pending: bytes, mode: str,
               budget: Budget) -> list[int]:
        banned = set(self.always_banned)
        if pending:
            for lead, group in self.tokens.groups.items():
                banned.update(self._group_bans(live, live_tags, mode, pending + lead, group, budget))
        else:
            banned.update(self._continuations(live, live_tags, mode, self.tokens.index,
                                              self.tokens.tags, budget))
        return sorted(banned)

    def _group_bans(self, live: str, live_tags: bytes, mode: str, head_bytes: bytes,
                    group: _Sorted, budget: Budget) -> list[int]:
        """Bans among the tokens that complete the pending character with these bytes."""
        budget.spend(GROUP_UNITS)
        added, added_tags, after, broken = self._piece(mode, head_bytes, budget)
        text, tags = live + added, live_tags + added_tags
        if self._completes(text, tags, len(live)):
            budget.spend(len(group.ids) // IDS_PER_UNIT)
            return group.ids
        if broken:
            return []  # the character stays broken: what follows starts after a U+FFFD
        return self._continuations(*self._live(text, tags), after, group, self.tokens.rest_tags,
                                   budget)

    def _piece(self, mode: str, data: bytes, budget: Budget) -> tuple[str, bytes, str, bool]:
        """What `data` adds after text in `mode`: characters, tags, the mode after, and
        whether bytes stay pending. It does not depend on the text: memoized."""
        key = (mode, data)
        piece = self._pieces.get(key)
        if piece is not None:
            budget.spend(1)
            return piece
        budget.spend(JOIN_UNITS)
        added, tags, n = _join("", b"", mode, data)
        return remember(self._pieces, key, (added, tags, n.mode, bool(n.pending)), 1 << 15)

    def _live(self, text: str, tags: bytes) -> tuple[str, bytes]:
        """The longest suffix of text that begins a pattern, and its tags."""
        depth = self.patterns.depth(text) if text else 0
        return (text[len(text) - depth :], tags[len(tags) - depth :]) if depth else ("", b"")

    def _continuations(self, live: str, live_tags: bytes, mode: str, index: _Sorted,
                       token_tags: list[bytes], budget: Budget) -> list[int]:
        """Tokens whose contribution, joined in `mode`, starts with the missing rest of a
        pattern begun by `live` and makes a match that counts. Each lookup spends from the
        budget before it runs (the number of patterns under `live` is unbounded)."""
        out: list[int] = []
        for length in range(len(live), 0, -1):
            u = live[-length:]
            if not self.patterns.is_live(u):
                continue
            u_scripts = set(live_tags[-length:]) - {0}
            for pattern in self.patterns.completions(u):
                budget.spend(1)
                v = pattern[length:]
                if not v:
                    continue
                for prefix, k in _forms(v, mode):
                    ids = index.starting_with(prefix)
                    if ids:
                        budget.spend(len(ids) // IDS_PER_UNIT)
                        out += self._counting(ids, pattern, u_scripts, k, len(prefix), token_tags)
        return out

    def _counting(self, ids: list[int], pattern: str, u_scripts: set[int], k: int, end: int,
                  token_tags: list[bytes]) -> list[int]:
        """Those of `ids` that complete `pattern` as a match that counts (scripts.py): all of
        them unless the live part has no letter or digit, or only letters of one foreign script."""
        scripts = self.patterns.scripts[pattern]
        if not scripts or len(u_scripts) > 1 or ALNUM in u_scripts or not u_scripts.isdisjoint(scripts):
            return ids
        head = bytes(u_scripts)
        return [i for i in ids if accepts(scripts, head + token_tags[i][k:end])]

    # -- pattern helpers ------------------------------------------------------------------

    def _completes(self, text: str, tags: bytes, start: int) -> bool:
        """Does text hold a match that counts and ends at or after index `start`?"""
        automaton = self.patterns.automaton
        if automaton is None or not text:
            return False
        scripts = self.patterns.scripts
        return any(end >= start and accepts(scripts[p], tags[end + 1 - len(p) : end + 1])
                   for end, p in automaton.iter(text))


def _join(live: str, live_tags: bytes, mode: str, data: bytes) -> tuple[str, bytes, Normalizer]:
    """`live` and its tags with the normalized characters of `data` joined after text that
    ends in `mode`; and the normalizer, in the state they leave."""
    n = Normalizer()
    n.feed(_SEED[mode])
    before = len(n.text)
    n.feed(data)
    return live + "".join(n.text[before:]), live_tags + bytes(n.tags[before:]), n


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all, also when engines sharing a luts directory write the same file
    at once: each writes a temporary file of its own, then renames it over the name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # derived data, read as before (mkstemp makes 0600)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
