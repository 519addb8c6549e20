"""`finsieve serve`: start what the role asks for, run until SIGTERM/SIGINT, drain, stop."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import structlog

from finsieve.config import Settings
from finsieve.gateway.server import GatewayService
from finsieve.grpc_server import RunningServer, Service, start_server
from finsieve.policy.guard import Policy
from finsieve.v1 import chat_pb2, chat_pb2_grpc, engine_pb2, engine_pb2_grpc
from finsieve.valkey import EmbeddedValkey, connect, redact

log = structlog.get_logger(__name__)


async def serve(settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncExitStack() as stack:
        engine_addresses = list(settings.engines)
        if settings.role in ("all", "gateway"):
            # First: valkey-server is forked before gRPC starts its threads.
            await _start_redis(settings, stack)
        if settings.role in ("all", "engine"):
            address = await _start_engine(settings, stack)
            engine_addresses = [address] if settings.role == "all" else engine_addresses
        if settings.role in ("all", "gateway"):
            gateway, running = await _start_gateway(settings, engine_addresses, stack)
            await stop.wait()
            await running.set_serving(False)  # load balancers stop sending first
            log.info("draining", in_flight=gateway.in_flight(), deadline_s=settings.drain_seconds)
            await gateway.drain(settings.drain_seconds)
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
    if settings.rules:
        engine.policy = await asyncio.to_thread(_watch_rules, settings, engine.token_bytes, stack)
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
        EngineService(engine),
        engine_pb2_grpc.add_EngineServicer_to_server,
    )
    running = await start_server(f"{host}:{port}", [service])
    stack.push_async_callback(running.server.stop, 1)
    log.info("engine serving", address=f"{host}:{running.port}", model=engine.model_name,
             device=str(device), max_batch=engine.max_batch, max_context=engine.max_context)
    return f"{host}:{running.port}"


def _watch_rules(settings: Settings, token_bytes: list[bytes],
                 stack: AsyncExitStack) -> Callable[[], Policy]:
    """Compile the rules directory now (a bad pack stops start-up) and on every change."""
    from finsieve.policy.guard import compile_policy
    from finsieve.policy.masks import TokenTable
    from finsieve.policy.reload import PolicyHolder, RulesWatcher

    directory, luts = Path(settings.rules), Path(settings.luts)
    tokens = TokenTable.load_or_build(token_bytes, luts)
    policy, version = compile_policy(directory, tokens, luts)
    holder = PolicyHolder(policy, version)
    watcher = RulesWatcher(directory, holder, lambda d: compile_policy(d, tokens, luts))
    watcher.start()
    stack.callback(watcher.stop)
    log.info("rules loaded", version=version, rules=len(policy.pack.rules), directory=str(directory))
    return lambda: holder.current


async def _start_redis(settings: Settings, stack: AsyncExitStack) -> None:
    url = settings.redis_url
    if not url:
        valkey = EmbeddedValkey(settings.state_path / "valkey")
        url = await asyncio.to_thread(valkey.start)
        stack.callback(valkey.stop)
        log.info("embedded valkey started", pid=valkey.process.pid, port=valkey.port)
    client = await connect(url)
    stack.push_async_callback(client.aclose)
    log.info("redis connected", url=redact(url))


async def _start_gateway(
    settings: Settings, engines: list[str], stack: AsyncExitStack
) -> tuple[GatewayService, RunningServer]:
    from finsieve.gateway.engines import EnginePool
    from finsieve.gateway.validation import Limits

    pool = EnginePool(engines)
    stack.push_async_callback(pool.close)
    gateway = GatewayService(pool, Limits(settings.max_tokens_limit, settings.max_input_bytes))
    service = Service(
        chat_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
        gateway,
        chat_pb2_grpc.add_GatewayServicer_to_server,
    )
    running = await start_server(f"{settings.host}:{settings.port}", [service])
    # After the drain: ends what is left of the streams.
    stack.push_async_callback(running.server.stop, 1)
    log.info("gateway serving", address=f"{settings.host}:{running.port}", engines=engines)
    return gateway, running
