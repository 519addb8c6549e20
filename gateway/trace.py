"""What the gateway saw of one request, turned into its audit records.

Values that rules say to mask or hash (`audit:` in the rule pack) are protected in every
text a record stores of what the client sent or the model said: the messages (as one
conversation), the delivered and suppressed text, metadata keys and values, the app and
user labels, the request id, stop sequences, error texts (PCI DSS 3.4: a card number may
come in any of them). The user and request ids go to the audit log as sent too (`ids`), so
that it indexes them by their keyed hash, never by the value (`audit.id_hash`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from prometheus_client import Histogram

from finsieve.auth import Principal
from finsieve.v1 import chat_pb2

from .sensitive import Sensitive

# The app's own labels for its end user and itself; the tenant never comes from metadata.
CLIENT_LABELS = ("app", "user")
TTFT = Histogram("finsieve_time_to_first_token_seconds", "Request received to first text delivered",
                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))


@dataclass
class Trace:
    request: chat_pb2.ChatRequest  # as the client sent it
    caller: Principal  # who sent it: decides the tenant
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
    moved_from: list[str] = field(default_factory=list)  # engines that lost it, in order
    _stored: tuple[dict[str, Any], set[str]] | None = field(default=None, init=False, repr=False)

    def identity(self) -> dict[str, str]:
        """Tenant and key from the credential; app and end user as the app labels them."""
        return {"tenant": self.caller.tenant, "key_id": self.caller.key_id,
                **{k: self.request.metadata.get(k, "") for k in CLIENT_LABELS}}

    def ids(self) -> dict[str, str]:
        """The client-chosen ids the trail indexes, as sent (indexed by keyed hash)."""
        return {"user": self.request.metadata.get("user", ""), "request_id": self.request.request_id}

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
        fields, hashes = self._stored_fields()
        return {"tenant": self.caller.tenant, "key_id": self.caller.key_id, **fields,
                "match_hashes": sorted(hashes)}

    def final_record(self, replayed: dict[str, Any] | None = None) -> dict[str, Any]:
        """The request's full record. For a cache hit, `replayed` is the record of the answer
        replayed: the hit names it and carries its interventions."""
        end = time.monotonic()
        fields, hashes = self._stored_fields()
        hashes = set(hashes)
        fields, delivered = self._with_answer(fields, "".join(self.delivered), hashes)
        if replayed is None:
            interventions = [self._protect(i, hashes) for i in self.interventions]
        else:
            interventions = replayed.get("interventions", [])
            hashes.update(replayed.get("match_hashes", []))
        record: dict[str, Any] = {
            "tenant": self.caller.tenant,
            "key_id": self.caller.key_id,
            **fields,
            "metadata": {self._text(k, hashes): self._text(v, hashes)
                         for k, v in sorted(self.request.metadata.items())},
            "model": self.model,
            "policy_version": self.policy_version,
            "delivered": delivered,
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
        if self.moved_from:
            record["moved_from"] = self.moved_from
        t = self.terminal
        if t is not None and t.WhichOneof("event") == "finished":
            record["finish_reason"] = chat_pb2.FinishReason.Name(
                t.finished.finish_reason).removeprefix("FINISH_REASON_")
            record["usage"] = {"prompt_tokens": t.finished.usage.prompt_tokens,
                               "completion_tokens": t.finished.usage.completion_tokens}
        elif t is not None:
            record["finish_reason"] = "ERROR"
            record["error"] = {"code": t.error.code, "message": self._text(t.error.message, hashes),
                               "field": self._text(t.error.field, hashes)}
        record["match_hashes"] = sorted(hashes)
        return record

    def _stored_fields(self) -> tuple[dict[str, Any], set[str]]:
        """What both records store of the request, protected once (a scan per field): the
        app and user labels, the request id, the messages, the sampling parameters."""
        if self._stored is None:
            hashes: set[str] = set()
            # One conversation: a value split over two messages is masked in both.
            contents = [m.content for m in self.request.messages]
            if self.sensitive is not None:
                contents = self.sensitive.messages(contents, hashes,
                                                   [m.role for m in self.request.messages])
            fields = {
                **{k: self._text(self.request.metadata.get(k, ""), hashes) for k in CLIENT_LABELS},
                "request_id": self._text(self.request.request_id, hashes),
                "messages": [{"role": m.role, "content": c}
                             for m, c in zip(self.request.messages, contents, strict=True)],
                "params": self._params(hashes),
            }
            self._stored = (fields, hashes)
        return self._stored

    def _with_answer(self, fields: dict[str, Any], answer: str, hashes: set[str]
                     ) -> tuple[dict[str, Any], str]:
        """The stored messages and the delivered answer, read as one conversation: the
        answer is its next message, so a number begun in a message and completed by the
        model is masked in both (the client has the answer: output rules decide delivery;
        the trail must not hold the number). A second scan of the messages, after the
        answer; the started record, written before it, holds what the messages alone show."""
        if self.sensitive is None:
            return fields, answer
        msgs = self.request.messages
        protected = self.sensitive.messages([m.content for m in msgs] + [answer], hashes,
                                            [m.role for m in msgs] + ["assistant"])
        stored = [{"role": m.role, "content": c} for m, c in zip(msgs, protected, strict=False)]
        return {**fields, "messages": stored}, protected[-1]

    def _text(self, text: str, hashes: set[str]) -> str:
        return self.sensitive.text(text, hashes) if self.sensitive else text

    def _protect(self, intervention: dict[str, Any], hashes: set[str]) -> dict[str, Any]:
        if self.sensitive is None or not intervention.get("suppressed"):
            return intervention
        return {**intervention, "suppressed": self.sensitive.suppressed(
            intervention.get("rule_id", ""), intervention["suppressed"], hashes)}

    def _params(self, hashes: set[str]) -> dict[str, Any]:
        params = json_format.MessageToDict(self.request.params, preserving_proto_field_name=True)
        if params.get("stop"):
            params["stop"] = [self._text(s, hashes) for s in params["stop"]]
        return params
