"""Issue #42, findings 3 and 4: background work that no exception ends, admin records that a
trail refusing writes delays but never loses (health NOT_SERVING meanwhile), no exception
text to any client, structlog calls checked for reserved names, and the officers' listener
bounded like the public port. Against a real server, a real Valkey made to refuse writes
(`maxmemory`), real rule files and raw TCP connections."""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import redis
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from finsieve import grpc_server, supervise
from finsieve.app.client import Credentials
from finsieve.config import Settings
from finsieve.v1 import audit_pb2, audit_pb2_grpc

from support.packs import apply
from support.paths import REPO
from support.processes import wait_for
from support.servers import CANARY, TightServer, free_port, start_server

IDLE_S = 2  # the server's FINSIEVE_MAX_CONNECTION_IDLE_S here
AUDIT_MAX_CALLS = 3  # its FINSIEVE_AUDIT_MAX_CALLS
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # completes the client's preface

# -- structlog: no reserved argument names -------------------------------------------------

TREES = ("finsieve", "gateway", "engine", "bench")
LEVELS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "msg",
          "log")
METHODS = frozenset(LEVELS) | {"a" + m for m in LEVELS}


def _reserved() -> frozenset[str]:
    """The named parameters of structlog's bound-logger methods (`self`, `event`, and `level`
    of log()): a keyword of that name raises TypeError ("got multiple values"), on the path
    that logs, often an error path no test reaches."""
    bound = structlog.make_filtering_bound_logger(logging.DEBUG)
    names = set()
    for method in METHODS:
        for p in inspect.signature(getattr(bound, method)).parameters.values():
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                names.add(p.name)
    return frozenset(names)


def _is_logger_source(node: ast.expr) -> bool:
    """structlog.get_logger(...) / getLogger / wrap_logger, or <something>.bind(...)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    f = node.func
    return (f.attr in ("get_logger", "getLogger", "wrap_logger")
            and isinstance(f.value, ast.Name) and f.value.id == "structlog") or f.attr in ("bind", "new")


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):  # self._log
        return node.attr
    return None


def structlog_problems(source: str, where: str) -> tuple[list[str], int]:
    """Problems in the structlog calls of one file, and how many calls were checked."""
    tree = ast.parse(source)
    loggers = {_name(t) for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and _is_logger_source(n.value) for t in n.targets} - {None}
    reserved = _reserved()
    problems, checked = [], 0
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in METHODS):
            continue
        target = node.func.value
        if not (_name(target) in loggers or _is_logger_source(target)):
            continue
        checked += 1
        at = f"{where}:{node.lineno}"
        for kw in node.keywords:
            if kw.arg is None:  # **mapping: a literal one is checked too
                if isinstance(kw.value, ast.Dict):
                    keys = [k.value for k in kw.value.keys
                            if isinstance(k, ast.Constant) and isinstance(k.value, str)]
                    problems += [f"{at}: **{{{k!r}: …}} is reserved" for k in keys
                                 if k in reserved or k.startswith("_")]
            elif kw.arg in reserved:
                problems.append(f"{at}: keyword {kw.arg}= is structlog's own argument")
            elif kw.arg.startswith("_"):  # structlog's and its processors' private keys
                problems.append(f"{at}: keyword {kw.arg}= (names starting with _ are structlog's)")
        positional = 2 if node.func.attr.removeprefix("a") == "log" else 1
        if len(node.args) > positional:  # formatted with %: almost always a mistake
            problems.append(f"{at}: {len(node.args)} positional arguments (the message is one)")
    return problems, checked


def test_the_checker_finds_what_it_looks_for():
    bad = ("import structlog\nlog = structlog.get_logger(__name__)\nbound = log.bind(x=1)\n"
           "log.error('lost', event='x')\nbound.info('y', _record=1)\n"
           "structlog.get_logger().warning('z', level=2)\nlog.info('a', **{'event': 1})\n"
           "log.info('fine', error='x')\n")
    problems, checked = structlog_problems(bad, "sample")
    assert checked == 5
    assert [p.split(":")[1] for p in problems] == ["4", "5", "6", "7"], problems


def test_no_structlog_call_passes_a_reserved_argument_name():
    problems, checked = [], 0
    for tree in TREES:
        for path in sorted((REPO / tree).rglob("*.py")):
            found, n = structlog_problems(path.read_text(), str(path.relative_to(REPO)))
            problems += found
            checked += n
    assert checked > 50, checked  # the checker sees the tree's log calls (79 today)
    assert not problems, "\n".join(problems)


def test_every_listener_is_made_by_start_server():
    """The rule "no exception text reaches a client" lives in start_server (HideErrors, the
    outermost interceptor): no other code of the tree makes a gRPC server."""
    makers = []
    for tree in TREES:
        for path in sorted((REPO / tree).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "server" and ast.unparse(node.func.value)
                        in ("grpc", "grpc.aio", "aio")):
                    makers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert len(makers) == 1 and makers[0].startswith("finsieve/grpc_server.py:"), makers
    source = (REPO / "finsieve" / "grpc_server.py").read_text()
    assert "interceptors=[HideErrors(), *interceptors]" in source


# -- the supervisor ------------------------------------------------------------------------


def test_a_supervised_task_is_started_again_after_each_failure():
    runs = []

    async def flaky() -> None:
        runs.append(time.monotonic())
        if len(runs) < 3:
            raise ValueError("boom")

    before = supervise.FAILURES.labels("flaky")._value.get()
    asyncio.run(asyncio.wait_for(supervise.supervise("flaky", flaky, supervise.Backoff(0.01, 0.05)), 10))
    assert len(runs) == 3
    assert runs[1] - runs[0] >= 0.01 and runs[2] - runs[1] >= 0.02  # backoff, doubling
    assert supervise.FAILURES.labels("flaky")._value.get() - before == 2

    async def broken() -> None:
        raise OSError("always")

    with pytest.raises(supervise.GaveUp):
        asyncio.run(asyncio.wait_for(
            supervise.supervise("broken", broken, supervise.Backoff(0.01, 0.02), give_up_after=3), 10))


def test_a_full_admin_backlog_holds_its_writer_back_and_loses_nothing(valkey):
    """A real Valkey refusing writes (maxmemory 1): health goes NOT_SERVING at the first
    failed write; with the backlog full the next record waits (the rule-pack watcher stops);
    once Valkey takes writes, every record lands in order and health is SERVING again."""
    import redis.asyncio as aredis

    from gateway.access import AdminTrail
    from gateway.audit import AuditLog

    async def run() -> tuple[list[bool], list[str], bool]:
        client = aredis.Redis(port=valkey.port, password=valkey.password)
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", 1)
        audit = AuditLog(client, b"k" * 32)
        trail = AdminTrail(audit, max_backlog=2, backoff=supervise.Backoff(0.01, 0.05))
        changes: list[bool] = []
        changed = asyncio.Event()

        async def health(serving: bool) -> None:
            changes.append(serving)
            changed.set()

        await trail.watch(health)
        trail.start()
        await trail.record({"event": "e1"})
        await asyncio.wait_for(changed.wait(), 10)  # e1 failed: NOT_SERVING
        await trail.record({"event": "e2"})
        await trail.record({"event": "e3"})  # e1 being written, e2 and e3 wait: full
        blocked = asyncio.create_task(trail.record({"event": "e4"}))
        await asyncio.sleep(0.3)  # (no synchronisation: it must still be waiting after it)
        held_back = not blocked.done()
        changed.clear()
        await client.config_set("maxmemory", 0)
        await asyncio.wait_for(blocked, 10)
        await asyncio.wait_for(changed.wait(), 10)  # the backlog is written: SERVING
        await trail.close(1)
        head = await audit.head()
        events = [(await audit.get(seq))["event"] for seq in range(1, head.seq + 1)]
        await client.aclose()
        return changes, events, held_back

    changes, events, held_back = asyncio.run(run())
    assert changes == [False, True]
    assert held_back
    assert events == ["e1", "e2", "e3", "e4"]


# -- against a real server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[TightServer]:
    tmp = tmp_path_factory.mktemp("supervision")
    rules = tmp / "rules"
    rules.mkdir()
    (rules / "canary.yaml").write_text(CANARY)
    secret = tmp / "engine.secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    metrics = free_port()
    if (REPO / "luts").is_dir():  # the token table built once (30 s on two cores); packs' own here
        shutil.copytree(REPO / "luts", tmp / "luts")
    server = start_server(
        tmp, "--model", str(default_model_dir), "--rules", str(rules), "--luts", str(tmp / "luts"),
        "--metrics-port", str(metrics),
        env={"FINSIEVE_ENGINE_SECRET_FILE": str(secret), "FINSIEVE_RULES_DEBOUNCE_MS": "20",
             "FINSIEVE_RULES_MAX_BYTES": "1048576", "FINSIEVE_CACHE_TTL_S": "0",
             "FINSIEVE_MAX_CONNECTION_IDLE_S": str(IDLE_S),
             "FINSIEVE_AUDIT_MAX_CALLS": str(AUDIT_MAX_CALLS)})
    yield TightServer(server, rules, f"http://127.0.0.1:{metrics}/metrics")
    server.stop()


def valkey_of(srv: TightServer) -> redis.Redis:
    return redis.Redis(port=srv.server.valkey_port(), password=srv.server.valkey_password())


@contextmanager
def refusing_writes(srv: TightServer) -> Iterator[None]:
    """The server's Valkey refuses every write (OOM: maxmemory 1, noeviction); reads work."""
    r = valkey_of(srv)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)
    try:
        yield
    finally:
        r.config_set("maxmemory", 0)
        r.close()


def health(target: str) -> int | grpc.StatusCode:
    """The standard health service's answer for the whole server, or the call's error."""
    with grpc.insecure_channel(target) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=10).status
        except grpc.RpcError as e:
            return e.code()


def officer(srv: TightServer, call):
    """call(stub) with the server's officer key: its answer, or the grpc error."""
    async def run():
        async with Credentials(srv.server.key("officer")).channel(srv.server.audit_target) as ch:
            try:
                return await call(audit_pb2_grpc.AuditServiceStub(ch))
            except grpc.aio.AioRpcError as e:
                return e
    return asyncio.run(run())


def admin_records(srv: TightServer) -> list[dict]:
    page = officer(srv, lambda s: s.Query(audit_pb2.AuditQuery(page_size=1000)))
    assert not isinstance(page, grpc.aio.AioRpcError), page
    return [r for r in (json.loads(x.json) for x in page.records) if r["type"] == "admin"]


def pack(rule_id: str, phrase: str) -> str:
    return (f"rules:\n  - id: {rule_id}\n    description: d\n    kind: literal\n"
            f"    patterns: [{phrase}]\n    action: block\n")


def test_rule_packs_loaded_while_the_trail_refuses_writes_are_recorded_once_it_is_back(srv):
    """The finding: the first failed admin write killed the watcher (structlog TypeError on
    its error path), and no later pack load was ever recorded."""
    backlog = lambda: srv.metric("finsieve_admin_backlog")  # noqa: E731
    assert health(srv.target) == health_pb2.HealthCheckResponse.SERVING
    versions = []
    with refusing_writes(srv):
        for n, phrase in enumerate(("zebra stripes", "okapi spots"), 1):
            file = srv.rules / f"h3-{n}.yaml"
            info = apply(srv, lambda f=file, n=n, p=phrase: f.write_text(pack(f"h3-{n}", p)))
            versions.append(info.policy_version)
            # The watcher saw the load (polled once a second) and its record waits.
            assert wait_for(lambda n=n: backlog() >= n, 15, 0.1), backlog()
            assert wait_for(lambda: health(srv.target) == health_pb2.HealthCheckResponse.NOT_SERVING,
                            15, 0.1)
    assert wait_for(lambda: health(srv.target) == health_pb2.HealthCheckResponse.SERVING, 30, 0.1)
    assert backlog() == 0
    loaded = [r for r in admin_records(srv) if r["event"] == "rule_pack_loaded"]
    assert [r["policy_version"] for r in loaded][-2:] == versions
    assert all(r["occurred_ms"] <= r["ts_ms"] for r in loaded[-2:])
    assert "admin audit record not written yet; retrying" in srv.server.log()


def test_an_officer_call_is_unavailable_while_the_trail_refuses_writes(srv):
    """docs/security.md's promise: an officer read that cannot be recorded is refused UNAVAILABLE
    (it was UNKNOWN with a Python TypeError's text)."""
    with refusing_writes(srv):
        error = officer(srv, lambda s: s.Query(audit_pb2.AuditQuery(page_size=1)))
    assert isinstance(error, grpc.aio.AioRpcError)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert error.details() == "the audit trail is unavailable; nothing was done"


def test_an_unexpected_error_is_internal_with_an_id_the_log_carries(srv):
    """A real fault no handler expects: an index key of the trail holding a string (WRONGTYPE
    from Valkey). The officer gets INTERNAL and an id, no exception text; the log has both."""
    from gateway.audit import index_key

    r = valkey_of(srv)
    key = index_key("rule_id", "h3-corrupted")
    r.set(key, "not an index")
    try:
        error = officer(srv, lambda s: s.Query(audit_pb2.AuditQuery(rule_id="h3-corrupted")))
    finally:
        r.delete(key)
        r.close()
    assert isinstance(error, grpc.aio.AioRpcError)
    assert error.code() == grpc.StatusCode.INTERNAL, error
    found = re.fullmatch(r"internal error \(id ([0-9a-f]{8})\); the operator can look it up in "
                         r"the log", error.details())
    assert found, error.details()
    for leak in ("WRONGTYPE", "ResponseError", "Traceback", "<class", "redis"):
        assert leak not in error.details()

    def logged() -> list[dict]:
        lines = [json.loads(line) for line in srv.server.log().splitlines() if found[1] in line]
        return [x for x in lines if x.get("error_id") == found[1]]

    assert wait_for(logged, 10)
    line = logged()[0]
    assert line["error_type"] == "ResponseError"
    assert line["method"] == "/finsieve.v1.AuditService/Query"
    assert "WRONGTYPE" in line["exception"]  # the traceback, for the operator


# -- the officers' listener is bounded -----------------------------------------------------


def open_silent_connections(target: str, n: int) -> list[socket.socket]:
    """n connections that send the HTTP/2 preface (half of them with the empty SETTINGS
    frame that completes it) and then nothing."""
    host, port = target.rsplit(":", 1)
    out = []
    for i in range(n):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(PREFACE + (EMPTY_SETTINGS if i % 2 else b""))
        s.setblocking(False)
        out.append(s)
    return out


def closed_by_server(s: socket.socket) -> bool:
    try:
        while data := s.recv(65536):  # the server's SETTINGS (and a GOAWAY) come first
            del data
        return True  # end of file
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def test_the_officers_port_closes_connections_that_open_no_call(srv):
    socks = open_silent_connections(srv.server.audit_target, 50)
    start = time.monotonic()
    try:
        open_ = set(range(len(socks)))

        def all_closed() -> bool:
            open_.difference_update({i for i in open_ if closed_by_server(socks[i])})
            return not open_

        assert wait_for(all_closed, IDLE_S + 10, 0.05), f"{len(open_)} of 50 still open"
        assert time.monotonic() - start >= IDLE_S * 0.8  # by the idle bound, not at once
    finally:
        for s in socks:
            s.close()


def test_the_officers_port_bounds_the_calls_open_at_once(srv):
    """gRPC health Watch streams (open for good, no credential needed) fill the officers'
    FINSIEVE_AUDIT_MAX_CALLS; one more call is refused RESOURCE_EXHAUSTED."""
    async def run() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(srv.server.audit_target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(AUDIT_MAX_CALLS)]
            try:
                for w in watches:  # each is open: its first status came
                    assert (await w.read()).status == health_pb2.HealthCheckResponse.SERVING
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    return e.code()
            finally:
                for w in watches:
                    w.cancel()

    assert asyncio.run(run()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The bound frees up with the calls.
    assert wait_for(lambda: health(srv.server.audit_target) == health_pb2.HealthCheckResponse.SERVING,
                    10, 0.1)


def test_an_engines_port_closes_connections_that_open_no_call_but_keeps_open_streams():
    """The engine's listener (server_options with clients=False, as serve.py builds it) has
    the idle bound too: a connection with no call open is closed, a gateway's long-lived
    stream (here a health Watch) is not."""
    settings = Settings.load(env={"FINSIEVE_MAX_CONNECTION_IDLE_S": str(IDLE_S)})

    async def run() -> None:
        running = await grpc_server.start_server(
            "127.0.0.1:0", [], options=grpc_server.server_options(
                settings, grpc_server.ENGINE_MESSAGE_BYTES, clients=False))
        target = f"127.0.0.1:{running.port}"
        try:
            async with grpc.aio.insecure_channel(target) as ch:
                watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                socks = open_silent_connections(target, 20)
                try:
                    open_ = set(range(len(socks)))

                    def all_closed() -> bool:
                        open_.difference_update({i for i in open_ if closed_by_server(socks[i])})
                        return not open_

                    assert await asyncio.to_thread(wait_for, all_closed, IDLE_S + 10, 0.05), \
                        f"{len(open_)} of 20 still open"
                finally:
                    for s in socks:
                        s.close()
                await running.set_serving(False)  # the stream that stayed open sees it
                assert (await asyncio.wait_for(watch.read(), 10)).status == \
                    health_pb2.HealthCheckResponse.NOT_SERVING
                watch.cancel()
        finally:
            await running.server.stop(0)

    asyncio.run(run())
