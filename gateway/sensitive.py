"""What the audit trail stores of a value a rule matched: per rule `audit: keep | mask | hash`.

`mask` replaces every letter and digit by `*`, except a payment card's first 6 and last 4
digits (PCI DSS 3.4); `hash` stores `[hash:…]` alone. Both add the value's keyed hash to
the record's `match_hashes`, which is indexed, so `audit query --match VALUE` finds it
without the trail ever holding the value. The hash ignores spaces, punctuation and case
(NFKC, case-folded, letters and digits only): `4111-1111-1111-1111` and
`4111 1111 1111 1111` are the same value.

Every field a record stores of what a client sent or the model said goes through here:
the messages (as one conversation: a number split over two messages is found and masked
in both, see `finsieve/policy/inputs.py`), the delivered and suppressed text, metadata keys
and values, the user and request ids, stop sequences and error texts. A value that two
rules' matches overlap is protected whole: the part past the first match is masked
entirely, never left in clear.
"""

from __future__ import annotations

import hashlib
import hmac
import unicodedata

from finsieve.policy.inputs import ConversationMatch, conversation_matches
from finsieve.policy.pack import Pack, RuleSet
from finsieve.policy.schema import Rule

from .audit import derive_key

# A rule checked by one of these finds card numbers (`card_number`: Luhn and a reader's
# grouping, rules/identifiers.yaml).
CARD_VALIDATORS = frozenset({"luhn", "card_number"})


def canonical_value(value: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFKC", value).casefold() if c.isalnum())


def value_hash(key: bytes, value: str) -> str:
    """The keyed hash an officer's `--match VALUE` is compared by (key: the audit key)."""
    return hmac.new(derive_key(key, "match"), canonical_value(value).encode(),
                    hashlib.sha256).hexdigest()[:32]


def _masked(rule: Rule, value: str) -> str:
    if CARD_VALIDATORS & set(rule.validators):  # a card number: first 6 and last 4 digits stay
        digits = sum(c.isdigit() for c in value)
        out, seen = [], 0
        for c in value:
            if c.isdigit():
                out.append(c if seen < 6 or seen >= digits - 4 else "*")
                seen += 1
            else:
                out.append(c)
        return "".join(out)
    return "".join("*" if c.isalnum() else c for c in value)


class Sensitive:
    """Protects stored text according to the rules of one pack."""

    def __init__(self, pack: Pack, key: bytes) -> None:
        self.rules = RuleSet([r for r in pack.rules if r.audit != "keep"], pack.input.regex_timeout_s)
        self.by_id = {r.id: r for r in pack.rules}
        self.key = key

    def _protect(self, rule: Rule, value: str, hashes: set[str]) -> str:
        h = value_hash(self.key, value)
        hashes.add(h)
        return f"[hash:{h}]" if rule.audit == "hash" else _masked(rule, value)

    def text(self, text: str, hashes: set[str]) -> str:
        """`text` with every value a mask/hash rule matches protected; their hashes added."""
        return self.messages([text], hashes)[0]

    def messages(self, contents: list[str], hashes: set[str],
                 roles: list[str] | None = None) -> list[str]:
        """The messages of one conversation, each protected, values split over two or more
        of them included (each part protected as its share of the whole value). With their
        `roles`, the user's messages are also read as one stream (see `inputs.streams`)."""
        if not self.rules or not any(contents):
            return list(contents)
        edits: list[list[tuple[int, int, str]]] = [[] for _ in contents]
        for m in conversation_matches(self.rules, contents, roles):
            for part, shown in zip(m.parts, self._split(m, hashes), strict=True):
                edits[part.message].append((part.start, part.end, shown))
        return [_apply(c, sorted(e)) if e else c for c, e in zip(contents, edits, strict=True)]

    def _split(self, m: ConversationMatch, hashes: set[str]) -> list[str]:
        """The protected value, cut back into the parts of the messages it spans."""
        shown = self._protect(m.rule, m.text, hashes)
        if len(m.parts) == 1:
            return [shown]
        if m.rule.audit == "hash":  # the same `[hash:…]` in each message
            return [shown] * len(m.parts)
        # A mask keeps every character's place: each part is its own stretch of it.
        return [shown[p.at : p.at + p.chars] for p in m.parts]

    def suppressed(self, rule_id: str, text: str, hashes: set[str]) -> str:
        """The text a rule suppressed: protected as a whole by its own rule's mode, or
        scanned like any text when that rule keeps what it matched."""
        rule = self.by_id.get(rule_id)
        if rule is not None and rule.audit != "keep" and text:
            return self._protect(rule, text, hashes)
        return self.text(text, hashes)


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    """`text` with each raw byte span (start, end) replaced by its protected form. A span
    that overlaps the one before it: what it adds past that one is masked whole."""
    raw = text.encode()
    parts, pos = [], 0
    for start, end, shown in edits:
        if start < pos:
            if end > pos:
                parts.append("".join("*" if c.isalnum() else c
                                     for c in raw[pos:end].decode("utf-8", "replace")))
                pos = end
            continue
        parts.append(raw[pos:start].decode("utf-8", "replace"))
        parts.append(shown)
        pos = end
    parts.append(raw[pos:].decode("utf-8", "replace"))
    return "".join(parts)
