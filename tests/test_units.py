"""Pure pieces without a model: text assembly, stop strings, configuration."""

from __future__ import annotations

import pytest

from finsieve.config import ConfigError, Settings
from finsieve.engine.tokens import IncrementalText, find_stop, stop_holdback


def test_incremental_text_keeps_half_characters_pending():
    table = [bytes([b]) for b in "年化15%".encode()]
    text = IncrementalText(table)
    pieces = [text.add(i) for i in range(len(table))]
    assert pieces == ["", "", "年", "", "", "化", "1", "5", "%"]
    assert text.text == "年化15%"


def test_incremental_text_replaces_invalid_bytes_instead_of_stalling():
    text = IncrementalText([b"\xff", b"ok"])
    assert text.add(0) + text.add(1) == "\ufffdok"


@pytest.mark.parametrize(
    ("text", "stops", "held"),
    [("the end", ("END",), 0), ("the E", ("END",), 1), ("the EN", ("END",), 2),
     ("the EN", ("N!", "ENX"), 2), ("abc", (), 0), ("xEEN", ("EEND",), 3)],
)
def test_stop_holdback_holds_only_a_possible_stop_prefix(text, stops, held):
    assert stop_holdback(text, stops) == held


def test_find_stop_finds_the_earliest():
    assert find_stop("a STOP b END", ("END", "STOP"), 0) == 2
    assert find_stop("a STOP b", ("END",), 0) == -1


def test_settings_from_environment_and_flags():
    s = Settings.load({"port": 7000}, env={"FINSIEVE_PORT": "6000", "FINSIEVE_MAX_BATCH": "4",
                                           "FINSIEVE_ENGINES": "a:1, b:2"})
    assert (s.port, s.max_batch, s.engines) == (7000, 4, ("a:1", "b:2"))


@pytest.mark.parametrize(
    ("env", "message"),
    [({"FINSIEVE_PORT": "eighty"}, "FINSIEVE_PORT: 'eighty'"),
     ({"FINSIEVE_ROLE": "boss"}, "expected one of all, engine, gateway"),
     ({"FINSIEVE_MAX_BATCH": "0"}, "FINSIEVE_MAX_BATCH: must be positive"),
     ({"FINSIEVE_ROLE": "gateway"}, "--engine")],
)
def test_bad_settings_name_the_setting(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Settings.load(env=env)


def test_waiting_deltas_of_a_request_go_out_as_one_and_order_is_kept():
    from finsieve.gateway.outbox import coalesce
    from finsieve.v1 import chat_pb2

    def delta(rid: str, text: str) -> chat_pb2.ChatServerMessage:
        return chat_pb2.ChatServerMessage(request_id=rid, delta=chat_pb2.Delta(text=text, tokens=1))

    def finished(rid: str) -> chat_pb2.ChatServerMessage:
        return chat_pb2.ChatServerMessage(request_id=rid, finished=chat_pb2.Finished())

    held = delta("a", "x")
    events = [held, delta("a", "y"), delta("b", "1"), delta("a", "z"), finished("a"),
              delta("a", "late"), delta("b", "2"), None]
    out = coalesce(events)
    summary = [(e.request_id, e.WhichOneof("event"), e.delta.text, e.delta.tokens) if e else None
               for e in out]
    assert summary == [("a", "delta", "xyz", 3), ("b", "delta", "12", 2), ("a", "finished", "", 0),
                       ("a", "delta", "late", 1), None]
    assert held.delta.text == "x"  # the original is untouched (the cache keeps it)
