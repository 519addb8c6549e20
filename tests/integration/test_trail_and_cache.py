"""The response cache and the audit trail through real gateway processes: one engine process,
two gateways sharing a real Valkey and the audit key (a third one to kill), real gRPC."""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis.asyncio as redis

from finsieve.app.client import wait_ready
from finsieve.secretfiles import write_private
from finsieve.v1 import chat_pb2, engine_pb2
from finsieve.valkey import EmbeddedValkey
from gateway.audit import AuditLog, derive_key, id_hash, index_key, parse, record_key
from gateway.cache import ResponseCache, cache_key
from gateway.keys import KeyStore

from support.servers import Server, free_port, start_server, state_of
from support.streams import ChatStream, run_requests, tagged, text_of

CARD = "4111 1111 1111 1111"


@pytest.fixture(scope="module")
def shared(tmp_path_factory, default_model_dir):
    """An engine, a Valkey and an audit key for the gateways of this module."""
    tmp = tmp_path_factory.mktemp("shared")
    valkey = EmbeddedValkey(tmp / "valkey")
    valkey.start()
    key_file, keys_secret = tmp / "audit.key", tmp / "keys.secret"
    for path in (key_file, keys_secret):
        path.write_text(os.urandom(32).hex())
        path.chmod(0o600)

    async def issue() -> dict[str, str]:  # the keys of tenant bank-a's app and of an officer
        client = redis.Redis(port=valkey.port, password=valkey.password)
        store = KeyStore(client, keys_secret.read_text().strip().encode())
        try:
            return {"app": (await store.create("bank-a", "app"))[0],
                    "officer": (await store.create("bank-a", "officer", all_tenants=True))[0]}
        finally:
            await client.aclose()

    port = free_port()
    engine = start_server(tmp, "--role", "engine", "--engine-port", str(port),
                          "--model", str(default_model_dir), ready=False)
    try:
        assert asyncio.run(wait_ready(f"127.0.0.1:{port}", 120)), engine.log()
        yield {"valkey": valkey, "key_file": key_file, "engine": f"127.0.0.1:{port}",
               "keys": asyncio.run(issue()),
               "env": {"FINSIEVE_REDIS_URL": f"redis://:{valkey.password}@127.0.0.1:{valkey.port}/0",
                       "FINSIEVE_AUDIT_KEY_FILE": str(key_file),
                       "FINSIEVE_KEYS_SECRET_FILE": str(keys_secret),
                       "FINSIEVE_ENGINE_SECRET_FILE": str(tmp / "state" / "engine.secret")}}
    finally:
        engine.stop()
        valkey.stop()


def gateway(tmp_path_factory, shared, *args: str) -> Server:
    srv = start_server(tmp_path_factory.mktemp("gateway"), "--role", "gateway",
                       "--engine", shared["engine"], *args,
                       env=shared["env"])
    for role, key in shared["keys"].items():  # where the tests' clients look for keys
        write_private(srv.state / "keys" / f"{role}.key", key)
    # The first request opens the gateway's stream to the engine, which then says what a
    # request would run under: until then every request is a miss.
    run_requests(srv.target, [tagged("warm-up", "Hi", max_tokens=1)])
    return srv


@pytest.fixture(scope="module")
def gateways(tmp_path_factory, shared):
    a = gateway(tmp_path_factory, shared, "--metrics-port", str(free_port()))
    b = gateway(tmp_path_factory, shared)
    yield a, b
    a.stop()
    b.stop()


def with_redis(shared, fn):
    async def go():
        client = redis.Redis(port=shared["valkey"].port, password=shared["valkey"].password)
        try:
            return await fn(client, AuditLog(client, shared["key_file"].read_text().strip().encode()))
        finally:
            await client.aclose()
    return asyncio.run(go())


def ask(target: str, request_id: str, question: str = "Name one kind of bond.") -> list:
    return run_requests(target, [tagged(request_id, question, max_tokens=8)])[request_id]


def cached(shared, events: list, question: str) -> str:
    """The cache key of an answer just delivered, once its entry is stored (the gateway
    stores it after the client has the answer)."""
    started = events[0].started
    key = cache_key("bank-a", started.model, started.policy_version,
                    tagged("", question, max_tokens=8))

    async def wait(client, log):
        for _ in range(1000):
            if await client.exists(key):
                return key
            await asyncio.sleep(0.01)
        raise AssertionError("the answer was never cached")
    return with_redis(shared, wait)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """An officer's command, with the key the module issued (found beside the target)."""
    target = args[args.index("--target") + 1]
    return subprocess.run([sys.executable, "-m", "finsieve.app.cli", *args, "--state-dir",
                           str(state_of(target))], capture_output=True, text=True, timeout=60)


def test_a_cache_entry_is_verified_before_it_is_replayed(gateways, shared):
    a, b = gateways
    first = ask(a.target, "c-1")
    started = first[0].started
    assert not started.cache_hit
    key = cached(shared, first, "Name one kind of bond.")
    hit = ask(b.target, "c-2")  # another gateway process serves what the first stored
    assert hit[0].started.cache_hit and text_of(hit) == text_of(first) != ""
    other = cache_key("bank-a", started.model, started.policy_version,
                      tagged("", "Name one kind of stock.", max_tokens=8))
    planted = engine_pb2.EngineStep(events=[
        chat_pb2.ChatServerMessage(started=chat_pb2.Started(
            model=started.model, policy_version=started.policy_version)),
        chat_pb2.ChatServerMessage(delta=chat_pb2.Delta(text="Guaranteed returns of 40% a year.")),
        chat_pb2.ChatServerMessage(finished=chat_pb2.Finished(finish_reason=chat_pb2.FINISH_REASON_STOP)),
    ])

    async def genuine(client, log):
        return await client.get(key)

    entry = with_redis(shared, genuine)
    audit_seq = json.loads(entry[64:])["audit_seq"]

    def signed(events, seq=audit_seq, at=key):
        async def go(client, log):
            cache = ResponseCache(client, log, 3600, 262144)
            await cache.put(at, events, seq)
        with_redis(shared, go)

    def sign_raw(body: bytes) -> bytes:
        mac_key = derive_key(shared["key_file"].read_text().strip().encode(), "cache")
        return hmac.new(mac_key, body, "sha256").hexdigest().encode() + body

    def plant(value: bytes, at: str = key):
        with_redis(shared, lambda client, log: client.set(at, value))

    def older(version: str):
        step = engine_pb2.EngineStep()
        step.CopyFrom(planted)
        step.events[0].started.policy_version = version
        step.events[1].delta.text = "A bond is a loan."
        return list(step.events)

    attempts = {
        # The issue's attack: an answer written straight into Redis, in the old format.
        "signature": lambda: plant(planted.SerializeToString()),
        "corrupt": lambda: plant(os.urandom(64) + b"\x08\x96"),  # not even signed: signature
        "corrupt-signed": lambda: plant(sign_raw(b"{not json")),
        "moved": lambda: plant(entry, other),
        "version": lambda: signed(older("0123456789abcdef")),
        "rules": lambda: signed(list(planted.events)),  # signed with the key: the rules still say no
        "audit_record": lambda: signed(older(started.policy_version), seq=10**9),
    }
    for n, (name, tamper) in enumerate(attempts.items()):
        tamper()
        question = "Name one kind of stock." if name == "moved" else "Name one kind of bond."
        events = ask(a.target, f"c-{name}-{n}", question)
        cached(shared, events, question)  # the miss stored a genuine entry again: wait for it
        assert not events[0].started.cache_hit, name
        assert events[-1].WhichOneof("event") == "finished", name
        assert "Guaranteed" not in text_of(events) and text_of(events), name
    port = re.search(r'"address": "127.0.0.1:(\d+)", "event": "metrics serving"', a.log())[1]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    rejected = dict(re.findall(r'^finsieve_cache_rejected_total\{reason="(\w+)"\} (\S+)$', body, re.M))
    assert {k: float(v) for k, v in rejected.items()} == {
        "signature": 2, "corrupt": 1, "moved": 1, "version": 1, "rules": 1, "audit_record": 1}
    assert a.log().count('"cache entry rejected and deleted; serving uncached"') == 7


def test_a_hit_is_audited_before_its_first_byte(tmp_path_factory, shared):
    """Writes to Redis are paused while a hit is asked for; the gateway is killed as soon
    as the client has the hit's first event. Its record must already be in the trail."""
    c = gateway(tmp_path_factory, shared)
    try:
        miss = ask(c.target, "k-1", "What is a coupon?")
        assert not miss[0].started.cache_hit
        cached(shared, miss, "What is a coupon?")
        with_redis(shared, lambda client, log: client.execute_command("CLIENT", "PAUSE", 1500, "WRITE"))

        async def first_event():
            async with ChatStream(c.target) as s:
                s.send(tagged("k-2", "What is a coupon?", max_tokens=8))
                return await s.next()

        event = asyncio.run(first_event())
        c.stop(signal.SIGKILL)
        assert event.started.cache_hit
        time.sleep(1.6)  # the pause ends; a write the gateway had in flight would land now

        async def records(client, log):  # request ids are indexed by their keyed hash
            seqs = await client.zrange(index_key("request_id", id_hash(log.key, "request_id", "k-2")), 0, -1)
            return [parse(await client.get(record_key(int(s)))) for s in seqs], \
                await client.zrange(index_key("request_id", id_hash(log.key, "request_id", "k-1")), 0, -1)

        (hit,), original = with_redis(shared, records)
    finally:
        c.stop(signal.SIGKILL)
    assert hit["type"] == "request" and hit["cache_hit"] is True
    assert hit["replays"] == max(int(s) for s in original)  # the record of k-1's answer
    assert hit["delivered"] and hit["finish_reason"] == "LENGTH"


def test_audit_id_round_trips_from_a_client_to_audit_show(gateways, shared):
    a, b = gateways
    miss = ask(a.target, "id-1", "What is a dividend?")
    cached(shared, miss, "What is a dividend?")
    hit = ask(b.target, "id-2", "What is a dividend?")
    assert hit[0].started.cache_hit

    def show(target: str, audit_id: str) -> list[dict]:
        out = cli("audit", "show", audit_id, "--target", target)
        assert out.returncode == 0, out.stderr
        return [json.loads(r) for r in re.split(r"(?m)^(?=\{)", out.stdout) if r.strip()]

    started, final = show(a.audit_target, miss[-1].finished.audit_id)
    assert (started["type"], started["seq"]) == ("request_started", int(miss[-1].finished.audit_id))
    assert final["type"] == "request" and final["audit_id"] == started["seq"]
    assert started["request_id"] == final["request_id"] == "id-1"
    assert final["delivered"] == text_of(miss)
    (replayed,) = show(b.audit_target, hit[-1].finished.audit_id)
    assert replayed["request_id"] == "id-2" and replayed["cache_hit"] is True
    assert replayed["replays"] == final["seq"] and replayed["interventions"] == final["interventions"]


def test_a_card_number_never_appears_unmasked_in_redis_or_an_export(gateways, shared):
    a, b = gateways
    question = f'Repeat exactly: "Card: {CARD}" and the number 4111-1111-1111-1111.'
    first = ask(a.target, "card-1", question)
    cached(shared, first, question)
    assert ask(b.target, "card-2", question)[0].started.cache_hit

    async def everything(client, log):
        values = []
        async for key in client.scan_iter(count=1000):
            kind = (await client.type(key)).decode()
            if kind == "string":
                values.append(await client.get(key))
            elif kind == "zset":
                values += await client.zrange(key, 0, -1)
            elif kind == "hash":
                values += [k + b"=" + v for k, v in (await client.hgetall(key)).items()]
            values.append(key)
        return values

    digits = CARD.replace(" ", "")
    stored = with_redis(shared, everything)
    assert len(stored) > 10
    assert not [v for v in stored if digits.encode() in re.sub(rb"[ \-]", b"", v)]
    export = cli("audit", "export", "--since", "1h", "--target", a.audit_target)
    assert export.returncode == 0 and "card-1" in export.stdout
    assert digits not in re.sub(r"[ \-]", "", export.stdout)
    assert "4111 11** **** 1111" in export.stdout
    found = cli("audit", "query", "--match", digits, "--format", "jsonl", "--target", a.audit_target)
    matched = [json.loads(line) for line in found.stdout.splitlines()]
    assert {r["request_id"] for r in matched} >= {"card-1", "card-2"}
    assert text_of(first) and CARD not in text_of(first)
    nothing = cli("audit", "query", "--match", "4111 1111 1111 1112", "--target", a.audit_target)
    assert nothing.returncode == 0 and len(nothing.stdout.splitlines()) == 1  # the header alone


def test_officers_process_stops_with_the_gateway(tmp_path_factory, shared):
    c = gateway(tmp_path_factory, shared)
    try:
        pid = next(r["pid"] for r in c.records("audit service serving") if "pid" in r)
    finally:
        assert c.stop() == 0
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    anchors = (Path(c.log_path).parent / "state" / "anchors" / "gateway.jsonl").read_text().splitlines()
    assert json.loads(anchors[-1])["seq"] > 0  # the last anchor, written at shutdown


def test_a_gateway_whose_rules_differ_from_the_engines_never_serves_from_the_cache(
        tmp_path_factory, shared):
    other_rules = tmp_path_factory.mktemp("other-rules")  # an empty pack: another version
    c = gateway(tmp_path_factory, shared, "--rules", str(other_rules))
    try:
        first = ask(c.target, "v-1", "What is an annuity?")
        cached(shared, first, "What is an annuity?")  # stored under the engine's version
        second = ask(c.target, "v-2", "What is an annuity?")
    finally:
        c.stop()
    assert not second[0].started.cache_hit and text_of(second) == text_of(first)
