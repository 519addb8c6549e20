"""Input-scope rules: applied to a request's messages before the model sees them.

A `redact` (or `rewrite`) span is replaced, so the model never reads it; a `halt` or
`block` span means the request is not decoded at all. The engine calls this off its
decode loop, after it has checked the prompt's token count against its context (a prompt
too long to serve is refused before any rule scans it).

A conversation is one text to a reader: a card number typed over two messages ("my card
is 5425 2334", then "3010 9903") is one number. So besides each message alone, the
messages are scanned joined by MESSAGE_JOIN, a newline, which the normalized view reads
as a space: a separator every identifier rule accepts between two groups of digits. A
match of that joined text that covers two or more messages counts when its rule protects
a value (`audit: mask` or `hash`: the identifiers, which a split hides); phrase rules are
judged within one message, as a reader of one turn reads them. Each covered part is
replaced in its own message (the model sees the replacement in each), and one intervention
names the whole value, messages joined: the audit trail masks and hashes it as one number,
so `--match` finds it whole. The gateway masks the stored messages with the same function
(`conversation_matches`), so what the model was not shown is never stored either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .guard import Intervention
from .matcher import scan_text
from .pack import RuleSet
from .schema import Rule

MESSAGE_JOIN = "\n"


class ChatMessage(Protocol):
    role: str
    content: str


@dataclass(frozen=True)
class Part:
    """The piece of one message that a match covers (raw UTF-8 byte offsets in it), and
    where that piece lies in the match's text (characters)."""

    message: int
    start: int
    end: int
    at: int = 0
    chars: int = 0


@dataclass(frozen=True)
class ConversationMatch:
    rule: Rule
    parts: tuple[Part, ...]  # in message order; more than one: it crosses a boundary
    text: str  # the raw text it covers, its messages joined by MESSAGE_JOIN


def crosses_messages(rule: Rule) -> bool:
    """Whether a match of `rule` may span messages: rules that protect a value."""
    return rule.audit != "keep"


def conversation_matches(rules: RuleSet, contents: Sequence[str]) -> list[ConversationMatch]:
    """Every match in each message alone, and every match of a value rule across messages
    (see the module's note), by message and start."""
    raws = [c.encode() for c in contents]
    found = []
    for i, (content, raw) in enumerate(zip(contents, raws, strict=True)):
        for m in scan_text(rules, content) if content else []:
            text = raw[m.start : m.end].decode("utf-8", "replace")
            found.append(ConversationMatch(m.rule, (Part(i, m.start, m.end, 0, len(text)),), text))
    if sum(1 for c in contents if c) > 1 and any(crosses_messages(r) for r in rules.rules):
        found += _crossing(rules, raws)
    return sorted(found, key=lambda m: (m.parts[0].message, m.parts[0].start))


def _crossing(rules: RuleSet, raws: list[bytes]) -> list[ConversationMatch]:
    joined = MESSAGE_JOIN.encode().join(raws)
    starts, at = [], 0
    for raw in raws:
        starts.append(at)
        at += len(raw) + len(MESSAGE_JOIN.encode())
    out = []
    for m in scan_text(rules, joined.decode("utf-8", "replace")):
        if not crosses_messages(m.rule):
            continue
        parts = tuple(_part(joined, m.start, i, max(m.start, s), min(m.end, s + len(raw)), s)
                      for i, (s, raw) in enumerate(zip(starts, raws, strict=True))
                      if max(m.start, s) < min(m.end, s + len(raw)))
        if len(parts) > 1:
            out.append(ConversationMatch(m.rule, parts, joined[m.start : m.end].decode("utf-8", "replace")))
    return out


def _part(joined: bytes, match_start: int, message: int, start: int, end: int,
          message_start: int) -> Part:
    """Message `message`'s piece [start, end) of the joined text (byte offsets in it)."""
    at = len(joined[match_start:start].decode("utf-8", "replace"))
    return Part(message, start - message_start, end - message_start, at,
                len(joined[start:end].decode("utf-8", "replace")))


@dataclass
class InputVerdict:
    messages: list[dict[str, str]]  # what the model reads, spans replaced
    events: list[Intervention] = field(default_factory=list)
    halted: bool = False  # a halting (or blocking) rule matched: nothing is decoded

    @property
    def changed(self) -> bool:
        return any(i.action not in ("halt", "block") for i in self.events)


def apply_input_rules(rules: RuleSet, messages: Iterable[ChatMessage]) -> InputVerdict:
    msgs = list(messages)
    verdict = InputVerdict([])
    contents = [m.content for m in msgs]
    edits: list[list[tuple[Part, ConversationMatch]]] = [[] for _ in msgs]
    for x in conversation_matches(rules, contents) if rules else []:
        if x.rule.action in ("halt", "block"):
            verdict.halted = True
            verdict.events.append(Intervention(x.rule.id, x.rule.action, 0, 0,
                                               message=x.rule.message, suppressed=x.text))
        else:
            for part in x.parts:
                edits[part.message].append((part, x))
    for m, content, mine in zip(msgs, contents, edits, strict=True):
        if mine:
            content = _replace(content, sorted(mine, key=lambda e: e[0].start), verdict)
        verdict.messages.append({"role": m.role, "content": content})
    return verdict


def _replace(content: str, edits: list[tuple[Part, ConversationMatch]], verdict: InputVerdict) -> str:
    """redact / rewrite: the model never sees the spans. A span that overlaps the one
    before it is removed with it (never left half in clear); its match's event is the one
    of the span that begins first."""
    raw = content.encode()
    parts: list[str] = []
    pos = 0
    for part, x in edits:
        if part.start < pos:
            pos = max(pos, part.end)
            continue
        parts.append(raw[pos : part.start].decode("utf-8", "replace"))
        at = sum(len(p) for p in parts)
        parts.append(x.rule.replacement)
        if part is x.parts[0]:  # one event per match, at its first part
            verdict.events.append(Intervention(x.rule.id, x.rule.action, at,
                                               at + len(x.rule.replacement), suppressed=x.text))
        pos = part.end
    parts.append(raw[pos:].decode("utf-8", "replace"))
    return "".join(parts)
