"""Issue 42's smaller findings, each against the real parts: secrets in Redis URLs, CSV cells
a spreadsheet would run, index entries past the chain head, the cache miss of a repeated
request, the rollback bound and a rules file caught half-written."""

from __future__ import annotations

import asyncio
import csv
import io
import re
import subprocess
import sys
import time
import unicodedata

import pytest
import redis.asyncio as redis

from finsieve.app.client import chat_request
from finsieve.display import cell, write_csv
from finsieve.valkey import redact
from gateway.audit import TIME, AuditLog, index_key, index_member
from gateway.audit_verify import verify

AUDIT_KEY = b"residue-audit-key-of-at-least-32-bytes"


# -- secrets in Redis URLs -------------------------------------------------------------------


@pytest.mark.parametrize("url, secret", [
    ("rediss://redis:6380/0?ssl_password=hunter2", "hunter2"),
    ("rediss://redis:6380/0?ssl_certfile=/c.pem&SSL_PASSWORD=hunter2&db=1", "hunter2"),
    ("redis://redis/0?sentinel_password=s3nt!nel", "s3nt!nel"),
    ("redis://redis/0?client_secret=abc%23def", "abc%23def"),
    ("redis://redis/0?x=1;auth_token=t0k3n", "t0k3n"),
    ("redis://redis/0?Token=t0k3n#frag", "t0k3n"),
    ("rediss://redis/0?ssl_pass%77ord=hunter2", "hunter2"),  # redis-py decodes the name
    ("rediss://user:pw@redis/0?ssl_password=hunter2", "hunter2"),
    ("unix:///run/r.sock?ssl_password=hun#ter2&db=0", "hun#ter2"),
    ("redis://u:pw@redis/0?token=se@cret", "cret"),  # an '@' in a value is no user part's end
    ("redis://redis/0?password=a;b", ";b"),  # parse_qsl splits on '&' only: the value is a;b
    ("redis+sentinel://:pw@s1:26379,s2/main?sentinel_password=a@b@c", "b@c"),
])
def test_every_secret_bearing_query_parameter_is_masked(url, secret):
    masked = redact(url)
    assert secret not in masked and "=***" in masked
    assert "redis" in masked or "r.sock" in masked  # still says where


def test_a_url_without_secrets_is_shown_as_written():
    url = "rediss://redis.bank:6380/2?ssl_certfile=/etc/c.pem&ssl_cert_reqs=required&db=2"
    assert redact(url) == url


def test_a_redis_url_s_ssl_password_is_masked_in_the_cli_s_connect_error(tmp_path):
    """The CLI's own error path (`keys create --direct` cannot reach Redis) names the URL,
    masked; `serve`'s `redis connected` line goes through the same `redact`."""
    for name in ("keys.secret", "audit.key"):
        (tmp_path / name).write_text("k" * 64)
        (tmp_path / name).chmod(0o600)
    url = "rediss://127.0.0.1:1/0?ssl_password=hunter2-the-passphrase"
    out = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "keys", "create", "--direct",
                          "--tenant", "t", "--role", "admin", "--state-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "FINSIEVE_REDIS_URL": url})
    assert out.returncode == 1 and "cannot connect" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert "127.0.0.1:1/0?ssl_password=***" in out.stderr
    assert "hunter2-the-passphrase" not in out.stdout + out.stderr


# -- CSV cells -------------------------------------------------------------------------------


def runs_as_formula(text: str) -> bool:
    """What a spreadsheet does with a cell: leading whitespace skipped, full-width forms read
    as their ASCII selves, then OWASP's list (=, +, -, @, tab, carriage return)."""
    rest = text.lstrip(" \u00a0\u3000")
    return bool(rest) and unicodedata.normalize("NFKC", rest[0]) in "=+-@\t\r"


@pytest.mark.parametrize("value", [
    "=1+1", "+1", "-1", "@SUM(A1)", " =1+1", "   +cmd", "\u00a0-2", "\u3000@x", "\t=1+1",
    "\r=1+1", "\n=1+1", " \t=1", "\uff1dHYPERLINK(\"http://x\")", "\ufe66cmd", "\t", "\r",
])
def test_a_cell_a_spreadsheet_would_run_is_neutralized(value):
    assert runs_as_formula(value) or value.startswith("\n")  # the cases are real
    out = cell(value)
    assert not runs_as_formula(out), out
    assert not any(c in out for c in "\t\r\n")  # shown as \u0009, \u000d, \u000a
    if value.lstrip(" \u00a0\u3000")[0] not in "\t\r\n":
        assert out.startswith("'"), out


@pytest.mark.parametrize("value", ["plain", " leading space", "a=b", "x-1", "'quoted", ""])
def test_a_harmless_cell_is_kept(value):
    assert cell(value) == value


def test_csv_rows_quote_every_field_so_no_separator_starts_a_cell():
    out = io.StringIO()
    write_csv(out, ("a", "b"), [{"a": "x;=cmd|' /C calc'!A0", "b": " =1+1"}])
    lines = out.getvalue().splitlines()
    assert lines[1] == '"x;=cmd|\' /C calc\'!A0","\' =1+1"'
    for row in csv.reader(io.StringIO(out.getvalue()), delimiter=";"):  # a ';' locale
        assert not any(runs_as_formula(f) for f in row), row


def test_audit_query_csv_neutralizes_a_user_with_a_leading_space(server):
    """End to end: a client's metadata user ` =HYPERLINK(..)` comes back as a text cell."""
    from support.streams import ChatStream

    req = chat_request("residue-csv", "Say hi.", max_tokens=1)
    req.metadata["user"] = " =HYPERLINK(\"http://x\")"

    async def go():
        async with ChatStream(server.target) as s:
            s.send(req)
            await s.until_done("residue-csv")
    asyncio.run(go())
    out = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "audit", "query", "--request-id",
                          "residue-csv", "--format", "csv", "--target", server.audit_target,
                          "--state-dir", str(server.state)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert rows and all(r["user"] == "' =HYPERLINK(\"http://x\")" for r in rows), rows


# -- index entries past the chain head -------------------------------------------------------


def _with_log(valkey, fn):
    async def go():
        client = redis.Redis(port=valkey.port, password=valkey.password)
        try:
            return await fn(AuditLog(client, AUDIT_KEY), client)
        finally:
            await client.aclose()
    return asyncio.run(go())


@pytest.mark.parametrize("index", [index_key("user", "u1"), index_key("request_id", "r-new"), TIME])
def test_verify_reports_an_index_entry_beyond_the_head(valkey, index):
    async def go(log, client):
        for i in range(5):
            await log.append("request", {"request_id": f"r{i}", "user": f"u{i % 2}"})
        assert (await verify(log)).ok
        # Tampering with write access to Redis: a record 9 that the chain never had.
        await client.zadd(index, {index_member(9): int(time.time() * 1000)})
        return await verify(log), await verify(log, since_ms=1, until_ms=int(time.time() * 1000) + 1)

    full, ranged = _with_log(valkey, go)
    name = index.removeprefix("{finsieve-audit}:")
    assert not full.ok and full.first_bad_seq == 9, full
    assert f"the index {name} lists record 9, beyond the chain head (record 5)" in full.reason
    if index == TIME:  # a time range is read through the time index
        assert not ranged.ok and f"{name} lists record 9, beyond the chain head" in ranged.reason


def test_records_appended_during_a_verify_are_not_beyond_the_head(valkey):
    async def go(log, client):
        for i in range(30):
            await log.append("request", {"request_id": f"r{i}", "user": "u"})

        async def keep_appending():
            for i in range(30):
                await log.append("request", {"request_id": f"late{i}", "user": "u"})
        writer = asyncio.create_task(keep_appending())
        verdicts = []
        while not writer.done():
            verdicts.append(await verify(log))
        await writer
        return verdicts

    verdicts = _with_log(valkey, go)
    assert verdicts and all(v.ok for v in verdicts), [v.reason for v in verdicts if not v.ok]


# -- finding 8: a repeated seeded request with an external Redis ----------------------------


def _metric(url: str, name: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


@pytest.mark.slow  # a server of its own: ~80 s on two shared cores
def test_a_repeat_sent_as_soon_as_the_answer_arrives_is_a_cache_hit(tmp_path, valkey,
                                                                      default_model_dir):
    """Finding 8, reproduced: an external Redis (`FINSIEVE_REDIS_URL`), an app key made with
    `keys create --direct`, `serve --role all`. The gateway stores an answer after the
    client has its last event (the audit record first, then the entry): a repeat that
    arrived before both writes landed was a miss, and was with a Redis a few milliseconds
    away. Here Valkey itself holds the writes (CLIENT PAUSE WRITE, as a slow or distant
    Redis would) from before the answer ends until the repeat has been looked up."""
    from gateway.cache import cache_key

    from support.servers import free_port, start_server
    from support.streams import ChatStream

    metrics = free_port()
    env = {"FINSIEVE_REDIS_URL": f"redis://:{valkey.password}@127.0.0.1:{valkey.port}/0",
           # No rate or stream limits: the repeat's path to its lookup writes nothing.
           "FINSIEVE_TENANT_REQUESTS_PER_S": "0", "FINSIEVE_TENANT_TOKENS_PER_MIN": "0",
           "FINSIEVE_TENANT_CONCURRENT_STREAMS": "0", "FINSIEVE_KEY_CACHE_S": "600",
           "FINSIEVE_CACHE_STORE_WAIT_MS": "30000"}
    srv = start_server(tmp_path, "--role", "all", "--model", str(default_model_dir),
                       "--metrics-port", str(metrics), env=env)
    metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    try:
        made = subprocess.run([sys.executable, "-m", "finsieve.app.cli", "keys", "create", "--direct",
                               "--tenant", "bank-r", "--role", "app", "--state-dir", str(srv.state)],
                              capture_output=True, text=True, timeout=60,
                              env={**__import__("os").environ, **env})
        assert made.returncode == 0, made.stderr
        key = made.stdout.splitlines()[0]

        def ask(rid: str):
            return chat_request(rid, "Name three colours.", max_tokens=12, temperature=0.7, seed=42)

        async def go():
            client = redis.Redis(port=valkey.port, password=valkey.password)
            try:
                async with ChatStream(srv.target, key) as s:
                    # Another question: opens the gateway's stream to its engine.
                    s.send(chat_request("warm-up", "Hi", max_tokens=1))
                    await s.until_done("warm-up")
                    s.send(ask("first"))
                    while not any(e.request_id == "first" and e.WhichOneof("event") == "delta"
                                  for e in s.events):
                        await s.next()
                    await client.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
                    try:
                        first = (await s.until_done("first"))["first"]
                        started = first[0].started
                        entry = cache_key("bank-r", started.model, started.policy_version, ask("x"))
                        assert not await client.exists(entry)  # its store is still held
                        looked_up = (await client.info("commandstats")).get(
                            "cmdstat_getrange", {}).get("calls", 0)
                        s.send(ask("repeat"))
                        deadline = time.monotonic() + 60
                        while time.monotonic() < deadline:  # until the repeat was looked up
                            stats = await client.info("commandstats")
                            if stats.get("cmdstat_getrange", {}).get("calls", 0) > looked_up or \
                                    _metric(metrics_url, "finsieve_cache_store_waiting") >= 1:
                                break
                            await asyncio.sleep(0.02)
                        else:
                            raise AssertionError("the repeat was never looked up")
                    finally:
                        await client.execute_command("CLIENT", "UNPAUSE")
                    repeat = (await s.until_done("repeat"))["repeat"]
                    return first, repeat
            finally:
                await client.aclose()

        first, repeat = asyncio.run(go())
        assert not first[0].started.cache_hit
        assert repeat[0].started.cache_hit, "the repeat was a cache miss"
        assert "".join(e.delta.text for e in repeat if e.HasField("delta")) == \
            "".join(e.delta.text for e in first if e.HasField("delta"))
        assert _metric(metrics_url, "finsieve_cache_store_waits_total") >= 1
    finally:
        srv.stop()


# -- the rollback bound, on the real model ---------------------------------------------------

# Any two words in a row: whatever the model is steered to after a rollback, it comes back
# to the blocked shape at once, so every request reaches the bound. The match always starts
# in an earlier token than the one that completes it: a rollback, never a resample.
TWO_WORDS = """\
rules:
  - id: two-words
    description: a phrase the model cannot stay away from
    kind: regex
    patterns: ['[a-z]+\\s+[a-z]+']
    max_span: 60
    action: block
"""


@pytest.fixture(scope="module")
def two_words(engine, tmp_path_factory):
    from finsieve.policy.guard import compile_policy
    from finsieve.policy.masks import TokenTable

    directory = tmp_path_factory.mktemp("two-words")
    (directory / "p.yaml").write_text(TWO_WORDS)
    return compile_policy(directory, TokenTable.build(engine.token_bytes), None)[0]


@pytest.mark.parametrize("bound", [0, 3])
def test_a_model_steered_back_to_a_blocked_phrase_halts_at_the_rollback_bound(
        engine, two_words, bound):
    from engine.engine import NO_POLICY
    from finsieve.v1 import chat_pb2

    engine.policy, engine.max_rollbacks = (lambda: two_words), bound
    try:
        events = engine.generate(chat_request("rb", 'Repeat exactly: "we offer great plans"',
                                              max_tokens=24))
    finally:
        engine.policy, engine.max_rollbacks = (lambda: NO_POLICY), 8
    interventions = [e.policy_event for e in events if e.WhichOneof("event") == "policy_event"]
    rollbacks = [i for i in interventions if i.rolled_back]
    assert events[-1].finished.finish_reason == chat_pb2.FINISH_REASON_CONTENT_FILTER, events[-1]
    assert len(rollbacks) == bound, [(i.action, i.rolled_back) for i in interventions]
    assert all(i.rule_id == "two-words" and i.tokens_recomputed >= 1 for i in rollbacks)
    assert len(interventions) == bound + 1  # and the halt, after the bound
    delivered = "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")
    assert not re.search(r"[a-z]+\s+[a-z]+", delivered.lower()), delivered


# -- hot reload of a rules file caught half-written ------------------------------------------

RULE = """\
rules:
  - id: {id}
    description: a test rule
    kind: literal
    patterns: [{pattern}, "{pattern} again"]
    action: block
"""


@pytest.mark.parametrize("cut, line", [
    ('patterns: [baz, "baz ag', 5),  # inside a quoted pattern: not YAML yet
    ("kind: lit", 4),  # inside a value: a rule with an unknown kind and no action
])
def test_a_rules_file_caught_half_written_is_refused_then_loaded_once_complete(
        tmp_path, cut, line):
    from finsieve.policy.pack import Pack
    from finsieve.policy.reload import RELOADS, PolicyHolder, RulesWatcher

    def compile_pack(directory):
        pack = Pack.load(directory)
        return pack, pack.version

    def until(condition) -> None:
        deadline = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < deadline, "the watcher did not act within 20 s"
            time.sleep(0.01)

    def rejections() -> float:
        return RELOADS.labels("rejected")._value.get()

    (tmp_path / "a.yaml").write_text(RULE.format(id="first", pattern="foo"))
    holder = PolicyHolder(*compile_pack(tmp_path))
    watcher = RulesWatcher(tmp_path, holder, compile_pack, debounce_ms=50)
    watcher.start()
    try:
        # The watcher is up once it loads a change: written again until it does, since a
        # write before its watch began is not seen (no sleep for it).
        def second_loaded() -> bool:
            if holder.current.rule("second") is not None:
                return True
            (tmp_path / "b.yaml").write_text(RULE.format(id="second", pattern="bar"))
            time.sleep(0.1)
            return False
        until(second_loaded)
        in_force, rejected = holder.version, rejections()

        whole = RULE.format(id="third", pattern="baz")
        head = whole[:whole.index(cut) + len(cut)]
        assert whole.startswith(head) and head != whole
        with (tmp_path / "c.yaml").open("w") as f:  # the writer has written half, not closed
            f.write(head)
            f.flush()
            until(lambda: holder.events[-1].kind == "rule_pack_rejected")
            assert holder.version == in_force and holder.current.rule("third") is None
            assert rejections() == rejected + 1
            reason = holder.events[-1].reason
            assert f"{tmp_path / 'c.yaml'}:{line}:" in reason, reason
            assert "b.yaml" not in reason and "a.yaml" not in reason
            f.write(whole[len(head):])  # the rest of the write
        until(lambda: holder.version != in_force)
        assert holder.current.rule("third") is not None
        assert holder.current.rule("first") is not None and holder.current.rule("second") is not None
        assert holder.events[-1].kind == "rule_pack_loaded"
    finally:
        watcher.stop()
