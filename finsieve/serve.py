"""`finsieve serve`: start what the role asks for, run until SIGTERM/SIGINT, drain, stop."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import threading
from contextlib import AsyncExitStack
from pathlib import Path

import prometheus_client
import redis.asyncio as redis
import structlog

from finsieve.config import ConfigError, Settings
from finsieve.gateway import officers
from finsieve.gateway.anchors import Anchoring, AnchorWriter
from finsieve.gateway.audit import AuditError, AuditLog
from finsieve.gateway.cache import ResponseCache
from finsieve.gateway.engines import EnginePool
from finsieve.gateway.rules import GatewayPolicy, compile_gateway_policy
from finsieve.gateway.server import GatewayService
from finsieve.grpc_server import RunningServer, Service, start_server
from finsieve.policy.reload import PolicyHolder, RulesWatcher
from finsieve.v1 import chat_pb2, chat_pb2_grpc, engine_pb2, engine_pb2_grpc
from finsieve.valkey import EmbeddedValkey, connect, redact

log = structlog.get_logger(__name__)


async def serve(settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if settings.metrics_port:
        prometheus_client.start_http_server(settings.metrics_port, addr=settings.host)
        log.info("metrics serving", address=f"{settings.host}:{settings.metrics_port}")
    async with AsyncExitStack() as stack:
        engine_addresses = list(settings.engines)
        client = url = None
        if settings.role in ("all", "gateway"):
            # First: valkey-server and the officers' process are started before gRPC starts
            # its threads.
            client, url = await _start_redis(settings, stack)
            key = _audit_key(settings)
            officers_process = officers.spawn(settings, url, key)
            stack.callback(officers_process.stop)
        if settings.role in ("all", "engine"):
            address = await _start_engine(settings, stack)
            engine_addresses = [address] if settings.role == "all" else engine_addresses
        if client is not None:
            audit = AuditLog(client, key, wait_replicas=settings.audit_wait_replicas,
                             wait_timeout_ms=settings.audit_wait_timeout_ms)
            anchoring = Anchoring(audit, AnchorWriter(officers.anchor_dir(settings), "gateway", key),
                                  settings.audit_anchor_interval_s)
            anchoring.start()
            port = await officers_process.ready()
            log.info("audit service serving", address=f"{settings.audit_host}:{port}")
            rules = _gateway_rules(settings, key, stack)
            gateway, running = await _start_gateway(settings, engine_addresses, audit, client,
                                                    rules, stack)
            await _admin(audit, {"event": "server_start", "role": settings.role})
            watch = asyncio.create_task(_watch_admin(gateway.engines, audit))
            await stop.wait()
            watch.cancel()
            await running.set_serving(False)  # load balancers stop sending first
            log.info("draining", in_flight=gateway.in_flight(), deadline_s=settings.drain_seconds)
            await gateway.drain(settings.drain_seconds)
            await _admin(audit, {"event": "server_stop", "role": settings.role})
            await anchoring.stop()
        else:
            await stop.wait()
    log.info("stopped")


async def _start_engine(settings: Settings, stack: AsyncExitStack) -> str:
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
    host = settings.host if settings.role == "engine" else "127.0.0.1"
    port = settings.engine_port if settings.role == "engine" else 0
    service = Service(
        engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name,
        EngineService(engine, holder),
        engine_pb2_grpc.add_EngineServicer_to_server,
    )
    running = await start_server(f"{host}:{port}", [service])
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


def _gateway_rules(settings: Settings, key: bytes,
                   stack: AsyncExitStack) -> PolicyHolder[GatewayPolicy] | None:
    """The gateway's own copy of the rules directory the engines load (cache replay check,
    masking in the trail), hot-reloaded like theirs."""
    if not settings.rules:
        return None
    directory = Path(settings.rules)
    policy, version = compile_gateway_policy(directory, key)
    holder = PolicyHolder(policy, version)
    watcher = RulesWatcher(directory, holder, lambda d: compile_gateway_policy(d, key))
    watcher.start()
    stack.callback(watcher.stop)
    return holder


async def _start_redis(settings: Settings, stack: AsyncExitStack) -> tuple[redis.Redis, str]:
    url = settings.redis_url
    if not url:
        valkey = EmbeddedValkey(settings.state_path / "valkey", settings.appendfsync)
        url = await asyncio.to_thread(valkey.start)
        stack.callback(valkey.stop)
        log.info("embedded valkey started", pid=valkey.process.pid, port=valkey.port,
                 appendfsync=settings.appendfsync)
    client = await connect(url)
    stack.push_async_callback(client.aclose)
    log.info("redis connected", url=redact(url))
    return client, url


def _audit_key(settings: Settings) -> bytes:
    """The chain's HMAC key: configured, or a file (made with a random key on first start)."""
    if settings.audit_key:
        return settings.audit_key.encode()
    path = Path(settings.audit_key_file) if settings.audit_key_file else settings.state_path / "audit.key"
    if not path.exists():
        if settings.audit_key_file:
            raise ConfigError(f"FINSIEVE_AUDIT_KEY_FILE {path}: no such file")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        log.info("audit key created", path=str(path))
    return path.read_text().strip().encode()


async def _start_gateway(
    settings: Settings, engines: list[str], audit: AuditLog, client: redis.Redis,
    rules: PolicyHolder[GatewayPolicy] | None, stack: AsyncExitStack,
) -> tuple[GatewayService, RunningServer]:
    from finsieve.gateway.validation import Limits

    pool = EnginePool(engines)
    stack.push_async_callback(pool.close)
    cache = ResponseCache(client, audit, settings.cache_ttl_s, settings.cache_max_bytes) \
        if settings.cache_ttl_s > 0 else None
    gateway = GatewayService(pool, Limits(settings.max_tokens_limit, settings.max_input_bytes),
                             audit, cache, settings.audit_fail_open, rules)
    running = await start_server(f"{settings.host}:{settings.port}", [Service(
        chat_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name, gateway,
        chat_pb2_grpc.add_GatewayServicer_to_server)])
    # After the drain: ends what is left of the streams.
    stack.push_async_callback(running.server.stop, 1)
    log.info("gateway serving", address=f"{settings.host}:{running.port}", engines=engines)
    return gateway, running


async def _admin(audit: AuditLog, body: dict) -> None:
    try:
        await audit.append("admin", body)
    except AuditError as e:
        log.error("admin audit event lost", event=body.get("event"), error=str(e))


async def _watch_admin(engines: EnginePool, audit: AuditLog) -> None:
    """Rule pack loads and rejections (seen through the engines' Info) become admin records."""
    seen: dict[str, tuple[int, int]] = {}
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
        await asyncio.sleep(1.0)
