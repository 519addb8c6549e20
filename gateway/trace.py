"""What the gateway saw of one request, turned into its audit records.

Values that rules say to mask or hash (`audit:` in the rule pack) are protected in every
text a record stores: the messages, the delivered text, the suppressed text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from prometheus_client import Histogram

from finsieve.v1 import chat_pb2

from .sensitive import Sensitive

IDENTITY = ("tenant", "app", "user")  # metadata keys that identify the caller
TTFT = Histogram("finsieve_time_to_first_token_seconds", "Request received to first text delivered",
                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))


@dataclass
class Trace:
    request: chat_pb2.ChatRequest  # as the client sent it
    sensitive: Sensitive | None = None  # of the gateway's rules; None: stored as sent
    started: float = field(default_factory=time.monotonic)
    first_delta: float | None = None
    audit_id: int = 0  # seq of the request_started record (a cache hit: of its one record)
    model: str = ""
    policy_version: str = ""
    cache_hit: bool = False
    delivered: list[str] = field(default_factory=list)
    interventions: list[dict[str, Any]] = field(default_factory=list)
    terminal: chat_pb2.ChatServerMessage | None = None
    events: list[chat_pb2.ChatServerMessage] = field(default_factory=list)  # as the client got them
    _messages: tuple[list[dict[str, str]], set[str]] | None = field(default=None, init=False, repr=False)

    def identity(self) -> dict[str, str]:
        return {k: self.request.metadata.get(k, "") for k in IDENTITY}

    def observe(self, event: chat_pb2.ChatServerMessage) -> None:
        """Record one event on its way to the client (suppressed text still attached)."""
        kind = event.WhichOneof("event")
        if kind == "started":
            self.model, self.policy_version = event.started.model, event.started.policy_version
        elif kind == "delta":
            if self.first_delta is None and event.delta.text:
                self.first_delta = time.monotonic()
                TTFT.observe(self.first_delta - self.started)
            self.delivered.append(event.delta.text)
        elif kind == "policy_event":
            self.interventions.append(
                json_format.MessageToDict(event.policy_event, preserving_proto_field_name=True))
        elif kind in ("finished", "error"):
            self.terminal = event

    def started_record(self) -> dict[str, Any]:
        """Written before the first byte is streamed: a crash mid-answer still leaves a trace."""
        messages, hashes = self._stored_messages()
        return {**self.identity(), "request_id": self.request.request_id,
                "messages": messages, "params": self._params(), "match_hashes": sorted(hashes)}

    def final_record(self, replayed: dict[str, Any] | None = None) -> dict[str, Any]:
        """The request's full record. For a cache hit, `replayed` is the record of the answer
        replayed: the hit names it and carries its interventions."""
        end = time.monotonic()
        messages, hashes = self._stored_messages()
        hashes = set(hashes)
        if replayed is None:
            interventions = [self._protect(i, hashes) for i in self.interventions]
        else:
            interventions = replayed.get("interventions", [])
            hashes.update(replayed.get("match_hashes", []))
        record: dict[str, Any] = {
            **self.identity(),
            "request_id": self.request.request_id,
            "metadata": dict(self.request.metadata),
            "model": self.model,
            "policy_version": self.policy_version,
            "params": self._params(),
            "messages": messages,
            "delivered": self._text("".join(self.delivered), hashes),
            "interventions": interventions,
            "cache_hit": self.cache_hit,
            "latency_ms": {
                "first_delta": round(1000 * (self.first_delta - self.started), 1)
                if self.first_delta else None,
                "total": round(1000 * (end - self.started), 1),
            },
        }
        if replayed is not None:
            record["replays"] = replayed.get("seq")
        elif self.audit_id:
            record["audit_id"] = self.audit_id
        t = self.terminal
        if t is not None and t.WhichOneof("event") == "finished":
            record["finish_reason"] = chat_pb2.FinishReason.Name(
                t.finished.finish_reason).removeprefix("FINISH_REASON_")
            record["usage"] = {"prompt_tokens": t.finished.usage.prompt_tokens,
                               "completion_tokens": t.finished.usage.completion_tokens}
        elif t is not None:
            record["finish_reason"] = "ERROR"
            record["error"] = {"code": t.error.code, "message": t.error.message,
                               "field": t.error.field}
        record["match_hashes"] = sorted(hashes)
        return record

    def _stored_messages(self) -> tuple[list[dict[str, str]], set[str]]:
        if self._messages is None:
            hashes: set[str] = set()
            messages = [{"role": m.role, "content": self._text(m.content, hashes)}
                        for m in self.request.messages]
            self._messages = (messages, hashes)
        return self._messages

    def _text(self, text: str, hashes: set[str]) -> str:
        return self.sensitive.text(text, hashes) if self.sensitive else text

    def _protect(self, intervention: dict[str, Any], hashes: set[str]) -> dict[str, Any]:
        if self.sensitive is None or not intervention.get("suppressed"):
            return intervention
        return {**intervention, "suppressed": self.sensitive.suppressed(
            intervention.get("rule_id", ""), intervention["suppressed"], hashes)}

    def _params(self) -> dict[str, Any]:
        return json_format.MessageToDict(self.request.params, preserving_proto_field_name=True)
