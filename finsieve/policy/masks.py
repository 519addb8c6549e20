"""Token-mask tables: which tokens would complete a literal pattern, given the text so far.

A pattern has thousands of tokenizations (casing, spacing, full-width forms, split
characters), so bans are computed over the *normalized contribution* of each token, not
over token-id sequences. For a matcher state the exact ban set is:

  * tokens whose contribution contains a whole pattern (the always-banned set), and
  * for every live suffix `u` of the text that begins a pattern `u·v`, the tokens whose
    contribution starts with `v` — one binary search in the sorted contributions.

Two contexts change a token's contribution: a text ending in a space swallows the token's
leading space, and pending bytes of an incomplete UTF-8 character are completed by the
token's leading continuation bytes. The latter are handled per group of tokens sharing
those leading bytes (a few dozen groups in a byte-level vocabulary).

Tables are keyed by tokenizer fingerprint and policy version, and persisted under `luts/`.
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import json
from collections import OrderedDict
from pathlib import Path

from .matcher import StreamMatcher
from .normalize import Normalizer
from .pack import Literals

FORMAT = 1
_CONT = range(0x80, 0xC0)


def fingerprint(token_bytes: list[bytes]) -> str:
    h = hashlib.sha256()
    for b in token_bytes:
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return h.hexdigest()[:16]


def _contribution(data: bytes) -> tuple[str, bytes]:
    """Normalized text of bytes fed to a fresh normalizer, and the bytes left pending."""
    n = Normalizer()
    n.feed(data)
    return "".join(n.text), n.pending


def _join(text: str, more: str) -> str:
    """text + more in the normalized view: a space after a space collapses."""
    return text + more[1:] if text.endswith(" ") and more.startswith(" ") else text + more


def _lead(data: bytes) -> int:
    k = 0
    while k < len(data) and data[k] in _CONT:
        k += 1
    return k


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
    """Per tokenizer: each token's normalized contribution, indexed for prefix queries."""

    def __init__(self, fp: str, contrib: list[str], lead: list[bytes], rest: list[str]) -> None:
        self.fingerprint = fp
        self.contrib = contrib
        self.index = _Sorted(contrib, list(range(len(contrib))))
        groups: dict[bytes, list[int]] = {}
        for i, b in enumerate(lead):
            if b:
                groups.setdefault(b, []).append(i)
        self.lead = lead
        self.rest = rest
        self.groups = {b: _Sorted([rest[i] for i in ids], ids) for b, ids in groups.items()}

    @classmethod
    def build(cls, token_bytes: list[bytes]) -> TokenTable:
        contrib, lead, rest = [], [], []
        for data in token_bytes:
            contrib.append(_contribution(data)[0])
            k = _lead(data)
            lead.append(data[:k])
            rest.append(_contribution(data[k:])[0] if k else "")
        return cls(fingerprint(token_bytes), contrib, lead, rest)

    @classmethod
    def load_or_build(cls, token_bytes: list[bytes], luts: Path | None) -> TokenTable:
        fp = fingerprint(token_bytes)
        path = luts / fp / "tokens.json.gz" if luts else None
        if path is not None and path.exists():
            try:
                data = json.loads(gzip.decompress(path.read_bytes()))
                if data["format"] == FORMAT and data["fingerprint"] == fp:
                    lead = [bytes.fromhex(h) for h in data["lead"]]
                    return cls(fp, data["contrib"], lead, data["rest"])
            except (OSError, ValueError, KeyError):
                pass  # stale or damaged: rebuilt below
        table = cls.build(token_bytes)
        if path is not None:
            _write(path, gzip.compress(json.dumps({
                "format": FORMAT, "fingerprint": fp, "contrib": table.contrib,
                "lead": [b.hex() for b in table.lead], "rest": table.rest,
            }, ensure_ascii=False).encode(), mtime=0))
        return table


class MaskTables:
    """Ban sets for one set of literal patterns over one tokenizer."""

    def __init__(self, tokens: TokenTable, patterns: list[str], always_banned: list[int] | None = None,
                 cache_size: int = 4096) -> None:
        self.tokens = tokens
        self.patterns = Literals({p: p for p in patterns})
        if always_banned is None:
            always_banned = [i for i, c in enumerate(tokens.contrib) if self._contains(c)]
        if not self.patterns.keys:
            always_banned = []
        self.always_banned = sorted(always_banned)
        self._always = dict.fromkeys(self.always_banned, True)
        self._cache: OrderedDict[tuple[str, bytes], list[int]] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def load_or_build(cls, tokens: TokenTable, patterns: list[str], policy_version: str,
                      luts: Path | None) -> MaskTables:
        digest = hashlib.sha256("\n".join(sorted(set(patterns))).encode()).hexdigest()[:16]
        path = luts / tokens.fingerprint / f"{policy_version}.banned.json" if luts else None
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text())
                if (data["format"], data["fingerprint"], data["patterns"]) == (
                    FORMAT, tokens.fingerprint, digest,
                ):
                    return cls(tokens, patterns, data["always_banned"])
            except (OSError, ValueError, KeyError):
                pass  # stale or damaged: rebuilt below
        tables = cls(tokens, patterns)
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
        """The ban set for a matcher's current state (its text and pending bytes)."""
        keep = self.max_tail
        tail = "".join(matcher.norm.text[-keep:]) if keep else ""
        return self.ban_set(tail, matcher.norm.pending)

    def is_banned(self, matcher: StreamMatcher, token: int) -> bool:
        """`token in ban_set_for(matcher)`, without building the set: does the token's
        normalized contribution complete a pattern inside itself? One automaton pass over a
        short string, for the engine's check of a token sampled before its exact mask was known."""
        if not self.patterns.keys or token >= len(self.tokens.contrib):
            return False
        keep = self.max_tail
        tail = "".join(matcher.norm.text[-keep:]) if keep else ""
        pending = matcher.norm.pending
        if not pending:
            return self._ends_in(tail, self.tokens.contrib[token])
        if self._always.get(token, False):
            return True
        lead = self.tokens.lead[token]
        if not lead:
            return False  # it leaves the pending character broken: only always-banned counts
        head, still_pending = _contribution(pending + lead)
        if self._ends_in(tail, head):
            return True
        return not still_pending and self._ends_in(_join(tail, head), self.tokens.rest[token])

    def _ends_in(self, live: str, head: str) -> bool:
        """`_completes`, reading the automaton's iterator to its end (never left half-read)."""
        text = _join(live, head)  # held while the C iterator reads it
        ends = [end for end, _ in self.patterns.automaton.iter(text)]
        return bool(ends) and max(ends) >= len(live)

    def ban_set(self, tail: str, pending: bytes = b"") -> list[int]:
        """Sorted ids of the tokens that would complete a pattern after `tail` (+ pending bytes)."""
        if not self.patterns.keys:
            return []
        live = tail[len(tail) - self.patterns.depth(tail):] if tail else ""
        if not live and not pending:
            return self.always_banned
        key = (live, pending)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        banned = set(self.always_banned)
        if pending:
            for lead, group in self.tokens.groups.items():
                banned.update(self._group_bans(live, pending + lead, group))
        else:
            banned.update(self._continuations(live, self.tokens.index))
        result = sorted(banned)
        self._cache[key] = result
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return result

    def _group_bans(self, live: str, head_bytes: bytes, group: _Sorted) -> list[int]:
        """Bans among the tokens that complete the pending character with these bytes."""
        head, still_pending = _contribution(head_bytes)
        if self._completes(live, head):
            return group.ids
        if still_pending:
            return []  # the character stays broken: what follows starts after a U+FFFD
        text = _join(live, head)
        return self._continuations(text[len(text) - self.patterns.depth(text):], group)

    def _continuations(self, live: str, index: _Sorted) -> list[int]:
        """Tokens whose contribution starts with the missing rest of a pattern begun by `live`."""
        out: list[int] = []
        space_before = live.endswith(" ")
        for length in range(len(live), 0, -1):
            u = live[-length:]
            if not self.patterns.is_live(u):
                continue
            for pattern in self.patterns.automaton.keys(u):
                v = pattern[length:]
                if not v:
                    continue
                out += index.starting_with(v)
                if space_before:  # " v…" loses its space after a space
                    out += index.starting_with(" " + v)
        return out

    # -- pattern helpers ------------------------------------------------------------------

    def _contains(self, s: str) -> bool:
        automaton = self.patterns.automaton
        return automaton is not None and bool(s) and next(automaton.iter(s), None) is not None

    def _completes(self, live: str, head: str) -> bool:
        """Does appending `head` to text ending in `live` complete a pattern inside head?"""
        text = _join(live, head)
        return any(end >= len(live) for end, _ in self.patterns.automaton.iter(text))


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
