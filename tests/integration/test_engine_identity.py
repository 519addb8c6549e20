"""An engine with mTLS trusts gateways by name, not every certificate its CA signed.

In a bank one CA issues the apps' and the gateways' certificates. An engine started with
--tls-client-ca accepts a caller only if its certificate carries an identity on
FINSIEVE_ENGINE_ALLOWED_PEERS (a SAN URI such as spiffe://bank-a/gateway, a SAN DNS name or
a subject CN) and, by default, the engine secret as well. Real certificates (openssl), a
real engine process with the real model, a real gateway in front of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.server import EngineService, GatewayGate, add_to_server
from finsieve.app.client import Credentials, chat_request, wait_ready
from finsieve.auth import GATEWAY_ROLE, AuthInterceptor, roles_for
from finsieve.config import Settings
from finsieve.errors import ConfigError
from finsieve.tls import check_transport, server_credentials
from finsieve.v1 import chat_pb2, engine_pb2, engine_pb2_grpc

from support.processes import wait_for
from support.servers import Server, free_port, start_server
from support.streams import ChatStream, kinds, text_of

GATEWAY_ID = "spiffe://bank-a/gateway"
ENGINE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


@pytest.fixture(scope="module")
def peers(certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Certificates of the CA the engine trusts (conftest's `certs`): the gateway's, a
    banking app's, and an app's whose subject CN spells the gateway's SPIFFE id."""
    d = tmp_path_factory.mktemp("peers")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    for name, subject, san in [
            # Also the gateway's serving certificate: its clients connect to 127.0.0.1.
            ("gateway", "/O=Bank A/CN=gateway", f"URI:{GATEWAY_ID},DNS:localhost,IP:127.0.0.1"),
            ("app", "/O=Bank A/CN=app", "URI:spiffe://bank-a/app"),
            ("spoof", "/O=Bank A/CN=" + GATEWAY_ID.replace("/", "\\/"), "URI:spiffe://bank-a/app")]:
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject)
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(certs / "ca.pem"), "-CAkey",
                str(certs / "ca.key"), "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                "-extfile", f"{name}.ext")
        (d / f"{name}.key").chmod(0o600)
    return d


@dataclass
class Engine:
    server: Server
    target: str
    secret: str
    secret_file: Path


def as_peer(certs: Path, peers: Path, name: str, secret: str = "") -> Credentials:
    """TLS to the engine with `name`'s client certificate, and `secret` as bearer if given."""
    return Credentials(secret, tls_ca=(certs / "ca.pem").read_bytes(),
                       tls_cert=(peers / f"{name}.pem").read_bytes(),
                       tls_key=(peers / f"{name}.key").read_bytes())


def start_engine(tmp: Path, certs: Path, model: Path, peers: Path) -> Engine:
    tmp.mkdir()
    secret_file = tmp / "engine.secret"
    secret_file.write_text(os.urandom(32).hex())
    secret_file.chmod(0o600)
    port = free_port()
    srv = start_server(tmp, "--role", "engine", "--engine-port", str(port), "--model", str(model),
                       "--no-rules", "--tls-cert", str(certs / "server.pem"),
                       "--tls-key", str(certs / "server.key"),
                       "--tls-client-ca", str(certs / "ca.pem"), ready=False,
                       env={"FINSIEVE_ENGINE_SECRET_FILE": str(secret_file),
                            "FINSIEVE_ENGINE_ALLOWED_PEERS": f"URI:{GATEWAY_ID}"})
    target = f"127.0.0.1:{port}"
    # Health stays reachable as before: any certificate of the CA, no engine secret.
    if not asyncio.run(wait_ready(target, 120, as_peer(certs, peers, "app"))):
        srv.stop()
        raise AssertionError(f"the engine did not come up:\n{srv.log()}")
    return Engine(srv, target, secret_file.read_text().strip(), secret_file)


@pytest.fixture(scope="module")
def mtls_engine(tmp_path_factory, certs, default_model_dir, peers) -> Engine:
    e = start_engine(tmp_path_factory.mktemp("engine") / "e", certs, default_model_dir, peers)
    yield e
    assert e.server.stop() == 0


# grpc.aio's client: when a server ends a stream before reading it (here: refused in its
# interceptor), the client's request write that was under way may fail the call as
# INTERNAL "Internal error from Core" instead of the server's status (measured: 5 of 60
# calls). That is the client library's race, not the engine's answer (its log says why it
# refused), so a call that ends so is made again, a few times.
CORE_RACE = "Internal error from Core"
CORE_RACE_TRIES = 6


async def generate(target: str, credentials: Credentials) -> grpc.StatusCode | str:
    """Call Engine/Generate directly, as a gateway would: the answer's text, or the status."""
    for _ in range(CORE_RACE_TRIES):
        result = await _generate_once(target, credentials)
        if result != (grpc.StatusCode.INTERNAL, CORE_RACE):
            break
    return result[0] if isinstance(result, tuple) else result


async def _generate_once(target: str, credentials: Credentials) -> tuple[grpc.StatusCode, str] | str:
    request = chat_pb2.ChatClientMessage(request=chat_request("direct", "Say hello.", max_tokens=3))
    async with credentials.channel(target) as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate(timeout=120)
        text = ""
        try:
            try:
                await call.write(request)
            except asyncio.InvalidStateError:  # the server ended the call before the write:
                return await call.code(), await call.details() or ""  # the status it gave
            async for step in call:
                for event in step.events:
                    text += event.delta.text
                    if event.WhichOneof("event") in ("finished", "error"):
                        call.cancel()
                        return text or event.WhichOneof("event")
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
    return "the stream ended without an answer"


async def info(target: str, credentials: Credentials) -> grpc.StatusCode:
    async with credentials.channel(target) as channel:
        try:
            await engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.InfoRequest(), timeout=30)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def refusals(engine: Engine) -> list[dict]:
    lines = [json.loads(line) for line in engine.server.log().splitlines() if line.startswith("{")]
    return [entry for entry in lines if entry.get("event", "").startswith("engine refused")]


def test_a_certificate_of_the_same_ca_not_on_the_allow_list_is_unauthenticated(mtls_engine, certs, peers):
    app = as_peer(certs, peers, "app")
    assert asyncio.run(generate(mtls_engine.target, app)) == grpc.StatusCode.UNAUTHENTICATED
    # Not even with the engine secret (leaked, or the app's operator has it).
    app_with_secret = as_peer(certs, peers, "app", mtls_engine.secret)
    assert asyncio.run(generate(mtls_engine.target, app_with_secret)) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(info(mtls_engine.target, app_with_secret)) == grpc.StatusCode.UNAUTHENTICATED
    # A subject CN that spells the allowed SAN URI is not that URI.
    spoof = as_peer(certs, peers, "spoof", mtls_engine.secret)
    assert asyncio.run(generate(mtls_engine.target, spoof)) == grpc.StatusCode.UNAUTHENTICATED

    # Each refusal is logged with the certificate's identities, never the secret.
    assert wait_for(lambda: len(refusals(mtls_engine)) >= 4, 10), mtls_engine.server.log()
    logged = refusals(mtls_engine)
    assert {tuple(r["peer_uris"]) for r in logged} == {("spiffe://bank-a/app",)}
    assert {tuple(r["peer_common_names"]) for r in logged} == {("app",), (GATEWAY_ID,)}
    assert all(r["level"] == "warning" and r["setting"] == "FINSIEVE_ENGINE_ALLOWED_PEERS"
               for r in logged)
    assert mtls_engine.secret not in mtls_engine.server.log()


def test_the_allowed_gateway_certificate_needs_the_engine_secret_too(mtls_engine, certs, peers):
    assert asyncio.run(generate(mtls_engine.target, as_peer(certs, peers, "gateway"))) == \
        grpc.StatusCode.UNAUTHENTICATED
    wrong = as_peer(certs, peers, "gateway", os.urandom(32).hex())
    assert asyncio.run(generate(mtls_engine.target, wrong)) == grpc.StatusCode.UNAUTHENTICATED
    allowed = as_peer(certs, peers, "gateway", mtls_engine.secret)
    assert asyncio.run(info(mtls_engine.target, allowed)) == grpc.StatusCode.OK
    answer = asyncio.run(generate(mtls_engine.target, allowed))
    assert isinstance(answer, str) and answer not in ("error", "finished"), answer


def test_the_allowed_gateway_serves_end_to_end(mtls_engine, certs, peers, tmp_path):
    """A gateway process whose certificate carries the allowed SAN, with the secret."""
    gateway = start_server(tmp_path, "--role", "gateway", "--engine", mtls_engine.target, "--no-rules",
                           "--engine-ca", str(certs / "ca.pem"),
                           "--tls-cert", str(peers / "gateway.pem"),
                           "--tls-key", str(peers / "gateway.key"),
                           "--engine-secret-file", str(mtls_engine.secret_file),
                           credentials=Credentials(tls_ca=(certs / "ca.pem").read_bytes()))
    try:
        client = Credentials(gateway.key("app"), tls_ca=(certs / "ca.pem").read_bytes())

        async def go():
            async with ChatStream(gateway.target, credentials=client) as s:
                s.send(chat_request("e2e", "Say hello.", max_tokens=4))
                return (await s.until_done("e2e"))["e2e"]

        events = asyncio.run(go())
        assert kinds(events)[-1] == "finished" and text_of(events), events
        assert "engine refused this gateway" not in gateway.log()
    finally:
        assert gateway.stop() == 0


def test_the_secret_can_be_made_optional_explicitly(engine, certs, peers):
    """FINSIEVE_ENGINE_REQUIRE_SECRET=false: the allowed certificate alone. The real engine
    service in this process (conftest's `engine`) behind the gate its settings give, over
    the TLS those settings serve."""
    settings = Settings.load({}, env={
        "FINSIEVE_ROLE": "engine", "FINSIEVE_TLS_CERT": str(certs / "server.pem"),
        "FINSIEVE_TLS_KEY": str(certs / "server.key"),
        "FINSIEVE_TLS_CLIENT_CA": str(certs / "ca.pem"),
        "FINSIEVE_ENGINE_ALLOWED_PEERS": f"URI:{GATEWAY_ID}",
        "FINSIEVE_ENGINE_REQUIRE_SECRET": "false"})
    check_transport(settings)
    gate = GatewayGate.of(settings, os.urandom(32).hex().encode(), apart=True)

    async def calls() -> list[grpc.StatusCode]:
        server = grpc.aio.server(interceptors=[AuthInterceptor(gate, roles_for({ENGINE: GATEWAY_ROLE}))])
        add_to_server(EngineService(engine), server)
        port = server.add_secure_port("127.0.0.1:0", server_credentials(settings))
        await server.start()
        try:
            target = f"127.0.0.1:{port}"
            return [await info(target, as_peer(certs, peers, "gateway")),
                    # A secret that is sent must still be right; other certificates stay out.
                    await info(target, as_peer(certs, peers, "gateway", os.urandom(32).hex())),
                    await info(target, as_peer(certs, peers, "app"))]
        finally:
            await server.stop(0)

    assert asyncio.run(calls()) == [grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED,
                                    grpc.StatusCode.UNAUTHENTICATED]


def test_health_needs_no_secret_and_no_allowed_name(mtls_engine, certs, peers):
    async def check() -> int:
        async with as_peer(certs, peers, "spoof").channel(mtls_engine.target) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
            return reply.status

    assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING


# -- configuration -------------------------------------------------------------------------

def test_an_mtls_engine_without_an_allow_list_refuses_to_start(tmp_path, certs):
    out = subprocess.run(
        [sys.executable, "-m", "finsieve.app.cli", "serve", "--role", "engine", "--engine-port", "0",
         "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
         "--tls-client-ca", str(certs / "ca.pem"), "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("FINSIEVE_")})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "--engine-allowed-peers" in out.stderr and "FINSIEVE_ENGINE_ALLOWED_PEERS" in out.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was made


MTLS_ENGINE = {"role": "engine", "tls_cert": "s.pem", "tls_key": "s.key", "tls_client_ca": "ca.pem"}


@pytest.mark.parametrize("settings, named", [
    (MTLS_ENGINE, "--engine-allowed-peers"),
    ({**MTLS_ENGINE, "engine_allowed_peers": "gateway"}, "--engine-allowed-peers gateway"),
    ({**MTLS_ENGINE, "engine_allowed_peers": "URI:"}, "--engine-allowed-peers URI:"),
    ({**MTLS_ENGINE, "engine_allowed_peers": "EMAIL:gw@bank-a"}, "--engine-allowed-peers EMAIL:"),
    ({"role": "engine", "engine_allowed_peers": f"URI:{GATEWAY_ID}"}, "--engine-allowed-peers"),
    ({"role": "engine", "engine_require_secret": False}, "FINSIEVE_ENGINE_REQUIRE_SECRET"),
])
def test_an_unusable_allow_list_is_refused_naming_the_setting(settings, named):
    with pytest.raises(ConfigError) as err:
        check_transport(Settings.load(settings, env={}))
    assert str(err.value).startswith(named), err.value


def test_allow_list_entries_of_every_kind_are_accepted():
    settings = Settings.load({**MTLS_ENGINE, "engine_allowed_peers":
                              f"URI:{GATEWAY_ID}, DNS:gw.bank-a.internal,CN:gateway,{GATEWAY_ID}"},
                             env={})
    check_transport(settings)
    # A gateway is not asked for the engines' list, but one given must still be readable
    # (one environment may serve both roles).
    gateway = {"role": "gateway", "engines": "127.0.0.1:1", "tls_cert": "s.pem", "tls_key": "s.key",
               "tls_client_ca": "ca.pem"}
    check_transport(Settings.load(gateway, env={}))
    with pytest.raises(ConfigError, match=r"^--engine-allowed-peers gateway"):
        check_transport(Settings.load({**gateway, "engine_allowed_peers": "gateway"}, env={}))
