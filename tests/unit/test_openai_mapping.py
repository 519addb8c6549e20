"""The OpenAI door's mapping (gateway/openai_api/mapping.py, errors.py): bodies to
ChatRequests with every refusal naming its parameter, events to OpenAI objects."""

from __future__ import annotations

import json

import grpc
import pytest

from finsieve.config import Settings
from finsieve.errors import ConfigError
from finsieve.tls import check_transport
from finsieve.v1 import chat_pb2
from gateway.openai_api.errors import ApiError, from_event
from gateway.openai_api.mapping import Answer, parse, to_call

MODEL = "SmolLM2-135M-Instruct"
BASE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def call(**changes):
    return to_call({**BASE, **changes}, "chatcmpl-1", MODEL)


def refused(body: dict, served: str | None = MODEL) -> ApiError:
    with pytest.raises(ApiError) as e:
        to_call(body, "chatcmpl-1", served)
    return e.value


def test_a_body_maps_onto_the_chat_request():
    c = call(messages=[{"role": "developer", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": "ok", "name": "bot"}],
             max_completion_tokens=12, temperature=0.5, top_p=0.9, top_k=40, seed=-3,
             stop="END", user="alice", metadata={"app": "notebook"}, stream=True,
             stream_options={"include_usage": True}, n=1, logprobs=False, parallel_tool_calls=True)
    r = c.request
    assert [(m.role, m.content) for m in r.messages] == \
        [("system", "Be brief."), ("user", "a\nb"), ("assistant", "ok")]
    p = r.params
    assert (p.max_tokens, p.temperature, round(p.top_p, 3), p.top_k, p.seed, list(p.stop)) == \
        (12, 0.5, 0.9, 40, -3, ["END"])
    assert dict(r.metadata) == {"user": "alice", "app": "notebook"}
    assert (r.request_id, c.stream, c.include_usage) == ("chatcmpl-1", True, True)
    assert c.rename == {"max_tokens": "max_completion_tokens"}
    unset = call().request.params
    assert (unset.max_tokens, unset.temperature, unset.HasField("seed")) == (0, 0.0, False)


@pytest.mark.parametrize("changes, param", [
    ({"model": None}, "model"), ({"model": 3}, "model"),
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"messages": [["user", "hi"]]}, "messages[0]"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": 2**31}, "max_completion_tokens"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": [1]}, "top_p"), ({"seed": 2**63}, "seed"),
    ({"stop": 5}, "stop"), ({"stop": ["a", 5]}, "stop[1]"), ({"user": 5}, "user"),
    ({"metadata": []}, "metadata"), ({"metadata": {"k": 1}}, "metadata[k]"),
    ({"stream": 1}, "stream"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
    ({"n": 2}, "n"), ({"tools": [{"type": "function"}]}, "tools"), ({"logprobs": True}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"functions": [{}]}, "functions"),
    ({"best_of": 2}, "best_of"),
])
def test_every_refusal_names_its_parameter(changes, param):
    e = refused({**BASE, **changes})
    assert (e.status, e.param) == (400, param)
    assert e.message.startswith(f"{param}: ")
    assert json.loads(e.body())["error"] == {"message": e.message, "type": "invalid_request_error",
                                             "param": param, "code": None}


def test_another_model_is_404_and_none_known_lets_the_pipeline_answer():
    e = refused({**BASE, "model": "gpt-4o"})
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
    assert to_call({**BASE, "model": "anything"}, "id", None).model == "anything"


@pytest.mark.parametrize("raw", [b"{", b"[]", b'"x"', b'{"a": NaN}', b'{"a": 1e999}', b"\xff"])
def test_a_body_that_is_no_json_object_is_refused(raw):
    with pytest.raises(ApiError) as e:
        parse(raw)
    assert (e.value.status, e.value.param) == (400, None)


def test_pipeline_errors_name_the_body_s_parameters():
    c = call(max_completion_tokens=5)
    bad = chat_pb2.Error(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], field="params.max_tokens",
                         message="params.max_tokens: must be between 1 and 1024 (0 = default)")
    e = from_event(bad, c.rename)
    assert (e.status, e.param) == (400, "max_completion_tokens")
    assert e.message == "max_completion_tokens: must be between 1 and 1024 (0 = default)"
    stop = chat_pb2.Error(code=3, field="params.stop[2]", message="params.stop[2]: too long")
    assert from_event(stop, {}).param == "stop[2]"
    limited = from_event(chat_pb2.Error(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                        message="rate", retry_after_ms=1500), {})
    assert (limited.status, limited.headers()) == (429, {"retry-after": "2"})
    for code, status in [(grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.INTERNAL, 500)]:
        assert from_event(chat_pb2.Error(code=code.value[0], message="x"), {}).status == status


def events(*pairs) -> list[chat_pb2.ChatServerMessage]:
    return [chat_pb2.ChatServerMessage(**{k: v}) for k, v in pairs]


def test_events_become_chunks_and_a_completion():
    answer = Answer(call(stream=True, stream_options={"include_usage": True}), "chatcmpl-1")
    stream = events(
        ("started", chat_pb2.Started(model=MODEL, policy_version="v1")),
        ("delta", chat_pb2.Delta(text="It is a ", tokens=3)),
        ("policy_event", chat_pb2.PolicyEvent(rule_id="r", action="halt", start=8, end=8, scope="output")),
        ("finished", chat_pb2.Finished(finish_reason=chat_pb2.FINISH_REASON_CONTENT_FILTER,
                                       usage=chat_pb2.Usage(prompt_tokens=9, completion_tokens=3),
                                       audit_id="42")))
    sse = b""
    for e in stream:
        answer.add(e)
        sse += answer.chunk(e)
    lines = [ln.removeprefix(b"data: ") for ln in sse.split(b"\n\n") if ln]
    assert lines[-1] == b"[DONE]"
    chunks = [json.loads(ln) for ln in lines[:-1]]
    assert [c["choices"][0]["delta"] if c["choices"] else None for c in chunks] == \
        [{"role": "assistant", "content": ""}, {"content": "It is a "}, {}, {}, None]
    assert chunks[2]["finsieve"]["policy_event"]["action"] == "halt"
    assert chunks[3]["choices"][0]["finish_reason"] == "content_filter"
    assert chunks[3]["finsieve"]["audit_id"] == "42"
    assert chunks[4]["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    assert {c["system_fingerprint"] for c in chunks} == {"v1"}
    done = json.loads(answer.completion())
    assert done["choices"][0]["message"] == {"role": "assistant", "content": "It is a "}
    assert done["finsieve"]["policy_events"][0]["rule_id"] == "r"


def test_an_error_event_or_an_end_without_answer_is_an_api_error():
    answer = Answer(call(), "chatcmpl-1")
    with pytest.raises(ApiError) as e:
        answer.add(chat_pb2.ChatServerMessage(error=chat_pb2.Error(
            code=grpc.StatusCode.UNAVAILABLE.value[0], message="the audit trail is unavailable",
            retry_after_ms=0)))
    assert e.value.status == 503
    with pytest.raises(ApiError) as e:
        answer.add(chat_pb2.ChatServerMessage(finished=chat_pb2.Finished(
            finish_reason=chat_pb2.FINISH_REASON_CANCELLED)))
    assert e.value.status == 500


def test_plaintext_http_beyond_loopback_is_refused_and_bounds_are_checked():
    with pytest.raises(ConfigError, match=r"--http-host 0\.0\.0\.0"):
        check_transport(Settings.load({"http_port": 8080, "http_host": "0.0.0.0"}, env={}))
    check_transport(Settings.load({"http_host": "0.0.0.0"}, env={}))  # the door is off
    with pytest.raises(ConfigError, match="FINSIEVE_HTTP_MAX_BODY_BYTES"):
        Settings.load({"http_max_body_bytes": 1000}, env={})
    with pytest.raises(ConfigError, match="FINSIEVE_HTTP_PORT"):
        Settings.load({"http_port": 70000}, env={})
