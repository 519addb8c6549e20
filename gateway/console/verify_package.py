#!/usr/bin/env python3
"""Verify a finsieve regulator package offline. Python 3.8 or newer, standard library only.

    python3 verify_package.py PACKAGE.zip                      # links, anchors, digests
    python3 verify_package.py PACKAGE.zip --key-file audit.key # and every HMAC and signature
    python3 verify_package.py PACKAGE.zip --anchors FILE       # and anchors kept elsewhere

Without a key it checks what needs none: every file against the manifest's SHA-256; that
the records run without a gap; that each links to the one before (`prev` is the HMAC of
the record before); that the first links to the start of the chain or to the retention
checkpoint, where it follows one; and that every anchor within the range names the HMAC the
record holds. Anchors given with --anchors (a copy the examiner obtained from write-once
storage, not from the package) pin the chain to what was anchored then.

Links alone do not prove a record's content: anyone can write a chain of strings that link.
With the audit key (--key-file, read on the bank's machine in the examiner's presence; it
never needs to leave it) the script also recomputes every record's HMAC, and checks the
signatures of the anchors, the chain head and the checkpoint, and the records that
announced each rule pack in force (rules/records.jsonl, whose snapshots rules/*.json must
match the SHA-256 they hold). Records of other tenants are
withheld: only their seq, link and HMAC are in the package, so their links are checked and
their content is not.

Exit status: 0 intact, 1 a fault (named, at the exact record), 2 a usage or reading error.
"""

import argparse
import hashlib
import hmac
import json
import sys
import zipfile
from pathlib import Path

FORMAT = "finsieve-regulator-package/1"
ANCHOR_FIELDS = ("seq", "record_hmac", "ts_ms", "writer", "sig")


class Fault(Exception):
    """The package does not verify; the message says where and why."""


def canonical(record, without="hmac"):
    """The bytes an HMAC covers: sorted keys, no spaces, UTF-8, without the MAC itself."""
    body = {k: v for k, v in record.items() if k != without}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def seal(key, record, without="hmac"):
    return hmac.new(key, canonical(record, without), hashlib.sha256).hexdigest()


def derive_key(key, purpose):
    return hmac.new(key, f"finsieve/{purpose}/v1".encode(), hashlib.sha256).digest()


def sealed_ok(key, record, field="hmac"):
    mac = record.get(field)
    return isinstance(mac, str) and hmac.compare_digest(mac, seal(key, record, field))


def read_package(path):
    """{name: bytes} of a package zip, or of the folder it was unpacked into."""
    path = Path(path)
    if path.is_dir():
        return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with zipfile.ZipFile(str(path)) as z:
        files = {}
        for name in z.namelist():
            if not name.endswith("/"):
                files[name.split("/", 1)[1] if "/" in name else name] = z.read(name)
        return files


def anchors_in(data, source):
    out = []
    for number, line in enumerate(data.splitlines(), 1):
        if line.strip():
            try:
                anchor = json.loads(line)
            except ValueError:
                raise Fault(f"{source} line {number}: not JSON") from None
            if not isinstance(anchor, dict) or not isinstance(anchor.get("seq"), int):
                raise Fault(f"{source} line {number}: not an anchor")
            out.append((anchor, f"{source} line {number}"))
    return out


def verify(files, key=None, extra_anchors=None):
    """The report's lines; raises Fault at the first fault."""
    if "manifest.json" not in files:
        raise Fault("manifest.json is missing: not a finsieve regulator package")
    manifest = json.loads(files["manifest.json"])
    if manifest.get("format") != FORMAT:
        raise Fault("manifest.json: format {!r}, expected {}".format(manifest.get("format"), FORMAT))
    for name, digest in sorted(manifest["files"].items()):
        if name not in files:
            raise Fault(f"{name} is missing from the package")
        if hashlib.sha256(files[name]).hexdigest() != digest:
            raise Fault(f"{name} was altered: its SHA-256 does not match the manifest")
    first, last = manifest["first_seq"], manifest["last_seq"]
    records = [json.loads(line) for line in files["records.jsonl"].splitlines() if line.strip()]
    checkpoint = json.loads(files["checkpoint.json"])
    head = json.loads(files["head.json"])
    report = []
    by_seq, withheld, prev = {}, 0, None
    for i, rec in enumerate(records):
        seq = first + i
        if rec.get("seq") != seq:
            raise Fault("record {} is missing: the package holds record {} in its place".format(
                seq, rec.get("seq")))
        if rec.get("missing"):
            raise Fault(f"record {seq} is missing: it was not in the trail when the package was "
                        "made")
        if prev is None:
            if seq == 1 and rec.get("prev") != "":
                raise Fault("record 1 does not start the chain")
            if checkpoint and checkpoint.get("through") == seq - 1 \
                    and rec.get("prev") != checkpoint.get("last_hmac"):
                raise Fault(f"record {seq} does not link to the retention checkpoint")
        elif rec.get("prev") != prev:
            raise Fault(f"record {seq} does not link to record {seq - 1}: inserted, deleted or "
                        "reordered")
        if rec.get("withheld"):
            withheld += 1
        elif key is not None and not sealed_ok(key, rec):
            raise Fault(f"record {seq} was altered: its HMAC does not match")
        by_seq[seq] = rec["hmac"]
        prev = rec["hmac"]
    if records and first + len(records) - 1 != last:
        raise Fault(f"the package ends at record {first + len(records) - 1}, its manifest says {last}")
    anchors = anchors_in(files.get("anchors.jsonl", b""), "anchors.jsonl")
    if extra_anchors is not None:
        anchors += anchors_in(extra_anchors[1], extra_anchors[0])
    matched = 0
    for anchor, source in anchors:
        if key is not None:
            body = {f: anchor.get(f) for f in ANCHOR_FIELDS}
            if not sealed_ok(derive_key(key, "anchor"), body, "sig"):
                raise Fault(f"{source}: the anchor is not signed with this audit key")
        if anchor["seq"] in by_seq:
            if anchor.get("record_hmac") != by_seq[anchor["seq"]]:
                raise Fault("record {} is not the record {} shows (anchored by {})".format(
                    anchor["seq"], source, anchor.get("writer")))
            matched += 1
    if key is not None:
        sig = hmac.new(derive_key(key, "head"), "{}:{}".format(head["seq"], head["hmac"]).encode(),
                       hashlib.sha256).hexdigest()
        if not hmac.compare_digest(sig, head.get("sig", "")):
            raise Fault("head.json: the chain head's signature does not match")
        if checkpoint and not sealed_ok(derive_key(key, "checkpoint"), checkpoint, "sig"):
            raise Fault("checkpoint.json: the retention checkpoint's signature does not match")
    if head["seq"] < last:
        raise Fault("the package holds records past the chain head (record {})".format(head["seq"]))
    if head["seq"] == last and records and head["hmac"] != by_seq[last]:
        raise Fault(f"the chain head does not match record {last}, the newest")
    snapshots = 0
    for line in files.get("rules/records.jsonl", b"").splitlines():
        rec = json.loads(line)
        if key is not None and not sealed_ok(key, rec):
            raise Fault("rules/records.jsonl: record {} was altered: its HMAC does not match".format(
                rec.get("seq")))
        name = "rules/{}.json".format(rec.get("policy_version"))
        if name in files:
            if hashlib.sha256(files[name]).hexdigest() != rec.get("sha256"):
                raise Fault("{} does not match the SHA-256 rules record {} holds".format(
                    name, rec.get("seq")))
            snapshots += 1
    report.append("records {} to {}: {} records, each linked to the one before{}".format(
        first, last, len(records), f"; {withheld} withheld (another tenant's: links only)"
        if withheld else ""))
    report.append(f"{matched} anchors matched their records")
    report.append(f"{snapshots} rule pack snapshots match their rules records")
    if key is not None:
        report.append("every HMAC recomputed with the audit key; anchors, head and checkpoint "
                      "signatures match")
    else:
        report.append("HMACs NOT checked (no --key-file): links show order and completeness, "
                      "not content")
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description="Verify a finsieve regulator package offline.")
    parser.add_argument("package", help="the package .zip, or the folder it was unpacked into")
    parser.add_argument("--key-file", help="the audit key file (FINSIEVE_AUDIT_KEY_FILE)")
    parser.add_argument("--anchors", help="anchors kept elsewhere (JSON lines), e.g. from write-once storage")
    args = parser.parse_args(argv)
    try:
        files = read_package(args.package)
        key = Path(args.key_file).read_bytes().strip() if args.key_file else None
        extra = (args.anchors, Path(args.anchors).read_bytes()) if args.anchors else None
    except (OSError, zipfile.BadZipFile) as e:
        print(f"cannot read: {e}", file=sys.stderr)
        return 2
    try:
        report = verify(files, key, extra)
    except Fault as e:
        print(f"package NOT intact: {e}")
        return 1
    except (ValueError, KeyError, TypeError) as e:
        print(f"package NOT intact: malformed ({type(e).__name__}: {e})")
        return 1
    print("package intact:")
    for line in report:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
