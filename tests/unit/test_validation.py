"""gateway/validation.py and finsieve/wire.py: what validation accepts fits the frame limit and
the engine link."""

from __future__ import annotations


def test_what_validation_accepts_fits_the_frame_limit_and_the_engine_link():
    """By construction: a valid request at every limit is within largest_valid_request, and
    its forwarded copy (a longer internal id) within the gateway-engine link's limit."""
    from finsieve.v1 import chat_pb2
    from finsieve.wire import (
        ENGINE_MESSAGE_BYTES,
        MAX_MESSAGE_BYTES,
        MAX_METADATA_CHARS,
        MAX_METADATA_ENTRIES,
        MAX_REQUEST_ID,
        MAX_STOP_CHARS,
        MAX_STOP_STRINGS,
        largest_valid_request,
    )
    from gateway.validation import Limits, validate

    for max_input, max_messages in [(262144, 256), (16384, 16), (7_000_000, 4096)]:
        wide = "😀"
        req = chat_pb2.ChatRequest(request_id=wide * MAX_REQUEST_ID)
        per = max_input // max_messages
        for _ in range(max_messages):
            req.messages.add(role="assistant", content="x" * per)
        p = req.params
        p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed = 1024, 2.0, 1.0, 1000, -(2**63)
        p.stop.extend([wide * MAX_STOP_CHARS] * MAX_STOP_STRINGS)
        for k in range(MAX_METADATA_ENTRIES):
            req.metadata[f"{k:03d}" + wide * (MAX_METADATA_CHARS - 3)] = wide * MAX_METADATA_CHARS
        validate(req, Limits(1024, max_input, max_messages))
        frame = chat_pb2.ChatClientMessage(request=req).ByteSize()
        assert frame <= largest_valid_request(max_input, max_messages)
        req.request_id = "r" + "9" * 20  # the longest internal id (a 64-bit counter)
        forwarded = chat_pb2.ChatClientMessage(request=req).ByteSize()
        assert forwarded <= frame + 64  # only the id differs
    assert MAX_MESSAGE_BYTES + 64 <= ENGINE_MESSAGE_BYTES  # so any accepted frame fits the link
