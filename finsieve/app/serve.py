"""`finsieve serve`: start what the role asks for, run until SIGTERM/SIGINT, drain, stop."""

from __future__ import annotations

import asyncio
import gc
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import prometheus_client
import structlog

from finsieve import secretfiles, supervise, tls
from finsieve.app.client import CredentialError, read_key_file
from finsieve.auth import GATEWAY_ROLE, ROLES, AuthInterceptor, Unauthenticated, roles_for
from finsieve.config import Settings
from finsieve.grpc_server import (
    RunningServer,
    Service,
    engine_channel_options,
    server_options,
    start_server,
)
from finsieve.policy.guard import Policy, compile_policy
from finsieve.policy.masks import TokenTable
from finsieve.policy.reload import PolicyHolder, RulesWatcher
from finsieve.policy.sources import PackLimits
from finsieve.v1 import chat_pb2, engine_pb2
from finsieve.valkey import Client, EmbeddedValkey, connect, redact
from finsieve.wire import ENGINE_MESSAGE_BYTES
from gateway import officers
from gateway.access import FLUSH_AT_SHUTDOWN_S, AdminTrail
from gateway.admin_service import key_event
from gateway.anchors import Anchoring, AnchorWriter
from gateway.audit import AuditLog
from gateway.audit_recovery import Checking, audit_log
from gateway.cache import ResponseCache
from gateway.core import Bounds, GatewayCore
from gateway.discovery import Discovery, Sources
from gateway.engines import EngineCredentials, EnginePool
from gateway.frames import add_gateway_to_server
from gateway.http_bounds import ListenerBounds
from gateway.identity import ClientAuthenticator
from gateway.keys import KeyStore
from gateway.limits import tenant_limiter
from gateway.openai_api.app import HttpBounds, OpenAIDoor
from gateway.openai_api.listener import HttpListener
from gateway.rules import GatewayPolicy, compile_gateway_policy
from gateway.server import GatewayService
from gateway.validation import Limits

if TYPE_CHECKING:  # a gateway-only process never loads torch
    from engine.server import EngineService

log = structlog.get_logger(__name__)

GATEWAY = chat_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
ENGINE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
ENGINE_SWITCH_INTERVAL_S = 0.0005  # see _start_engine
# The engine loop is started again after an exception escaped it, at most this many times
# in a row; then the process exits non-zero, as when the device fails, to be restarted.
ENGINE_LOOP_RESTARTS = 3
DEV_TENANT = "default"
HTTP_STOP_S = 5.0  # the HTTP listener's own stop, after the drain


class EngineStopped(RuntimeError):
    """The engine's device failed: the process exits non-zero so its supervisor restarts it."""


async def serve(settings: Settings) -> None:
    # Everything that can refuse a configuration does so before anything starts.
    tls.check_transport(settings)
    secretfiles.private_dir(settings.state_path)
    gateway_side = settings.role in ("all", "gateway")
    state = settings.state_path
    key = secretfiles.audit_key(settings.audit_key_file, state) if gateway_side else b""
    keys_secret = secretfiles.keys_secret(settings.keys_secret_file, state) if gateway_side else b""
    # Role all: the engine is in this process, on loopback; a fresh secret each start unless
    # one is configured (so that an operator can call the engine's Info).
    engine_secret = (secrets.token_hex(32).encode()
                     if settings.role == "all" and not settings.engine_secret_file
                     else secretfiles.engine_secret(settings.engine_secret_file, state))
    discovery = Discovery(Sources.of(settings)) if settings.role == "gateway" else None
    if discovery is not None:
        discovery.load()  # a bad engines file stops start-up here
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if settings.metrics_port:
        prometheus_client.start_http_server(settings.metrics_port, addr=settings.host)
        log.info("metrics serving", address=f"{settings.host}:{settings.metrics_port}")
    failed = asyncio.Event()  # the engine's device failed
    servers: list[RunningServer] = []
    async with AsyncExitStack() as stack:
        client = None
        engine_service = None
        if gateway_side:
            # First: valkey-server and the officers' process are started before gRPC starts
            # its threads.
            client, url, password = await _start_redis(settings, stack)
            officers_process = officers.spawn(
                settings, officers.Secrets(url, password, key, keys_secret))
            stack.callback(officers_process.stop)
        if settings.role in ("all", "engine"):
            address, engine_service = await _start_engine(settings, engine_secret, stack, servers,
                                                          failed)
            if settings.role == "all":
                discovery = Discovery(Sources(static=(address,)))
        if client is not None:
            audit = audit_log(settings, client, key, "gateway")
            stack.push_async_callback(audit.aclose)
            checking = Checking(audit, settings.audit_check_interval_s)
            checking.start()  # first: what a failover lost while this gateway was down
            anchoring = Anchoring(audit, AnchorWriter(officers.anchor_dir(settings), "gateway", key),
                                  settings.audit_anchor_interval_s)
            anchoring.start()
            trail = AdminTrail(audit, settings.admin_backlog_max)
            trail.start()
            keys = KeyStore(client, keys_secret, settings.key_cache_s, settings.key_cache_max)
            if not settings.redis_url:
                await _development_keys(settings, keys, trail)
            port = await officers_process.ready()
            log.info("audit and admin services serving", address=f"{settings.audit_host}:{port}")
            rules = _gateway_rules(settings, key, stack)
            engine_tls = tls.engine_channel_credentials(settings) if settings.role == "gateway" else None
            settle_heap()  # before the port opens: a first request must not wait for it
            assert discovery is not None  # role gateway, or all (its own engine)
            gateway, running = await _start_gateway(
                settings, discovery, EngineCredentials(engine_secret, engine_tls), audit,
                keys, client, rules, stack)
            servers.append(running)
            await trail.record({"event": "server_start", "role": settings.role})
            await trail.watch(running.set_serving)  # NOT_SERVING while admin records wait
            seen: dict[str, tuple[int, int]] = {}
            watch = supervise.start("admin-watch", lambda: _watch_admin(gateway.engines, trail, seen))
            await _until(stop, failed)
            watch.cancel()
            await trail.watch(None)  # from here health stays NOT_SERVING
            for s in servers:  # load balancers stop sending first
                await s.set_serving(False)
            if not failed.is_set():
                log.info("draining", in_flight=gateway.in_flight(), deadline_s=settings.drain_seconds)
                await gateway.drain(settings.drain_seconds)
            try:
                await asyncio.wait_for(trail.record({"event": "server_stop", "role": settings.role}),
                                       FLUSH_AT_SHUTDOWN_S)
            except TimeoutError:  # the backlog is full
                log.error("admin audit record lost at shutdown: the backlog is full",
                          action="server_stop")
            await trail.close()
            await anchoring.stop()
            await checking.stop()
        else:
            await _until(stop, failed)
            for s in servers:
                await s.set_serving(False)
            if engine_service is not None and not failed.is_set():
                # Gateways stop sending (its load says it drains) and run what still comes
                # elsewhere; the requests in flight finish before the listener stops.
                log.info("draining", deadline_s=settings.drain_seconds)
                left = await engine_service.drain(settings.drain_seconds)
                log.info("drained", unfinished=left)
    if failed.is_set():
        raise EngineStopped("the engine's device failed; exiting so that it is restarted")
    log.info("stopped")


def settle_heap() -> None:
    """Take what is alive now (the model, the tokenizer, the rule tables: ~650,000 objects
    in the GPU benchmark's engine) out of the garbage collector's full collections
    (`gc.freeze`), at start-up and after each rule pack swap. Each full collection walks
    every tracked object: with 10,000 literal rules it stalled every stream for ~300 ms, each
    time the requests' objects had piled up enough to trigger one (11 ms once frozen). Rule
    packs and requests hold no reference cycles, so a pack replaced by a reload is still
    freed, by reference counting, once no request uses it."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("heap settled", frozen_objects=gc.get_freeze_count(),
             seconds=round(time.perf_counter() - start, 3))


async def _until(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()


async def _start_engine(settings: Settings, secret: bytes, stack: AsyncExitStack,
                        servers: list[RunningServer], failed: asyncio.Event
                        ) -> tuple[str, EngineService]:
    """The engine, serving; its address and service."""
    # Imported here: a gateway-only process never loads torch.
    from engine.engine import EngineLimits, LLMEngine
    from engine.loader import load_model, resolve_device
    from engine.server import EngineService, GatewayGate, add_to_server

    device = resolve_device(settings.device)
    model = await asyncio.to_thread(load_model, settings.model, settings.state_path, device,
                                    settings.cpu_backend)
    limits = EngineLimits(settings.max_batch, settings.max_context, settings.default_max_tokens,
                          settings.batch_invariant, settings.max_rollbacks, settings.max_waiting,
                          settings.prefill_chunk, settings.gpu_memory_utilization,
                          settings.compile, settings.cuda_graphs, settings.prompt_batch_tokens,
                          settings.prompt_wait_steps, settings.prepare_workers,
                          settings.mixed_tokens, settings.cpu_prefill_chunk)
    engine = await asyncio.to_thread(LLMEngine, model, limits, device)
    holder = None
    if settings.rules:
        holder = await asyncio.to_thread(_watch_rules, settings, engine.token_bytes, stack,
                                         lambda p: engine.preparer.preload(p.pack.input, p.version))
        engine.policy = lambda: holder.current
    else:
        log.warning("serving without rules (--no-rules): answers are not filtered")
    loop = asyncio.get_running_loop()

    def run() -> None:
        backoff, failures = supervise.Backoff(), 0
        while True:
            started = time.monotonic()
            try:
                engine.run()
                break
            except Exception:  # a bug past the loop's own handling: never a silent stop
                supervise.FAILURES.labels("engine-loop").inc()
                failures = supervise.in_a_row(failures, time.monotonic() - started, backoff)
                if failures > ENGINE_LOOP_RESTARTS:
                    log.exception("engine loop failed; giving up", failures=failures)
                    engine.failed.set()
                    break
                delay = backoff.delay(failures)
                log.exception("engine loop failed; starting it again", failures=failures,
                              retry_in_s=delay)
                time.sleep(delay)
        if engine.failed.is_set():
            loop.call_soon_threadsafe(failed.set)

    # The engine loop gives the GIL up at every torch call and device wait; when a gRPC or
    # executor thread holds it then, the loop gets it back only at the holder's next switch:
    # 5 ms by default, a whole decode step. 0.5 ms bounds that wait (a loop of short
    # GIL-releasing calls beside a busy thread ran 7.5x faster).
    stack.callback(sys.setswitchinterval, sys.getswitchinterval())
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
    thread = threading.Thread(target=run, name="engine-loop", daemon=True)
    thread.start()
    stack.callback(thread.join, 10)
    stack.callback(engine.stop)
    apart = settings.role == "engine"  # else in this process, on loopback, for our gateway
    host = settings.host if apart else "127.0.0.1"
    port = settings.engine_port if apart else 0
    engine_service = EngineService(engine, holder)
    service = Service(ENGINE, engine_service, add_to_server)
    # Engines trust only gateways: the shared secret, and with mTLS an allowed certificate.
    gate = AuthInterceptor(GatewayGate.of(settings, secret, apart), roles_for({ENGINE: GATEWAY_ROLE}))
    settle_heap()  # before the port opens: ~0.4 s with the GIL held, a first request's wait
    running = await start_server(
        f"{host}:{port}", [service],
        options=server_options(settings, ENGINE_MESSAGE_BYTES, clients=False),
        interceptors=[gate], credentials=tls.server_credentials(settings) if apart else None)
    servers.append(running)
    stack.push_async_callback(running.server.stop, 1)
    log.info("engine serving", address=f"{host}:{running.port}", model=engine.model_name,
             device=str(device), max_batch=engine.max_batch, max_context=engine.max_context,
             mode=engine.mode)
    return f"{host}:{running.port}", engine_service


def _watch_rules(settings: Settings, token_bytes: list[bytes], stack: AsyncExitStack,
                 in_force: Callable[[Policy], object]) -> PolicyHolder:
    """Compile the rules directory now (a bad pack stops start-up) and on every change;
    in_force(policy) each time a policy comes in force."""
    directory, luts = Path(settings.rules), Path(settings.luts)
    limits = PackLimits.of(settings)
    tokens = TokenTable.load_or_build(token_bytes, luts)
    policy, version = compile_policy(directory, tokens, luts, limits)
    holder = PolicyHolder(policy, version)
    in_force(policy)

    def swapped() -> None:
        in_force(holder.current)
        settle_heap()

    watcher = RulesWatcher(directory, holder, lambda d: compile_policy(d, tokens, luts, limits),
                           settings.rules_debounce_ms, on_swap=swapped)
    watcher.start()
    stack.callback(watcher.stop)
    log.info("rules loaded", version=version, rules=len(policy.pack.rules), directory=str(directory))
    return holder


def _gateway_rules(settings: Settings, key: bytes,
                   stack: AsyncExitStack) -> PolicyHolder[GatewayPolicy] | None:
    """The gateway's own copy of the rules directory the engines load (cache replay check,
    masking in the trail), hot-reloaded like theirs."""
    if not settings.rules:
        return None
    directory, limits = Path(settings.rules), PackLimits.of(settings)
    policy, version = compile_gateway_policy(directory, key, limits)
    holder = PolicyHolder(policy, version)
    watcher = RulesWatcher(directory, holder, lambda d: compile_gateway_policy(d, key, limits),
                           settings.rules_debounce_ms, on_swap=settle_heap)
    watcher.start()
    stack.callback(watcher.stop)
    return holder


async def _start_redis(settings: Settings,
                       stack: AsyncExitStack) -> tuple[Client, str, str | None]:
    """A client of the configured Redis, or of an embedded Valkey; its URL and the embedded
    Valkey's password (never part of the URL, so it is never logged with it)."""
    url, password = settings.redis_url, None
    if not url:
        valkey = EmbeddedValkey(settings.state_path / "valkey", settings.appendfsync)
        url = await asyncio.to_thread(valkey.start)
        password = valkey.password
        stack.callback(valkey.stop)
        assert valkey.process is not None  # start() returned: it runs
        log.info("embedded valkey started", pid=valkey.process.pid, port=valkey.port,
                 appendfsync=settings.appendfsync)
    client = await connect(url, password=password, max_connections=settings.redis_max_connections)
    stack.push_async_callback(client.aclose)
    log.info("redis connected", url=redact(url))
    return client, url, password


async def _development_keys(settings: Settings, keys: KeyStore, trail: AdminTrail) -> None:
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
        new, info = await keys.create(DEV_TENANT, role, f"development {role} key",
                                      all_tenants=role != "app", created_by="serve")
        secretfiles.write_private(path, new + "\n")
        await trail.record({**key_event("key_created", info), "by": "serve"})
    log.info("development keys ready: for local use only; create real keys with "
             "`finsieve keys create`", directory=str(directory), tenant=DEV_TENANT)


async def _start_gateway(
    settings: Settings, discovery: Discovery, engine_credentials: EngineCredentials,
    audit: AuditLog, keys: KeyStore, client: Client,
    rules: PolicyHolder[GatewayPolicy] | None, stack: AsyncExitStack,
) -> tuple[GatewayCore, RunningServer]:
    auth = ClientAuthenticator.from_settings(settings, keys)
    limiter = tenant_limiter(settings, client)
    renew = supervise.start("tenant-leases", limiter.renew_leases)
    stack.callback(renew.cancel)
    pool = EnginePool([], settings.engine_connect_timeout_s, engine_channel_options(settings),
                      engine_credentials, settings.drain_seconds)
    stack.push_async_callback(pool.close)
    await discovery.start(pool)
    stack.push_async_callback(discovery.stop)  # before the pool closes
    pool.start()
    cache = ResponseCache(client, audit, settings.cache_ttl_s, settings.cache_max_bytes,
                          settings.cache_store_wait_ms / 1000) if settings.cache_ttl_s > 0 else None
    limits = Limits(settings.max_tokens_limit, settings.max_input_bytes, settings.max_messages)
    bounds = Bounds(settings.max_in_flight_per_stream, settings.max_in_flight_per_connection,
                    settings.outbox_max_events, settings.slow_reader_grace_s)
    gateway = GatewayCore(pool, limits, audit, cache, settings.audit_fail_open, rules, bounds,
                          auth, limiter)
    credentials = tls.server_credentials(settings)
    running = await start_server(
        f"{settings.host}:{settings.port}",
        [Service(GATEWAY, GatewayService(gateway), add_gateway_to_server)],
        options=server_options(settings, settings.max_message_bytes),
        max_concurrent_rpcs=settings.max_streams, credentials=credentials,
        interceptors=[AuthInterceptor(auth, roles_for({GATEWAY: "app"}))])
    # After the drain: ends what is left of the streams.
    stack.push_async_callback(running.server.stop, 1)
    log.info("gateway serving", address=f"{settings.host}:{running.port}",
             engines=sorted(discovery.engines()),
             tls=credentials is not None, mtls=bool(settings.tls_client_ca))
    if settings.http_port:
        await _start_http(settings, gateway, auth, stack)
    return gateway, running


async def _start_http(settings: Settings, gateway: GatewayCore, auth: ClientAuthenticator,
                      stack: AsyncExitStack) -> None:
    """The OpenAI-compatible door on the same pipeline: uvicorn on this event loop."""
    door = OpenAIDoor(gateway, auth, HttpBounds(settings.http_max_body_bytes,
                                                settings.http_read_timeout_s,
                                                settings.http_sse_keepalive_s))
    context = tls.server_ssl_context(settings)
    listener = HttpListener(door.app(), settings.http_host, settings.http_port, context,
                            ListenerBounds(settings.http_max_header_bytes,
                                           settings.http_max_connections,
                                           settings.http_read_timeout_s,
                                           settings.slow_reader_grace_s, settings.http_keepalive_s))
    port = listener.bind()
    task = supervise.start("http-listener", listener.serve)

    async def stop() -> None:  # after the drain, as for gRPC
        listener.stop()
        try:
            await asyncio.wait_for(asyncio.shield(task), HTTP_STOP_S)
        except TimeoutError:
            task.cancel()

    stack.push_async_callback(stop)
    log.info("http serving", address=f"{settings.http_host}:{port}", tls=context is not None,
             mtls=bool(settings.tls_client_ca))


async def _watch_admin(engines: EnginePool, trail: AdminTrail,
                       seen: dict[str, tuple[int, int]]) -> None:
    """Rule pack loads and rejections (seen through the engines' Info) become admin records.
    `seen` (each engine's counts already recorded) outlives a restart of this task."""
    while True:
        for client in engines.clients:
            info = await client.info()
            if info is None:
                continue
            # An engine starts with one pack loaded and none rejected: what it did before this
            # gateway first reached it is recorded too (as one load: the version in force).
            loads, rejections = seen.get(client.address, (1, 0))
            if info.pack_loads > loads:
                await trail.record({"event": "rule_pack_loaded", "engine": client.address,
                                    "policy_version": info.policy_version})
            if info.pack_rejections > rejections:
                await trail.record({"event": "rule_pack_rejected", "engine": client.address,
                                    "policy_version": info.policy_version,
                                    "reason": info.last_rejection})
            seen[client.address] = (info.pack_loads, info.pack_rejections)
        for address in seen.keys() - {c.address for c in engines.clients}:
            del seen[address]  # engines come and go (a DNS name's pods): bounded by those in service
        await asyncio.sleep(1.0)
