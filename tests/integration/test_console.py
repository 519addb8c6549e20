"""The officers' web console over real HTTP, on the session server (a real gateway, engine
and Valkey, its trail filled by real requests): login and its refusals, security headers and
cookie flags, CSRF, GET never changing anything, tenancy, review records, legal holds
against retention, exports, the regulator package verified offline, and the re-scan of a
draft pack. The same pages in a real browser, with axe-core: test_console_browser.py."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
import ssl
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from gateway.audit import AuditLog, Filters, sealed_ok
from gateway.console import holds

from support.console import (
    CONSOLE_USER,
    LOGIN,
    SESSION,
    ConsoleClient,
    console_alone,
    cookie_of,
    head_seq,
    new_key,
    records_after,
    trail,
)

SCRIPT = Path(__file__).resolve().parents[2] / "gateway" / "console" / "verify_package.py"


def key_id(key: str) -> str:
    return key.split("_")[1]


def officer(server) -> ConsoleClient:
    client = ConsoleClient(server.console_url)
    assert client.login(server.key("officer")).status_code == 303
    return client


def test_every_response_carries_the_security_headers_and_cookies_their_flags(server):
    client = ConsoleClient(server.console_url)
    form = client.http.get("/login")
    for response in (form, client.http.get("/static/console.css"), client.http.get("/nowhere")):
        h = response.headers
        assert h["content-security-policy"].startswith("default-src 'self'")
        assert "frame-ancestors 'none'" in h["content-security-policy"]
        assert "unsafe-inline" not in h["content-security-policy"]
        assert h["strict-transport-security"].startswith("max-age=")
        assert (h["x-content-type-options"], h["referrer-policy"]) == ("nosniff", "no-referrer")
        assert h["cache-control"] == "no-store"
    login = client.login(server.key("officer"))
    for response, name in ((form, LOGIN), (login, SESSION)):
        cookie = cookie_of(response, name)
        assert cookie is not None and name.startswith("__Host-")
        attributes = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
        assert {"secure", "httponly", "samesite", "path", "max-age"} <= attributes
        assert "domain" not in attributes
        assert "SameSite=Strict" in cookie and "Path=/;" in cookie
    assert "Max-Age=900;" in cookie_of(login, SESSION)  # FINSIEVE_CONSOLE_SESSION_S, short


def test_a_slow_head_or_body_is_cut_off_and_the_console_keeps_serving(server):
    """Slowloris, both ways at once: a request's head sent a byte at a time is cut off, and a
    login form's body that stops arriving gets 408, each within FINSIEVE_HTTP_READ_TIMEOUT_S
    (10 s on the session server). uvicorn alone waits for ever once a byte came, and the
    form's handler would wait for its body before any check, holding one of the console's
    few connections."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(server.console_url)
    started = time.monotonic()
    with socket.create_connection((url.hostname, url.port), timeout=30) as head, \
            socket.create_connection((url.hostname, url.port), timeout=30) as body:
        head.sendall(b"GET /login HTTP/1.1\r\nHost: x\r\n")
        body.sendall(b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\nkey=")
        head_closed, answer, body_answered = None, b"", None
        for _ in range(60):  # a header byte every 0.5 s, for at most 30 s
            if head_closed is None:
                try:
                    head.sendall(b"X")
                    head.settimeout(0.25)
                    if head.recv(1024) == b"":
                        head_closed = time.monotonic() - started
                except TimeoutError:
                    pass
                except OSError:  # reset: closed too
                    head_closed = time.monotonic() - started
            if body_answered is None:
                body.settimeout(0.25)
                try:
                    while chunk := body.recv(65536):
                        answer += chunk
                    body_answered = time.monotonic() - started  # answered, then closed
                except TimeoutError:
                    pass
            if head_closed is not None and body_answered is not None:
                break
    assert head_closed is not None and 9 < head_closed < 20
    assert body_answered is not None and 9 < body_answered < 20
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"connection: close" in answer.lower()
    assert ConsoleClient(server.console_url).http.get("/login").status_code == 200


def test_only_an_officer_key_logs_in_and_every_page_needs_a_session(server):
    for key, status in ((server.key("app"), 403), (server.key("admin"), 403),
                        ("fsk_0123456789abcdef_" + "ab" * 32, 401), ("not a key", 401)):
        client = ConsoleClient(server.console_url)
        response = client.login(key)
        assert response.status_code == status
        assert cookie_of(response, SESSION) is None and not client.session
        assert "officer key" in response.text or "not a valid key" in response.text
        assert client.get("/search").headers["location"] == "/login"
    client = ConsoleClient(server.console_url)
    client.session = "forged-session-token"
    for path in ("/search", "/queue", "/rules", "/history", "/holds", "/package", "/rescan",
                 "/export.csv", "/package.zip", "/conversation/1"):
        assert client.get(path).status_code == 303, path


def test_a_login_form_without_its_cookie_is_refused(server):
    client = ConsoleClient(server.console_url)
    token = client.http.get("/login").text.split('name="login_csrf" value="')[1].split('"')[0]
    response = client.http.post("/login", data={"login_csrf": token, "key": server.key("officer")})
    assert response.status_code == 403 and cookie_of(response, SESSION) is None


def test_a_post_without_its_csrf_token_or_from_another_site_changes_nothing(server, console_trail):
    client = officer(server)
    audit_id = console_trail["blocked"]
    before = len(trail(server, "subject", audit_id))
    good = {"decision": "reviewed", "comment": "csrf probe"}
    for csrf, headers in (("", {}), ("forged", {}), (None, {"origin": "https://evil.example"}),
                          (None, {"sec-fetch-site": "cross-site"})):
        response = client.post(f"/conversation/{audit_id}/review", good, csrf, headers)
        assert response.status_code == 403
    assert len(trail(server, "subject", audit_id)) == before
    assert client.post("/logout", {}, "forged").status_code == 403
    assert client.get("/search").status_code == 200  # still logged in


def test_get_never_changes_state(server, console_trail):
    client = officer(server)
    audit_id = console_trail["card"]
    start = head_seq(server)
    for path in (f"/conversation/{audit_id}/review?decision=closed&comment=x", "/holds/1/release",
                 "/logout", f"/conversation/{audit_id}", "/search?rule=payment-card-number", "/queue",
                 "/holds", "/rules", "/history", "/rescan", "/package"):
        assert client.get(path).status_code in (200, 405), path
    assert client.get(f"/conversation/{audit_id}/review").status_code == 405
    added = records_after(server, start)
    assert not [r for r in added if r["type"] in ("review", "hold")]
    # Only this officer's records: a record another test's answer left may land meanwhile.
    mine = [r for r in added if r.get("by") == key_id(server.key("officer"))]
    assert mine and {(r["type"], r["reader"]) for r in mine} == {("access", key_id(server.key("officer")))}
    assert client.get("/search").status_code == 200  # a GET of /logout logged nobody out


def test_page_views_and_exports_are_audit_records_found_in_who_looked(server, console_trail):
    client = officer(server)
    start = head_seq(server)
    assert client.get("/search", rule="payment-card-number", match="4111 1111 1111 1111").status_code == 200
    assert client.get("/export.csv", rule="payment-card-number").status_code == 200
    added = [r for r in records_after(server, start) if r.get("by") == key_id(server.key("officer"))]
    events = [r["event"] for r in added]
    assert events[:2] == ["console_search", "console_export"]
    search = added[0]
    assert search["filters"]["rule_id"] == "payment-card-number"
    assert "4111" not in json.dumps(search)  # the identifier only as its keyed hash
    assert search["filters"]["match"] in search.get("match_hashes", []) or search["filters"]["match"]
    history = client.get("/history").text
    assert f"seq {search['seq']}" in history and "console_export" in history


def test_an_officer_reads_its_own_tenant_only(server, console_trail):
    own = ConsoleClient(server.console_url)
    assert own.login(new_key(server, "t-console", "officer", name="tenant officer")).status_code == 303
    assert "console-blocked" not in own.get("/search").text  # tenant default's conversation
    assert own.get(f"/conversation/{console_trail['blocked']}").status_code == 404
    refused = own.get("/search", tenant="default")
    assert refused.status_code == 400 and "your own tenant" in refused.text
    assert own.get("/history", reader="everyone").status_code == 400
    everyone = officer(server)
    assert everyone.get(f"/conversation/{console_trail['blocked']}").status_code == 200
    assert everyone.get("/history", reader="everyone").status_code == 200


def test_each_search_field_is_checked_and_named(server):
    client = officer(server)
    for name, value in (("since", "yesterday"), ("rule", "Not A Rule!"), ("action", "explode"),
                        ("finish_reason", "BORED"), ("audit_id", "0123"), ("match", "--"),
                        ("page_size", "7"), ("after", "x.y"), ("tenant", "bad tenant"),
                        ("user", "u" * 300)):
        response = client.get("/search", **{name: value})
        assert response.status_code == 400, name
        assert f'href="#f-{name}"' in response.text, name
        assert "Traceback" not in response.text


def test_a_review_is_an_append_only_record_shown_with_the_conversation(server, console_trail):
    client = officer(server)
    audit_id = console_trail["blocked"]
    page = client.get(f"/conversation/{audit_id}").text
    assert "never delivered" in page and "Chain: ✓ verified" in page
    assert "guaranteed returns" in page.split("Never delivered:")[1][:200]  # what the model tried
    queued = []
    for decision in ("escalated", "reviewed"):  # escalated stays in the queue, reviewed leaves it
        response = client.post(f"/conversation/{audit_id}/review",
                               {"decision": decision, "comment": f"{decision}: card 4111 1111 1111 1111"})
        assert response.status_code == 303
        queued.append(client.get("/queue").text.count(f'href="/conversation/{audit_id}"'))
    assert queued == [1, 0]
    reviews = trail(server, "subject", audit_id)
    assert [r["decision"] for r in reviews][-2:] == ["escalated", "reviewed"]
    last = reviews[-1]
    assert (last["type"], last["by"], last["kind"]) == ("review", key_id(server.key("officer")), "review")
    assert "4111 1111 1111 1111" not in last["comment"]  # masked by the rules, like any stored text
    page = client.get(f"/conversation/{audit_id}").text
    assert page.count("escalated: card") == 1 and page.count("reviewed: card") == 1
    bad = client.post(f"/conversation/{audit_id}/review", {"decision": "approved", "comment": ""})
    assert bad.status_code == 400 and "decision" in bad.text


def test_exports_are_the_chained_records_and_neutralized_csv(server, console_trail):
    client = officer(server)
    jsonl = client.get("/export.jsonl", user=CONSOLE_USER)
    assert jsonl.headers["content-disposition"].startswith("attachment;")
    exported = [json.loads(line) for line in jsonl.text.splitlines()]
    assert {str(r["audit_id"]) for r in exported} >= set(console_trail.values())
    key = (server.state / "audit.key").read_bytes().strip()
    assert all(sealed_ok(key, r) for r in exported)
    rows = list(csv.DictReader(io.StringIO(client.get("/export.csv", user=CONSOLE_USER).text)))
    assert {r["audit_id"] for r in rows} >= set(console_trail.values())
    assert any("promissory" in r["rules"] for r in rows)


def test_the_regulator_package_verifies_offline_and_a_changed_record_does_not(server, console_trail,
                                                                              tmp_path):
    client = officer(server)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    response = client.get("/package.zip", since=today)
    assert response.status_code == 200, response.text[:500]
    package = tmp_path / "package.zip"
    package.write_bytes(response.content)
    key_file = server.state / "audit.key"

    def verify(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-I", str(SCRIPT), *args], capture_output=True, text=True)

    plain, keyed = verify(str(package)), verify(str(package), "--key-file", str(key_file))
    assert (plain.returncode, keyed.returncode) == (0, 0), plain.stdout + keyed.stdout
    assert "HMACs NOT checked" in plain.stdout and "every HMAC recomputed" in keyed.stdout
    with zipfile.ZipFile(package) as z:
        files = {n: z.read(n) for n in z.namelist()}
    name = next(n for n in files if n.endswith("records.jsonl") and "rules/" not in n)
    lines = files[name].splitlines()
    target = next(i for i, line in enumerate(lines) if b"console-blocked" in line)
    changed = json.loads(lines[target])
    changed["delivered"] = "We offer guaranteed returns."
    lines[target] = json.dumps(changed, sort_keys=True, separators=(",", ":")).encode()
    unpacked = tmp_path / "unpacked"
    for n, data in files.items():
        path = unpacked / n.split("/", 1)[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\n".join(lines) + b"\n" if n == name else data)
    manifest = json.loads((unpacked / "manifest.json").read_text())
    tampered = verify(str(unpacked), "--key-file", str(key_file))
    assert tampered.returncode == 1 and "records.jsonl was altered" in tampered.stdout
    manifest["files"]["records.jsonl"] = hashlib.sha256((unpacked / "records.jsonl").read_bytes()).hexdigest()
    (unpacked / "manifest.json").write_text(json.dumps(manifest))  # a forger redoes the digests too
    tampered = verify(str(unpacked), "--key-file", str(key_file))
    assert tampered.returncode == 1
    assert f"record {changed['seq']} was altered: its HMAC does not match" in tampered.stdout
    built = trail(server, "reader", key_id(server.key("officer")))[-1]
    assert built["event"] == "console_package_built" and len(built["manifest_sha256"]) == 64


def test_the_rescan_applies_a_draft_read_only_and_names_a_bad_one(server, console_trail):
    client = officer(server)
    draft = ("rules:\n  - id: draft-valid\n    description: a draft\n    kind: literal\n"
             "    patterns: [still valid]\n    scope: input\n    action: block\n")
    start = head_seq(server)
    page = client.post("/rescan", {"pack": draft, "user": CONSOLE_USER})
    assert page.status_code == 200
    assert "draft-valid" in page.text and f'href="/conversation/{console_trail["card"]}"' in page.text
    added = records_after(server, start)
    assert not [r for r in added if r["type"] in ("review", "hold")]
    assert {r["type"] for r in added if r.get("by") == key_id(server.key("officer"))} == {"access"}
    assert any(r["event"] == "console_rescan" and len(r["draft_sha256"]) == 64 for r in added)
    bad = client.post("/rescan", {"pack": "rules:\n  - id: x\n    kind: literal\n"})
    assert bad.status_code == 400 and "draft.yaml:" in bad.text


def test_a_legal_hold_keeps_its_records_from_retention_until_released(valkey):
    """On a Valkey of its own: records written at chosen times, a hold on the older ones,
    retention's cut honouring it, then its release."""
    import redis.asyncio as redis

    from finsieve.auth import Principal

    async def go() -> tuple[int, int, int]:
        client = redis.Redis(port=valkey.port, password=valkey.password)
        now = [1_000_000]
        log = AuditLog(client, b"k" * 32, clock_ms=lambda: now[0])
        for t in range(10):
            now[0] = 1_000_000 + t * 1000
            await log.append("request", {"tenant": "bank-a", "user": f"u{t}"})
        who = Principal("key1", "bank-a", "officer")
        now[0] = 1_050_000
        await holds.place(log, who, "case 7", "subpoena", Filters(1_003_000, 1_004_000, "bank-a"))
        cut = await holds.retention_cut(log, 1_040_000)
        trimmed_held = await log.trim(cut)
        hold = (await holds.holds(log))[0]
        await holds.release(log, who, hold, "case closed")
        trimmed_after = await log.trim(await holds.retention_cut(log, 1_040_000))
        await client.aclose()
        return cut, trimmed_held, trimmed_after

    cut, trimmed_held, trimmed_after = asyncio.run(go())
    assert cut == 1_003_000  # the hold's first record's time
    assert trimmed_held == 3  # records at 1_000_000..1_002_000 only
    assert trimmed_after == 7  # released: the rest of the old records go


def test_the_console_serves_tls_with_the_listeners_certificates_and_mtls_when_asked(valkey, certs,
                                                                                   tmp_path):
    """The console's own listener: TLS with the certificate every listener serves, never
    plaintext; with a client CA, a page only for a client certificate the CA signed."""
    tls = {"tls_cert": str(certs / "server.pem"), "tls_key": str(certs / "server.key")}
    trusted = str(certs / "ca.pem")

    async def get(port: int, client_cert: str = "") -> str:
        context = ssl.create_default_context(cafile=trusted)
        if client_cert:
            context.load_cert_chain(str(certs / f"{client_cert}.pem"), str(certs / f"{client_cert}.key"))
        try:
            async with httpx.AsyncClient(verify=context) as https:
                return str((await https.get(f"https://127.0.0.1:{port}/login")).status_code)
        except httpx.HTTPError:
            return "refused"

    async def plaintext(port: int) -> str:
        try:
            async with httpx.AsyncClient() as plain:
                await plain.get(f"http://127.0.0.1:{port}/login")
            return "served"
        except httpx.HTTPError:
            return "refused"

    async def go() -> list[str]:
        async with console_alone(valkey, tmp_path, **tls) as port:
            seen = [await get(port), await plaintext(port)]
        async with console_alone(valkey, tmp_path, **tls, tls_client_ca=trusted) as port:
            seen += [await get(port), await get(port, "client"), await get(port, "stranger")]
        return seen

    assert asyncio.run(go()) == ["200", "refused", "refused", "200", "refused"]


def test_an_address_naming_no_record_is_a_404_page(server):
    client = officer(server)
    for path in ("/conversation/0", "/conversation/" + "9" * 5000, "/conversation/x1",
                 "/conversation/99999999999999"):
        response = client.get(path)
        assert response.status_code == 404 and "Traceback" not in response.text, path
    assert client.post("/holds/" + "9" * 5000 + "/release", {"reason": "r"}).status_code == 404


def test_an_export_cut_short_by_its_bound_says_so_in_its_last_line(valkey, tmp_path):
    import redis.asyncio as redis

    from gateway.keys import KeyStore

    def export(port: int, key: str) -> list[str]:
        web = ConsoleClient(f"http://127.0.0.1:{port}")
        assert web.login(key).status_code == 303
        return web.get("/export.jsonl").text.splitlines()

    async def go() -> list[str]:
        client = redis.Redis(port=valkey.port, password=valkey.password)
        log = AuditLog(client, b"k" * 32)
        for user in ("u1", "u2", "u3"):
            await log.append("request", {"tenant": "t", "user": user, "finish_reason": "STOP"})
        key, _ = await KeyStore(client, b"s" * 32, 5.0, 100).create("t", "officer", "o", all_tenants=True)
        await client.aclose()
        async with console_alone(valkey, tmp_path, console_export_max=2) as port:
            return await asyncio.to_thread(export, port, key)

    lines = [json.loads(line) for line in asyncio.run(go())]
    assert [r.get("user") for r in lines[:2]] == ["u3", "u2"]  # newest first
    assert "stopped at its bound" in lines[2]["incomplete"] and len(lines) == 3


def test_a_console_port_in_use_stops_start_up_naming_the_setting():
    import socket

    from finsieve.errors import ConfigError
    from gateway.console.server import _listen

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        refused = rf"^FINSIEVE_CONSOLE_PORT {port} on 127\.0\.0\.1: cannot listen"
        with pytest.raises(ConfigError, match=refused):
            _listen("127.0.0.1", port)
