"""Engines found at run time and the gateway's link to them (the default suite's share; the
processes killed and stopped are in test_chaos.py): an engine written to the watched file is
used within 10 s with no restart; an engine's listener takes its gateways' keepalive pings."""

from __future__ import annotations

import asyncio
import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from finsieve import grpc_server
from finsieve.config import Settings
from gateway.engines import EngineCredentials, EnginePool

from support.fleet import ask, check_outcome, check_trail, log_lines, request
from support.processes import wait_for
from support.servers import free_port, start_server
from support.streams import ChatStream


def test_an_engine_written_to_the_watched_file_is_used_within_10_s(tight_server, tmp_path):
    listed = tmp_path / "engines"
    listed.write_text("# no engine yet\n")
    gateway = start_server(tmp_path, "--role", "gateway", "--engines-file", str(listed), "--no-rules",
                           env={"FINSIEVE_ENGINE_SECRET_FILE": str(tight_server.engine_secret_file),
                                "FINSIEVE_CACHE_TTL_S": "0"})
    outcomes = {}
    try:
        outcomes["file-none"] = none = ask(gateway.target, "file-none")
        assert check_outcome(none) == "unavailable" and "none is in service" in none[-1].error.message

        listed.write_text(f"# the engines\n  {tight_server.engine_target}  # one\n")
        written, n = time.monotonic(), 0

        def served() -> bool:
            nonlocal n
            n += 1
            outcomes[f"file-{n}"] = events = ask(gateway.target, f"file-{n}")
            return check_outcome(events) == "finished"

        assert wait_for(served, 10, 0.05) and time.monotonic() - written < 10

        # A bad line: the file is refused, FILE:LINE named, and the engine stays in service. (A
        # write that is not atomic may be seen half done first: an empty file is refused too.)
        listed.write_text(f"{tight_server.engine_target}\nnode-2:port\n")

        def refused() -> list[str]:
            return [line["problem"] for line in log_lines(
                gateway, "engines file refused; the previous engines stay")]

        assert wait_for(lambda: any(p.startswith(f"{listed}:2: 'node-2:port': ") for p in refused()))
        outcomes["file-bad"] = events = ask(gateway.target, "file-bad")
        assert check_outcome(events) == "finished"

        # Replaced while a request runs on it: the engine is drained (the request finishes),
        # then closed; requests go to the one listed now.
        dead = f"127.0.0.1:{free_port()}"

        async def replaced_mid_answer() -> list:
            async with ChatStream(gateway.target) as s:
                s.send(request("file-drained", 24))
                while (await s.next()).WhichOneof("event") != "delta":
                    pass
                listed.write_text(f"{dead}\n")
                return (await s.until_done("file-drained"))["file-drained"]

        outcomes["file-drained"] = events = asyncio.run(replaced_mid_answer())
        assert check_outcome(events) == "finished" and events[-1].finished.usage.completion_tokens == 24
        (removed,) = log_lines(gateway, "engine removed; draining it")
        assert (removed["engine"], removed["in_flight"]) == (tight_server.engine_target, 1)
        assert wait_for(lambda: [(line["engine"], line["unfinished"]) for line in log_lines(
            gateway, "engine closed")] == [(tight_server.engine_target, 0)])
        outcomes["file-dead"] = events = ask(gateway.target, "file-dead")
        assert check_outcome(events) == "unavailable" and dead in events[-1].error.message
        check_trail(gateway, outcomes)
    finally:
        assert gateway.stop() == 0


def watch_for(server_options: list, settings: Settings, seconds: float) -> grpc.aio.AioRpcError | None:
    """A long-lived stream (a health Watch) over a gateway's engine channel to a server with
    `server_options`: None if it is still open after `seconds`, else how it ended."""
    async def run() -> grpc.aio.AioRpcError | None:
        running = await grpc_server.start_server("127.0.0.1:0", [], options=server_options)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}",
                                                 grpc_server.engine_channel_options(settings)) as ch:
                watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                try:
                    await asyncio.wait_for(watch.read(), seconds)
                except TimeoutError:
                    watch.cancel()
                    return None
                except grpc.aio.AioRpcError as e:
                    return e
                raise AssertionError("the Watch sent a second status")
        finally:
            await running.server.stop(0)

    return asyncio.run(run())


def test_an_engines_listener_takes_its_gateways_keepalive_pings():
    """Pings every second for 5 s: an engine's listener takes them (and, though a maximum
    connection age is set, never closes the stream); a clients' listener, which allows one
    ping every FINSIEVE_MIN_PING_INTERVAL_S (10 s), ends the connection with GOAWAY
    too_many_pings at the third one too soon, which on an engine link would end every
    request on it. (Old: the listeners' minimum interval was set under a key gRPC does not
    know, so every listener kept gRPC's 5 minutes and the engine's did the same.)"""
    settings = Settings.load(env={"FINSIEVE_ENGINE_KEEPALIVE_TIME_S": "1",
                                  "FINSIEVE_ENGINE_KEEPALIVE_TIMEOUT_S": "1",
                                  "FINSIEVE_MAX_CONNECTION_AGE_S": "1"})
    engine = grpc_server.server_options(settings, grpc_server.ENGINE_MESSAGE_BYTES, clients=False)
    assert watch_for(engine, settings, 5) is None
    clients = grpc_server.server_options(settings.replace(max_connection_age_s=0.0),
                                         grpc_server.ENGINE_MESSAGE_BYTES)
    ended = watch_for(clients, settings, 5)
    assert ended is not None and ended.code() == grpc.StatusCode.UNAVAILABLE
    assert ended.details() == "Too many pings", ended  # gRPC's words for GOAWAY too_many_pings


def test_an_engine_found_by_dns_name_is_checked_against_that_name(certs, tmp_path):
    """Over TLS, the engines a DNS name gives are connected by address and their certificate
    checked against the name: here a certificate for engine.test alone, served on 127.0.0.1."""
    subprocess.run(["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                    "-nodes", "-keyout", "engine.key", "-out", "engine.csr", "-subj", "/CN=engine.test"],
                   cwd=tmp_path, check=True, capture_output=True)
    (tmp_path / "engine.ext").write_text("subjectAltName=DNS:engine.test\n")
    subprocess.run(["openssl", "x509", "-req", "-in", "engine.csr", "-CA", str(certs / "ca.pem"),
                    "-CAkey", str(certs / "ca.key"), "-CAcreateserial", "-out", "engine.pem",
                    "-days", "1", "-extfile", "engine.ext"], cwd=tmp_path, check=True,
                   capture_output=True)
    credentials = EngineCredentials(tls=grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes()))

    async def run() -> dict[str, bool]:
        served = grpc.ssl_server_credentials([((tmp_path / "engine.key").read_bytes(),
                                               (tmp_path / "engine.pem").read_bytes())])
        running = await grpc_server.start_server("127.0.0.1:0", [], credentials=served)
        address = f"127.0.0.1:{running.port}"
        reached = {}
        try:
            for name in ("engine.test", ""):  # "": checked against the address
                pool = EnginePool([], 2, credentials=credentials)
                pool.update({address: name})
                (client,) = pool.clients
                try:
                    await health_pb2_grpc.HealthStub(client._channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=5)
                    reached[name] = True
                except grpc.aio.AioRpcError:
                    reached[name] = False
                await pool.close()
        finally:
            await running.server.stop(0)
        return reached

    assert asyncio.run(run()) == {"engine.test": True, "": False}
