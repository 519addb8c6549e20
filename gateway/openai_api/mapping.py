"""OpenAI chat completions <-> the gateway's ChatRequest and events.

A body is checked for shape and type here (each refusal names its parameter); the ranges
(max_tokens, temperature, stop strings, sizes, …) are the pipeline's own checks
(gateway/validation.py), the same for both doors. What the endpoint does not do (tools,
logprobs, several choices, images, audio) is refused, never silently dropped. Unset
sampling numbers mean the server's defaults, as on gRPC: greedy unless `temperature` is set.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from finsieve.v1 import chat_pb2

from .errors import ApiError, from_event, invalid

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MESSAGE_KEYS = {"role", "content", "name"}  # `name` is accepted and not used
INT32_MAX = 2**31 - 1
INT64 = (-(2**63), 2**63 - 1)
# Parameters this endpoint does not implement, each accepted only at its neutral value (or
# null), so that a client library's explicit defaults pass and a real use is refused.
NEUTRAL: dict[str, Any] = {
    "n": 1, "logprobs": False, "top_logprobs": 0, "frequency_penalty": 0, "presence_penalty": 0,
    "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "functions": [],
    "function_call": "none", "logit_bias": {}, "modalities": ["text"], "audio": None,
    "prediction": None, "reasoning_effort": None, "web_search_options": None,
}
IGNORED = {"parallel_tool_calls", "service_tier", "store"}  # no effect here, whatever their value
SUPPORTED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
             "top_k", "seed", "stop", "user", "metadata", "stream", "stream_options"}
FINISH = {chat_pb2.FINISH_REASON_STOP: "stop", chat_pb2.FINISH_REASON_LENGTH: "length",
          chat_pb2.FINISH_REASON_CONTENT_FILTER: "content_filter"}


@dataclass(frozen=True)
class Call:
    """A request body, checked: the ChatRequest and how to answer."""

    request: chat_pb2.ChatRequest
    model: str
    stream: bool
    include_usage: bool
    rename: dict[str, str]  # ChatRequest params named otherwise in the body


def parse(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid(None, "the body is not valid JSON (UTF-8, no NaN or Infinity)") from None
    if not isinstance(body, dict):
        raise invalid(None, "the body must be a JSON object")
    return body


def to_call(body: dict[str, Any], request_id: str, served_model: str | None) -> Call:
    """The ChatRequest a body asks for; ApiError(400 or 404) naming the parameter."""
    for name, value in body.items():
        if name in SUPPORTED or name in IGNORED:
            continue
        if name not in NEUTRAL:
            raise invalid(name, "unrecognized request argument")
        if value is not None and value != NEUTRAL[name]:
            raise invalid(name, "only 1 choice is supported" if name == "n"
                          else "not supported by this endpoint")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "required: the model's name (GET /v1/models)")
    if served_model is not None and model != served_model:
        raise ApiError(404, f"the model {model[:64]!r} does not exist; this gateway serves "
                       f"{served_model!r}", "model", "model_not_found")
    req = chat_pb2.ChatRequest(request_id=request_id)
    _messages(body.get("messages"), req)
    rename = _params(body, req.params)
    if (user := body.get("user")) is not None:
        req.metadata["user"] = _string(user, "user")
    _metadata(body.get("metadata"), req)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream", "expected true or false")
    return Call(req, model, bool(stream), _include_usage(body.get("stream_options"), bool(stream)),
                rename)


def _messages(messages: Any, req: chat_pb2.ChatRequest) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "required: a list of at least one message")
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(at, "expected an object with role and content")
        if extra := sorted(set(m) - MESSAGE_KEYS):
            raise invalid(f"{at}.{extra[0]}", "not supported by this endpoint (text chat only)")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{at}.role", f"expected one of {', '.join(ROLES)}")
        req.messages.add(role=ROLES[role], content=_content(m.get("content"), f"{at}.content"))


def _content(content: Any, at: str) -> str:
    """A string, or text parts (joined with newlines, as vLLM does)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(at, "expected a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid(f"{at}[{j}].type", "only text parts are supported")
        texts.append(_string(part.get("text"), f"{at}[{j}].text"))
    return "\n".join(texts)


def _params(body: dict[str, Any], p: chat_pb2.SamplingParams) -> dict[str, str]:
    rename: dict[str, str] = {}
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if (n := body.get(name)) is not None:
        p.max_tokens = _integer(n, name, 1, INT32_MAX)
        rename["max_tokens"] = name
    if (t := body.get("temperature")) is not None:
        p.temperature = _number(t, "temperature")
    if (top_p := body.get("top_p")) is not None:
        p.top_p = _number(top_p, "top_p")
    if (k := body.get("top_k")) is not None:
        p.top_k = _integer(k, "top_k", 0, INT32_MAX)
    if (seed := body.get("seed")) is not None:
        p.seed = _integer(seed, "seed", *INT64)
    stop = body.get("stop")
    if isinstance(stop, str):
        p.stop.append(stop)
    elif isinstance(stop, list):
        p.stop.extend(_string(s, f"stop[{i}]") for i, s in enumerate(stop))
    elif stop is not None:
        raise invalid("stop", "expected a string or a list of strings")
    return rename


def _metadata(metadata: Any, req: chat_pb2.ChatRequest) -> None:
    """Tags for the audit trail (`app` and `user` are its labels), as gRPC's metadata."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise invalid("metadata", "expected an object of string values")
    for key, value in metadata.items():
        if key == "user" and "user" in req.metadata:
            continue  # the `user` parameter decides
        req.metadata[key] = _string(value, f"metadata[{key[:32]}]")


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options", "only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", "expected an object")
    for key in options:
        if key not in ("include_usage", "include_obfuscation"):  # no obfuscation is needed here
            raise invalid(f"stream_options.{key}", "not supported by this endpoint")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise invalid("stream_options.include_usage", "expected true or false")
    return usage


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise invalid(param, "expected a string")
    return value


def _number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(param, "expected a number")
    return float(value)


def _integer(value: Any, param: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(param, "expected an integer")
    if not low <= value <= high:
        raise invalid(param, f"expected an integer from {low} to {high}")
    return value


# -- answers --------------------------------------------------------------------------------


def policy_event(e: chat_pb2.PolicyEvent) -> dict[str, Any]:
    """An intervention, as the extension field `finsieve` carries it (the suppressed text
    never: the pipeline cleared it)."""
    return {"rule_id": e.rule_id, "action": e.action, "scope": e.scope, "start": e.start,
            "end": e.end, "rolled_back": e.rolled_back, "tokens_recomputed": e.tokens_recomputed,
            "message": e.message}


@dataclass
class Answer:
    """One request's events, turned into what the client reads: chunks as they come, or one
    completion at the end. `finsieve` is the extension field standard clients ignore."""

    call: Call
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    model: str = ""
    fingerprint: str = ""  # the policy version in force: what answered, with the model
    cache_hit: bool = False
    text: list[str] = field(default_factory=list)
    interventions: list[dict[str, Any]] = field(default_factory=list)
    finished: chat_pb2.Finished | None = None

    def add(self, event: chat_pb2.ChatServerMessage) -> None:
        """Take one event; ApiError for an Error event (or an end that is no answer)."""
        kind = event.WhichOneof("event")
        if kind == "started":
            s = event.started
            self.model, self.fingerprint, self.cache_hit = s.model, s.policy_version, s.cache_hit
        elif kind == "delta":
            self.text.append(event.delta.text)
        elif kind == "policy_event":
            self.interventions.append(policy_event(event.policy_event))
        elif kind == "finished":
            if event.finished.finish_reason not in FINISH:
                raise ApiError(500, "the request ended without an answer")
            self.finished = event.finished
        elif kind == "error":
            raise from_event(event.error, self.call.rename)

    def completion(self) -> bytes:
        assert self.finished is not None
        f = self.finished
        return orjson.dumps({
            **self._head("chat.completion"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(self.text)},
                         "logprobs": None, "finish_reason": FINISH[f.finish_reason]}],
            "usage": _usage(f.usage),
            "finsieve": {"audit_id": f.audit_id, "policy_version": self.fingerprint,
                         "cache_hit": self.cache_hit, "policy_events": self.interventions},
        })

    def chunk(self, event: chat_pb2.ChatServerMessage) -> bytes:
        """The SSE lines for one event (after `add` took it)."""
        kind = event.WhichOneof("event")
        if kind == "started":
            return self._sse({"role": "assistant", "content": ""})
        if kind == "delta":
            return self._sse({"content": event.delta.text})
        if kind == "policy_event":
            return self._sse({}, extension={"policy_event": self.interventions[-1]})
        assert self.finished is not None
        f = self.finished
        out = self._sse({}, FINISH[f.finish_reason], {"audit_id": f.audit_id,
                                                      "policy_version": self.fingerprint,
                                                      "cache_hit": self.cache_hit})
        if self.call.include_usage:
            out += _data({**self._head("chat.completion.chunk"), "choices": [],
                          "usage": _usage(f.usage)})
        return out + b"data: [DONE]\n\n"

    def _sse(self, delta: dict[str, Any], finish: str | None = None,
             extension: dict[str, Any] | None = None) -> bytes:
        chunk: dict[str, Any] = {**self._head("chat.completion.chunk"), "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if self.call.include_usage:
            chunk["usage"] = None
        if extension is not None:
            chunk["finsieve"] = extension
        return _data(chunk)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.model or self.call.model, "system_fingerprint": self.fingerprint}


def error_chunk(e: ApiError) -> bytes:
    """An error after the stream began: the client library raises it (openai.APIError)."""
    return b"data: " + e.body() + b"\n\n"


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _usage(u: chat_pb2.Usage) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}
