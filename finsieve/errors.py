"""Errors a client can cause, carried as gRPC status codes with the field at fault."""

from __future__ import annotations

import grpc

from finsieve.v1 import chat_pb2


class RequestError(Exception):
    """A request that cannot be served; becomes an `Error` event for that request."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "",
                 retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_ms = retry_after_ms

    def to_event(self, request_id: str) -> chat_pb2.ChatServerMessage:
        return error_event(request_id, self.code, self.message, self.field, self.retry_after_ms)


def invalid(field: str, message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}", field)


def error_event(
    request_id: str, code: grpc.StatusCode, message: str, field: str = "", retry_after_ms: int = 0
) -> chat_pb2.ChatServerMessage:
    return chat_pb2.ChatServerMessage(
        request_id=request_id,
        error=chat_pb2.Error(code=code.value[0], message=message, field=field,
                             retry_after_ms=retry_after_ms),
    )
