"""The Chat service's wire: a client frame that does not parse is one request's error, never
the end of the stream.

gRPC's generated deserializer raises on a frame with invalid UTF-8 in a string field (or any
malformed frame), which ends the stream's reader and with it every request on the stream.
Here such a frame becomes a `BadFrame` carrying what can still be read of it (which oneof
member and its request_id, read as raw bytes), and the gateway answers it with an
INVALID_ARGUMENT Error event for that request id while the stream goes on. An Error event,
not a call status, because a status would end the stream and every other request on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import empty_pb2
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from finsieve.v1 import chat_pb2, chat_pb2_grpc

_MEMBERS = {1: "request", 2: "cancel"}  # ChatClientMessage's oneof, by field number
_LENGTH_DELIMITED = 2


@dataclass(frozen=True)
class BadFrame:
    field: str  # "request", "cancel", or "" when not even that can be read
    request_id: str  # "" when it cannot be read as UTF-8
    reason: str


def parse_client_message(data: bytes) -> chat_pb2.ChatClientMessage | BadFrame:
    try:
        return chat_pb2.ChatClientMessage.FromString(data)
    except DecodeError as e:
        field, request_id = _probe(data)
        why = "a string field is not valid UTF-8" if "UTF-8" in str(e) else "it is not valid protobuf"
        return BadFrame(field, request_id, f"the frame cannot be read: {why}")


def _probe(data: bytes) -> tuple[str, str]:
    """The frame's oneof member and request_id, read as unknown fields of an empty message:
    the protobuf library parses the wire format without checking strings."""
    field, request_id = "", ""
    try:
        for outer in _unknown_fields(data):
            if outer.field_number in _MEMBERS and outer.wire_type == _LENGTH_DELIMITED:
                field, request_id = _MEMBERS[outer.field_number], ""  # the last member wins
                for inner in _unknown_fields(outer.data):
                    if inner.field_number == 1 and inner.wire_type == _LENGTH_DELIMITED:
                        request_id = inner.data.decode("utf-8", "strict")
    except (DecodeError, UnicodeDecodeError):
        pass
    return field, request_id


def _unknown_fields(data: bytes) -> Iterator[Any]:
    """The fields of data read as unknown fields of an empty message, one at a time (by
    index: the stubs declare no iteration)."""
    fields = UnknownFieldSet(empty_pb2.Empty.FromString(data))
    return (fields[i] for i in range(len(fields)))


def add_gateway_to_server(servicer: chat_pb2_grpc.GatewayServicer, server: grpc.aio.Server) -> None:
    """The generated registration, with the lenient deserializer."""
    handlers = {
        "Chat": grpc.stream_stream_rpc_method_handler(
            servicer.Chat,
            request_deserializer=parse_client_message,
            response_serializer=chat_pb2.ChatServerMessage.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("finsieve.v1.Gateway", handlers),))
    server.add_registered_method_handlers("finsieve.v1.Gateway", handlers)
