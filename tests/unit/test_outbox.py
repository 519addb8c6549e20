"""gateway/outbox.py: a stream's bounded queue of events, deltas of a request merged."""

from __future__ import annotations

import asyncio


def _delta(rid: str, text: str):
    from finsieve.v1 import chat_pb2

    return chat_pb2.ChatServerMessage(request_id=rid, delta=chat_pb2.Delta(text=text, tokens=1))


def _finished(rid: str):
    from finsieve.v1 import chat_pb2

    return chat_pb2.ChatServerMessage(request_id=rid, finished=chat_pb2.Finished())


def test_waiting_deltas_of_a_request_go_out_as_one_and_order_is_kept():
    from gateway.outbox import Outbox

    held = _delta("a", "x")
    events = [held, _delta("a", "y"), _delta("b", "1"), _delta("a", "z"), _finished("a"),
              _delta("a", "late"), _delta("b", "2"), None]
    out = Outbox()
    for e in events:
        out.put(e)
    summary = [(e.request_id, e.WhichOneof("event"), e.delta.text, e.delta.tokens) if e else None
               for e in asyncio.run(out.take())]
    assert summary == [("a", "delta", "xyz", 3), ("b", "delta", "12", 2), ("a", "finished", "", 0),
                       ("a", "delta", "late", 1), None]
    assert held.delta.text == "x"  # the original is untouched (the cache keeps it)


def test_outbox_is_bounded_deltas_merge_and_other_events_overflow_it():
    from gateway.outbox import Outbox

    out = Outbox(max_events=3)
    for i in range(10_000):  # a long answer to a client that does not read: one event
        out.put(_delta("a", str(i % 10)))
    assert not out.overflowed
    out.put(_finished("a"))
    out.put(_finished("b"))
    assert not out.overflowed
    out.put(_finished("c"))
    assert out.overflowed
    out.put(_delta("d", "dropped"))
    assert asyncio.run(out.take()) == []
