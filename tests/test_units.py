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
