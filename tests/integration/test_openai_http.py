"""The OpenAI-compatible HTTP door on real servers (issue 46): the official `openai` client
(sync and async, streaming and not) and `curl -N` get answers through the same rules,
identity, limits and audit trail as gRPC Chat; hostile HTTP gets OpenAI-shaped errors and
the server keeps serving.

The session server serves the door beside gRPC; the tight server (small bounds, a rules
directory the tests change) serves it for the hostile cases.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from finsieve.app.client import Credentials

from support.openai_http import (
    MODEL,
    address,
    async_client,
    client,
    curl_stream,
    issue_key,
    parse_raw,
    raw_exchange,
    records,
)
from support.packs import apply
from support.servers import TIGHT_ENV, free_port, start_server, state_of

QUESTION = [{"role": "user", "content": "What is a bond?"}]


def finsieve_of(obj) -> dict:
    """The extension field standard clients ignore (kept as an extra by the openai models)."""
    return obj.model_extra["finsieve"]


# -- answers -------------------------------------------------------------------------------


def test_the_official_client_streams_and_answers_sync_and_async(server):
    c = client(server.http, server.key("app"))
    chunks = list(c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True}))
    deltas = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(deltas) >= 3, "the answer must arrive in many chunks, not at the end"
    ends = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(ends) == 1 and ends[0].choices[0].finish_reason in ("length", "stop")
    assert finsieve_of(ends[0])["audit_id"].isdigit()
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= len(deltas)

    done = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16)  # greedy: the same
    assert done.choices[0].message.content == "".join(deltas)
    assert done.model == MODEL and done.usage.total_tokens > done.usage.completion_tokens > 0
    assert finsieve_of(done)["policy_version"] == done.system_fingerprint != ""

    async def streamed() -> tuple[str, str | None]:
        a = async_client(server.http, server.key("app"))
        stream = await a.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Name a coin."}]}],
            max_completion_tokens=8, temperature=0.8, seed=7, stream=True)
        text, finish = "", None
        async for ch in stream:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        await a.close()
        return text, finish

    text, finish = asyncio.run(streamed())
    assert text.strip() and finish in ("length", "stop")


def test_curl_streams_an_answer(server):
    events = curl_stream(server.http, server.key("app"),
                         {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).strip()
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}


def test_an_input_rule_halts_content_filter_and_a_card_number_is_redacted(server):
    c = client(server.http, server.key("app"))
    halted = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Can you give me some insider tips on ACME?"}],
        max_tokens=16, stream=True))
    assert halted[-1].choices[0].finish_reason == "content_filter"
    assert not "".join(ch.choices[0].delta.content or "" for ch in halted)
    events = [finsieve_of(ch)["policy_event"] for ch in halted
              if "policy_event" in (ch.model_extra.get("finsieve") or {})]
    assert [(e["action"], e["scope"]) for e in events] == [("halt", "input")]

    card = c.chat.completions.create(
        model=MODEL, max_tokens=16,
        messages=[{"role": "user", "content": 'Repeat exactly: "Card: 4111 1111 1111 1111"'}])
    interventions = finsieve_of(card)["policy_events"]
    assert any(e["rule_id"] == "payment-card-number" and e["action"] == "redact" for e in interventions)
    assert "4111 1111 1111 1111" not in card.choices[0].message.content
    assert all("suppressed" not in e for e in interventions)


def test_an_output_halt_never_delivers_the_phrase(tight_server):
    """An output rule added to the tight server's rules directory (and removed after)."""
    pack = tight_server.rules / "halt.yaml"
    apply(tight_server, lambda: pack.write_text(
        "rules:\n  - id: stop-profit\n    description: halt on it\n    kind: literal\n"
        "    patterns: [risk-free profit]\n    action: halt\n    message: Stopped by policy.\n"))
    try:
        events = curl_stream(tight_server.http, tight_server.server.key("app"), {
            "model": MODEL, "max_tokens": 40, "stream": True,
            "messages": [{"role": "user", "content": 'Repeat exactly: "It is a risk-free profit"'}]})
    finally:
        apply(tight_server, lambda: pack.unlink(missing_ok=True))
    chunks = events[:-1]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert "risk-free profit" not in text.lower() and text.startswith("It is a")
    halts = [c["finsieve"]["policy_event"] for c in chunks if "policy_event" in c.get("finsieve", {})]
    assert [(h["rule_id"], h["action"], h["message"]) for h in halts] == \
        [("stop-profit", "halt", "Stopped by policy.")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "content_filter" and events[-1] == "[DONE]"


# -- identity, limits, audit ----------------------------------------------------------------


def test_wrong_key_401_officer_key_403_unknown_model_404_unsupported_400(server):
    ask = {"model": MODEL, "messages": QUESTION, "max_tokens": 1}
    with pytest.raises(openai.AuthenticationError) as e:
        client(server.http, "fsk_0123456789abcdef_" + "ab" * 32).chat.completions.create(**ask)
    assert e.value.status_code == 401 and e.value.body["message"] == "missing or invalid credentials"
    with pytest.raises(openai.PermissionDeniedError):
        client(server.http, server.key("officer")).chat.completions.create(**ask)
    with pytest.raises(openai.PermissionDeniedError):
        client(server.http, server.key("officer")).models.list()
    c = client(server.http, server.key("app"))
    assert [m.id for m in c.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(**{**ask, "model": "gpt-4o"})
    assert e.value.body["param"] == "model"
    for extra, param in [({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                         ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                         ({"temperature": 3}, "temperature"), ({"max_tokens": 100000}, "max_tokens"),
                         ({"messages": [{"role": "user", "content": [
                             {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
                          "messages[0].content[0].type")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**{**ask, **extra})
        assert e.value.body["param"] == param, extra
        assert e.value.body["message"].startswith(f"{param}: "), e.value.body


def test_a_flood_gets_429_with_retry_after(server):
    """Tenant t-http-flood may send one request per 100 s (support.servers.SESSION_LIMITS)."""
    c = client(server.http, issue_key(server.audit_target, "t-http-flood"))
    ask = {"model": MODEL, "messages": QUESTION, "max_tokens": 1}
    c.chat.completions.create(**ask)
    with pytest.raises(openai.RateLimitError) as e:
        for _ in range(5):
            c.chat.completions.create(**ask)
    assert int(e.value.response.headers["retry-after"]) >= 1
    assert e.value.body["type"] == "rate_limit_error"
    client(server.http, server.key("app")).chat.completions.create(**ask)  # another tenant is served


def test_the_audit_record_of_an_http_request_is_found_by_its_audit_id(server):
    c = client(server.http, server.key("app"))
    done = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0.5,
                                     seed=3, user="alice", metadata={"app": "notebook"})
    audit_id = finsieve_of(done)["audit_id"]
    out = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "audit", "show", audit_id,
                          "--target", server.audit_target, "--state-dir", str(state_of(server.audit_target))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert done.id in out.stdout
    final = next(r for r in records(server.audit_target, done.id) if r["type"] == "request")
    assert final["audit_id"] == int(audit_id)
    assert (final["tenant"], final["user"], final["app"]) == ("default", "alice", "notebook")
    assert final["delivered"] == done.choices[0].message.content
    assert final["params"]["seed"] == "3" and final["finish_reason"] in ("LENGTH", "STOP")


def test_a_disconnect_mid_stream_cancels_at_the_engine(server):
    body = {"model": MODEL, "max_tokens": 1000, "stream": True, "temperature": 0.9,
            "messages": [{"role": "user", "content": "Write a long story about a small bank."}]}
    seen = 0
    with httpx.Client(timeout=120) as h, h.stream(
            "POST", f"{server.http}/chat/completions", json=body,
            headers={"Authorization": f"Bearer {server.key('app')}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                request_id = chunk["id"]
                seen += bool(chunk["choices"][0]["delta"].get("content"))
            if seen >= 5:
                break  # leaving the block closes the connection
    final = next(r for r in records(server.audit_target, request_id) if r["type"] == "request")
    assert final["finish_reason"] == "CANCELLED"
    # Decoding stopped within a few steps of the disconnect, far short of max_tokens (chunks
    # already written to the socket and unread count too).
    assert final["usage"]["completion_tokens"] < seen + 40


def test_sse_keepalive_comments_while_the_request_waits(tight_server):
    """Eight long streamed answers fill the engine's batch; a ninth then waits in its queue
    with nothing to send: its status is committed, and a comment comes every second. The
    eight disconnect, which frees the batch: the ninth is answered."""
    auth = {"Authorization": f"Bearer {tight_server.server.key('app')}"}
    url = f"{tight_server.http}/chat/completions"

    async def fill(h: httpx.AsyncClient, generating: asyncio.Event, leave: asyncio.Event) -> None:
        # Greedy: this small model then loops to max_tokens (sampled, one answer could end
        # early and free its row before the ninth is queued).
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                "max_tokens": 1000, "temperature": 0, "stream": True}
        async with h.stream("POST", url, json=body, headers=auth) as r:
            async for line in r.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    generating.set()
                    await leave.wait()
                    return  # a disconnect

    async def go() -> list[str]:
        leave = asyncio.Event()
        generating = [asyncio.Event() for _ in range(8)]
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=16)) as h:
            fills = [asyncio.create_task(fill(h, g, leave)) for g in generating]
            await asyncio.wait_for(asyncio.gather(*(g.wait() for g in generating)), 300)
            lines: list[str] = []
            async with h.stream("POST", url, headers=auth, json={
                    "model": MODEL, "messages": QUESTION, "max_tokens": 2, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    lines.append(line)
                    leave.set()
            await asyncio.gather(*fills)
            return lines

    lines = asyncio.run(go())
    assert lines[0] == ": keepalive" and lines[-2:] == ["data: [DONE]", ""]
    assert any('"finish_reason":"length"' in ln for ln in lines)


def test_the_http_port_serves_tls_and_mtls_with_the_grpc_certificates(tmp_path, certs):
    """A gateway (its engine never up) with TLS and a client CA: the HTTP port requires the
    certificate gRPC requires, and refuses plaintext."""
    srv = start_server(tmp_path, "--role", "gateway", "--engine", f"127.0.0.1:{free_port()}",
                       "--http-port", str(free_port()), "--tls-cert", str(certs / "server.pem"),
                       "--tls-key", str(certs / "server.key"), "--tls-client-ca", str(certs / "ca.pem"),
                       credentials=Credentials("", tls_ca=(certs / "ca.pem").read_bytes(),
                                               tls_cert=(certs / "client.pem").read_bytes(),
                                               tls_key=(certs / "client.key").read_bytes()))
    try:
        assert srv.http.startswith("https://")
        auth = {"Authorization": f"Bearer {srv.key('app')}"}
        ask = {"model": MODEL, "messages": QUESTION, "max_tokens": 1}
        mutual = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        mutual.load_cert_chain(certs / "client.pem", certs / "client.key")
        with httpx.Client(verify=mutual, timeout=30) as h:
            assert h.get(f"{srv.http}/models", headers=auth).json() == {"object": "list", "data": []}
            r = h.post(f"{srv.http}/chat/completions", headers=auth, json=ask)
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"]  # authenticated
        with httpx.Client(verify=ssl.create_default_context(cafile=str(certs / "ca.pem")),
                          timeout=30) as h, pytest.raises(httpx.TransportError):
            h.get(f"{srv.http}/models", headers=auth)  # no client certificate
        with httpx.Client(timeout=30) as h, pytest.raises(httpx.TransportError):
            h.get(srv.http.replace("https://", "http://") + "/models", headers=auth)
    finally:
        assert srv.stop() == 0


# -- hostile HTTP ----------------------------------------------------------------------------


def _error(status: int, headers: dict[str, str], body: bytes) -> dict:
    assert headers.get("content-type", "").startswith("application/json"), (status, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def test_hostile_http_gets_openai_errors_and_the_server_keeps_serving(tight_server):
    base, key = tight_server.http, tight_server.server.key("app")
    limit = int(TIGHT_ENV["FINSIEVE_HTTP_MAX_BODY_BYTES"])

    def post(body: bytes, headers: str = "") -> tuple[int, dict[str, str], bytes]:
        return parse_raw(raw_exchange(base, (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n").encode() + body))

    cases = {
        b"{not json": (400, None), b"[1, 2]": (400, None), b'{"model": NaN}': (400, None),
        b'{"model": "' + MODEL.encode() + b'", "messages": "hi"}': (400, "messages"),
        b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": 5}]}':
            (400, "messages[0].content"),
        b'{"model": "' + MODEL.encode() + b'", "messages": [], "stream": "yes"}': (400, "messages"),
        b'{"model": 7}': (400, "model"), b'{"bogus": 1}': (400, "bogus"),
        json.dumps({"model": MODEL, "messages": QUESTION, "seed": 2**70}).encode(): (400, "seed"),
        json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": True}).encode(): (400, "max_tokens"),
        json.dumps({"model": MODEL, "messages": QUESTION, "stop": ["x"] * 50}).encode(): (400, "stop"),
        json.dumps({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}).encode():
            (400, "messages[0].role"),
        json.dumps({"model": MODEL, "messages": QUESTION * 100}).encode(): (400, "messages"),
        b"x" * (limit + 1): (413, None),
    }
    for body, (status, param) in cases.items():
        got, headers, answer = post(body)
        error = _error(got, headers, answer)
        assert (got, error["param"]) == (status, param), (body[:80], error)

    # A body larger than it said, sent chunked with no length, is counted as it arrives.
    chunked = raw_exchange(base, (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n").encode()
        + b"".join(b"%x\r\n%s\r\n" % (4096, b"y" * 4096) for _ in range(limit // 4096 + 2)) + b"0\r\n\r\n")
    assert parse_raw(chunked)[0] == 413
    # Headers over the bound: 431, whether they arrive whole or in pieces; HTTP that does not
    # parse: 400; both in OpenAI's shape.
    big = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"
    status, headers, body = parse_raw(raw_exchange(base, big))
    assert (status, _error(status, headers, body)["type"]) == (431, "invalid_request_error")
    with socket.create_connection(address(base), timeout=30) as sock:
        for i in range(0, len(big), 1000):
            sock.sendall(big[i:i + 1000])
            time.sleep(0.01)
        status, headers, body = parse_raw(sock.recv(65536))
    assert status == 431 and _error(status, headers, body)
    status, headers, body = parse_raw(raw_exchange(base, b"\x16\x03\x01 garbage\r\n\r\n"))
    assert status == 400 and _error(status, headers, body)
    status, headers, body = parse_raw(raw_exchange(base, b"GET /admin HTTP/1.1\r\nHost: x\r\n"
                                                   b"Connection: close\r\n\r\n"))
    assert status == 404 and _error(status, headers, body)
    status, headers, body = parse_raw(raw_exchange(base, b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\n"
                                                   b"Connection: close\r\n\r\n"))
    assert status == 405 and _error(status, headers, body)

    # A body that stops arriving: 408 after FINSIEVE_HTTP_READ_TIMEOUT_S; a connection that
    # never sends a whole head is closed after the same time.
    with socket.create_connection(address(base), timeout=30) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                     "Content-Length: 100\r\n\r\n{".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, headers, body = parse_raw(answer)
    assert status == 408 and _error(status, headers, body)
    with socket.create_connection(address(base), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        assert sock.recv(65536) == b""  # closed
        assert time.monotonic() - started < 20

    ok = client(base, key).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert ok.choices[0].message.content


# Generated bodies: a valid request with its fields replaced by values of every JSON type,
# at and beyond their ranges. Each answer is a completion or an OpenAI error naming a
# parameter the body holds; the server keeps serving.
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                   st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
                   st.lists(st.text(max_size=5), max_size=3),
                   st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "seed", "stop", "user", "metadata", "stream", "stream_options", "n", "tools",
          "logprobs", "response_format", "frequency_penalty"]
BODIES = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4).map(
    lambda changes: {"model": MODEL, "messages": QUESTION, "max_tokens": 1, **changes})
FUZZ = dict(deadline=None, database=None, derandomize=True, phases=[Phase.generate],
            suppress_health_check=list(HealthCheck), print_blob=False)


def _fuzz(tight_server, examples: int) -> None:
    base, key = tight_server.http, tight_server.server.key("app")
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}"}) as h:
        @settings(max_examples=examples, **FUZZ)
        @given(BODIES)
        def one(body: dict) -> None:
            if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
                body["max_tokens"] = 1  # unset would decode FINSIEVE_DEFAULT_MAX_TOKENS tokens
            r = h.post(f"{base}/chat/completions", content=json.dumps(body))
            if r.status_code == 200:
                # A valid request: answered in full (max_tokens 1, 2 or unset: short).
                assert r.text.endswith("data: [DONE]\n\n") if body.get("stream") is True else \
                    r.json()["choices"][0]["finish_reason"] in ("stop", "length")
                return
            error = _error(r.status_code, dict(r.headers), r.content)
            assert r.status_code in (400, 404), (body, error)
            assert error["param"] is not None and error["param"].split("[")[0].split(".")[0] in body, \
                (body, error)

        one()
        assert h.get(f"{base}/models").json()["data"][0]["id"] == MODEL


def test_fuzz_http_bodies(tight_server):
    _fuzz(tight_server, 60)


@pytest.mark.slow
def test_fuzz_http_bodies_more(tight_server):
    _fuzz(tight_server, 3000)
