"""Fuzzing a running server (issue 8): generated Chat requests and rule packs.

Requests: batches on one stream each, mixing well-formed requests (1-2 tokens), each field
at and beyond its limit, random text, malformed frames, duplicate ids, cancels and cancel
storms, abrupt disconnects. Every request gets exactly one clear terminal event (the one its
flaw calls for), the stream then ends cleanly, and after each batch a well-formed request
gets the same answer as at the start.

Packs: written into the server's rules directory one at a time, through its real watcher.
Each is loaded or rejected exactly as the loader says here; a rejected one leaves the
version in force unchanged, with a reason naming the file. After each batch of packs the
base rules are back: the canary input rule halts, and the reference answer is unchanged.

The default suite runs >= 10,000 requests and >= 1,000 packs; `make test-slow` ten times more.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from finsieve.app.client import chat_request
from finsieve.policy.reload import MAX_REASON_CHARS
from finsieve.v1 import chat_pb2
from gateway.frames import BadFrame, parse_client_message

from support.packs import apply, canary_halts, reload
from support.servers import TIGHT_ENV
from support.streams import ChatStream, RawStream

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
MAX_INPUT = int(TIGHT_ENV["FINSIEVE_MAX_INPUT_BYTES"])
MAX_MESSAGES = int(TIGHT_ENV["FINSIEVE_MAX_MESSAGES"])
MAX_FRAME = int(TIGHT_ENV["FINSIEVE_MAX_MESSAGE_BYTES"])
REFERENCE = chat_request("reference", "Say hello.", max_tokens=2)
# No shrinking: against a running server it takes unbounded time; the failing example is
# printed as generated.
SETTINGS = dict(deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck), print_blob=False)


# -- generated requests -----------------------------------------------------------------------


@dataclass
class Case:
    frame: bytes
    expect: str  # "ok": served or refused for load; "field:<f>": INVALID_ARGUMENT naming f; "any"
    request_id: str | None  # the id its terminal event carries (None: no terminal, e.g. a cancel)
    ends_call: bool = False  # beyond the frame limit: gRPC ends the call


texts = st.text(st.characters(codec="utf-8"), max_size=40)
small = st.sampled_from(["Hi.", "Say hi.", "2+2?", "Name a color."])


def _base(rid: str, draw) -> chat_pb2.ChatRequest:
    req = chat_request(rid, draw(small), max_tokens=1)
    p = req.params
    if draw(st.booleans()):
        p.temperature = draw(st.integers(1, 200)) / 100
        p.top_p = draw(st.integers(0, 100)) / 100
        p.top_k = draw(st.integers(0, 1000))
        p.seed = draw(st.integers(-(2**63), 2**63 - 1))
    return req


# Strategies drawn from for every case are built once: hypothesis validates each new
# strategy object on its first draw (a third of the generation time when built per case).
# Mostly flaws (refused cheaply); values exactly at a limit are served (and cost a prefill).
PERTURBATIONS = st.sampled_from([
    "id_empty", "id_long", "no_messages", "many_messages", "role", "content_over",
    "max_tokens", "temperature_low", "temperature_bad", "top_p", "top_k", "stops",
    "stop_empty", "stop_long", "metadata_many", "metadata_key", "metadata_value", "text",
] * 3 + ["id_max", "max_messages", "content_max", "temperature_edge", "top_k_max", "stops_max",
         "metadata_max"])
CASE_KINDS = st.sampled_from(["valid"] + ["perturbed"] * 30 + ["raw"] * 3 + ["bad_utf8"] * 2
                             + ["duplicate"])
ROLES_OR_TEXT = st.sampled_from(["user", "system", "assistant"]) | texts
METADATA = st.dictionaries(texts, texts, max_size=3)
# A message as its repeated field's bytes: parsing n copies is ~10x faster than extending
# the field by n messages (20,000 in the largest cases), the same request.
ONE_MESSAGE = chat_pb2.ChatRequest(messages=[chat_pb2.Message(role="user", content="x")]).SerializeToString()


def _perturb(req: chat_pb2.ChatRequest, draw) -> str:
    """Change one field, at or beyond its limit; what the gateway must say ("ok" or a field)."""
    p = req.params
    kind = draw(PERTURBATIONS)
    if kind == "id_empty":
        req.request_id = ""
        return "field:request_id"
    if kind == "id_long":
        req.request_id = draw(st.sampled_from(["x", "é", "😀"])) * 129
        return "field:request_id"
    if kind == "id_max":
        req.request_id = req.request_id[:8] + "😀" * 120
        return "ok"
    if kind == "no_messages":
        req.ClearField("messages")
        return "field:messages"
    if kind in ("many_messages", "max_messages"):
        n = MAX_MESSAGES + (kind == "many_messages") * draw(st.sampled_from([1, 1000, 20000]))
        req.ClearField("messages")
        req.MergeFromString(ONE_MESSAGE * n)
        return "field:messages" if kind == "many_messages" else "ok"
    if kind == "role":
        role = draw(texts.filter(lambda r: r not in ("system", "user", "assistant")))
        i = draw(st.integers(0, len(req.messages) - 1))
        req.messages[i].role = role
        return f"field:messages[{i}].role"
    if kind in ("content_over", "content_max"):
        size = MAX_INPUT + (kind == "content_over") * draw(st.sampled_from([1, 4, 50000]))
        ch = draw(st.sampled_from(["a", "é", "😀"]))
        n_bytes = len(ch.encode())
        req.messages[0].content = ch * (size // n_bytes) + "a" * (size % n_bytes)
        # At the limit: accepted here, then too many tokens for the context (the engine says so).
        return "field:messages[0].content" if kind == "content_over" else "any"
    if kind == "max_tokens":
        p.max_tokens = draw(st.sampled_from([-1, 1025, 2**31 - 1, -(2**31)]))
        return "field:params.max_tokens"
    if kind == "temperature_low":
        p.temperature = draw(st.floats(1.401298464324817e-45, 0.00989999994635582, width=32))
        return "field:params.temperature"
    if kind == "temperature_bad":
        p.temperature = draw(st.sampled_from([-1e-45, -0.5, 2.001, 1e38, math.inf, -math.inf, math.nan]))
        return "field:params.temperature"
    if kind == "temperature_edge":
        p.temperature = draw(st.sampled_from([0.01, 2.0]))
        return "ok"
    if kind == "top_p":
        p.top_p = draw(st.sampled_from([-0.001, 1.001, math.nan, math.inf]))
        return "field:params.top_p"
    if kind in ("top_k", "top_k_max"):
        p.top_k = 1000 if kind == "top_k_max" else draw(st.sampled_from([-1, 1001, 2**31 - 1]))
        return "ok" if kind == "top_k_max" else "field:params.top_k"
    if kind == "stops":
        p.stop.extend(["s"] * 9)
        return "field:params.stop"
    if kind in ("stop_empty", "stop_long"):
        p.stop.extend(["ok", "" if kind == "stop_empty" else "y" * 65])
        return "field:params.stop[1]"
    if kind == "stops_max":
        p.stop.extend([chr(0x4E00 + i) * 64 for i in range(8)])
        return "ok"
    if kind == "metadata_many":
        req.metadata.update({f"k{i}": "v" for i in range(33)})
        return "field:metadata"
    if kind in ("metadata_key", "metadata_value"):
        key = "k" * 257 if kind == "metadata_key" else "tenant"
        req.metadata[key] = "v" * (257 if kind == "metadata_value" else 1)
        return f"field:metadata[{key[:32]}]"
    if kind == "metadata_max":
        req.metadata.update({f"{i:03d}" + "k" * 253: "😀" * 256 for i in range(32)})
        return "ok"
    # random text everywhere a string goes: the role decides
    req.messages[0].role = draw(ROLES_OR_TEXT)
    req.messages[0].content = draw(texts)
    req.metadata.update(draw(METADATA))
    return "ok" if req.messages[0].role in ("user", "system", "assistant") else "field:messages[0].role"


@st.composite
def cases(draw, rid: str) -> Case:
    kind = draw(CASE_KINDS)
    if kind == "raw":  # anything at all: what it parses to decides the id
        frame = draw(st.binary(max_size=64))
        parsed = parse_client_message(frame)
        if isinstance(parsed, BadFrame):
            return Case(frame, "any", parsed.request_id)
        which = parsed.WhichOneof("msg")
        return Case(frame, "any", parsed.request.request_id if which == "request"
                    else "" if which is None else None)
    req = _base(rid, draw)
    if kind == "bad_utf8":
        req.messages[0].content = "\x00MARK\x00"
        frame = chat_pb2.ChatClientMessage(request=req).SerializeToString()
        # As long as the marker: the frame stays well-formed protobuf, only a string is broken.
        broken = draw(st.sampled_from([b"\xff" * 6, b"ab\xc3(cd", b"\xed\xa0\x80abc"]))
        return Case(frame.replace(b"\x00MARK\x00", broken), "field:request", rid)
    expect = "ok" if kind == "valid" else "any" if kind == "duplicate" else _perturb(req, draw)
    if kind == "duplicate":
        req.request_id = "dup"
    frame = chat_pb2.ChatClientMessage(request=req).SerializeToString()
    return Case(frame, expect, req.request_id, ends_call=len(frame) > MAX_FRAME)


@st.composite
def batches(draw) -> tuple[list[Case], list[str], bool]:
    n = draw(st.integers(100, 110))
    items = [draw(cases(f"q{i}")) for i in range(n)]
    # At most one frame beyond the limit, last: it ends the call.
    kept = [c for c in items if not c.ends_call]
    if len(kept) < len(items) and draw(st.integers(0, 9)) == 5:
        kept.append(next(c for c in items if c.ends_call))
    cancels = draw(st.lists(st.sampled_from([f"q{i}" for i in range(n)] + ["dup", "nobody", ""]),
                            max_size=8))
    # Hypothesis starts from the simplest values (0): the rare events are a value in the middle.
    if draw(st.integers(0, 9)) == 5:
        cancels += [draw(st.sampled_from(["q0", "q1", "nobody"]))] * 200  # a storm
    disconnect = draw(st.integers(0, 19)) == 10
    return kept, cancels, disconnect


@dataclass
class Tally:
    counts: collections.Counter = field(default_factory=collections.Counter)

    def __str__(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))


def check_terminal(case: Case, e: chat_pb2.ChatServerMessage) -> str:
    kind = e.WhichOneof("event")
    if kind == "finished":
        assert case.expect in ("ok", "any"), (case.expect, e)
        return "finished"
    err = e.error
    assert err.code in (INVALID, EXHAUSTED), e
    if err.code == EXHAUSTED:  # too many in flight: a bound, with a retry hint
        assert case.expect in ("ok", "any") and err.retry_after_ms > 0, (case.expect, e)
        return "resource_exhausted"
    assert err.message, e
    if case.expect.startswith("field:"):
        assert err.field == case.expect.removeprefix("field:"), (case.expect, e)
    elif case.expect == "ok":  # well-formed: only the engine may refuse it (prompt too long)
        assert err.field == "messages", e
    return "invalid_argument"


async def run_batch(target: str, batch: tuple[list[Case], list[str], bool], tally: Tally) -> None:
    items, cancels, disconnect = batch
    s = RawStream(target)
    try:
        await _run_batch(s, items, cancels, disconnect, tally)
    finally:
        await s.close()


async def _run_batch(s: RawStream, items: list[Case], cancels: list[str], disconnect: bool,
                     tally: Tally) -> None:
    for case in items:
        s.send(case.frame)
    for rid in cancels:
        s.send(chat_pb2.ChatClientMessage(cancel=chat_pb2.Cancel(request_id=rid)).SerializeToString())
    tally.counts["requests"] += len(items)
    tally.counts["cancels"] += len(cancels)
    if disconnect:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await asyncio.wait_for(s.call.read(), 60)
        tally.counts["disconnects"] += 1
        return  # closed abruptly, with requests in flight
    expected = [c for c in items if c.request_id is not None and not c.ends_call]
    want = collections.Counter(c.request_id for c in expected)
    by_id: dict[str, list[Case]] = collections.defaultdict(list)
    for c in expected:
        by_id[c.request_id].append(c)
    got: collections.Counter = collections.Counter()
    s.close_writes()  # the server ends the call once all are answered
    try:
        while True:
            e = await asyncio.wait_for(s.call.read(), 120)
            if e is grpc.aio.EOF:
                break
            if e.WhichOneof("event") not in ("finished", "error"):
                continue
            got[e.request_id] += 1
            assert got[e.request_id] <= want[e.request_id], f"an extra terminal event: {e}"
            cases_for = by_id[e.request_id]
            # Duplicate ids: any of that id's cases may be the one answered.
            outcomes = []
            for c in cases_for:
                try:
                    outcomes.append(check_terminal(c, e))
                    break
                except AssertionError as err:
                    outcomes.append(err)
            assert any(isinstance(o, str) for o in outcomes), outcomes
            tally.counts[next(o for o in outcomes if isinstance(o, str))] += 1
        code = await s.call.code()
    except grpc.aio.AioRpcError as err:
        code = err.code()
    if any(c.ends_call for c in items):  # gRPC ends the call on it: what was pending is lost
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        tally.counts["oversized frames"] += 1
    else:
        assert got == want, f"missing: {want - got}"
        assert code == grpc.StatusCode.OK


async def reference_answer(target: str) -> str:
    async with ChatStream(target) as s:
        s.send(REFERENCE)
        events = (await s.until_done("reference"))["reference"]
    assert events[-1].WhichOneof("event") == "finished", events
    return "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")


def fuzz_requests(tight_server, examples: int) -> Tally:
    tally = Tally()
    reference = asyncio.run(reference_answer(tight_server.target))
    assert reference

    @settings(max_examples=examples, **SETTINGS)
    @given(batches())
    def one(batch):
        async def go():
            await run_batch(tight_server.target, batch, tally)
            assert await reference_answer(tight_server.target) == reference

        asyncio.run(go())

    one()
    assert tight_server.server.process.poll() is None
    return tally


@pytest.mark.timeout(900)
def test_fuzz_chat_requests(tight_server):
    tally = fuzz_requests(tight_server, 100)
    print(f"fuzzed requests: {tally}")
    assert tally.counts["requests"] >= 10_000


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_fuzz_chat_requests_more(tight_server):
    tally = fuzz_requests(tight_server, 1000)
    print(f"fuzzed requests: {tally}")
    assert tally.counts["requests"] >= 100_000


# -- generated rule packs ------------------------------------------------------------------------


ids = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True) | texts
regexes = st.sampled_from([
    r"\d+%", r"(a|aa)+b", r"(", r"[", r"\bfoo\b", r"a{1,5}", r"${num}", r"${nope}",
    "(" * 40 + "a" + ")" * 40, r"(?<=x)y", r"\p{Han}+", r".*", r"a++", r"(?i)x",
]) | texts
literals = st.sampled_from(["guaranteed returns", "hello", "ＦＵＬＬ", "年化收益", " ", ""]) | texts


@st.composite
def rule_dicts(draw) -> dict:
    kind = draw(st.sampled_from(["literal", "regex", "other"]))
    rule = {
        "id": draw(ids),
        "description": draw(st.sampled_from(["fuzz", ""]) | texts),
        "kind": kind,
        "patterns": draw(st.lists(regexes if kind == "regex" else literals, max_size=3)),
        # Rarely an output block literal: each needs a token-mask table built.
        "action": draw(st.sampled_from(["halt", "redact", "rewrite", "block", "explode"])),
        "scope": draw(st.sampled_from(["input", "output", "both", "nowhere"])),
    }
    for key, values in [("replacement", st.sampled_from(["[X]", ""]) | texts),
                        ("max_span", st.integers(-5, 500) | st.just("ten")),
                        ("validators", st.lists(st.sampled_from(["luhn", "iban", "crc"]), max_size=2)),
                        ("severity", st.sampled_from(["low", "critical", "enormous"])),
                        ("enabled", st.booleans()), ("colour", st.just("red"))]:
        if draw(st.integers(0, 3)) == 0:
            rule[key] = draw(values)
    if rule["action"] == "block" and rule["scope"] != "input" and kind == "literal":
        rule["scope"] = draw(st.sampled_from(["input", "output"]))
    return rule


def _deep(n: int) -> str:
    return "rules: " + "[" * n + "]" * n + "\n"


def _laughs(levels: int, width: int) -> str:
    lines = ["l0: &l0 [" + ", ".join(['"lol"'] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nrules: *l{levels - 1}\n"


hostile = st.one_of(
    st.builds(_deep, st.integers(30, 5000)),
    st.builds(_laughs, st.integers(2, 12), st.integers(2, 12)),
    st.just("x: &a [*a]\nrules: []\n"),
    st.just("definitions:\n  a: '${a}${a}'\nrules: []\n"),
    st.builds(lambda n: "rules:\n  - id: pad\n    description: '" + "p" * n + "'\n",
              st.integers(1, 1_200_000)),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    texts,
)


@st.composite
def packs(draw) -> tuple[str, str]:
    """(what kind, the file's text); fifo, dir and dangling (symlink) have no text."""
    kind = draw(st.sampled_from(["structured"] * 6 + ["hostile"] * 3 + ["fifo", "dir", "dangling"]))
    if kind == "hostile":
        return kind, draw(hostile)
    if kind != "structured":
        return kind, ""
    doc: dict = {"rules": draw(st.lists(rule_dicts(), max_size=4))}
    if draw(st.booleans()):
        doc["definitions"] = draw(st.dictionaries(st.sampled_from(["num", "pct", "a"]), regexes, max_size=2))
    if draw(st.integers(0, 5)) == 0:
        doc["surprise"] = 1
    return kind, yaml.safe_dump(doc, allow_unicode=True)


def place(rules: Path, kind: str, text: str = "") -> None:
    """fuzz.yaml as the pack says; kind "absent": no fuzz.yaml (the base rules alone)."""
    path, staged = rules / "fuzz.yaml", rules / ".fuzz.tmp"
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "dangling":
        path.symlink_to(rules / "nowhere.yaml")
    elif kind != "absent":
        staged.write_text(text, encoding="utf-8", errors="surrogatepass")
        os.replace(staged, path)  # one change, not a half-written file


def fuzz_packs(tight_server, examples: int) -> Tally:
    tally = Tally()
    rules = tight_server.rules
    base = tight_server.engine_info().policy_version
    reference = asyncio.run(reference_answer(tight_server.target))

    @settings(max_examples=examples, **SETTINGS)
    @given(st.lists(packs(), min_size=20, max_size=20))
    def one(batch):
        t0 = time.monotonic()
        for kind, text in batch:
            before = tight_server.engine_info()
            info, version = reload(tight_server, lambda kind=kind, text=text: place(rules, kind, text),
                                   before)
            if version is not None:  # the loader here takes it: so did the engine
                assert info.policy_version == version
                tally.counts["loaded"] += 1
            else:
                assert info.policy_version == before.policy_version  # nothing changed in force
                assert "fuzz.yaml" in info.last_rejection
                assert len(info.last_rejection) <= MAX_REASON_CHARS + 100
                tally.counts["rejected"] += 1
            tally.counts["packs"] += 1
        tally.counts["ms packs"] += int(1000 * (time.monotonic() - t0))
        t0 = time.monotonic()
        # The base rules back: the same version, the canary halts, the same answer.
        info = apply(tight_server, lambda: place(rules, "absent"))
        assert info.policy_version == base
        assert canary_halts(tight_server)
        assert asyncio.run(reference_answer(tight_server.target)) == reference
        tally.counts["ms checks"] += int(1000 * (time.monotonic() - t0))

    try:
        one()
    finally:
        apply(tight_server, lambda: place(rules, "absent"))
    assert tight_server.server.process.poll() is None
    return tally


@pytest.mark.timeout(900)
def test_fuzz_rule_packs(tight_server):
    tally = fuzz_packs(tight_server, 50)
    print(f"fuzzed packs: {tally}")
    assert tally.counts["packs"] >= 1000


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_fuzz_rule_packs_more(tight_server):
    tally = fuzz_packs(tight_server, 500)
    print(f"fuzzed packs: {tally}")
    assert tally.counts["packs"] >= 10_000
