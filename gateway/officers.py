"""The officers' process: the AuditService and the AdminService on their own listener (and the
web console on its own port, when FINSIEVE_CONSOLE_PORT is set), event loop, Redis connection
and a lower CPU priority (`FINSIEVE_AUDIT_NICE`), so that reading,
parsing and exporting large records never competes with chat streams for the gateway's
event loop (nor, with the niceness, for the CPU). Retention runs here too, and records each
trim in the trail; what this process appends it anchors in its own file.

The gateway starts it with `spawn` and hands it the settings and its secrets (the Redis URL
and password, the audit key, the keys secret) on its stdin (never in its environment or
arguments); it dies with the gateway.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from finsieve import logs, supervise, tls
from finsieve.auth import AuthInterceptor, roles_for
from finsieve.config import Settings
from finsieve.grpc_server import Service, server_options, start_server
from finsieve.policy.reload import PolicyHolder, RulesWatcher
from finsieve.policy.sources import PackLimits
from finsieve.v1 import admin_pb2, admin_pb2_grpc, audit_pb2, audit_pb2_grpc
from finsieve.valkey import ERRORS, Client, connect, die_with_parent

from .access import AdminTrail
from .admin_service import AdminService
from .anchors import Anchoring, AnchorWriter
from .audit import AuditError, AuditLog
from .audit_recovery import Checking, audit_log
from .audit_service import AuditService
from .console import rulebook
from .console import server as console_server
from .console.app import Console
from .console.holds import retention_cut
from .console.server import RunningConsole
from .console.sessions import Sessions
from .identity import ClientAuthenticator
from .keys import KeyStore
from .limits import tenant_limiter
from .rules import compile_gateway_policy

log = structlog.get_logger(__name__)

RETENTION_EVERY_S = 3600.0


class OfficersError(OSError):
    """The officers' process did not come up; the message says why."""


def anchor_dir(settings: Settings) -> Path:
    return settings.state_path / "anchors"


class Officers:
    """The running officers' process, seen from the gateway."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    async def ready(self, timeout: float = 60.0) -> int:
        """Its listener's port once it serves. Raises OfficersError."""
        assert self.process.stdout is not None
        try:
            line = await asyncio.wait_for(asyncio.to_thread(self.process.stdout.readline), timeout)
        except TimeoutError:
            self.stop()
            raise OfficersError(f"the officers' AuditService did not start within {timeout:g} s") from None
        try:
            reply = json.loads(line) if line else {}
        except ValueError:
            reply = {}
        if isinstance(reply, dict) and isinstance(reply.get("port"), int):
            return reply["port"]
        self.stop()
        why = reply.get("error") if isinstance(reply, dict) else None
        raise OfficersError(f"the officers' AuditService did not start: {why or 'it exited'}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()


@dataclass(frozen=True)
class Secrets:
    redis_url: str
    redis_password: str | None  # the embedded Valkey's (kept out of the URL)
    audit_key: bytes
    keys_secret: bytes


def spawn(settings: Settings, secrets: Secrets) -> Officers:
    """Start the officers' process (before gRPC starts threads in this one)."""
    # Its settings come on stdin: it needs none of ours, and some may be secrets.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FINSIEVE_")}
    process = subprocess.Popen([sys.executable, "-m", "gateway.officers"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert process.stdin is not None
    config = {"settings": dataclasses.asdict(settings), "redis_url": secrets.redis_url,
              "redis_password": secrets.redis_password, "key": secrets.audit_key.hex(),
              "keys_secret": secrets.keys_secret.hex(), "parent": os.getpid()}
    process.stdin.write(json.dumps(config).encode() + b"\n")
    process.stdin.flush()  # and left open: its end tells the child the gateway is gone
    return Officers(process)


# -- the child --------------------------------------------------------------------------


async def _serve(settings: Settings, secrets: Secrets) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    threading.Thread(target=_until_parent_gone, args=(loop, stop), name="parent-watch",
                     daemon=True).start()
    client = await connect(secrets.redis_url, password=secrets.redis_password,
                           max_connections=settings.redis_max_connections)
    key = secrets.audit_key
    audit = audit_log(settings, client, key, "officers")
    checking = Checking(audit, settings.audit_check_interval_s)
    checking.start()
    anchoring = Anchoring(audit, AnchorWriter(anchor_dir(settings), "officers", key),
                          settings.audit_anchor_interval_s)
    anchoring.start()
    keys = KeyStore(client, secrets.keys_secret, settings.key_cache_s, settings.key_cache_max)
    auth = ClientAuthenticator.from_settings(settings, keys)
    audit_name, admin_name = (pb.DESCRIPTOR.services_by_name[name].full_name for pb, name in
                              ((audit_pb2, "AuditService"), (admin_pb2, "AdminService")))
    running = await start_server(
        f"{settings.audit_host}:{settings.audit_port}",
        [Service(audit_name, AuditService(audit, anchor_dir(settings), settings.audit_page_bytes),
                 audit_pb2_grpc.add_AuditServiceServicer_to_server),
         Service(admin_name, AdminService(keys, tenant_limiter(settings, client), audit),
                 admin_pb2_grpc.add_AdminServiceServicer_to_server)],
        # The public port's bounds: frame limit, handshake time, keepalive, idle and age (an
        # export still streaming at the age gets FINSIEVE_DRAIN_SECONDS to finish); calls.
        options=server_options(settings, settings.max_message_bytes),
        max_concurrent_rpcs=settings.audit_max_calls,
        credentials=tls.server_credentials(settings),
        interceptors=[AuthInterceptor(auth, roles_for({audit_name: "officer",
                                                       admin_name: "admin"}))])
    trail = AdminTrail(audit, settings.admin_backlog_max)
    trail.start()
    console = await _start_console(settings, audit, keys, client, trail) if settings.console_port else None
    print(json.dumps({"port": running.port}), flush=True)
    log.info("audit service serving", address=f"{settings.audit_host}:{running.port}",
             pid=os.getpid(), nice=os.nice(0))
    await trail.watch(running.set_serving)  # NOT_SERVING while a trim's record waits
    retention = supervise.start("audit-retention",
                                lambda: _retain(audit, trail, settings.audit_retention_days))
    await stop.wait()
    retention.cancel()
    if console is not None:
        await console.stop()
    await trail.watch(None)
    await running.set_serving(False)
    await trail.close()
    await running.server.stop(1)
    await anchoring.stop()
    await checking.stop()
    await audit.aclose()
    await client.aclose()


async def _start_console(settings: Settings, audit: AuditLog, keys: KeyStore, client: Client,
                         trail: AdminTrail) -> RunningConsole:
    """The officers' web console, and the archive of the rule packs it shows (the rules
    directory the gateway shares with its engines, watched here too)."""
    holder = None
    if settings.rules:
        limits = PackLimits.of(settings)
        policy, version = compile_gateway_policy(Path(settings.rules), audit.key, limits)
        holder = PolicyHolder(policy, version)
        watcher = RulesWatcher(Path(settings.rules), holder,
                               lambda d: compile_gateway_policy(d, audit.key, limits),
                               settings.rules_debounce_ms)
        watcher.start()  # a daemon thread: it ends with the process
    console = await console_server.start(Console(
        settings, audit, keys, Sessions(client, keys, settings.console_session_s), anchor_dir(settings),
        holder))
    if holder is not None:
        console.tasks.append(supervise.start("rules-archive",
                                             lambda: rulebook.keep_archived(audit, trail, holder)))
    log.info("console serving", address=f"{settings.audit_host}:{console.port}",
             tls=bool(settings.tls_cert))
    return console


def _until_parent_gone(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Stdin's end (or any failure to read it) tells this process the gateway is gone."""
    try:
        sys.stdin.read()
    finally:
        loop.call_soon_threadsafe(stop.set)


async def _retain(audit: AuditLog, trail: AdminTrail, days: float) -> None:
    """Once an hour: trim records older than `days`, by sequence (0: keep everything), up to
    the oldest record a legal hold keeps. A trim that fails (or whose holds cannot be read)
    is tried at the next hour; the record of one that is done is written until it lands
    (the trail's backlog)."""
    while days > 0:
        try:
            # Legal holds first: what an active hold covers, and all after it, is kept.
            trimmed = await audit.trim(await retention_cut(audit, int((time.time() - days * 86400) * 1000)))
        except AuditError as e:
            log.error("audit trim failed", error=str(e))
            trimmed = 0
        except ERRORS as e:
            log.error("audit trim failed", error=f"{type(e).__name__}: {e}")
            trimmed = 0
        if trimmed:
            log.info("audit trail trimmed", records=trimmed)
            await trail.record({"event": "audit_trimmed", "records": trimmed,
                                "retention_days": days})
        await asyncio.sleep(RETENTION_EVERY_S)


def main() -> int:
    config = json.loads(sys.stdin.readline())
    settings = Settings.load(config["settings"], env={})
    logs.configure(settings.log_format, settings.log_level)
    if platform.system() == "Linux":
        die_with_parent()
    if os.getppid() != config["parent"]:
        return 1  # the gateway died before we could tie our life to it
    os.nice(settings.audit_nice)
    try:
        asyncio.run(_serve(settings, Secrets(config["redis_url"], config["redis_password"],
                                             bytes.fromhex(config["key"]),
                                             bytes.fromhex(config["keys_secret"]))))
    except Exception as e:  # one line for the gateway's start-up error; no stack trace
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
