"""`finsieve serve`: start what the role asks for, run until SIGTERM/SIGINT, drain, stop."""

from __future__ import annotations

import asyncio
import secrets
import signal
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path

import prometheus_client
import redis.asyncio as redis
import structlog

from finsieve import secretfiles, tls
from finsieve.auth import GATEWAY_ROLE, ROLES, AuthInterceptor, SharedSecret, Unauthenticated, roles_for
from finsieve.client import CredentialError, read_key_file
from finsieve.config import Settings
from finsieve.gateway.admin_service import AdminService, key_event
from finsieve.gateway.audit import AuditError, AuditLog
from finsieve.gateway.audit_service import AuditService
from finsieve.gateway.cache import ResponseCache
from finsieve.gateway.engines import EngineCredentials, EnginePool
from finsieve.gateway.identity import CertMap, ClientAuthenticator
from finsieve.gateway.keys import KeyStore
from finsieve.gateway.limits import Limiter, TenantLimits, load_limits_file
from finsieve.gateway.server import GatewayService
from finsieve.grpc_server import RunningServer, Service, start_server
from finsieve.policy.reload import PolicyHolder
from finsieve.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    audit_pb2,
    audit_pb2_grpc,
    chat_pb2,
    chat_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
)
from finsieve.valkey import EmbeddedValkey, connect, redact

log = structlog.get_logger(__name__)


def _name(module) -> str:
    return next(iter(module.DESCRIPTOR.services_by_name.values())).full_name


GATEWAY, AUDIT, ADMIN, ENGINE = (_name(m) for m in (chat_pb2, audit_pb2, admin_pb2, engine_pb2))
DEV_TENANT = "default"


async def serve(settings: Settings) -> None:
    # Everything that can refuse a configuration does so before anything starts.
    tls.check_transport(settings)
    secretfiles.private_dir(settings.state_path)
    gateway_side = settings.role in ("all", "gateway")
    audit_key = secretfiles.audit_key(settings) if gateway_side else b""
    keys_secret = secretfiles.keys_secret(settings) if gateway_side else b""
    # Role all: the engine is in this process, on loopback; a fresh secret each start.
    engine_secret = (secrets.token_hex(32).encode() if settings.role == "all"
                     else secretfiles.engine_secret(settings))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if settings.metrics_port:
        prometheus_client.start_http_server(settings.metrics_port, addr=settings.host)
        log.info("metrics serving", address=f"{settings.host}:{settings.metrics_port}")
    async with AsyncExitStack() as stack:
        engine_addresses = list(settings.engines)
        client = None
        embedded = False
        if gateway_side:
            # First: valkey-server is forked before gRPC starts its threads.
            client, embedded = await _start_redis(settings, stack)
        if settings.role in ("all", "engine"):
            address = await _start_engine(settings, engine_secret, stack)
            engine_addresses = [address] if settings.role == "all" else engine_addresses
        if client is not None:
            audit = AuditLog(client, audit_key)
            keys = KeyStore(client, keys_secret, settings.key_cache_s, settings.key_cache_max)
            if embedded:
                await _development_keys(settings, keys, audit)
            engine_tls = tls.engine_channel_credentials(settings) if settings.role == "gateway" else None
            gateway, running = await _start_gateway(
                settings, engine_addresses, EngineCredentials(engine_secret, engine_tls), audit,
                keys, client, stack)
            await _admin(audit, {"event": "server_start", "role": settings.role})
            watch = asyncio.create_task(_watch_admin(gateway.engines, audit, settings))
            await stop.wait()
            watch.cancel()
            await running.set_serving(False)  # load balancers stop sending first
            log.info("draining", in_flight=gateway.in_flight(), deadline_s=settings.drain_seconds)
            await gateway.drain(settings.drain_seconds)
            await _admin(audit, {"event": "server_stop", "role": settings.role})
        else:
            await stop.wait()
    log.info("stopped")


async def _start_engine(settings: Settings, secret: bytes, stack: AsyncExitStack) -> str:
    # Imported here: a gateway-only process never loads torch.
    from finsieve.engine.engine import EngineLimits, LLMEngine
    from finsieve.engine.loader import load_model, resolve_device
    from finsieve.engine.server import EngineService

    device = resolve_device(settings.device)
    model = await asyncio.to_thread(load_model, settings.model, settings.state_path, device)
    limits = EngineLimits(settings.max_batch, settings.max_context, settings.default_max_tokens,
                          settings.batch_invariant, settings.max_rollbacks)
    engine = await asyncio.to_thread(LLMEngine, model, limits, device)
    holder = None
    if settings.rules:
        holder = await asyncio.to_thread(_watch_rules, settings, engine.token_bytes, stack)
        engine.policy = lambda: holder.current
    else:
        log.warning("serving without rules (--no-rules): answers are not filtered")
    thread = threading.Thread(target=engine.run, name="engine-loop", daemon=True)
    thread.start()
    stack.callback(thread.join, 10)
    stack.callback(engine.stop)
    apart = settings.role == "engine"  # else in this process, on loopback, for our gateway
    host = settings.host if apart else "127.0.0.1"
    port = settings.engine_port if apart else 0
    service = Service(ENGINE, EngineService(engine, holder), engine_pb2_grpc.add_EngineServicer_to_server)
    # Engines trust only gateways: the shared secret, or a client certificate they verified.
    gate = AuthInterceptor(SharedSecret(secret, trust_client_certificates=apart and bool(
        settings.tls_client_ca)), roles_for({ENGINE: GATEWAY_ROLE}))
    running = await start_server(f"{host}:{port}", [service], interceptors=[gate],
                                 credentials=tls.server_credentials(settings) if apart else None)
    stack.push_async_callback(running.server.stop, 1)
    log.info("engine serving", address=f"{host}:{running.port}", model=engine.model_name,
             device=str(device), max_batch=engine.max_batch, max_context=engine.max_context)
    return f"{host}:{running.port}"


def _watch_rules(settings: Settings, token_bytes: list[bytes], stack: AsyncExitStack) -> PolicyHolder:
    """Compile the rules directory now (a bad pack stops start-up) and on every change."""
    from finsieve.policy.guard import compile_policy
    from finsieve.policy.masks import TokenTable
    from finsieve.policy.reload import RulesWatcher

    directory, luts = Path(settings.rules), Path(settings.luts)
    tokens = TokenTable.load_or_build(token_bytes, luts)
    policy, version = compile_policy(directory, tokens, luts)
    holder = PolicyHolder(policy, version)
    watcher = RulesWatcher(directory, holder, lambda d: compile_policy(d, tokens, luts))
    watcher.start()
    stack.callback(watcher.stop)
    log.info("rules loaded", version=version, rules=len(policy.pack.rules), directory=str(directory))
    return holder


async def _start_redis(settings: Settings, stack: AsyncExitStack) -> tuple[redis.Redis, bool]:
    """A client of the configured Redis, or of an embedded Valkey; and whether it is embedded."""
    url, password = settings.redis_url, None
    if not url:
        valkey = EmbeddedValkey(settings.state_path / "valkey", settings.appendfsync)
        url = await asyncio.to_thread(valkey.start)
        password = valkey.password
        stack.callback(valkey.stop)
        log.info("embedded valkey started", pid=valkey.process.pid, port=valkey.port,
                 appendfsync=settings.appendfsync)
    client = await connect(url, password=password)
    stack.push_async_callback(client.aclose)
    log.info("redis connected", url=redact(url))
    return client, not settings.redis_url


async def _development_keys(settings: Settings, keys: KeyStore, audit: AuditLog) -> None:
    """One key per role in <state dir>/keys/<role>.key (0600), so the README's commands work
    against the embedded default. Kept while they verify; made again when they do not."""
    directory = secretfiles.private_dir(settings.state_path / "keys")
    for role in ROLES:
        path = directory / f"{role}.key"
        try:
            await keys.verify(read_key_file(path, "development key"))
            continue
        except (CredentialError, Unauthenticated):
            pass
        key, info = await keys.create(DEV_TENANT, role, f"development {role} key",
                                      all_tenants=role != "app", created_by="serve")
        secretfiles.write_private(path, key + "\n")
        await _admin(audit, {**key_event("key_created", info), "by": "serve"})
    log.info("development keys ready: for local use only; create real keys with "
             "`finsieve keys create`", directory=str(directory), tenant=DEV_TENANT)


async def _start_gateway(
    settings: Settings, engines: list[str], engine_credentials: EngineCredentials,
    audit: AuditLog, keys: KeyStore, client: redis.Redis, stack: AsyncExitStack,
) -> tuple[GatewayService, RunningServer]:
    from finsieve.gateway.validation import Limits

    certs = CertMap.load(Path(settings.client_cert_map)) if settings.client_cert_map else None
    per_tenant = load_limits_file(Path(settings.limits_file)) if settings.limits_file else {}
    credentials = tls.server_credentials(settings)
    auth = ClientAuthenticator(keys, certs)
    limiter = Limiter(client, TenantLimits(settings.tenant_requests_per_s,
                                           settings.tenant_tokens_per_min,
                                           settings.tenant_concurrent_streams),
                      per_tenant, settings.key_cache_s, settings.key_cache_max)
    renew = asyncio.create_task(limiter.renew_leases())
    stack.callback(renew.cancel)
    pool = EnginePool(engines, engine_credentials)
    stack.push_async_callback(pool.close)
    cache = ResponseCache(client, settings.cache_ttl_s, settings.cache_max_bytes) \
        if settings.cache_ttl_s > 0 else None
    gateway = GatewayService(pool, Limits(settings.max_tokens_limit, settings.max_input_bytes),
                             audit, cache, settings.audit_fail_open, auth, limiter)
    running = await start_server(
        f"{settings.host}:{settings.port}",
        [Service(GATEWAY, gateway, chat_pb2_grpc.add_GatewayServicer_to_server)],
        credentials=credentials,
        interceptors=[AuthInterceptor(auth, roles_for({GATEWAY: "app"}))])
    # After the drain: ends what is left of the streams.
    stack.push_async_callback(running.server.stop, 1)
    log.info("gateway serving", address=f"{settings.host}:{running.port}", engines=engines,
             tls=credentials is not None, mtls=bool(settings.tls_client_ca))
    # Records hold every user's messages: officers get their own listener, loopback by default.
    officers = await start_server(
        f"{settings.audit_host}:{settings.audit_port}",
        [Service(AUDIT, AuditService(audit), audit_pb2_grpc.add_AuditServiceServicer_to_server),
         Service(ADMIN, AdminService(keys, limiter, audit),
                 admin_pb2_grpc.add_AdminServiceServicer_to_server)],
        credentials=credentials,
        interceptors=[AuthInterceptor(auth, roles_for({AUDIT: "officer", ADMIN: "admin"}))])
    stack.push_async_callback(officers.server.stop, 1)
    log.info("audit and admin services serving", address=f"{settings.audit_host}:{officers.port}")
    return gateway, running


async def _admin(audit: AuditLog, body: dict) -> None:
    try:
        await audit.append("admin", body)
    except AuditError as e:
        log.error("admin audit event lost", event=body.get("event"), error=str(e))


async def _watch_admin(engines: EnginePool, audit: AuditLog, settings: Settings) -> None:
    """Rule pack loads and rejections (seen through the engines' Info) become admin records;
    retention trims the trail once an hour."""
    seen: dict[str, tuple[int, int]] = {}
    next_trim = 0.0
    while True:
        for client in engines.clients:
            info = await client.info()
            if info is None:
                continue
            loads, rejections = seen.get(client.address, (info.pack_loads, info.pack_rejections))
            if info.pack_loads > loads:
                await _admin(audit, {"event": "rule_pack_loaded", "engine": client.address,
                                     "policy_version": info.policy_version})
            if info.pack_rejections > rejections:
                await _admin(audit, {"event": "rule_pack_rejected", "engine": client.address,
                                     "policy_version": info.policy_version,
                                     "reason": info.last_rejection})
            seen[client.address] = (info.pack_loads, info.pack_rejections)
        if settings.audit_retention_days > 0 and time.monotonic() >= next_trim:
            cutoff = int((time.time() - settings.audit_retention_days * 86400) * 1000)
            try:
                if trimmed := await audit.trim(cutoff):
                    log.info("audit trail trimmed", records=trimmed)
            except (AuditError, redis.RedisError) as e:
                log.error("audit trim failed", error=str(e))
            next_trim = time.monotonic() + 3600
        await asyncio.sleep(1.0)
