"""Issue 42's smaller findings, each against the real parts: secrets in Redis URLs, CSV cells
a spreadsheet would run, index entries past the chain head, the cache miss of a repeated
request, the rollback bound and a rules file caught half-written."""

from __future__ import annotations

import asyncio
import csv
import io
import subprocess
import sys
import time
import unicodedata

import pytest
import redis.asyncio as redis

from finsieve.client import chat_request
from finsieve.display import cell, write_csv
from finsieve.gateway.audit import TIME, AuditLog, index_key, index_member
from finsieve.gateway.audit_verify import verify
from finsieve.valkey import redact

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
    out = subprocess.run([sys.executable, "-m", "finsieve.cli", "keys", "create", "--direct",
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
    from conftest import ChatStream

    req = chat_request("residue-csv", "Say hi.", max_tokens=1)
    req.metadata["user"] = " =HYPERLINK(\"http://x\")"

    async def go():
        async with ChatStream(server.target) as s:
            s.send(req)
            await s.until_done("residue-csv")
    asyncio.run(go())
    out = subprocess.run([sys.executable, "-m", "finsieve.cli", "audit", "query", "--request-id",
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
