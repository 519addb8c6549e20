"""Checks of a client's ChatRequest: the first field at fault becomes the Error's field."""

from __future__ import annotations

import math
from dataclasses import dataclass

from finsieve.errors import invalid
from finsieve.v1 import chat_pb2

ROLES = ("system", "user", "assistant")
MAX_REQUEST_ID = 128
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64
MAX_METADATA_ENTRIES = 32
MAX_METADATA_CHARS = 256


@dataclass(frozen=True)
class Limits:
    max_tokens: int
    max_input_bytes: int


def validate(req: chat_pb2.ChatRequest, limits: Limits) -> None:
    """Raise RequestError(INVALID_ARGUMENT, field=…) for the first problem found."""
    if not req.request_id:
        raise invalid("request_id", "required: a client-chosen id, unique among its requests in flight")
    if len(req.request_id) > MAX_REQUEST_ID:
        raise invalid("request_id", f"at most {MAX_REQUEST_ID} characters")
    if not req.messages:
        raise invalid("messages", "at least one message is required")
    total = 0
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise invalid(f"messages[{i}].role", f"{m.role!r} is not one of {', '.join(ROLES)}")
        total += len(m.content.encode())
        if total > limits.max_input_bytes:
            raise invalid(
                f"messages[{i}].content",
                f"the messages exceed {limits.max_input_bytes} bytes in total",
            )
    _validate_params(req.params, limits)
    if len(req.metadata) > MAX_METADATA_ENTRIES:
        raise invalid("metadata", f"at most {MAX_METADATA_ENTRIES} entries")
    for key, value in req.metadata.items():
        if len(key) > MAX_METADATA_CHARS or len(value) > MAX_METADATA_CHARS:
            raise invalid(
                f"metadata[{key[:32]}]", f"keys and values are at most {MAX_METADATA_CHARS} characters"
            )


def _validate_params(p: chat_pb2.SamplingParams, limits: Limits) -> None:
    if not 0 <= p.max_tokens <= limits.max_tokens:
        raise invalid("params.max_tokens", f"must be between 1 and {limits.max_tokens} (0 = default)")
    if not (math.isfinite(p.temperature) and 0 <= p.temperature <= 2):
        raise invalid("params.temperature", "must be between 0 and 2 (0 = greedy)")
    if not (math.isfinite(p.top_p) and 0 <= p.top_p <= 1):
        raise invalid("params.top_p", "must be between 0 and 1 (0 = unset, i.e. 1)")
    if p.top_k < 0:
        raise invalid("params.top_k", "must not be negative (0 = off)")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise invalid("params.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for i, s in enumerate(p.stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise invalid(f"params.stop[{i}]", f"must be 1 to {MAX_STOP_CHARS} characters")
