"""Refusals in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
status a client library turns into its own exception (openai.BadRequestError for 400, …)."""

from __future__ import annotations

import math

import grpc
import orjson

from finsieve.v1 import chat_pb2

# The gateway's gRPC codes as HTTP statuses and OpenAI error types.
_BY_CODE: dict[int, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT.value[0]: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED.value[0]: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED.value[0]: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND.value[0]: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE.value[0]: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED.value[0]: (504, "timeout_error"),
}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
          431: "invalid_request_error", 500: "server_error", 503: "service_unavailable_error"}
_CODES = {401: "invalid_api_key", 413: "request_too_large", 429: "rate_limit_exceeded"}


class ApiError(Exception):
    """A refusal of one HTTP request; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after_ms: int = 0,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _CODES.get(status)
        self.retry_after_ms = retry_after_ms
        self.type = error_type or _TYPES.get(status, "server_error")

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}})

    def headers(self) -> dict[str, str]:
        """Retry-After in whole seconds (at least 1) where the gateway gave a hint."""
        if not self.retry_after_ms:
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_after_ms / 1000)))}


def invalid(param: str | None, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param)


def from_event(error: chat_pb2.Error, rename: dict[str, str]) -> ApiError:
    """An Error event of the pipeline, its field named as the client's body named it
    (`params.temperature` -> `temperature`), and its message's leading field too."""
    status, kind = _BY_CODE.get(error.code, (500, "server_error"))
    param = openai_param(error.field, rename) if error.field else None
    message = error.message
    if error.field and param and message.startswith(f"{error.field}: "):
        message = f"{param}: {message[len(error.field) + 2:]}"
    return ApiError(status, message, param, retry_after_ms=error.retry_after_ms, error_type=kind)


def openai_param(field: str, rename: dict[str, str]) -> str:
    """A ChatRequest field path as the OpenAI body names it."""
    head, dot, rest = field.partition(".")
    if head == "params" and dot:
        name, bracket, index = rest.partition("[")
        return rename.get(name, name) + bracket + index
    if field == "metadata[user]":
        return "user"
    return field
