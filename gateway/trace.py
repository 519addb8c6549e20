"""What the gateway saw of one request, turned into its audit record at the end."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from prometheus_client import Histogram

from finsieve.auth import Principal
from finsieve.v1 import chat_pb2

# The app's own labels for its end user and itself; the tenant never comes from metadata.
CLIENT_LABELS = ("app", "user")
TTFT = Histogram("finsieve_time_to_first_token_seconds", "Request received to first text delivered",
                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))


@dataclass
class Trace:
    request: chat_pb2.ChatRequest  # as the client sent it
    caller: Principal  # who sent it: decides the tenant
    started: float = field(default_factory=time.monotonic)
    first_delta: float | None = None
    model: str = ""
    policy_version: str = ""
    cache_hit: bool = False
    delivered: list[str] = field(default_factory=list)
    interventions: list[dict[str, Any]] = field(default_factory=list)
    terminal: chat_pb2.ChatServerMessage | None = None
    events: list[chat_pb2.ChatServerMessage] = field(default_factory=list)  # as the client got them

    def identity(self) -> dict[str, str]:
        """Tenant and key from the credential; app and end user as the app labels them."""
        return {"tenant": self.caller.tenant, "key_id": self.caller.key_id,
                **{k: self.request.metadata.get(k, "") for k in CLIENT_LABELS}}

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
        return {**self.identity(), "request_id": self.request.request_id,
                "messages": self._messages(), "params": self._params()}

    def final_record(self) -> dict[str, Any]:
        end = time.monotonic()
        record: dict[str, Any] = {
            **self.identity(),
            "request_id": self.request.request_id,
            "metadata": dict(self.request.metadata),
            "model": self.model,
            "policy_version": self.policy_version,
            "params": self._params(),
            "messages": self._messages(),
            "delivered": "".join(self.delivered),
            "interventions": self.interventions,
            "cache_hit": self.cache_hit,
            "latency_ms": {
                "first_delta": round(1000 * (self.first_delta - self.started), 1)
                if self.first_delta else None,
                "total": round(1000 * (end - self.started), 1),
            },
        }
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
        return record

    def _messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.request.messages]

    def _params(self) -> dict[str, Any]:
        return json_format.MessageToDict(self.request.params, preserving_proto_field_name=True)
