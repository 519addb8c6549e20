"""Identity and tenancy on real servers: keys, roles, tenants, TLS/mTLS, limits, secrets."""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis.asyncio as redis
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from finsieve.app.client import Credentials, chat_request
from finsieve.config import Settings
from finsieve.display import cell
from finsieve.errors import ConfigError
from finsieve.secretfiles import read_secret
from finsieve.tls import check_transport
from finsieve.v1 import admin_pb2, admin_pb2_grpc, audit_pb2, audit_pb2_grpc, chat_pb2, engine_pb2
from finsieve.valkey import EmbeddedValkey, redact

from support.servers import free_port, start_server
from support.streams import ChatStream, text_of

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED
CREATED: list[str] = []  # every key this module issued: none may reach a log
WRONG_KEY = "fsk_0123456789abcdef_" + "ab" * 32  # well formed, never issued


def run(coro):
    return asyncio.run(coro)


def admin_call(server, fn, key: str | None = None):
    """fn(AdminService stub) with `key` (default: the server's development admin key)."""
    async def go():
        async with Credentials(key or server.key("admin")).channel(server.audit_target) as ch:
            return await fn(admin_pb2_grpc.AdminServiceStub(ch))
    return run(go())


def audit_call(server, fn, key: str | None = None):
    async def go():
        async with Credentials(key or server.key("officer")).channel(server.audit_target) as ch:
            return await fn(audit_pb2_grpc.AuditServiceStub(ch))
    return run(go())


def new_key(server, tenant: str, role: str, admin_key: str | None = None, **kw) -> tuple[str, str]:
    """(key, key id) issued through the AdminService."""
    reply = admin_call(server, lambda s: s.CreateKey(admin_pb2.CreateKeyRequest(
        tenant=tenant, role=role, **kw)), admin_key)
    CREATED.append(reply.key)
    return reply.key, reply.info.key_id


def chat(target: str, key: str, *requests: chat_pb2.ChatRequest, credentials=None) -> dict:
    async def go():
        async with ChatStream(target, key, credentials) as s:
            for r in requests:
                s.send(r)
            return await s.until_done(*(r.request_id for r in requests))
    return run(go())


def records(server, **query) -> list[dict]:
    page = audit_call(server, lambda s: s.Query(audit_pb2.AuditQuery(page_size=1000, **query)))
    return [json.loads(r.json) for r in page.records]


def code_of(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


# -- every method of every service, by credential ---------------------------------------


SERVICES = {  # service -> (listener, role that may call it)
    chat_pb2.DESCRIPTOR.services_by_name["Gateway"]: ("target", "app"),
    audit_pb2.DESCRIPTOR.services_by_name["AuditService"]: ("audit_target", "officer"),
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"]: ("audit_target", "admin"),
}


async def status_of(target: str, method, key: str) -> grpc.StatusCode:
    """Call a method with an empty request (raw bytes). A streaming call sends nothing: a
    grpc.aio client whose write races the server's refusal reports INTERNAL "Internal error
    from Core" instead of the status the server sent (grpc/grpc#36066)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    async with Credentials(key).channel(target) as ch:
        try:
            if method.client_streaming:
                async for _ in ch.stream_stream(path)(iter(())):
                    pass
            elif method.server_streaming:
                async for _ in ch.unary_stream(path)(b""):
                    pass
            else:
                await ch.unary_unary(path)(b"", timeout=30)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def bad_keys(server) -> dict[str, str]:
    expired, _ = new_key(server, "bank-a", "app", expires_in_s=1)
    revoked, revoked_id = new_key(server, "bank-a", "admin")
    admin_call(server, lambda s: s.RevokeKey(admin_pb2.RevokeKeyRequest(key_id=revoked_id)))
    created = time.time()
    while time.time() < created + 1.5:  # the expiry is absolute: it only needs to pass once
        time.sleep(0.1)
    return {"no key": "", "wrong key": WRONG_KEY, "not a key": "hunter2", "expired key": expired,
            "revoked key": revoked}


@pytest.mark.parametrize("credential", ["no key", "wrong key", "not a key", "expired key",
                                        "revoked key", "app", "officer", "admin"])
def test_each_credential_against_every_method_of_every_service(server, bad_keys, credential):
    key = bad_keys.get(credential) if credential in bad_keys else server.key(credential)
    for service, (listener, role) in SERVICES.items():
        for method in service.methods:
            got = run(status_of(getattr(server, listener), method, key))
            if credential in bad_keys:
                expected = UNAUTHENTICATED
            elif credential != role:
                expected = DENIED
            else:  # admitted: whatever the handler says of an empty request
                assert got not in (UNAUTHENTICATED, DENIED), (method.full_name, got)
                continue
            assert got == expected, (credential, method.full_name, got)


def test_refusals_say_nothing_more(server):
    async def go(key: str, method) -> grpc.aio.AioRpcError:
        async with Credentials(key).channel(server.audit_target) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(method)(b"")
            return e.value

    for key, method, text in [(WRONG_KEY, "/finsieve.v1.AuditService/Verify",
                               "missing or invalid credentials"),
                              (server.key("app"), "/finsieve.v1.AdminService/ListKeys",
                               "permission denied")]:
        err = run(go(key, method))
        assert err.details() == text
        assert not rpc_status.from_call(err) or not rpc_status.from_call(err).details


def test_a_direct_call_to_the_engine_without_the_gateways_secret_is_refused(server):
    """The engine hands out suppressed text and skips the gateway's checks: it must refuse
    anyone but its gateway, API keys of every role included."""
    engine = next(json.loads(line)["address"] for line in server.log().splitlines()
                  if '"engine serving"' in line)
    methods = engine_pb2.DESCRIPTOR.services_by_name["Engine"].methods
    for key in ("", WRONG_KEY, server.key("app"), server.key("officer"), server.key("admin")):
        for method in methods:
            assert run(status_of(engine, method, key)) == UNAUTHENTICATED, (method.name, key[:8])


# -- tenancy ------------------------------------------------------------------------------


def test_the_tenant_comes_from_the_key_never_from_metadata(server):
    key, key_id = new_key(server, "bank-a", "app", name="mobile")
    req = chat_request("spoof-1", "Say hi.", max_tokens=3)
    req.metadata.update({"tenant": "bank-evil", "user": "alice", "app": "mobile"})
    assert chat(server.target, key, req)["spoof-1"][-1].HasField("finished")
    started, final = records(server, request_id="spoof-1")
    for rec in (started, final):
        assert (rec["tenant"], rec["key_id"], rec["user"]) == ("bank-a", key_id, "alice")
    assert final["metadata"]["tenant"] == "bank-evil"  # kept as evidence of what was sent
    # Nothing was recorded under the spoofed tenant (but this query itself, as every read is).
    assert {r["type"] for r in records(server, tenant="bank-evil")} == {"access"}


def test_the_same_greedy_prompt_from_another_tenant_is_a_cache_miss(server):
    key_a, _ = new_key(server, "t-cache-a", "app")
    key_b, _ = new_key(server, "t-cache-b", "app")
    req = chat_request("c", "Name one kind of savings account.", max_tokens=6)
    hits = []
    for key in (key_a, key_b, key_a):
        events = chat(server.target, key, req)["c"]
        hits.append(events[0].started.cache_hit)
    assert hits == [False, False, True]


def test_a_key_revoked_while_its_stream_is_open_serves_no_further_request(server):
    """Revoked in the officers' process, the key stops working on the gateway's open stream
    within FINSIEVE_KEY_CACHE_S (5 s here): every request it still served was sent before."""
    key, key_id = new_key(server, "bank-a", "app")

    async def go():
        async with ChatStream(server.target, key) as s:
            s.send(chat_request("r0", "Say hi.", max_tokens=1))
            first = (await s.until_done("r0"))["r0"]
            await asyncio.to_thread(admin_call, server, lambda a: a.RevokeKey(
                admin_pb2.RevokeKeyRequest(key_id=key_id)))
            revoked, served = time.monotonic(), []
            for i in range(1, 200):
                sent = time.monotonic()
                s.send(chat_request(f"r{i}", "Say hi.", max_tokens=1))
                last = (await s.until_done(f"r{i}"))[f"r{i}"][-1]
                if last.HasField("error"):
                    return first, last, served
                served.append(sent - revoked)
                await asyncio.sleep(0.1)
            return first, last, served

    first, last, served = run(go())
    assert first[-1].HasField("finished")
    assert last.error.code == UNAUTHENTICATED.value[0]
    assert all(after < 5.0 for after in served), served


def test_an_officer_reads_its_own_tenant_only(server):
    app_key, _ = new_key(server, "bank-o", "app")
    chat(server.target, app_key, chat_request("own-1", "Say hi.", max_tokens=2))
    chat(server.target, server.key("app"), chat_request("other-1", "Say hi.", max_tokens=2))
    officer, _ = new_key(server, "bank-o", "officer")
    mine = [json.loads(r.json) for r in audit_call(
        server, lambda s: s.Query(audit_pb2.AuditQuery(page_size=1000)), officer).records]
    assert mine and {r["tenant"] for r in mine} == {"bank-o"}
    assert "own-1" in {r.get("request_id") for r in mine}
    other_seq = records(server, request_id="other-1")[0]["seq"]
    for ask in (lambda s: s.Query(audit_pb2.AuditQuery(tenant="default")),
                lambda s: s.Get(audit_pb2.AuditGetRequest(seq=other_seq)),
                # the whole chain: every tenant's counts and index keys
                lambda s: s.Verify(audit_pb2.AuditVerifyRequest())):
        assert code_of(lambda ask=ask: audit_call(server, ask, officer)) == DENIED


def test_the_officers_port_refuses_a_frame_over_the_client_limit(server):
    """The officers' listener has the public port's frame limit (1 MiB by default), not gRPC's
    8 MiB channel default: an oversized query is refused before it is parsed or authorized."""
    huge = audit_pb2.AuditQuery(match="x" * (2 << 20))
    ok = audit_pb2.AuditQuery(request_id="no-such-request")
    assert code_of(lambda: audit_call(server, lambda s: s.Query(huge))) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    assert audit_call(server, lambda s: s.Query(ok)).records is not None  # the port goes on


def test_an_admin_acts_on_its_own_tenant_only(server):
    admin, _ = new_key(server, "bank-x", "admin")
    assert code_of(lambda: new_key(server, "bank-y", "app", admin)) == DENIED
    assert code_of(lambda: new_key(server, "bank-x", "officer", admin, all_tenants=True)) == DENIED
    _, foreign = new_key(server, "bank-y", "app")
    assert code_of(lambda: admin_call(server, lambda s: s.RevokeKey(
        admin_pb2.RevokeKeyRequest(key_id=foreign)), admin)) == DENIED
    new_key(server, "bank-x", "app", admin, name="teller app")
    listed = admin_call(server, lambda s: s.ListKeys(admin_pb2.ListKeysRequest()), admin).keys
    assert {k.tenant for k in listed} == {"bank-x"} and len(listed) == 2
    # A key that reaches every tenant, at home in bank-x: only an admin who does too revokes it.
    _, everywhere = new_key(server, "bank-x", "officer", all_tenants=True)
    assert code_of(lambda: admin_call(server, lambda s: s.RevokeKey(
        admin_pb2.RevokeKeyRequest(key_id=everywhere)), admin)) == DENIED
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        new_key(server, "bank-x", "root", admin)
    detail = error_details_pb2.BadRequest()
    rpc_status.from_call(bad.value).details[0].Unpack(detail)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert detail.field_violations[0].field == "role"


# -- limits ---------------------------------------------------------------------------------


def test_generated_tokens_per_minute_are_limited_per_tenant(server):
    """t-tokens may generate 10 tokens a minute (support.servers.SESSION_LIMITS)."""
    key, _ = new_key(server, "t-tokens", "app")
    first = chat(server.target, key, chat_request("t0", "Describe a bond.", max_tokens=12))["t0"]
    assert first[-1].finished.usage.completion_tokens > 0
    for i in range(1, 20):  # charged once the first has finished: bounded polling, no timing
        sampled = chat_request(f"t{i}", "Describe a bond.", max_tokens=1, temperature=0.8)
        last = chat(server.target, key, sampled)[f"t{i}"][-1]
        if last.HasField("error"):
            break
    assert last.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert last.error.retry_after_ms > 1000
    other = chat(server.target, server.key("app"), chat_request("t-other", "Hi", max_tokens=1))
    assert other["t-other"][-1].HasField("finished")  # another tenant is not affected


@pytest.fixture(scope="module")
def shared_valkey(tmp_path_factory) -> EmbeddedValkey:
    v = EmbeddedValkey(tmp_path_factory.mktemp("shared") / "valkey")
    v.start()
    yield v
    v.stop()


@pytest.mark.parametrize("tokens_per_min", [200_000, 999_999_999_999])
def test_a_token_buckets_level_never_reads_as_a_card_number(shared_valkey, tokens_per_min):
    """The level a bucket stores (in the AOF too) is a float: written in full, 200,000 a
    minute less 53 tokens read `199947.33333333`, 14 Luhn-valid digits for a PAN scanner."""
    from gateway.limits import Limiter, TenantLimits

    from support.pan_scan import card_numbers

    async def levels() -> list[bytes]:
        client = redis.Redis(port=shared_valkey.port, password=shared_valkey.password)
        try:
            tenant = f"t-level-{tokens_per_min}"
            limiter = Limiter(client, TenantLimits(tokens_per_min=tokens_per_min), {})
            out = []
            for cost in (53, 1, 7, 11):
                await limiter.charge(tenant, cost)
                out.append(await client.hget(f"{{finsieve-limits:{tenant}}}:tpm", "t"))
            return out
        finally:
            await client.aclose()

    for level in asyncio.run(levels()):
        assert len(re.sub(r"\D", "", level.decode().split("e")[0])) <= 10, level
        assert not card_numbers(level.decode())


def test_limits_are_shared_by_two_gateways(tmp_path, shared_valkey):
    """Two gateway processes on one Valkey draw from the same buckets and stream slots."""
    url = f"redis://:{shared_valkey.password}@127.0.0.1:{shared_valkey.port}/0"
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir(mode=0o700)
    env = {"FINSIEVE_REDIS_URL": url}
    for name in ("keys.secret", "audit.key"):
        (secrets_dir / name).write_text(os.urandom(32).hex())
        (secrets_dir / name).chmod(0o600)
    env |= {"FINSIEVE_KEYS_SECRET_FILE": str(secrets_dir / "keys.secret"),
            "FINSIEVE_AUDIT_KEY_FILE": str(secrets_dir / "audit.key")}
    (tmp_path / "limits.yaml").write_text("tenants:\n  t-rate: {requests_per_s: 0.01}\n"
                                          "  t-streams: {concurrent_streams: 1}\n")
    # Gateway b reads the URL from a file: its password is then in no process's environment.
    (secrets_dir / "redis.url").write_text(url)
    (secrets_dir / "redis.url").chmod(0o600)
    env_b = {"FINSIEVE_REDIS_URL": "", "FINSIEVE_REDIS_URL_FILE": str(secrets_dir / "redis.url"),
             **{k: v for k, v in env.items() if k != "FINSIEVE_REDIS_URL"}}
    gateways = []
    try:  # every gateway started is stopped, also when the next fails to start
        for name, env_of in (("a", env), ("b", env_b)):
            (tmp_path / name).mkdir()
            gateways.append(start_server(tmp_path / name, "--role", "gateway", "--engine",
                                         f"127.0.0.1:{free_port()}", "--limits-file",
                                         str(tmp_path / "limits.yaml"), env=env_of))
        b_pid = gateways[1].process.pid
        children = Path(f"/proc/{b_pid}/task/{b_pid}/children").read_text().split()
        for pid in [b_pid, *map(int, children)]:  # the gateway and its officers' process
            assert shared_valkey.password.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
        keys = {}
        for tenant in ("t-rate", "t-streams"):  # no admin key exists yet: the bootstrap path
            out = subprocess.run(
                [sys.executable, "-m", "finsieve.app.cli", "keys", "create", "--direct", "--tenant",
                 tenant, "--role", "app"], capture_output=True, text=True, timeout=60,
                env={**os.environ, **env}, check=True)
            keys[tenant] = out.stdout.splitlines()[0]
            CREATED.append(keys[tenant])
        a, b = gateways
        reqs = [chat_request(f"q{i}", "Hello?", max_tokens=2) for i in range(3)]
        outcomes = [chat(g.target, keys["t-rate"], r)[r.request_id][-1].error
                    for g, r in zip((a, b, a), reqs, strict=True)]
        # The first is admitted (it then fails at the dead engine); one request per 100 s.
        assert outcomes[0].code == grpc.StatusCode.UNAVAILABLE.value[0]
        for refused in outcomes[1:]:
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert refused.retry_after_ms > 10_000

        async def hold_a_stream_on_a_then_open_on_b() -> tuple[grpc.aio.AioRpcError, bool]:
            async with ChatStream(a.target, keys["t-streams"]) as held:
                held.send(chat_request("h", "Hi", max_tokens=1))
                await held.until_done("h")  # the stream's slot is taken
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async with ChatStream(b.target, keys["t-streams"]) as s:
                        await s.next()  # refused on opening: nothing written (see status_of)
            for _ in range(100):  # the slot is freed when the first stream ends
                try:
                    async with ChatStream(b.target, keys["t-streams"]) as s:
                        s.send(chat_request("y", "Hi", max_tokens=1))
                        await s.until_done("y")
                        return refused.value, True
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
            return refused.value, False

        refused, freed = run(hold_a_stream_on_a_then_open_on_b())
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and freed
        retry = error_details_pb2.RetryInfo()
        rpc_status.from_call(refused).details[0].Unpack(retry)
        assert retry.retry_delay.ToMilliseconds() > 0
    finally:
        for g in gateways:
            g.stop()
    for g in gateways:  # the URL is logged, its password never
        log = g.log()
        assert "redis connected" in log and shared_valkey.password not in log


# -- TLS ------------------------------------------------------------------------------------


def tls(certs: Path, client: str | None = "client", key: str = "") -> Credentials:
    pem = {} if client is None else {"tls_cert": (certs / f"{client}.pem").read_bytes(),
                                     "tls_key": (certs / f"{client}.key").read_bytes()}
    return Credentials(key, tls_ca=(certs / "ca.pem").read_bytes(), **pem)


def test_tls_serves_and_plaintext_is_refused(tmp_path, certs):
    dead = f"127.0.0.1:{free_port()}"
    srv = start_server(tmp_path, "--role", "gateway", "--engine", dead, "--tls-cert",
                       str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
                       credentials=tls(certs, None))
    try:
        key = srv.key("app")
        events = chat(srv.target, key, chat_request("t", "Hi", max_tokens=2),
                      credentials=tls(certs, None, key))["t"]
        assert dead in events[-1].error.message  # authenticated over TLS, then the dead engine
        assert code_of(lambda: chat(srv.target, key, chat_request("p", "Hi"))) == \
            grpc.StatusCode.UNAVAILABLE  # a plaintext client gets no connection
    finally:
        assert srv.stop() == 0


def test_mtls_identifies_the_client_by_its_certificate(tmp_path, certs):
    (tmp_path / "certs.yaml").write_text(
        'certificates:\n  - subject: "CN=mobile-app,O=Bank A"\n    tenant: bank-a\n    role: app\n')
    srv = start_server(tmp_path, "--role", "gateway", "--engine", f"127.0.0.1:{free_port()}",
                       "--tls-cert", str(certs / "server.pem"), "--tls-key",
                       str(certs / "server.key"), "--tls-client-ca", str(certs / "ca.pem"),
                       "--client-cert-map", str(tmp_path / "certs.yaml"), credentials=tls(certs))
    try:
        chat(srv.target, "", chat_request("m", "Hi", max_tokens=2), credentials=tls(certs))
        officer = tls(certs, key=srv.key("officer"))  # a key decides over the certificate

        async def query():
            async with officer.channel(srv.audit_target) as ch:
                return await audit_pb2_grpc.AuditServiceStub(ch).Query(
                    audit_pb2.AuditQuery(request_id="m"))

        recs = [json.loads(r.json) for r in run(query()).records]
        assert [(r["tenant"], r["key_id"]) for r in recs] == \
            [("bank-a", "cert:CN=mobile-app,O=Bank A")] * 2
        for creds in (tls(certs, None, srv.key("app")), tls(certs, "stranger"), Credentials(srv.key("app"))):
            assert code_of(lambda creds=creds: chat(srv.target, "", chat_request("n", "Hi"),
                                                    credentials=creds)) == grpc.StatusCode.UNAVAILABLE
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("settings, named", [
    ({"host": "0.0.0.0"}, "--host 0.0.0.0"),
    ({"audit_host": "10.0.0.5"}, "--audit-host 10.0.0.5"),
    ({"role": "engine", "host": "::"}, "--host ::"),
    ({"role": "gateway", "engines": "127.0.0.1:1,10.1.2.3:50052"}, "--engine 10.1.2.3:50052"),
    ({"tls_cert": "cert.pem"}, "--tls-cert and --tls-key"),
    ({"client_cert_map": "map.yaml"}, "--client-cert-map"),
])
def test_plaintext_beyond_loopback_and_half_tls_are_refused(settings, named):
    with pytest.raises(ConfigError) as err:
        check_transport(Settings.load(settings, env={}))
    message = str(err.value)
    assert message.startswith(named)
    if "plaintext" in message:  # says why, and what to do
        assert "--allow-insecure" in message
        assert ("--engine-ca" if "engine " in named else "--tls-cert") in message
    allowed = Settings.load({**settings, "allow_insecure": True}, env={})
    if "plaintext" in message:
        check_transport(allowed)  # an explicit choice


def test_serve_refuses_a_plaintext_public_bind(tmp_path):
    out = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "serve", "--host", "0.0.0.0",
                          "--state-dir", str(tmp_path / "state")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "--host 0.0.0.0: refusing plaintext on a non-loopback address" in out.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was made


def test_serve_refuses_a_directory_that_holds_no_model(tmp_path):
    """A model that cannot be loaded is one line naming the flag, not a stack trace."""
    out = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "serve", "--role", "engine",
                          "--model", str(tmp_path), "--engine-port", "0",
                          "--state-dir", str(tmp_path / "state")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"finsieve serve: --model {tmp_path}: not a Hugging Face model directory" in out.stderr


# -- secrets ---------------------------------------------------------------------------------


def test_secret_files_modes_and_the_valkey_child(server):
    state = server.state
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for path in [state / "keys", state / "valkey", *(state / "valkey").rglob("*")]:
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    for path in [state / "audit.key", state / "keys.secret", *(state / "keys").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    port = next(json.loads(line)["port"] for line in server.log().splitlines()
                if '"embedded valkey started"' in line)

    async def without_password():
        client = redis.Redis(port=port)
        try:
            await client.get("anything")
        finally:
            await client.aclose()

    with pytest.raises(redis.AuthenticationError):
        run(without_password())


def test_valkey_gets_its_password_outside_argv_and_inherits_no_secret(tmp_path, monkeypatch):
    """valkey-server rewrites its own /proc environ and cmdline (to set its title), so a
    wrapper records what it was really given, then runs the real server."""
    from finsieve.valkey import valkey_binary

    wrapper = tmp_path / "valkey-server"
    wrapper.write_text(f'#!/bin/sh\nenv > {tmp_path}/env\necho "$@" > {tmp_path}/argv\n'
                       f'exec {valkey_binary()} "$@"\n')
    wrapper.chmod(0o700)
    monkeypatch.setenv("FINSIEVE_AUDIT_KEY", "an-audit-key-in-the-environment")
    monkeypatch.setenv("FINSIEVE_API_KEY", WRONG_KEY)
    server = EmbeddedValkey(tmp_path / "valkey", binary=wrapper)
    server.start()
    try:
        env, argv = (tmp_path / "env").read_text(), (tmp_path / "argv").read_text()
        assert "FINSIEVE" not in env and "PATH=" in env
        assert server.password not in argv and server.password not in env

        async def ping(password: str | None) -> bool:
            client = redis.Redis(port=server.port, password=password)
            try:
                return await client.ping()
            except redis.AuthenticationError:
                return False
            finally:
                await client.aclose()

        assert run(ping(server.password)) and not run(ping(None))
    finally:
        server.stop()


@pytest.mark.parametrize("content, mode, why", [
    ("", 0o600, "the file is empty"),
    ("short", 0o600, "holds 5 bytes, at least 32"),
    ("x" * 64, 0o640, "readable or writable by group or others (mode 640)"),
    (None, 0o600, "no such file"),
])
def test_a_weak_audit_key_file_is_refused(tmp_path, content, mode, why):
    path = tmp_path / "audit.key"
    if content is not None:
        path.write_text(content)
        path.chmod(mode)
        if os.geteuid() == 0:  # root's own group-readable file is a mounted Secret's (allowed)
            os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError) as err:
        read_secret(path, "FINSIEVE_AUDIT_KEY_FILE")
    assert why in str(err.value) and str(path) in str(err.value)
    if content:
        assert content not in str(err.value)


def test_start_up_refuses_a_readable_audit_key(tmp_path):
    path = tmp_path / "audit.key"
    path.write_text("k" * 64)
    path.chmod(0o644)
    out = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "serve", "--state-dir",
                          str(tmp_path / "state")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FINSIEVE_AUDIT_KEY_FILE": str(path)})
    assert out.returncode == 1 and "FINSIEVE_AUDIT_KEY_FILE" in out.stderr
    assert "chmod 600" in out.stderr and "k" * 64 not in out.stderr
    assert not (tmp_path / "state" / "valkey").exists()  # refused before anything started


@pytest.mark.parametrize("url, secret", [
    ("redis://:hunter2@127.0.0.1:6379/0", "hunter2"),
    ("redis://default:hunter2@redis:6379/0", "hunter2"),
    ("redis://user:p#ss@w0rd@redis:6379/0", "p#ss@w0rd"),
    ("rediss://user:pa/ss?x@redis/0", "pa/ss?x"),
    ("redis://redis:6379/0?password=hunter2&db=1", "hunter2"),
    ("unix:///run/redis.sock?db=0&password=hun#ter2", "hun#ter2"),
    ("redis://onlyatoken@redis:6379", "onlyatoken"),
    ("redis://redis/0?pass%77ord=hunter2", "hunter2"),  # redis-py decodes the name
])
def test_redis_urls_are_masked_in_every_form(url, secret):
    masked = redact(url)
    assert secret not in masked and "***" in masked
    assert "redis" in masked


@pytest.mark.parametrize("kind, text, message", [
    ("limits", "tenants:\n  bank-a: {requests_per_s: -1}\n",
     "tenants.bank-a.requests_per_s: expected 0 (unlimited)"),
    ("limits", "tenants:\n  bank-a: {tokens_per_minute: 5}\n",
     "tenants.bank-a.tokens_per_minute: unknown limit"),
    ("limits", "tenants:\n  bank a: {}\n", "tenants.bank a: not a tenant name"),
    ("limits", "tenants:\n  bank-a: [\n", ":3: not valid YAML"),
    ("certs", "certificates:\n  - {subject: 'CN=a', tenant: bank-a, role: root}\n",
     "certificates[0].role: expected one of app, officer, admin"),
    ("certs", "certificates:\n  - {subject: 'CN=a', san: 'x', tenant: t, role: app}\n",
     "certificates[0]: give exactly one of subject or san"),
    ("certs", "certificates:\n  - {san: 'x', tenant: t, role: app, all_tenants: true}\n",
     "certificates[0].all_tenants: true or false; only officer and admin"),
    ("certs", "certificates:\n  - {san: x, tenant: t, role: app}\n  - {san: x, tenant: u, role: app}\n",
     "certificates[1].san: 'x' is mapped twice"),
])
def test_limits_and_certificate_map_files_name_the_entry_at_fault(tmp_path, kind, text, message):
    from gateway.identity import CertMap
    from gateway.limits import load_limits_file

    path = tmp_path / f"{kind}.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        (load_limits_file if kind == "limits" else CertMap.load)(path)
    assert str(path) in str(err.value) and message in str(err.value), str(err.value)


def test_cells_are_neutralized_for_tables_and_spreadsheets():
    assert cell("=HYPERLINK(\"http://x\")") == "'=HYPERLINK(\"http://x\")"
    assert [cell(s)[0] for s in ("+1", "-1", "@SUM(A1)")] == ["'"] * 3
    assert cell("alice\u202eecila") == "alice\\u202eecila"
    assert cell("a\x1b[31mred\r\nb\u2066") == "a\\u001b[31mred\\u000d\\u000ab\\u2066"
    assert cell("plain user 42") == "plain user 42"


# -- the audit trail and the logs -----------------------------------------------------------


def test_admin_actions_and_officer_reads_are_audited_and_cli_output_is_neutralized(server):
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "finsieve.app.cli", *args, "--target",
                               server.audit_target, "--state-dir", str(server.state)],
                              capture_output=True, text=True, timeout=60)

    started_ms = int(time.time() * 1000)
    created = cli("keys", "create", "--tenant", "bank-cli", "--role", "app", "--name",
                  "=cmd|' /C calc'!A0", "--expires", "90d")
    assert created.returncode == 0, created.stderr
    key = created.stdout.splitlines()[0]
    CREATED.append(key)
    assert re.fullmatch(r"fsk_[0-9a-f]{16}_[0-9a-f]{64}", key)
    key_id = key.split("_")[1]
    listed = cli("keys", "list", "--tenant", "bank-cli", "--format", "csv").stdout
    assert "'=cmd" in listed and key not in listed
    assert cli("limits", "set", "bank-cli", "--requests-per-s", "5").returncode == 0
    assert "requests_per_s 5" in cli("limits", "show", "bank-cli").stdout
    req = chat_request("cli-evil", "Say hi.", max_tokens=2)
    req.metadata["user"] = "@SUM(1+1)\u202e"
    chat(server.target, key, req)
    table = cli("audit", "query", "--request-id", "cli-evil").stdout
    csv = cli("audit", "query", "--request-id", "cli-evil", "--format", "csv").stdout
    for out in (table, csv):
        assert "'@SUM(1+1)\\u202e" in out and "\u202e" not in out
    seq = records(server, request_id="cli-evil")[0]["seq"]
    for args in (("audit", "show", str(seq)), ("audit", "verify"),
                 ("audit", "export", "--since", "1h"), ("keys", "revoke", key_id)):
        assert cli(*args).returncode == 0, args
    trail = records(server, since_ms=started_ms)
    admin = {(r["event"], r["by"]) for r in trail if r["type"] == "admin"}
    officer_id, admin_id = (server.key(role).split("_")[1] for role in ("officer", "admin"))
    for event in ("key_created", "keys_listed", "tenant_limits_set", "tenant_limits_read",
                  "key_revoked"):
        assert (event, admin_id) in admin, event
    reads = {(r["event"], r["by"]) for r in trail if r["type"] == "access"}
    for event in ("audit_query", "audit_get", "audit_verify", "audit_export"):
        assert (event, officer_id) in reads, event
    assert not any(k in json.dumps(trail) for k in CREATED)  # never a key in the trail


def test_no_prompt_answer_key_or_password_in_the_logs(server):
    marker = "ZEBRA-7305-PRIVATE"
    events = chat(server.target, server.key("app"),
                  chat_request("log-1", f"Repeat this code: {marker}", max_tokens=16))["log-1"]
    answer = text_of(events).strip()
    log = server.log()
    assert "request finished" in log and answer
    secrets = [marker, answer, *CREATED, *(server.key(r) for r in ("app", "officer", "admin")),
               re.search(r"^requirepass (\S+)$", (server.state / "valkey/valkey.conf").read_text(),
                         re.M)[1],
               (server.state / "audit.key").read_text().strip(),
               (server.state / "keys.secret").read_text().strip()]
    for secret in secrets:
        assert secret not in log
    for key in CREATED:  # nor half of one: the secret part alone
        assert key.split("_")[2] not in log
