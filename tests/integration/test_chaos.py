"""Engines and gateways lost while clients stream through them (`make test-chaos`): real
processes on loopback, the real model, each test bounded in requests and time. Each ends
with the trail's checks (support/fleet.py): `audit verify` passes and every request the
clients saw end, and every audit_id they received, is in the trail."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from support.fleet import (
    UNAVAILABLE,
    Fleet,
    ask,
    check_outcome,
    check_trail,
    delivered_before_end,
    generated_tokens,
    log_lines,
    moves,
    request,
    streaming,
)
from support.processes import wait_for
from support.streams import ChatStream

# Each starts two or three engines and a gateway; on a busy two-core machine a test took up
# to 2.5 minutes.
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

# Two engines of two KV slots each: eight requests put two running and two waiting on each.
REQUESTS = 8
TOKENS = 64  # long enough that both engines stream before either finishes one


@pytest.fixture
def fleet(tmp_path, default_model_dir):
    fleet = Fleet.new(tmp_path, default_model_dir)
    yield fleet
    fleet.stop()


def run_through(gateway, ids: list[str], act, streaming_count: int) -> dict[str, list]:
    """Send every request on one stream; once `streaming_count` of them deliver text, act();
    then read every request to its end. Events per request."""
    async def go() -> dict[str, list]:
        async with ChatStream(gateway.target) as s:
            for request_id in ids:
                s.send(request(request_id, TOKENS))
            await streaming(s, streaming_count)
            act()
            return await s.until_done(*ids, timeout=300)
    return asyncio.run(go())


def test_kill_9_of_an_engine_mid_stream(fleet):
    """The killed engine's requests that had delivered nothing run on the other engine (a
    request_moved record each); those that had delivered text end UNAVAILABLE with a retry
    hint. The gateway keeps serving, and uses the engine again once it is restarted."""
    a, b = fleet.engines(2, "--max-batch", "2")
    gateway = fleet.gateway("--engine", a.target, "--engine", b.target)
    ids = [f"kill-{n}" for n in range(REQUESTS)]
    # Three requests delivering text: the engines run two at most each, so both are streaming.
    outcomes = run_through(gateway, ids, lambda: a.process.send_signal(signal.SIGKILL), 3)

    ends = {rid: check_outcome(events) for rid, events in outcomes.items()}
    lost = [rid for rid, end in ends.items() if end == "unavailable"]
    assert lost, ends  # the killed engine was streaming: its requests that had delivered text end
    assert all(delivered_before_end(outcomes[rid]) for rid in lost), ends  # never one that had not
    assert check_outcome(ask(gateway.target, "kill-after")) == "finished"  # on the other engine

    # Restarted on its address, the engine is used again with no step on the gateway.
    (again,) = fleet.engines(1, "--max-batch", "2", ports=[int(a.target.rsplit(":", 1)[1])])
    assert wait_for(lambda: check_outcome(ask(gateway.target, f"kill-back-{time.monotonic_ns()}"))
                    == "finished" and generated_tokens(again) > 0, 60, 0.1)

    records = check_trail(gateway, outcomes)
    moved = moves(records)
    assert moved and {(m["from_engine"], m["to_engine"]) for m in moved} == {(a.target, b.target)}, \
        (ends, moved)
    started = {r["seq"]: r["request_id"] for r in records if r["type"] == "request_started"}
    finals = {r["request_id"]: r for r in records if r["type"] == "request"}
    for m in moved:  # each moved request finished on the other engine, the trail says where
        rid = started[m["audit_id"]]
        assert ends[rid] == "finished" and finals[rid]["moved_from"] == [a.target]
    for events in outcomes.values():  # a moved request's client got one Started all the same
        assert [e.WhichOneof("event") for e in events].count("started") <= 1


def test_sigstop_of_an_engine(fleet):
    """A stopped engine answers no ping: the gateway drops its connection within the
    keepalive bound (1 s + 1 s here), and its requests move or end UNAVAILABLE as if it had
    died. Continued, it is connected again and used."""
    a, b = fleet.engines(2, "--max-batch", "2")
    gateway = fleet.gateway("--engine", a.target, "--engine", b.target)
    ids = [f"stop-{n}" for n in range(REQUESTS)]
    stopped = 0.0

    def stop() -> None:
        nonlocal stopped
        stopped = time.monotonic()
        a.process.send_signal(signal.SIGSTOP)

    async def go() -> tuple[dict[str, list], float]:
        async with ChatStream(gateway.target) as s:
            for request_id in ids:
                s.send(request(request_id, TOKENS))
            await streaming(s, 3)
            stop()
            first_end = 0.0
            while not first_end:
                e = await s.next(60)
                if e.WhichOneof("event") == "error":
                    first_end = time.monotonic() - stopped
            return await s.until_done(*ids, timeout=300), first_end

    try:
        outcomes, detected_s = asyncio.run(go())
        ends = {rid: check_outcome(events) for rid, events in outcomes.items()}
        assert detected_s < 15, detected_s  # keepalive 1 s + timeout 1 s, on a busy machine
        lost = [rid for rid, end in ends.items() if end == "unavailable"]
        assert lost and all(delivered_before_end(outcomes[rid]) for rid in lost), ends
        assert any(line["engine"] == a.target for line in log_lines(
            gateway, "engine marked down; probing it in the background")), gateway.log()[-3000:]
        assert check_outcome(ask(gateway.target, "stop-after")) == "finished"  # on the other
    finally:
        a.process.send_signal(signal.SIGCONT)

    def reconnected() -> bool:
        return sum(line["engine"] == a.target for line in log_lines(gateway, "engine up")) >= 2

    assert wait_for(reconnected, 60, 0.1), gateway.log()[-3000:]
    before = generated_tokens(a)
    assert wait_for(lambda: check_outcome(ask(gateway.target, f"stop-back-{time.monotonic_ns()}"))
                    == "finished" and generated_tokens(a) > before, 60, 0.1), gateway.log()[-3000:]
    records = check_trail(gateway, outcomes)
    assert moves(records) and {m["from_engine"] for m in moves(records)} == {a.target}, ends
    assert "too_many_pings" not in gateway.log() + a.log() + b.log()


def test_sigterm_of_a_gateway(fleet):
    """A gateway told to stop refuses new requests UNAVAILABLE, lets those in flight finish,
    writes their records and exits 0; restarted on its state, its trail has them all."""
    (engine,) = fleet.engines(1, "--max-batch", "4")
    gateway = fleet.gateway("--engine", engine.target)
    ids = [f"term-{n}" for n in range(4)]

    async def go() -> tuple[dict[str, list], list, list]:
        async with ChatStream(gateway.target) as s:
            for request_id in ids:
                s.send(request(request_id, TOKENS))
            await streaming(s, len(ids))
            gateway.process.send_signal(signal.SIGTERM)
            while not log_lines(gateway, "draining"):
                await asyncio.sleep(0.02)
            s.send(request("term-late", 4))  # on a stream already open
            async with ChatStream(gateway.target) as other:  # on a new one
                other.send(request("term-new", 4))
                new = (await other.until_done("term-new", timeout=60))["term-new"]
            done = await s.until_done(*ids, "term-late", timeout=300)
            return {rid: done[rid] for rid in ids}, done["term-late"], new

    outcomes, late, new = asyncio.run(go())
    assert all(check_outcome(events) == "finished" for events in outcomes.values())
    for refused in (late, new):  # "retry elsewhere": another gateway, at once
        assert (refused[-1].error.code, refused[-1].error.message) == (
            UNAVAILABLE, "the gateway is shutting down; retry elsewhere")
    assert gateway.process.wait(90) == 0
    again = fleet.gateway("--engine", engine.target, directory=gateway.state.parent)
    check_trail(again, outcomes)


def test_sigterm_of_an_engine(fleet):
    """An engine told to stop says so in its load: its gateway sends it nothing more, its
    requests in flight (running or queued) finish there, and it exits 0."""
    a, b = fleet.engines(2, "--max-batch", "2")
    gateway = fleet.gateway("--engine", a.target, "--engine", b.target)
    ids = [f"drain-{n}" for n in range(REQUESTS)]
    outcomes = run_through(gateway, ids, lambda: a.process.send_signal(signal.SIGTERM), 3)
    assert all(check_outcome(events) == "finished" for events in outcomes.values())
    assert a.process.wait(90) == 0
    assert check_outcome(ask(gateway.target, "drain-after")) == "finished"
    assert generated_tokens(b) > 0 and not moves(check_trail(gateway, outcomes))
