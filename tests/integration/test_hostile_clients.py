"""Hostile clients: one bad request, frame or client never hurts anyone else (issue 8).

All on real gRPC against a full server (real model, real Valkey) with small bounds
(support.servers.TIGHT_ENV), shared by the module.
"""

from __future__ import annotations

import asyncio
import json
import socket

import grpc
import pytest
import redis.asyncio as redis

from finsieve.app.client import Credentials, chat_request
from finsieve.v1 import audit_pb2, audit_pb2_grpc, chat_pb2, chat_pb2_grpc
from finsieve.valkey import EmbeddedValkey
from gateway.audit import AuditLog, Filters
from gateway.audit_verify import verify

from support.processes import wait_for
from support.servers import dev_key, free_port, start_server
from support.streams import ChatStream, RawStream, kinds, text_of

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
LONG = 1000  # max_tokens of a request that is still generating when the test acts on it
# A client's receive window this small makes the server's writes block after a few KB.
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 4096), ("grpc.http2.bdp_probe", 0)]


def final_record(audit_target: str, request_id: str) -> dict | None:
    async def query() -> list[dict]:
        async with Credentials(dev_key(audit_target, "officer")).channel(audit_target) as ch:
            page = await audit_pb2_grpc.AuditServiceStub(ch).Query(
                audit_pb2.AuditQuery(request_id=request_id, page_size=100))
        return [json.loads(r.json) for r in page.records]

    return next((r for r in asyncio.run(query()) if r["type"] == "request"), None)


async def until_generating(s: ChatStream, *request_ids: str) -> None:
    """Read until each request has delivered text: it is in the engine's batch."""
    waiting = set(request_ids)
    while waiting:
        e = await s.next()
        if e.WhichOneof("event") == "delta":
            waiting.discard(e.request_id)
        assert e.WhichOneof("event") not in ("error", "finished"), e


def _varint_len(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def frame_of_size(size: int) -> bytes:
    """A ChatClientMessage of exactly `size` bytes: a one- or two-character id (whichever
    makes the size come out) and empty messages. The count is found by the wire format's
    arithmetic (building one 8 MiB candidate takes ~1 s), the frame built once."""
    for request_id in ("x", "xy"):
        for n in range(size // 2 - 8, size // 2 + 1):
            # ChatRequest: the id's tag, length and bytes; each empty message its tag and a
            # zero length. ChatClientMessage: the request's tag and length, then the request.
            request = 2 + len(request_id) + 2 * n
            if 1 + _varint_len(request) + request == size:
                data = chat_pb2.ChatClientMessage(request=chat_pb2.ChatRequest(
                    request_id=request_id, messages=[chat_pb2.Message()] * n)).SerializeToString()
                assert len(data) == size, (len(data), size)
                return data
    raise AssertionError(f"no frame of {size} bytes")


# -- validation at the edge ----------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-3])
def test_a_tiny_temperature_is_refused_and_the_batch_is_unharmed(tight_server, temperature):
    """Old: 1e-45 passed validation; logits / 1e-45 overflowed and the engine's step failed
    every running request with INTERNAL."""
    async def go():
        async with ChatStream(tight_server.target) as a, ChatStream(tight_server.target) as b:
            a.send(chat_request("other", "Describe a savings account.", max_tokens=12))
            await until_generating(a, "other")
            b.send(chat_request("tiny", "Hello?", max_tokens=4, temperature=temperature))
            tiny = (await b.until_done("tiny"))["tiny"][-1]
            return tiny, (await a.until_done("other"))["other"]

    tiny, other = asyncio.run(go())
    assert tiny.error.code == INVALID and tiny.error.field == "params.temperature"
    assert "0.01" in tiny.error.message
    assert other[-1].finished.finish_reason == chat_pb2.FINISH_REASON_LENGTH


def test_an_oversized_frame_ends_only_its_own_call(tight_server):
    """Old: an 8 MiB frame (a one-character id, a million empty messages) passed; its
    forwarded copy, with a longer id, broke the shared engine stream: UNAVAILABLE for all."""
    async def go():
        async with ChatStream(tight_server.target) as a:
            a.send(chat_request("other", "Describe a savings account.", max_tokens=12))
            await until_generating(a, "other")
            huge = RawStream(tight_server.target, [("grpc.max_send_message_length", 16 << 20)])
            huge.send(frame_of_size(8 * 1024 * 1024))
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await huge.terminals(1)
            await huge.close()
            # At the frame limit exactly: refused by count, and that stream goes on.
            edge = RawStream(tight_server.target)
            edge.send(frame_of_size(131072))
            edge.send(chat_request("after", "Say hello.", max_tokens=2))
            refused, after = await edge.terminals(2)
            await edge.close()
            return ended.value, refused, after, (await a.until_done("other"))["other"]

    ended, refused, after, other = asyncio.run(go())
    assert ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.error.code == INVALID and refused.error.field == "messages"
    assert "at most 16 messages" in refused.error.message
    assert after.request_id == "after" and after.finished.finish_reason == chat_pb2.FINISH_REASON_LENGTH
    assert other[-1].finished.finish_reason == chat_pb2.FINISH_REASON_LENGTH


def test_a_frame_with_invalid_utf8_is_one_requests_error(tight_server):
    """Old: the generated deserializer raised, silently ending the stream's reader: the
    requests after it were never answered."""
    bad = chat_pb2.ChatClientMessage(request=chat_request("bad", "PLACEHOLDER", max_tokens=2))
    bad_frame = bad.SerializeToString().replace(b"PLACEHOLDER", b"\xff\xfe broken \xc3")
    bad_cancel = chat_pb2.ChatClientMessage(cancel=chat_pb2.Cancel(request_id="XXXX")) \
        .SerializeToString().replace(b"XXXX", b"\xff\xff\xff\xff")

    async def go():
        s = RawStream(tight_server.target)
        s.send(chat_request("first", "Say hello.", max_tokens=2))
        s.send(bad_frame)
        s.send(bad_cancel)
        s.send(b"\x0a\xff\xff")  # not protobuf at all
        s.send(chat_request("last", "Say hello.", max_tokens=2))
        got = await s.terminals(5)
        await s.close()
        return {e.request_id + "/" + e.error.field: e for e in got}

    got = asyncio.run(go())
    assert set(got) == {"first/", "bad/request", "/cancel", "/", "last/"}
    assert got["bad/request"].error.code == INVALID
    assert "UTF-8" in got["bad/request"].error.message
    assert got["/cancel"].error.code == INVALID and "UTF-8" in got["/cancel"].error.message
    assert "not valid protobuf" in got["/"].error.message
    assert got["first/"].finished.finish_reason == chat_pb2.FINISH_REASON_LENGTH
    assert got["last/"].finished.finish_reason == chat_pb2.FINISH_REASON_LENGTH


# -- bounds per client -------------------------------------------------------------------


def test_requests_in_flight_are_bounded_per_stream_and_per_connection(tight_server):
    async def go():
        channel = Credentials(dev_key(tight_server.target)).channel(tight_server.target)
        stub = chat_pb2_grpc.GatewayStub(channel)
        queues = [asyncio.Queue(), asyncio.Queue()]

        async def feed(q):
            while (m := await q.get()) is not None:
                yield m

        calls = [stub.Chat(feed(q)) for q in queues]

        def send(i: int, rid: str, **kw) -> None:
            msg = chat_pb2.ChatClientMessage(request=chat_request(rid, "Tell me about bonds.", **kw)) \
                if "cancel" not in kw else chat_pb2.ChatClientMessage(cancel=chat_pb2.Cancel(request_id=rid))
            queues[i].put_nowait(msg)

        ended: list[dict] = [{}, {}]  # per call: request id -> its terminal event

        async def terminal(i: int, rid: str):
            # Requests end in any order: cancelled together, their ends may swap.
            while rid not in ended[i]:
                e = await asyncio.wait_for(calls[i].read(), 300)
                if e.WhichOneof("event") in ("finished", "error"):
                    ended[i][e.request_id] = e
            return ended[i].pop(rid)

        for n in range(5):  # the fifth is one too many on this stream
            send(0, f"s{n}", max_tokens=LONG)
        per_stream = await terminal(0, "s4")
        for n in range(3):  # 4 + 2 fill the connection
            send(1, f"c{n}", max_tokens=LONG)
        per_connection = await terminal(1, "c2")
        for rid in ("s0", "s1", "s2", "s3"):
            send(0, rid, cancel=True)
        for rid in ("c0", "c1"):
            send(1, rid, cancel=True)
        cancelled = [await terminal(0, f"s{n}") for n in range(4)]
        cancelled += [await terminal(1, f"c{n}") for n in range(2)]
        send(1, "again", max_tokens=2)
        again = await terminal(1, "again")
        for q in queues:
            q.put_nowait(None)
        await channel.close()
        return per_stream, per_connection, cancelled, again

    per_stream, per_connection, cancelled, again = asyncio.run(go())
    assert per_stream.error.code == EXHAUSTED and per_stream.error.retry_after_ms > 0
    assert "FINSIEVE_MAX_IN_FLIGHT_PER_STREAM" in per_stream.error.message
    assert per_connection.error.code == EXHAUSTED
    assert "FINSIEVE_MAX_IN_FLIGHT_PER_CONNECTION" in per_connection.error.message
    assert all(e.finished.finish_reason == chat_pb2.FINISH_REASON_CANCELLED for e in cancelled)
    assert again.finished.finish_reason == chat_pb2.FINISH_REASON_LENGTH


def test_concurrent_streams_are_bounded(tight_server):
    async def go():
        async with Credentials(dev_key(tight_server.target)).channel(tight_server.target) as channel:
            stub = chat_pb2_grpc.GatewayStub(channel)
            idle = asyncio.Event()

            async def nothing():
                await idle.wait()
                return
                yield

            calls = [stub.Chat(nothing()) for _ in range(40)]
            codes = [asyncio.ensure_future(c.code()) for c in calls]
            # The server allows 24 calls at once: 16 of these 40 are refused.
            while sum(c.done() for c in codes) < 16:
                done, _ = await asyncio.wait([c for c in codes if not c.done()], timeout=60,
                                             return_when=asyncio.FIRST_COMPLETED)
                assert done, "no call was refused"
            refused = [c.result() for c in codes if c.done()]
            for c in calls:
                c.cancel()
            return refused

    refused = asyncio.run(go())
    assert len(refused) >= 16
    assert set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_a_client_that_stops_reading_is_ended_and_its_request_cancelled(tight_server):
    ended = tight_server.metric("finsieve_streams_ended_total", reason="slow_reader")

    async def go():
        s = RawStream(tight_server.target, SMALL_WINDOW)
        s.send(chat_request("slow-long", "Describe the bond market in detail.", max_tokens=LONG))
        for n in range(40):  # ~150-byte errors: more than the client's window holds
            s.send(chat_request(f"bad{n}", "x", temperature=-1))
        # It reads nothing: after the grace period (2 s) the gateway ends the stream.
        assert await asyncio.to_thread(
            wait_for, lambda: tight_server.metric("finsieve_streams_ended_total",
                                                  reason="slow_reader") > ended, 120, 0.1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.terminals(100)
        await s.close()
        return err.value

    err = asyncio.run(go())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "read nothing" in err.details()
    assert wait_for(lambda: final_record(tight_server.server.audit_target, "slow-long"), 120, 0.2)
    record = final_record(tight_server.server.audit_target, "slow-long")
    assert record["finish_reason"] == "CANCELLED"
    assert record["usage"]["completion_tokens"] < LONG


def test_a_flood_from_a_client_that_does_not_read_is_held_back_not_buffered(tight_server):
    """The stream's reader stops taking its messages while half the outbox bound (32 events)
    waits: the flood waits in gRPC's flow control, on the client's side; nothing overflows,
    and the grace period ends the stream."""
    overflowed = tight_server.metric("finsieve_streams_ended_total", reason="overflow")
    ended = tight_server.metric("finsieve_streams_ended_total", reason="slow_reader")

    async def go():
        s = RawStream(tight_server.target, SMALL_WINDOW)
        for n in range(3000):
            s.send(chat_request(f"bad{n}", "x", temperature=-1))
        assert await asyncio.to_thread(
            wait_for, lambda: tight_server.metric("finsieve_streams_ended_total",
                                                  reason="slow_reader") > ended, 120, 0.1)
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                got.append(await asyncio.wait_for(s.call.read(), 60))
        await s.close()
        return err.value, len(got)

    err, answered = asyncio.run(go())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "read nothing" in err.details()
    assert answered < 200  # what the window and the outbox held, not the 3,000 sent
    assert tight_server.metric("finsieve_streams_ended_total", reason="overflow") == overflowed


def test_cancel_storms_reach_the_engine_once(tight_server):
    """Old: all 5,000 duplicate cancels were forwarded; each scanned every live request on
    the thread that decodes for everyone."""
    forwarded = tight_server.metric("finsieve_gateway_cancels_total", outcome="forwarded")
    dropped = tight_server.metric("finsieve_gateway_cancels_total", outcome="dropped")

    async def go():
        async with ChatStream(tight_server.target) as s:
            s.send(chat_request("storm", "Describe the bond market.", max_tokens=LONG))
            await until_generating(s, "storm")
            for n in range(5000):
                s.cancel("storm")
                s.cancel(f"unknown-{n}")
            done = (await s.until_done("storm"))["storm"]
            s.send(chat_request("after", "Say hello.", max_tokens=2))
            return done, (await s.until_done("after"))["after"]

    done, after = asyncio.run(go())
    assert done[-1].finished.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    assert kinds(after)[-1] == "finished" and text_of(after)
    assert wait_for(lambda: tight_server.metric("finsieve_gateway_cancels_total",
                                                outcome="dropped") == dropped + 9999, 120, 0.1)
    assert tight_server.metric("finsieve_gateway_cancels_total", outcome="forwarded") == forwarded + 1


# -- clients that go away -------------------------------------------------------------------


def test_a_client_that_disconnects_has_every_request_cancelled_and_audited(tight_server):
    """Old: Chat's cleanup iterated the requests while awaiting ("dictionary changed size
    during iteration"); most requests of a departed client kept generating."""
    ids = [f"gone{n}" for n in range(4)]

    async def go():
        s = ChatStream(tight_server.target)
        for rid in ids:
            s.send(chat_request(rid, "Describe the bond market in detail.", max_tokens=LONG))
        await until_generating(s, *ids)
        await s.__aexit__()  # abruptly: the call is cancelled, the channel closed

    asyncio.run(go())
    audit = tight_server.server.audit_target
    assert wait_for(lambda: all(final_record(audit, rid) for rid in ids), 120, 0.2)
    for rid in ids:
        record = final_record(audit, rid)
        assert record["finish_reason"] == "CANCELLED", record
        assert record["usage"]["completion_tokens"] < LONG


def test_a_passed_deadline_cancels_the_requests_at_the_engine(tight_server):
    ids = [f"late{n}" for n in range(3)]

    async def go():
        s = RawStream(tight_server.target, timeout=5)
        for rid in ids:
            s.send(chat_request(rid, "Describe the bond market in detail.", max_tokens=LONG))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.terminals(len(ids) + 1)
        await s.close()
        return err.value.code()

    assert asyncio.run(go()) == grpc.StatusCode.DEADLINE_EXCEEDED
    audit = tight_server.server.audit_target
    assert wait_for(lambda: all(final_record(audit, rid) for rid in ids), 120, 0.2)
    assert {final_record(audit, rid)["finish_reason"] for rid in ids} == {"CANCELLED"}


# -- engines that do not answer -----------------------------------------------------------------


def test_engines_that_do_not_answer_are_marked_down_once_and_serialize_nothing(tight_server, tmp_path):
    """Old: every request waited for the silent engines' connect timeout in turn, under one
    lock; here a 60 s timeout would cost each request a minute."""
    silent = socket.socket()  # accepts TCP (the kernel's backlog), never speaks HTTP/2
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    dead = f"127.0.0.1:{free_port()}"  # refuses connections
    engines = [f"127.0.0.1:{silent.getsockname()[1]}", dead, tight_server.engine_target]
    gateway = start_server(tmp_path, "--role", "gateway", *(a for e in engines for a in ("--engine", e)),
                           env={"FINSIEVE_ENGINE_CONNECT_TIMEOUT_S": "60", "FINSIEVE_CACHE_TTL_S": "0",
                                "FINSIEVE_ENGINE_SECRET_FILE": str(tight_server.engine_secret_file)})
    try:
        async def wave(tag: str):
            s = RawStream(gateway.target, timeout=30)
            for n in range(8):
                s.send(chat_request(f"{tag}{n}", "Say hello.", max_tokens=2))
            done = await s.terminals(8)
            await s.close()
            return [e for e in done if e.WhichOneof("event") == "finished"]

        def marked_down() -> int:
            lines = [json.loads(ln) for ln in gateway.log().splitlines() if ln.startswith("{")]
            return sum(ln["event"].startswith("engine marked down") and ln.get("engine") == dead
                       for ln in lines)

        assert len(asyncio.run(wave("a"))) == 8
        assert wait_for(lambda: marked_down() > 0, timeout=60)
        assert len(asyncio.run(wave("b"))) == 8
        assert marked_down() == 1
    finally:
        gateway.stop()
        silent.close()


# -- the audit trail -------------------------------------------------------------------------------


def test_an_intervention_without_a_rule_id_keeps_its_audit_record(tmp_path):
    """Old: index_values raised KeyError (protobuf's JSON mapping omits an empty rule_id), so
    the request's final record was lost."""
    valkey = EmbeddedValkey(tmp_path / "valkey", appendfsync="no")
    valkey.start()

    async def go():
        client = redis.Redis(port=valkey.port, password=valkey.password)
        try:
            log = AuditLog(client, b"key")
            await log.append("request", {"request_id": "r1", "finish_reason": "CONTENT_FILTER",
                                         "interventions": [{"action": "halt",
                                                            "message": "no allowed continuation"}]})
            found, _ = await log.query(Filters(action="halt"), limit=10)
            return found, await verify(log)
        finally:
            await client.aclose()

    try:
        found, verdict = asyncio.run(go())
    finally:
        valkey.stop()
    assert [r["request_id"] for r in found] == ["r1"] and verdict.ok
