"""The errors of the base: an operator's (a setting that cannot be used, a model that cannot be
loaded), and a client's, carried as gRPC status codes with the field at fault."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from finsieve.v1 import chat_pb2


class ConfigError(ValueError):
    """A setting has a value that cannot be used; the message names the setting."""


class ModelLoadError(RuntimeError):
    """The model the settings name cannot be found or loaded; the message says what to do.
    (Here, not in the loader: the CLI tells it apart without importing torch.)"""


class RequestError(Exception):
    """A request that cannot be served; becomes an `Error` event for that request."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "",
                 retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_ms = retry_after_ms

    def __reduce__(self) -> tuple:  # crosses from a preparation worker process whole
        return RequestError, (self.code, self.message, self.field, self.retry_after_ms)

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


def retry_status(code: grpc.StatusCode, message: str, retry_after_ms: int) -> grpc.Status:
    """A whole call's refusal with a google.rpc.RetryInfo saying when to try again."""
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=retry_after_ms // 1000,
                                          nanos=retry_after_ms % 1000 * 1_000_000)))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message,
                                                  details=[detail]))
