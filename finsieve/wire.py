"""Wire limits: how large a frame may be, and the bounds of a ChatRequest's fields that size
it. A leaf: the settings check their frame limit against it, the servers and the gateway's
validation read it, and it imports nothing of the project."""

from __future__ import annotations

# The most a client's frame may be (FINSIEVE_MAX_MESSAGE_BYTES is at most this), and the
# gateway <-> engine link's limit: a forwarded request differs from the client's frame only by
# its id (at most ~20 bytes longer), so whatever a gateway accepts fits the link by construction.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
ENGINE_MESSAGE_BYTES = MAX_MESSAGE_BYTES + 64 * 1024

# A ChatRequest's fields (gateway/validation.py refuses a request past any of them).
MAX_REQUEST_ID = 128
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64
MAX_METADATA_ENTRIES = 32
MAX_METADATA_CHARS = 256


def largest_valid_request(max_input_bytes: int, max_messages: int) -> int:
    """An upper bound on the wire size of a ChatClientMessage that validation accepts: the
    messages' text plus the most every other field may add (UTF-8: 4 bytes a character)."""
    varint, tag = 5, 1
    per_message = 2 * (tag + varint) + (tag + varint + len("assistant"))
    stop = MAX_STOP_STRINGS * (tag + varint + 4 * MAX_STOP_CHARS)
    metadata = MAX_METADATA_ENTRIES * (3 * (tag + varint) + 2 * 4 * MAX_METADATA_CHARS)
    params = 6 * (tag + 10) + stop + 2 * (tag + varint)
    request_id = tag + varint + 4 * MAX_REQUEST_ID
    return max_input_bytes + max_messages * per_message + metadata + params + request_id + 2 * (tag + varint)
