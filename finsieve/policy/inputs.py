"""Input-scope rules: applied to a request's messages before the model sees them.

A `redact` (or `rewrite`) span is replaced, so the model never reads it; a `halt` or
`block` span means the request is not decoded at all. The engine calls this off its
decode loop, after it has checked the prompt's token count against its context (a prompt
too long to serve is refused before any rule scans it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from .guard import Intervention
from .matcher import scan_text
from .pack import RuleSet


class ChatMessage(Protocol):
    role: str
    content: str


@dataclass
class InputVerdict:
    messages: list[dict[str, str]]  # what the model reads, spans replaced
    events: list[Intervention] = field(default_factory=list)
    halted: bool = False  # a halting (or blocking) rule matched: nothing is decoded

    @property
    def changed(self) -> bool:
        return any(i.action not in ("halt", "block") for i in self.events)


def apply_input_rules(rules: RuleSet, messages: Iterable[ChatMessage]) -> InputVerdict:
    verdict = InputVerdict([])
    for m in messages:
        content = m.content
        if rules:
            content = _scan(rules, content, verdict)
        verdict.messages.append({"role": m.role, "content": content})
    return verdict


def _scan(rules: RuleSet, content: str, verdict: InputVerdict) -> str:
    raw = content.encode()
    parts: list[str] = []
    pos = 0
    for x in sorted(scan_text(rules, content), key=lambda x: x.start):
        suppressed = raw[x.start : x.end].decode("utf-8", "replace")
        if x.rule.action in ("halt", "block"):
            verdict.halted = True
            verdict.events.append(Intervention(x.rule.id, x.rule.action, 0, 0,
                                               message=x.rule.message, suppressed=suppressed))
        elif x.start >= pos:  # redact / rewrite: the model never sees the span
            parts.append(raw[pos : x.start].decode("utf-8", "replace"))
            at = sum(len(p) for p in parts)
            parts.append(x.rule.replacement)
            verdict.events.append(Intervention(x.rule.id, x.rule.action, at,
                                               at + len(x.rule.replacement), suppressed=suppressed))
            pos = x.end
    parts.append(raw[pos:].decode("utf-8", "replace"))
    return "".join(parts)
