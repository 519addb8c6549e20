"""A compiled rule pack: an Aho-Corasick automaton and regexes per scope, and its version."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import ahocorasick
import regex

from .first_chars import first_chars, is_word
from .memo import memoized, remember
from .normalize import VIEW_VERSION
from .schema import REGEX_FLAGS, Rule, load_rules
from .scripts import regex_scripts, scripts_of
from .sources import DEFAULT_LIMITS, PackLimits

FORMAT = 1  # bump when compilation changes what a version means
MEMO_CHARS = 64  # longest text whose answers are memoized (entries are bounded in number)
# Longest live suffix that Literals.scan walks from each character of; past it, one pass of
# the automaton over the whole text costs less (a walk per character is quadratic in it).
WALK_CHARS = 16


# Literals.scan's answer: ((end, pattern, owners), ...) and the live suffix after them.
Hit = tuple[int, str, tuple[Rule, ...]]
Hits = tuple[Hit, ...]
Scan = tuple[Hits, str]


@dataclass(frozen=True)
class CompiledRegex:
    rule: Rule
    pattern: regex.Pattern[str]
    max_span: int
    scripts: frozenset[int]  # of its letters: see scripts.py


class Literals:
    """An Aho-Corasick automaton over literal patterns, and the live-suffix questions on it."""

    def __init__(self, values: dict[str, object]) -> None:
        self.keys = tuple(sorted(values))
        self.automaton: ahocorasick.Automaton | None = None
        if values:
            self.automaton = ahocorasick.Automaton()
            for p, value in values.items():
                self.automaton.add_word(p, value)
            self.automaton.make_automaton()
        self.scripts = {p: scripts_of(p) for p in self.keys}  # see scripts.py
        # A key that begins a longer key stays a live partial match after it completes.
        self.proper_prefixes = frozenset(
            a for a, b in itertools.pairwise(self.keys) if b.startswith(a)
        )
        self.max_len = max((len(p) for p in self.keys), default=0)
        # Per token, the mask asks for the live depth of a short suffix; the same suffixes
        # come back again and again, so answers are kept (bounded; thread-safe).
        self._suffix_depth: dict[str, int] = {}
        # A token's own hits and live depth (see scan), kept for token-sized texts.
        self._alone: dict[str, tuple[Hits, int]] = {}

    def is_live(self, s: str) -> bool:
        """Is s a proper prefix of some pattern (so a match may still grow from it)?"""
        a = self.automaton
        return a is not None and a.match(s) and (s in self.proper_prefixes or not a.exists(s))

    def completions(self, prefix: str) -> Iterable[str]:
        """The patterns that begin with prefix."""
        return self.automaton.keys(prefix) if self.automaton is not None else ()

    def depth(self, text: str) -> int:
        """Length of the longest suffix of text that is live."""
        top = min(len(text), self.max_len - 1)
        if top <= 0:
            return 0
        suffix = text[len(text) - top :]
        if top > MEMO_CHARS:  # kept only when short: a pack's long literals would make each entry as long
            return self._longest_live_suffix(suffix)
        depth = self._suffix_depth.get(suffix)
        if depth is None:
            depth = remember(self._suffix_depth, suffix, self._longest_live_suffix(suffix), 1 << 16)
        return depth

    def scan(self, live: str, new: str) -> Scan:
        """The matches ending in `new` found in live + new (`live`: the text's live suffix
        before `new`), as (end index in `new`, pattern, owners), and the live suffix of
        live + new.

        What lies in `new` alone depends on `new` only, and tokens recur: it is memoized.
        The pairs (live, new) rarely recur (on uniformly random tokens 93 in 100 were new),
        so what begins in `live` is found by a walk of the trie from each of its characters:
        a match or live suffix that begins there begins with a suffix of `live` that is a
        trie node, and `longest_prefix` says in one call how far the walk gets. A `live`
        longer than WALK_CHARS: one pass of the automaton over live + new instead."""
        if len(live) > WALK_CHARS:
            return self._scan_whole(live, new)
        alone, depth = self._scan_alone(new)
        if not live:
            return alone, new[len(new) - depth :] if depth else ""
        a = self.automaton
        assert a is not None
        text, n_live = live + new, len(live)
        crossing: list[Hit] = []
        deepest = 0
        for j in range(n_live):
            rest = text[j:]
            reach = a.longest_prefix(rest)
            for length in range(n_live - j + 1, reach + 1):  # a key that ends in `new`?
                found = a.get(rest[:length], None)
                if found is not None:
                    crossing.append((j + length - 1 - n_live, *found))
            if not deepest and reach == len(rest) and self.is_live(rest):
                deepest = len(rest)  # the first found begins earliest: the longest
        if crossing:  # in the automaton's order: by end, the longest first
            alone = tuple(sorted((*crossing, *alone), key=lambda h: (h[0], -len(h[1]))))
        depth = deepest or depth
        return alone, text[len(text) - depth :] if depth else ""

    def _scan_alone(self, new: str) -> tuple[Hits, int]:
        """The matches in `new` and the depth of its longest live suffix (see scan)."""
        found = self._alone.get(new)
        if found is None:
            hits, live = self._scan_whole("", new)
            found = (hits, len(live))
            if len(new) <= MEMO_CHARS:
                remember(self._alone, new, found, 1 << 16)
        return found

    def _scan_whole(self, live: str, new: str) -> Scan:
        """scan, by one pass of the automaton over live + new."""
        assert self.automaton is not None
        text = live + new
        # A fresh iterator per scan: pyahocorasick's `iter.set()` frees memory it does not
        # own when the strings fed to one iterator differ in width (an emoji, then ASCII),
        # which crashed the engine for everyone.
        hits = tuple((end - len(live), pattern, owners)
                     for end, (pattern, owners) in self.automaton.iter(text)
                     if end >= len(live))  # one that ended in `live` was reported when it was fed
        depth = self.depth(text)
        return hits, text[len(text) - depth :] if depth else ""

    def _longest_live_suffix(self, text: str) -> int:
        for length in range(len(text), 0, -1):
            if self.is_live(text[-length:]):
                return length
        return 0


class RuleSet:
    """The rules of one scope (input or output), compiled for streaming matching."""

    def __init__(self, rules: list[Rule], regex_timeout_s: float = DEFAULT_LIMITS.regex_timeout_s) -> None:
        self.rules = tuple(rules)
        self.regex_timeout_s = regex_timeout_s  # per search; the matcher fails closed past it
        literals: dict[str, list[Rule]] = {}
        for rule in rules:
            if rule.kind == "literal":
                for p in rule.patterns:
                    literals.setdefault(p, []).append(rule)
        self.literals = Literals({p: (p, tuple(owners)) for p, owners in literals.items()})
        self.regexes = [
            CompiledRegex(rule, regex.compile(p, REGEX_FLAGS), rule.max_span, regex_scripts(p))
            for rule in rules if rule.kind == "regex" for p in rule.patterns
        ]
        self.max_regex_span = max((r.max_span for r in self.regexes), default=0)
        self._first = [first_chars(r.pattern.pattern) for r in self.regexes]
        # A token's characters come back again and again: answers are kept (bounded), per
        # kind of character before them (what the filters below read of it).
        self._by_char = memoized(self._starting_with, 1 << 16)
        self._by_token: dict[tuple[str, str], tuple[int, ...]] = {}  # (new, representative)
        self._kinds: dict[tuple[bool, ...], str] = {}
        self._kind_of: dict[str, str] = {}  # prev -> its representative

    def regexes_starting_in(self, new: str, prev: str) -> tuple[int, ...]:
        """Indexes of the regexes whose match can begin in the (normalized) characters
        `new`; `prev`: the character before them ("" at the start)."""
        if len(new) > MEMO_CHARS:
            # A whole text (input rules, audit masking): one search per regex, in C with the
            # GIL released, costs less than finding out in Python which ones can start.
            return tuple(range(len(self.regexes)))
        # Plain dicts (see remember): asked once per token.
        kind = self._kind_of.get(prev)
        if kind is None:
            kind = remember(self._kind_of, prev, self._representative(prev), 1 << 12)
        key = (new, kind)
        found = self._by_token.get(key)
        if found is None:
            found = remember(self._by_token, key, self._starting_in(new, kind), 1 << 16)
        return found

    def _starting_in(self, new: str, prev: str) -> tuple[int, ...]:
        """A match beginning at new[j] begins with new[j:] (new ends the text): its first
        character, the one before it, and its first few characters must all allow it."""
        found: set[int] = set()
        for j, ch in enumerate(new):
            for i in self._by_char(ch, prev):
                f = self._first[i]
                if f is None or f.can_begin(new[j:]):
                    found.add(i)
            prev = ch
        return tuple(sorted(found))

    def _representative(self, prev: str) -> str:
        """The first character seen that every filter treats like `prev`."""
        kind = (is_word(prev), *(f.can_follow(prev) for f in self._first
                                 if f is not None and f.not_after is not None))
        return self._kinds.setdefault(kind, prev)

    def _starting_with(self, ch: str, prev: str) -> tuple[int, ...]:
        word_start = not is_word(prev)
        return tuple(i for i, f in enumerate(self._first)
                     if f is None or (ch in f and (word_start or not f.word_start)
                                      and f.can_follow(prev)))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def literal_patterns(self, actions: tuple[str, ...]) -> list[str]:
        """Literal patterns of rules with one of these actions (the mask takes `block`)."""
        return sorted({p for r in self.rules if r.kind == "literal" and r.action in actions
                       for p in r.patterns})


class Pack:
    """An immutable compiled pack. Holders of an old pack keep it across a reload."""

    def __init__(self, rules: list[Rule], source: str = "", limits: PackLimits = DEFAULT_LIMITS) -> None:
        self.rules = tuple(rules)
        self.source = source
        self.version = _version(rules)
        self.input = RuleSet([r for r in rules if r.applies_to_input], limits.regex_timeout_s)
        self.output = RuleSet([r for r in rules if r.applies_to_output], limits.regex_timeout_s)

    @classmethod
    def load(cls, directory: Path, limits: PackLimits = DEFAULT_LIMITS) -> Pack:
        """Load and compile; raises schema.PackError listing every problem."""
        return cls(load_rules(directory, limits), str(directory), limits)

    def rule(self, rule_id: str) -> Rule | None:
        return next((r for r in self.rules if r.id == rule_id), None)


def _version(rules: list[Rule]) -> str:
    """Content hash of what is enforced: the compiled rules, not file names or comments."""
    canon = [{k: v for k, v in asdict(r).items() if k != "source"} for r in sorted(rules, key=lambda r: r.id)]
    # The same rules under another normalized view enforce something else: another version.
    blob = json.dumps({"format": FORMAT, "view": VIEW_VERSION, "rules": canon}, sort_keys=True,
                      ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
