"""Every bad request gets an Error naming the field, and the stream keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from finsieve.app.client import chat_request
from finsieve.v1 import chat_pb2, engine_pb2, engine_pb2_grpc

from support.processes import pids_named, wait_gone
from support.servers import free_port, start_server
from support.streams import ChatStream, kinds, text_of

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def _params(**kw):
    def change(r: chat_pb2.ChatRequest) -> None:
        for k, v in kw.items():
            setattr(r.params, k, v)
    return change


def _content(text: str):
    def change(r: chat_pb2.ChatRequest) -> None:
        r.messages[0].content = text
    return change


CASES = {
    "empty messages": (lambda r: r.ClearField("messages"), "messages"),
    "unknown role": (lambda r: setattr(r.messages[0], "role", "robot"), "messages[0].role"),
    "negative max_tokens": (_params(max_tokens=-1), "params.max_tokens"),
    "max_tokens above the limit": (_params(max_tokens=1_000_000), "params.max_tokens"),
    "negative temperature": (_params(temperature=-0.5), "params.temperature"),
    "negative top_p": (_params(top_p=-0.1), "params.top_p"),
    "top_p above 1": (_params(top_p=1.5), "params.top_p"),
    "prompt longer than the context": (_content("interest rates and bonds " * 1200), "messages"),
    "message over the input limit": (_content("x" * 512 * 1024), "messages[0].content"),
    "empty request_id": (lambda r: setattr(r, "request_id", ""), "request_id"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_gets_invalid_argument_and_stream_keeps_serving(server, case):
    change, field = CASES[case]
    bad = chat_request("bad", "What is a stock?", max_tokens=4)
    change(bad)
    # A good request after it; top_p 0 means "unset" and is accepted.
    good = chat_request("good", "Say hello.", max_tokens=3, temperature=0.7, seed=3)

    async def go():
        async with ChatStream(server.target) as s:
            s.send(bad)
            s.send(good)
            return await s.until_done(bad.request_id, "good")

    result = asyncio.run(go())
    error = result[bad.request_id][-1]
    assert error.WhichOneof("event") == "error", case
    assert error.error.code == INVALID
    assert error.error.field == field
    assert field in error.error.message
    assert kinds(result["good"])[-1] == "finished"
    assert text_of(result["good"])


def test_duplicate_in_flight_request_id_is_refused_and_the_first_finishes(server):
    async def go():
        async with ChatStream(server.target) as s:
            s.send(chat_request("dup", "Tell me about savings.", max_tokens=20))
            s.send(chat_request("dup", "Another question.", max_tokens=20))
            await s.until_done("dup")  # the first terminal event: the refusal
            await s.until_done("dup")  # then the first request's finish
            return s.events

    events = asyncio.run(go())
    terminal = [e for e in events if e.WhichOneof("event") in ("error", "finished")]
    assert terminal[0].error.code == INVALID and terminal[0].error.field == "request_id"
    assert terminal[1].finished.usage.completion_tokens > 0


def _valkey_pid(log: str) -> int:
    for line in log.splitlines():
        if '"embedded valkey started"' in line:
            return json.loads(line)["pid"]
    raise AssertionError(f"no valkey start in the log:\n{log}")


def test_unreachable_engine_is_unavailable_and_valkey_stops_with_the_server(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    srv = start_server(tmp_path, "--role", "gateway", "--engine", dead)
    valkey = _valkey_pid(srv.log())
    assert valkey in pids_named("valkey-server")

    async def go():
        async with ChatStream(srv.target) as s:
            s.send(chat_request("u", "Hello?", max_tokens=4))
            return (await s.until_done("u"))["u"]

    error = asyncio.run(go())[-1].error
    assert error.code == UNAVAILABLE
    assert dead in error.message and "unreachable" in error.message
    assert srv.stop() == 0
    assert wait_gone(valkey), "valkey-server outlived the server"


def test_valkey_does_not_outlive_a_killed_server(tmp_path):
    srv = start_server(tmp_path, "--role", "gateway", "--engine", f"127.0.0.1:{free_port()}")
    valkey = _valkey_pid(srv.log())
    srv.stop(signal.SIGKILL)
    assert wait_gone(valkey), "valkey-server orphaned after kill -9 of the server"


def test_unreachable_redis_is_a_clear_startup_error(tmp_path):
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    srv = start_server(tmp_path, "--role", "gateway", "--engine", "127.0.0.1:1",
                       env={"FINSIEVE_REDIS_URL": url}, ready=False)
    assert srv.process.wait(60) == 1
    out = srv.log()
    assert "cannot connect" in out and "FINSIEVE_REDIS_URL" in out
    assert "Traceback" not in out and "hunter2" not in out


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tmp_path, default_model_dir):
    srv = start_server(tmp_path, "--model", str(default_model_dir))
    valkey = _valkey_pid(srv.log())

    async def go():
        async with ChatStream(srv.target) as s:
            # Long enough to be in flight when "late" comes, on the fast CPU path too (greedy,
            # this model loops to max_tokens): 40 tokens once ended within the 0.5 s below,
            # and the drained server closed the stream before "late" was answered.
            s.send(chat_request("first", "Write a long story.", max_tokens=300))
            while (await s.next()).WhichOneof("event") != "delta":
                pass
            srv.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            s.send(chat_request("late", "Too late?", max_tokens=4))
            return await s.until_done("first", "late")

    result = asyncio.run(go())
    assert result["late"][-1].error.code == UNAVAILABLE
    assert result["first"][-1].finished.finish_reason == chat_pb2.FINISH_REASON_LENGTH
    assert srv.process.wait(30) == 0
    assert wait_gone(valkey)


def test_chat_cli_json_prints_one_event_object_per_line(server):
    out = subprocess.run(
        [sys.executable, "-m", "finsieve.app.cli", "chat", "--target", server.target, "--json",
         "--state-dir", str(server.state), "--max-tokens", "6", "Say hello."],
        capture_output=True, text=True, timeout=120, check=True,
    )
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert all(e["request_id"] == "cli-1" for e in events)
    assert "started" in events[0] and "finished" in events[-1]
    assert events[-1]["finished"]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert any("delta" in e for e in events)


def test_chat_cli_reports_an_unreachable_gateway(tmp_path):
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "finsieve.app.cli", "chat", "--target", f"127.0.0.1:{free_port()}",
         "hello"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "FINSIEVE_API_KEY": "fsk_0123456789abcdef_" + "0" * 64},
    )
    assert out.returncode == 1
    assert "UNAVAILABLE" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - start < 30


def test_engine_and_gateway_apart_with_one_engine_down(tmp_path, default_model_dir, certs):
    """docs/operations.md's split deployment: a gateway in front of a dead and a live engine, the
    live one over TLS, authenticated by the engine secret."""
    engine_port = free_port()
    for part in ("e", "g"):
        (tmp_path / part).mkdir()
    engine = start_server(tmp_path / "e", "--role", "engine", "--engine-port", str(engine_port),
                          "--model", str(default_model_dir), "--tls-cert", str(certs / "server.pem"),
                          "--tls-key", str(certs / "server.key"), ready=False)
    try:
        import grpc as g
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from finsieve.app.client import READY_CHANNEL_OPTIONS, Credentials

        tls = Credentials(tls_ca=(certs / "ca.pem").read_bytes())

        async def engine_up() -> bool:
            # Reconnecting as often as it polls: the engine is seen once it serves, not after
            # gRPC's reconnect backoff (see finsieve.app.client.wait_ready).
            async with tls.channel(f"127.0.0.1:{engine_port}", READY_CHANNEL_OPTIONS) as ch:
                for _ in range(600):
                    try:
                        r = await health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(), timeout=1)
                        if r.status == health_pb2.HealthCheckResponse.SERVING:
                            return True
                    except g.aio.AioRpcError:
                        await asyncio.sleep(0.2)
            return False

        assert asyncio.run(engine_up()), engine.log()

        async def info_without_the_secret() -> g.StatusCode:
            async with tls.channel(f"127.0.0.1:{engine_port}") as ch:
                try:
                    await engine_pb2_grpc.EngineStub(ch).Info(engine_pb2.InfoRequest(), timeout=10)
                except g.aio.AioRpcError as e:
                    return e.code()
            return g.StatusCode.OK

        assert asyncio.run(info_without_the_secret()) == g.StatusCode.UNAUTHENTICATED
        # The engine made its secret on first start; the gateway is given a copy of it.
        gateway = start_server(tmp_path / "g", "--role", "gateway",
                               "--engine", f"127.0.0.1:{free_port()}",
                               "--engine", f"127.0.0.1:{engine_port}",
                               "--engine-secret-file", str(tmp_path / "e/state/engine.secret"),
                               "--engine-ca", str(certs / "ca.pem"))
        try:
            async def go():
                async with ChatStream(gateway.target) as s:
                    for i in range(3):
                        s.send(chat_request(f"x{i}", "Say hello.", max_tokens=4))
                    return await s.until_done("x0", "x1", "x2")

            for events in asyncio.run(go()).values():
                assert kinds(events)[-1] == "finished" and text_of(events)
            assert "engine serving" not in gateway.log()  # the gateway process loads no model
        finally:
            assert gateway.stop() == 0
    finally:
        assert engine.stop() == 0
