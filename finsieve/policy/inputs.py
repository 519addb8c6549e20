"""Input-scope rules: applied to a request's messages before the model sees them.

A `redact` (or `rewrite`) span is replaced, so the model never reads it; a `halt` or
`block` span means the request is not decoded at all. The engine calls this off its
decode loop, after it has checked the prompt's token count against its context (a prompt
too long to serve is refused before any rule scans it).

A conversation is one text to a reader: a card number typed over two messages ("my card
is 5425 2334", then "3010 9903") is one number. So besides each message alone, the
messages are scanned joined by MESSAGE_JOIN, a space: a separator every identifier rule
accepts between two groups of digits. Only the stretches around each boundary are scanned
(`_windows`: a match is at most max_span normalized characters long). A match there
that covers two or more messages counts when its rule protects
a value (`audit: mask` or `hash`: the identifiers, which a split hides); phrase rules are
judged within one message, as a reader of one turn reads them. Each covered part is
replaced in its own message (the model sees the replacement in each), and one intervention
names the whole value, messages joined: the audit trail masks and hashes it as one number,
so `--match` finds it whole. The gateway masks the stored messages with the same function
(`conversation_matches`), so what the model was not shown is never stored either.

Which messages are read as neighbours (`streams`): all of them in turn, the user's alone
(a number typed over two user turns, an assistant's "ok" between them), and those that hold
a digit (a user's "and then" between the halves). The gateway stores the model's answer as
the next message of the conversation, so a number it completes is masked in both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

import regex

from .guard import Intervention
from .matcher import scan_text
from .pack import RuleSet
from .schema import Rule

MESSAGE_JOIN = " "
WINDOW_JOIN = " x "  # between two windows (see _crossing): a letter ends every number


class ChatMessage(Protocol):  # read only: a proto message, a NamedTuple, …
    @property
    def role(self) -> str: ...
    @property
    def content(self) -> str: ...


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


def conversation_matches(rules: RuleSet, contents: Sequence[str],
                         roles: Sequence[str] | None = None) -> list[ConversationMatch]:
    """Every match in each message alone, and every match of a value rule across messages
    of one of the conversation's streams (see `streams`), by message and start."""
    raws = [c.encode() for c in contents]
    found: list[ConversationMatch] = []
    for i, (content, raw) in enumerate(zip(contents, raws, strict=True)):
        for m in scan_text(rules, content) if content else []:
            text = raw[m.start : m.end].decode("utf-8", "replace")
            found.append(ConversationMatch(m.rule, (Part(i, m.start, m.end, 0, len(text)),), text))
    if sum(1 for c in contents if c) > 1 and any(crosses_messages(r) for r in rules.rules):
        reach = max(rules.max_regex_span, rules.literals.max_len) + CONTEXT_CHARS
        windows = [w for order in streams(contents, roles) for w in _windows(contents, order, reach)]
        seen: set[tuple[str, tuple[Part, ...]]] = set()  # a match two streams both hold
        for crossing in _crossing(rules, windows):
            if (crossing.rule.id, crossing.parts) not in seen:
                seen.add((crossing.rule.id, crossing.parts))
                found.append(crossing)
    return sorted(found, key=lambda m: (m.parts[0].message, m.parts[0].start))


def streams(contents: Sequence[str], roles: Sequence[str] | None = None) -> list[list[int]]:
    """The orders in which a reader joins the messages of one conversation (each a list of
    message indexes, two or more): all of them in turn; the user's messages alone (a
    number typed over two user turns is one number whatever the assistant said between);
    and the messages that hold a digit (a turn without one, "ok" or "and then", holds no
    part of a number and does not end one). At most three: windows of each, so the cost
    stays the boundaries' (see `_windows`)."""
    orders = [[i for i, c in enumerate(contents) if c]]
    if roles is not None:
        orders.append([i for i in orders[0] if roles[i] == "user"])
    orders.append([i for i in orders[0] if any(ch.isdigit() for ch in contents[i])])
    out: list[list[int]] = []
    for order in orders:
        if len(order) > 1 and order not in out:
            out.append(order)
    return out


# A segment of a window: (message, raw byte start, raw byte end, its bytes).
Segment = tuple[int, int, int, bytes]
# Characters a lookbehind or lookahead may read beyond a match (the matcher keeps 8).
CONTEXT_CHARS = 32
# What the normalized view may drop or fold into a neighbour (so it may count for nothing):
# whitespace, controls, format and default-ignorable characters, combining marks.
_MAY_VANISH = r"[\s\p{Cc}\p{Cf}\p{Mn}\p{Me}\p{Default_Ignorable_Code_Point}]"


@lru_cache(maxsize=16)
def _first_kept(n: int) -> regex.Pattern[str]:
    """Matches text up to its n-th character that cannot vanish (one C call a message)."""
    return regex.compile(rf"(?:{_MAY_VANISH}*+[^{_MAY_VANISH[1:-1]}]){{{n}}}")


def _significant_from(text: str, n: int, backwards: bool) -> int:
    """The character index that n characters that cannot vanish from the normalized view
    reach from the end (backwards) or the start of text; 0 or len(text) when it has fewer."""
    m = _first_kept(n).match(text[::-1] if backwards else text)
    if m is None:
        return 0 if backwards else len(text)
    return len(text) - m.end() if backwards else m.end()


def _windows(contents: Sequence[str], order: Sequence[int], reach: int) -> list[list[Segment]]:
    """The stretches of the joined conversation that a match across a boundary can lie in:
    the last `reach` characters of a message (that the normalized view keeps: each is at
    least one character there) and the first `reach` of the next, a short message between
    them whole. A match is at most max_span normalized characters, so scanning these
    finds what scanning the whole joined text would, at the cost of the boundaries only.
    `order`: the messages of one stream, in turn."""
    windows: list[list[Segment]] = []
    current: list[Segment] = []
    for k, i in enumerate(order):
        text = contents[i]
        raw = text.encode()
        head = len(text[: _significant_from(text, reach, False)].encode())
        tail = len(text[: _significant_from(text, reach, True)].encode())
        if not current:
            current = [(i, tail, len(raw), raw[tail:])]
        elif head >= tail or k == len(order) - 1:  # short (or last): the window goes on
            current.append((i, 0, len(raw), raw) if head >= tail else (i, 0, head, raw[:head]))
        else:
            windows.append([*current, (i, 0, head, raw[:head])])
            current = [(i, tail, len(raw), raw[tail:])]
    if len(current) > 1:
        windows.append(current)
    return windows


def _crossing(rules: RuleSet, windows: list[list[Segment]]) -> list[ConversationMatch]:
    """The matches of value rules in the windows that cover two or more messages. One scan
    for all (a scan's fixed cost is most of a window's): the windows are joined by
    WINDOW_JOIN, which no match of a number crosses; one that did would only mask more."""
    pieces: list[bytes] = []
    segments: list[tuple[Segment, int]] = []  # each with where it starts in the text
    at = 0
    for window in windows:
        for k, seg in enumerate(window):
            if pieces:
                pieces.append((MESSAGE_JOIN if k else WINDOW_JOIN).encode())
                at += len(pieces[-1])
            segments.append((seg, at))
            pieces.append(seg[3])
            at += len(seg[3])
    joined = b"".join(pieces)
    out = []
    for m in scan_text(rules, joined.decode("utf-8", "replace")) if segments else []:
        if not crosses_messages(m.rule):
            continue
        parts = tuple(_part(joined, m.start, i, max(m.start, s), min(m.end, s + len(seg)), s - first)
                      for (i, first, _, seg), s in segments
                      if max(m.start, s) < min(m.end, s + len(seg)))
        if len({p.message for p in parts}) > 1:
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
    for x in conversation_matches(rules, contents, [m.role for m in msgs]) if rules else []:
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
