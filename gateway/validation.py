"""Checks of a client's ChatRequest: the first field at fault becomes the Error's field.

Counts are checked before anything is iterated, so a frame of a million empty messages
costs one comparison. Every bound is in docs/operations.md ("Limits and bounds").
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from finsieve.errors import invalid
from finsieve.v1 import chat_pb2
from finsieve.wire import (
    MAX_METADATA_CHARS,
    MAX_METADATA_ENTRIES,
    MAX_REQUEST_ID,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
)

ROLES = ("system", "user", "assistant")
# Sampling: dividing logits by a temperature below the floor overflows float32 (1e-45 is a
# valid float). top_k beyond a few hundred is top_k off in all but name.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1000


def _float32(x: float) -> float:
    """x as the wire carries it: a client's 0.01 arrives as 0.0099999998, and is allowed."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class Limits:
    max_tokens: int
    max_input_bytes: int
    max_messages: int = 256


def validate(req: chat_pb2.ChatRequest, limits: Limits) -> None:
    """Raise RequestError(INVALID_ARGUMENT, field=…) for the first problem found."""
    if not req.request_id:
        raise invalid("request_id", "required: a client-chosen id, unique among its requests in flight")
    if len(req.request_id) > MAX_REQUEST_ID:
        raise invalid("request_id", f"at most {MAX_REQUEST_ID} characters")
    if not req.messages:
        raise invalid("messages", "at least one message is required")
    if len(req.messages) > limits.max_messages:
        raise invalid("messages", f"at most {limits.max_messages} messages")
    total = 0
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise invalid(f"messages[{i}].role", f"{m.role[:32]!r} is not one of {', '.join(ROLES)}")
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
    t = p.temperature
    if not (math.isfinite(t) and (t == 0 or _float32(MIN_TEMPERATURE) <= t <= MAX_TEMPERATURE)):
        raise invalid("params.temperature",
                      f"must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}")
    if not (math.isfinite(p.top_p) and 0 <= p.top_p <= 1):
        raise invalid("params.top_p", "must be between 0 and 1 (0 = unset, i.e. 1)")
    if not 0 <= p.top_k <= MAX_TOP_K:
        raise invalid("params.top_k", f"must be between 0 (off) and {MAX_TOP_K}")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise invalid("params.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for i, s in enumerate(p.stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise invalid(f"params.stop[{i}]", f"must be 1 to {MAX_STOP_CHARS} characters")
