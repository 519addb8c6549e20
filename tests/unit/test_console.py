"""The console's parts without a server: the regulator package's verification script (standard
library only, the same bytes and MACs as the trail), interventions placed in the delivered
text, what officers type, cursors, rule diffs, and the same-site check of forms."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import sys
from types import ModuleType

import pytest

from finsieve.auth import Principal
from gateway.anchors import signed
from gateway.audit import canonical, derive_key, head_sig, seal, stored
from gateway.console.conversation import notes_of, pieces
from gateway.console.forms import Form, parse_time, search_filters
from gateway.console.http_guard import _same_origin
from gateway.console.rulebook import diff
from gateway.console.trail import Back

from support.paths import REPO

SCRIPT = REPO / "gateway" / "console" / "verify_package.py"
KEY = b"an-audit-key-of-at-least-32-bytes!!"


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("verify_package", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_verification_script_imports_the_standard_library_only():
    imported = set()
    for node in ast.walk(ast.parse(SCRIPT.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names


@pytest.mark.parametrize("record", [
    {"seq": 3, "prev": "ab", "type": "request", "ts_ms": 1, "delivered": "Ünïcödé ＄ 日本 \u202e",
     "latency_ms": {"total": 12.3, "first_delta": None}, "interventions": [{"start": 0, "end": 2}]},
    {"seq": 1, "prev": "", "type": "admin", "ts_ms": 2, "event": "x", "values": [1, 2.5, True, None]},
])
def test_the_script_computes_the_trails_bytes_and_macs(record):
    v = script()
    assert v.canonical(record) == canonical(record)
    assert v.seal(KEY, record) == seal(KEY, record)
    assert v.derive_key(KEY, "anchor") == derive_key(KEY, "anchor")


def chain(n: int) -> list[dict]:
    records, prev = [], ""
    for seq in range(1, n + 1):
        rec = {"seq": seq, "prev": prev, "type": "request", "ts_ms": seq, "tenant": f"t{seq % 2}"}
        rec["hmac"] = seal(KEY, rec)
        records.append(rec)
        prev = rec["hmac"]
    return records


def package(records: list[dict], anchors: list[dict] | None = None) -> dict[str, bytes]:
    files = {
        "records.jsonl": b"".join(stored(r).encode() + b"\n" for r in records),
        "anchors.jsonl": b"".join(json.dumps(a).encode() + b"\n" for a in anchors or []),
        "head.json": json.dumps({"seq": records[-1]["seq"], "hmac": records[-1]["hmac"],
                                 "sig": head_sig(KEY, records[-1]["seq"], records[-1]["hmac"])}).encode(),
        "checkpoint.json": b"null",
    }
    files["manifest.json"] = json.dumps({
        "format": "finsieve-regulator-package/1", "first_seq": records[0]["seq"],
        "last_seq": records[-1]["seq"],
        "files": {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}}).encode()
    return files


def test_an_intact_package_verifies_with_and_without_the_key():
    v = script()
    records = chain(6)
    anchors = [signed(KEY, 4, records[3]["hmac"], "host/gateway")]
    records[1] = {"seq": 2, "prev": records[1]["prev"], "hmac": records[1]["hmac"], "withheld": True}
    files = package(records, anchors)
    assert "1 anchors matched" in " ".join(v.verify(files))
    report = " ".join(v.verify(files, KEY))
    assert "every HMAC recomputed" in report and "1 withheld" in report


@pytest.mark.parametrize("tamper, fault", [
    (lambda r: r.pop(2), "record 3 is missing"),
    (lambda r: r.insert(1, r.pop(2)), "record 2 is missing"),
    (lambda r: r[3].update(tenant="t9"), "record 4 was altered"),
    (lambda r: r[4].update(prev="00" * 32), "record 5 does not link to record 4"),
])
def test_each_tampering_is_named_at_its_record(tamper, fault):
    v = script()
    records = chain(6)
    tamper(records)
    files = package(records)
    files["manifest.json"] = json.dumps({**json.loads(files["manifest.json"]), "last_seq": 6}).encode()
    with pytest.raises(v.Fault, match=fault):
        v.verify(files, KEY)


def test_an_anchor_from_elsewhere_pins_the_chain_and_a_forged_one_is_refused():
    v = script()
    records = chain(5)
    good = signed(KEY, 3, records[2]["hmac"], "host/gateway")
    v.verify(package(records), KEY, ("worm.jsonl", json.dumps(good).encode()))
    other = signed(KEY, 3, "ff" * 32, "host/gateway")  # the chain was rewritten since
    with pytest.raises(v.Fault, match=r"record 3 is not the record worm\.jsonl line 1 shows"):
        v.verify(package(records), None, ("worm.jsonl", json.dumps(other).encode()))
    forged = {**good, "sig": "00" * 32}
    with pytest.raises(v.Fault, match="not signed with this audit key"):
        v.verify(package(records), KEY, ("worm.jsonl", json.dumps(forged).encode()))


def test_interventions_are_placed_in_the_delivered_text():
    delivered = "We offer guarantees. Card 4111 11** **** 1111 ok"
    interventions = [
        {"rule_id": "promise", "action": "block", "start": 8, "end": 8, "rolled_back": True,
         "suppressed": "guaranteed returns", "scope": "output"},
        {"rule_id": "card", "action": "redact", "start": 26, "end": 45, "scope": "output"},
        {"rule_id": "stop", "action": "halt", "start": 999, "end": 999, "suppressed": "rest"},
        {"rule_id": "typed", "action": "redact", "start": 0, "end": 3, "scope": "input"},
    ]
    notes = notes_of(interventions, "output")
    assert [n.rule_id for n in notes] == ["promise", "card", "stop"]
    out = pieces(delivered, notes)
    assert "".join(p.text for p in out) == delivered  # nothing lost, nothing added
    marked = [(p.text, p.note.rule_id) for p in out if p.note is not None]
    assert marked == [("", "promise"), ("4111 11** **** 1111", "card"), ("", "stop")]
    assert out[0].text == "We offer" and out[-1].note.rule_id == "stop"  # a halt past the end: at the end
    assert notes[0].where(len(delivered)).startswith("at character 8 of 48")


def test_what_officers_type_is_checked_and_scoped_to_their_tenant():
    assert parse_time("2026-03-01") == 1772323200000
    assert parse_time("2026-03-01", end=True) == 1772323200000 + 86_400_000 - 1
    assert parse_time("2026-03-01T09:30", end=True) == 1772323200000 + 9.5 * 3_600_000 + 59_999
    assert parse_time("March 1st") is None
    tenant_officer = Principal("k", "bank-a", "officer")
    form = Form({"tenant": "bank-b", "rule": "ok-rule", "until": "2026-01-01", "since": "2026-02-01"})
    f = search_filters(form, tenant_officer, KEY)
    assert f.tenant == "bank-a" and set(form.errors) == {"tenant", "until"}
    form = Form({"user": "alice", "match": "4111 1111 1111 1111"})
    f = search_filters(form, Principal("k", "bank-a", "officer", all_tenants=True), KEY)
    assert not form.errors and f.tenant == "" and "alice" not in f.user and "4111" not in f.match


def test_a_cursor_reads_back_what_it_wrote_and_nothing_else():
    assert Back.parse(Back(1700000000000, 42).token()) == Back(1700000000000, 42)
    for token in ("", "1", "1.2.3", "a.b", "-1.2", "1." + "9" * 25, "١.٢"):
        assert Back.parse(token) is None, token


def test_a_diff_names_added_removed_and_changed_fields():
    before = [{"id": "a", "action": "block", "patterns": ["x"]}, {"id": "b", "action": "redact"}]
    after = [{"id": "a", "action": "halt", "patterns": ["x"]}, {"id": "c", "action": "block"}]
    d = diff(before, after)
    assert [r["id"] for r in d.added] == ["c"] and [r["id"] for r in d.removed] == ["b"]
    assert [(c.rule_id, c.fields) for c in d.changed] == [("a", [("action", "block", "halt")])]


@pytest.mark.parametrize("headers, same", [
    ({}, True),
    ({b"origin": b"http://console:8443", b"host": b"console:8443"}, True),
    ({b"origin": b"null", b"host": b"console:8443"}, True),  # no-referrer: the browser hides it
    ({b"origin": b"https://evil.example", b"host": b"console:8443"}, False),
    ({b"sec-fetch-site": b"same-origin", b"origin": b"null"}, True),
    ({b"sec-fetch-site": b"cross-site", b"origin": b"null"}, False),
    ({b"sec-fetch-site": b"same-site"}, False),
])
def test_a_form_from_another_site_is_told_apart(headers, same):
    assert _same_origin(headers, {"scheme": "http"}) is same


def test_a_seal_checked_on_the_stored_bytes_agrees_with_the_trails():
    from gateway.audit import sealed_ok
    from gateway.console.trail import sealed_bytes

    rec = {"seq": 9, "prev": "ab" * 32, "type": "request", "ts_ms": 5, "app": "x", "delivered": '"hmac":"',
           "metadata": {"hmac": "c" * 64}, "tenant": "t"}
    rec["hmac"] = seal(KEY, rec)
    raw = stored(rec).encode()
    assert sealed_bytes(KEY, raw) and sealed_ok(KEY, rec)
    assert not sealed_bytes(KEY, raw.replace(b'"tenant":"t"', b'"tenant":"u"'))
    assert not sealed_bytes(b"another-key-of-at-least-32-bytes!!", raw)
    assert not sealed_bytes(KEY, json.dumps(rec, sort_keys=True).encode())  # not as the trail stores it
