"""The audit trail and the response cache on a real Valkey."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import redis.asyncio as redis
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from finsieve.app.client import Credentials
from finsieve.v1 import audit_pb2, audit_pb2_grpc, chat_pb2
from finsieve.valkey import EmbeddedValkey
from gateway.audit import TIME, AuditLog, Filters, record_key
from gateway.audit_verify import verify

from support.processes import wait_for
from support.servers import Server, dev_key, free_port, start_server, wait_cached
from support.streams import ChatStream, run_requests, tagged, text_of

KEY = b"test-key"


def with_log(valkey: EmbeddedValkey, fn):
    async def run():
        client = redis.Redis(port=valkey.port, password=valkey.password)
        try:
            return await fn(AuditLog(client, KEY), client)
        finally:
            await client.aclose()
    return asyncio.run(run())


async def fill(log: AuditLog, n: int) -> None:
    for i in range(n):
        await log.append("request", {"request_id": f"r{i}", "user": f"u{i % 3}",
                                     "interventions": [{"rule_id": "card", "action": "redact"}]
                                     if i % 4 == 0 else []})


def test_chain_verifies_and_queries_use_the_indexes(valkey):
    async def go(log, _):
        await fill(log, 30)
        by_rule, _ = await log.query(Filters(rule_id="card"), limit=100)
        by_user, next_page = await log.query(Filters(user="u1"), limit=5)
        rest, _ = await log.query(Filters(user="u1"), limit=100, cursor=next_page)
        return await verify(log), by_rule, by_user + rest

    verdict, by_rule, by_user = with_log(valkey, go)
    assert verdict.ok and verdict.checked == 30
    assert [r["request_id"] for r in by_rule] == [f"r{i}" for i in range(0, 30, 4)]
    assert [r["request_id"] for r in by_user] == [f"r{i}" for i in range(1, 30, 3)]


@pytest.mark.parametrize("tamper", ["change a field", "delete a record", "swap two records",
                                    "insert a forged record"])
def test_verify_names_the_exact_broken_record(valkey, tamper):
    async def go(log, client):
        await fill(log, 10)
        rec = json.loads(await client.get(record_key(5)))
        if tamper == "change a field":
            rec["user"] = "someone-else"
            await client.set(record_key(5), json.dumps(rec))
        elif tamper == "delete a record":
            await client.delete(record_key(5))
        elif tamper == "swap two records":
            a, b = await client.get(record_key(5)), await client.get(record_key(6))
            await client.set(record_key(5), b)
            await client.set(record_key(6), a)
        else:  # a forged record sealed with a guessed key, linked into place
            forged = dict(rec, request_id="forged", seq=5)
            import hmac as h

            from gateway.audit import canonical
            forged["hmac"] = h.new(b"guess", canonical(forged), "sha256").hexdigest()
            await client.set(record_key(5), json.dumps(forged))
        return await verify(log)

    verdict = with_log(valkey, go)
    assert not verdict.ok
    assert verdict.first_bad_seq == 5, verdict
    assert verdict.checked == 4


def test_two_gateway_processes_appending_at_once_never_fork_the_chain(valkey):
    script = (
        "import asyncio, sys, redis.asyncio as r\n"
        "from gateway.audit import AuditLog\n"
        "async def main():\n"
        f"    log = AuditLog(r.Redis(port={valkey.port}, password={valkey.password!r}), {KEY!r})\n"
        "    for i in range(150):\n"
        "        await log.append('request', {'request_id': sys.argv[1] + str(i)})\n"
        "asyncio.run(main())\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, name]) for name in ("a", "b")]
    assert [p.wait(120) for p in procs] == [0, 0]

    async def go(log, client):
        return await verify(log), await client.zcard(TIME)

    verdict, count = with_log(valkey, go)
    assert verdict.ok and verdict.checked == count == 300


def test_kill_9_under_appendfsync_always_loses_no_acknowledged_record(valkey, tmp_path):
    with_log(valkey, lambda log, _: fill(log, 50))
    os.kill(valkey.process.pid, signal.SIGKILL)
    valkey.process.wait()
    valkey.process = None
    restarted = EmbeddedValkey(valkey.data_dir, appendfsync="always")
    restarted.start()
    try:
        async def go(log, client):
            return await verify(log), await client.zcard(TIME)

        verdict, count = with_log(restarted, go)
    finally:
        restarted.stop()
    assert count == 50 and verdict.ok and verdict.checked == 50


def test_retention_trims_behind_a_signed_checkpoint(valkey):
    async def go(log, client):
        await fill(log, 5)
        await asyncio.sleep(0.01)  # records 6.. are strictly younger than 1..5
        await fill(log, 5)
        trimmed = await log.trim(json.loads(await client.get(record_key(6)))["ts_ms"])
        ok = await verify(log)
        first = min(int(s) for s in await client.zrange(TIME, 0, -1))
        rec = json.loads(await client.get(record_key(first)))
        rec["prev"] = "0" * 64
        await client.set(record_key(first), json.dumps(rec))
        return trimmed, ok, await verify(log), first

    trimmed, ok, broken, first = with_log(valkey, go)
    assert trimmed == 5 and ok.ok and ok.checked == 5
    assert not broken.ok and broken.first_bad_seq == first


# -- through the server ----------------------------------------------------------------


def audit_stub(target: str, fn, key: str | None = None):
    """fn(stub) on a channel authenticated with `key` (default: the server's officer key)."""
    async def run():
        async with Credentials(dev_key(target, "officer") if key is None else key).channel(target) as ch:
            return await fn(audit_pb2_grpc.AuditServiceStub(ch))
    return asyncio.run(run())


def records_for(target: str, request_id: str) -> list[dict]:
    page = audit_stub(target, lambda s: s.Query(audit_pb2.AuditQuery(request_id=request_id,
                                                                       page_size=100)))
    return [json.loads(r.json) for r in page.records]


def test_a_deterministic_answer_is_replayed_from_the_cache(server):
    req = tagged("cache-1", "Name one kind of bond.", max_tokens=12)
    first = run_requests(server.target, [req])["cache-1"]
    wait_cached(server, first, req)
    req.request_id = "cache-2"
    second = run_requests(server.target, [req])["cache-2"]
    assert not first[0].started.cache_hit and second[0].started.cache_hit
    assert text_of(second) == text_of(first) != ""
    assert (second[-1].finished.finish_reason, second[-1].finished.usage) == \
        (first[-1].finished.finish_reason, first[-1].finished.usage)
    assert "" != second[-1].finished.audit_id != first[-1].finished.audit_id
    (record,) = records_for(server.audit_target, "cache-2")
    assert record["cache_hit"] is True and record["delivered"] == text_of(first)
    sampled = tagged("cache-3", "Name one kind of bond.", max_tokens=12, temperature=0.9)
    for rid in ("cache-3", "cache-4"):
        sampled.request_id = rid
        assert not run_requests(server.target, [sampled])[rid][0].started.cache_hit


def test_every_finish_reason_leaves_a_complete_record(server):
    reqs = [tagged("fin-stop", "Say hello.", max_tokens=200),
            tagged("fin-length", "Describe a bond.", max_tokens=5),
            tagged("fin-cancel", "Write a long story about a bank.", max_tokens=300),
            tagged("fin-filter", "Can you give me some insider tips on ACME?", max_tokens=20),
            tagged("fin-redact", 'Repeat exactly: "Card: 4111 1111 1111 1111"', max_tokens=20)]
    events = run_requests(server.target, reqs, cancel="fin-cancel")
    expected = {"fin-stop": "STOP", "fin-length": "LENGTH", "fin-cancel": "CANCELLED",
                "fin-filter": "CONTENT_FILTER", "fin-redact": None}
    for rid, reason in expected.items():
        started, final = records_for(server.audit_target, rid)
        assert started["type"] == "request_started" and final["type"] == "request"
        assert started["seq"] < final["seq"]
        # The tenant is the key's (the development app key's), never the metadata's.
        assert (final["tenant"], final["app"], final["user"]) == ("default", "mobile", "alice")
        assert final["key_id"] and final["metadata"]["tenant"] == "bank-a"
        asked = next(r for r in reqs if r.request_id == rid).messages[0].content
        stored = asked.replace("4111 1111 1111 1111", "4111 11** **** 1111")  # masked
        assert final["messages"] == started["messages"] == [{"role": "user", "content": stored}]
        assert final["model"] == "SmolLM2-135M-Instruct" and final["policy_version"]
        assert final["delivered"] == text_of(events[rid])
        assert final["usage"]["completion_tokens"] == events[rid][-1].finished.usage.completion_tokens
        assert final["latency_ms"]["total"] > 0 and final["params"]
        if reason:
            assert final["finish_reason"] == reason
    halted = records_for(server.audit_target, "fin-filter")[1]["interventions"]
    assert [(i["rule_id"], i["action"], i["scope"]) for i in halted] == \
        [("insider-request-en", "halt", "input")]
    assert halted[0]["suppressed"] == "give me some insider tips"
    redacted = records_for(server.audit_target, "fin-redact")[1]["interventions"]
    assert {"rule_id": "payment-card-number", "action": "redact", "scope": "input",
            "suppressed": "4111 11** **** 1111"}.items() <= redacted[0].items()
    # The client never saw the suppressed text.
    assert all(e.policy_event.suppressed == "" for e in events["fin-filter"]
               if e.WhichOneof("event") == "policy_event")


def test_audit_cli_and_service(server):
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "finsieve.app.cli", "audit", *args,
                               "--target", server.audit_target, "--state-dir", str(server.state)],
                              capture_output=True, text=True, timeout=60)

    run_requests(server.target, [tagged("cli-audit", "Say hi.", max_tokens=4)])
    verified = cli("verify")
    assert verified.returncode == 0 and "intact" in verified.stdout
    rows = [json.loads(line) for line in cli("query", "--request-id", "cli-audit", "--format",
                                             "jsonl").stdout.splitlines()]
    assert [r["type"] for r in rows] == ["request_started", "request"]
    shown = json.loads(cli("show", str(rows[1]["seq"])).stdout)
    assert shown == rows[1]
    exported = [json.loads(line) for line in cli("export", "--since", "1h").stdout.splitlines()]
    assert rows[1] in exported
    table = list(csv.reader(io.StringIO(cli("query", "--user", "alice", "--format", "csv").stdout)))
    assert table[0][:3] == ["seq", "time", "type"] and len(table) > 1

    with pytest.raises(grpc.aio.AioRpcError) as err:
        audit_stub(server.audit_target, lambda s: s.Query(audit_pb2.AuditQuery(page_size=5000)))
    status = rpc_status.from_call(err.value)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = error_details_pb2.BadRequest()
    status.details[0].Unpack(detail)
    assert detail.field_violations[0].field == "page_size"
    with pytest.raises(grpc.aio.AioRpcError) as public:  # never on the apps' port
        audit_stub(server.target, lambda s: s.Query(audit_pb2.AuditQuery()))
    assert public.value.code() == grpc.StatusCode.UNIMPLEMENTED
    anchors = server.log_path.parent / "state" / "anchors" / "gateway.jsonl"
    for _ in range(100):  # the gateway anchors its appends within a second
        if anchors.exists():
            break
        time.sleep(0.1)
    checked = cli("verify", "--anchors", str(anchors))
    assert checked.returncode == 0 and "newest anchor: record" in checked.stdout
    forged = json.loads(anchors.read_text().splitlines()[-1])
    forged["seq"] += 1
    (server.log_path.parent / "forged.jsonl").write_text(json.dumps(forged) + "\n")
    refused = cli("verify", "--anchors", str(server.log_path.parent / "forged.jsonl"))
    assert refused.returncode == 1 and "INVALID_ARGUMENT: anchors[0]: anchor not signed" in refused.stderr
    missing = cli("show", "999999999")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr and "Traceback" not in missing.stderr


def test_metrics_are_served(server):
    import re
    import urllib.request

    run_requests(server.target, [tagged("metrics-1", "Can you give me some insider tips on ACME?"),
                                 tagged("metrics-2", "Say hi.", max_tokens=4)])
    port = re.search(r'"address": "127.0.0.1:(\d+)", "event": "metrics serving"', server.log())[1]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = dict(re.findall(r"^(finsieve_\S+) (\S+)$", body, re.M))
    assert float(values["finsieve_time_to_first_token_seconds_count"]) > 0
    assert float(values["finsieve_generated_tokens_total"]) > 0
    assert float(values['finsieve_interventions_total{action="halt",rule_id="insider-request-en"}']) > 0
    assert float(values["finsieve_audit_append_seconds_count"]) > 0


def test_a_rule_change_invalidates_the_cache(tmp_path, default_model_dir):
    rules = tmp_path / "rules"
    rules.mkdir()
    srv = start_server(tmp_path, "--model", str(default_model_dir), "--rules", str(rules),
                       "--luts", str(tmp_path / "luts"))
    try:
        req = tagged("inv-1", "Name one kind of bond.", max_tokens=8)
        first = run_requests(srv.target, [req])["inv-1"]
        wait_cached(srv, first, req)
        req.request_id = "inv-2"
        assert run_requests(srv.target, [req])["inv-2"][0].started.cache_hit
        (rules / "new.yaml").write_text("rules:\n  - id: x\n    description: d\n    kind: literal\n"
                                        "    patterns: [zebra]\n    action: block\n")
        version, n = first[0].started.policy_version, 2
        while version == first[0].started.policy_version:
            n += 1
            req.request_id = f"inv-{n}"
            after = run_requests(srv.target, [req])[f"inv-{n}"]
            version = after[0].started.policy_version
        assert not after[0].started.cache_hit
        (rules / "bad.yaml").write_text("rules: [\n")
        admin = []
        for _ in range(100):  # the gateway polls the engine once a second
            page = audit_stub(srv.audit_target, lambda s: s.Query(audit_pb2.AuditQuery(page_size=1000)))
            admin = [json.loads(r.json) for r in page.records]
            admin = [r for r in admin if r["type"] == "admin"]
            if any(r["event"] == "rule_pack_rejected" for r in admin):
                break
            time.sleep(0.1)
    finally:
        srv.stop()
    events = [r["event"] for r in admin]
    assert events[:4] == ["key_created"] * 3 + ["server_start"]  # development keys first
    loaded = next(r for r in admin if r["event"] == "rule_pack_loaded")
    assert loaded["policy_version"] == version
    rejected = next(r for r in admin if r["event"] == "rule_pack_rejected")
    assert "bad.yaml:2: -: yaml: not valid YAML" in rejected["reason"]


def gateway_of_its_own(tight_server, tmp_path, env: dict[str, str] | None = None) -> Server:
    """A gateway process with an embedded Valkey of its own, which a test may kill, in front
    of the shared tight server's engine (no model loaded for one test: ~8 s of start-up).
    Its rules are the engine's, so that it uses its response cache: a gateway whose rules
    are another version never does."""
    return start_server(tmp_path, "--role", "gateway", "--engine", tight_server.engine_target,
                        "--rules", str(tight_server.rules),
                        env={"FINSIEVE_ENGINE_SECRET_FILE": str(tight_server.engine_secret_file),
                             **(env or {})})


def test_requests_are_refused_when_the_audit_trail_is_down(tight_server, tmp_path):
    srv = gateway_of_its_own(tight_server, tmp_path)
    try:
        # A key verified just before Redis went away stays good (nothing can be revoked
        # meanwhile); a request is then refused for want of its audit record.
        run_requests(srv.target, [tagged("before", "Say hi.", max_tokens=1)])
        valkey = next(json.loads(line)["pid"] for line in srv.log().splitlines()
                      if '"embedded valkey started"' in line)
        os.kill(valkey, signal.SIGKILL)
        events = run_requests(srv.target, [tagged("down", "Say hi.", max_tokens=4)])["down"]
        # The engine runs while the record is written; nothing it made reached the client.
        assert [e.WhichOneof("event") for e in events] == ["error"]
        error = events[0]
        assert error.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "audit trail is unavailable" in error.error.message
    finally:
        srv.stop()
    assert free_port()  # the server stopped cleanly enough to leave the machine usable


NO_RATE_LIMITS = {"FINSIEVE_TENANT_REQUESTS_PER_S": "0", "FINSIEVE_TENANT_TOKENS_PER_MIN": "0"}
ENGINE_TOKENS = "finsieve_generated_tokens_total"


async def _held_up(srv: Server, tight_server, stream, request, pause_s: float = 2.0):
    """Send `request` while the gateway's Valkey holds every write for pause_s (under the
    gateway's 3 s socket timeout): how long after the pause its first event came (negative:
    before), the engine's generated tokens just before the pause ended less those at its
    start, and the request's events."""
    await asyncio.to_thread(_engine_idle, tight_server)
    db = srv.valkey()
    try:
        before = await asyncio.to_thread(tight_server.metric, ENGINE_TOKENS)
        await db.execute_command("CLIENT", "PAUSE", int(pause_s * 1000), "WRITE")
        paused_until = time.monotonic() + pause_s
    finally:
        await db.aclose()
    stream.send(request)
    arrived: list[float] = []
    first = asyncio.ensure_future(stream.next())
    first.add_done_callback(lambda _: arrived.append(time.monotonic()))
    await asyncio.sleep(max(paused_until - 0.3 - time.monotonic(), 0))
    during = await asyncio.to_thread(tight_server.metric, ENGINE_TOKENS) - before
    await first
    events = (await stream.until_done(request.request_id))[request.request_id]
    return arrived[0] - paused_until, during, events


def _engine_idle(tight_server) -> None:
    """Until the engine holds no request and its token count has settled (a request's last
    token may be counted just after its events left)."""
    counted = -1.0

    def settled() -> bool:
        nonlocal counted
        busy = any(tight_server.metric(f"finsieve_engine_{queue}") for queue in ("running", "waiting"))
        before, counted = counted, tight_server.metric(ENGINE_TOKENS)
        return not busy and counted == before

    wait_for(settled, every=0.2)


def _records(srv: Server, request_id: str, n: int) -> list[dict]:
    """The request's records once there are n (the final one is written after its last event)."""
    wait_for(lambda: len(records_for(srv.audit_target, request_id)) >= n, every=0.05)
    return records_for(srv.audit_target, request_id)


def test_nothing_reaches_the_client_before_its_request_started_record_is_in(tight_server, tmp_path):
    """The record is written while the engine runs the request: with Valkey holding every
    write (rate limits off, the key verified before), the engine generates meanwhile, its
    events wait for the record, and the trail has it before the answer's."""
    srv = gateway_of_its_own(tight_server, tmp_path, NO_RATE_LIMITS)

    async def go():
        async with ChatStream(srv.target) as stream:
            stream.send(tagged("warm", "Say hi.", max_tokens=1))  # the key, verified and cached
            await stream.until_done("warm")
            return await _held_up(srv, tight_server, stream,
                                  tagged("held", "Name one kind of bond.", max_tokens=6))

    try:
        after_pause, during, events = asyncio.run(go())
        records = _records(srv, "held", 2)
    finally:
        srv.stop()
    assert during > 0  # the engine worked on it while its record was held up
    assert after_pause >= -0.01  # and nothing came before the writes were let through
    assert events[-1].finished.finish_reason == chat_pb2.FINISH_REASON_LENGTH
    assert [r["type"] for r in records] == ["request_started", "request"]
    assert int(events[-1].finished.audit_id) == records[0]["seq"]


def test_after_a_failed_audit_write_records_are_written_before_engines_start(tight_server, tmp_path):
    """A trail that fails must not cost the engines the work of the requests it refuses: for
    a while after a failed write the record goes in first, then the engine starts."""
    srv = gateway_of_its_own(tight_server, tmp_path, NO_RATE_LIMITS)

    async def go():
        async with ChatStream(srv.target) as stream:
            stream.send(tagged("warm", "Say hi.", max_tokens=1))
            await stream.until_done("warm")
            db = srv.valkey()
            try:
                await db.config_set("maxmemory", 1)  # every write refused (OOM): the record too
                stream.send(tagged("refused", "Say hi.", max_tokens=4))
                refused = (await stream.until_done("refused"))["refused"]
            finally:
                await db.config_set("maxmemory", 0)
                await db.aclose()
            held = await _held_up(srv, tight_server, stream,
                                  tagged("after", "Name one kind of bond.", max_tokens=6))
            return refused, held

    try:
        refused, (after_pause, during, events) = asyncio.run(go())
        records = _records(srv, "after", 2)
    finally:
        srv.stop()
    assert [e.WhichOneof("event") for e in refused] == ["error"]
    assert refused[0].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert during == 0  # the engine had not started it while its record was held up
    assert after_pause >= -0.01
    assert events[-1].finished.finish_reason == chat_pb2.FINISH_REASON_LENGTH
    assert [r["type"] for r in records] == ["request_started", "request"]


def test_with_audit_fail_open_a_redis_failure_is_served_uncached(tight_server, tmp_path):
    srv = gateway_of_its_own(tight_server, tmp_path, {"FINSIEVE_AUDIT_FAIL_OPEN": "true"})
    try:
        run_requests(srv.target, [tagged("before", "Say hi.", max_tokens=1)])  # key verified
        valkey = next(json.loads(line)["pid"] for line in srv.log().splitlines()
                      if '"embedded valkey started"' in line)
        os.kill(valkey, signal.SIGKILL)
        req = tagged("open-1", "Name one kind of bond.", max_tokens=8)
        first = run_requests(srv.target, [req])["open-1"]
        req.request_id = "open-2"
        second = run_requests(srv.target, [req])["open-2"]
    finally:
        srv.stop()
    for events in (first, second):
        assert events[-1].finished.finish_reason == chat_pb2.FINISH_REASON_LENGTH
        assert not events[0].started.cache_hit
    assert text_of(first) == text_of(second) != ""
    assert "cache lookup failed; serving uncached" in srv.log()


def test_failed_requests_are_audited_and_verify_exits_1_at_a_broken_record(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    srv = start_server(tmp_path, "--role", "gateway", "--engine", dead)
    try:
        events = run_requests(srv.target, [tagged("err-1", "Hello?", max_tokens=4)])["err-1"]
        assert events[-1].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        _, final = records_for(srv.audit_target, "err-1")
        assert final["finish_reason"] == "ERROR" and dead in final["error"]["message"]
        assert final["error"]["code"] == grpc.StatusCode.UNAVAILABLE.value[0]

        def verify() -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "finsieve.app.cli", "audit", "verify",
                                   "--target", srv.audit_target, "--state-dir", str(srv.state)],
                                  capture_output=True, text=True, timeout=60)

        assert verify().returncode == 0
        async def tamper():
            client = srv.valkey()
            rec = json.loads(await client.get(record_key(final["seq"])))
            rec["delivered"] = "something else"
            await client.set(record_key(final["seq"]), json.dumps(rec))
            await client.aclose()

        asyncio.run(tamper())
        broken = verify()
        assert broken.returncode == 1
        assert f"BROKEN at record {final['seq']}" in broken.stdout and "altered" in broken.stdout
    finally:
        srv.stop()


def test_a_gateway_records_a_pack_its_engine_loaded_before_they_met(tight_server, tmp_path):
    """A gateway that reaches an engine after the engine reloaded its rules records the pack
    in force (it used to take the engine's count then as its baseline: a change never told)."""
    loaded = tight_server.metric("finsieve_rule_pack_reloads_total", result="loaded")
    (tight_server.rules / "met-later.yaml").write_text(
        "rules:\n  - id: met-later\n    description: d\n    kind: literal\n"
        "    patterns: [quokka]\n    action: block\n")
    try:
        assert wait_for(lambda: tight_server.metric(
            "finsieve_rule_pack_reloads_total", result="loaded") > loaded, 30, 0.1)
        gateway = start_server(tmp_path, "--role", "gateway", "--engine", tight_server.engine_target,
                               env={"FINSIEVE_ENGINE_SECRET_FILE": str(tight_server.engine_secret_file)})
        try:
            def admin() -> list[dict]:
                page = audit_stub(gateway.audit_target,
                                  lambda s: s.Query(audit_pb2.AuditQuery(page_size=1000)))
                return [r for r in map(json.loads, (r.json for r in page.records))
                        if r["type"] == "admin" and r["event"] == "rule_pack_loaded"]

            assert wait_for(lambda: admin(), 30, 0.2)
            assert admin()[0]["engine"] == tight_server.engine_target
        finally:
            gateway.stop()
    finally:
        loaded = tight_server.metric("finsieve_rule_pack_reloads_total", result="loaded")
        (tight_server.rules / "met-later.yaml").unlink()  # the shared server's pack, as it was
        assert wait_for(lambda: tight_server.metric(
            "finsieve_rule_pack_reloads_total", result="loaded") > loaded, 30, 0.1)
