"""Pure pieces without a model: text assembly, stop strings, configuration."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tokens import IncrementalText, find_stop, stop_holdback
from finsieve.config import ConfigError, Settings


def test_incremental_text_keeps_half_characters_pending():
    table = [bytes([b]) for b in "年化15%".encode()]
    text = IncrementalText(table)
    pieces = [text.add(i) for i in range(len(table))]
    assert pieces == ["", "", "年", "", "", "化", "1", "5", "%"]
    assert text.text == "年化15%"


def test_incremental_text_replaces_invalid_bytes_instead_of_stalling():
    text = IncrementalText([b"\xff", b"ok"])
    assert text.add(0) + text.add(1) == "\ufffdok"


def test_incremental_text_knows_the_raw_offset_of_every_character():
    # U+FFFD for 1 byte, for 2 (an incomplete character cut short), and a genuine one (3)
    table = [b"\xff", b"ok", b"\xe4\xb8", b"\xef\xbf\xbd", b"!"]
    text = IncrementalText(table)
    for t in range(len(table)):
        text.add(t)
    assert text.text == "\ufffdok\ufffd\ufffd!"
    assert [text.raw_offset(i) for i in range(len(text.text) + 1)] == [0, 1, 2, 3, 5, 8, 9]
    text.cut(3)
    assert (text.text, text.raw_len) == ("\ufffdok", 3)


# Bytes that make every kind of invalid UTF-8: stray continuations, lone and cut-short
# leads, overlongs, surrogates, past U+10FFFF; and valid characters around them.
_UTF8_PIECES = st.lists(st.sampled_from(
    [bytes([b]) for b in (0x61, 0x80, 0xBF, 0xC0, 0xC3, 0xA9, 0xE0, 0xA0, 0xED, 0xE4, 0xB8,
                          0xAD, 0xF0, 0x90, 0x8D, 0xF4, 0x8F, 0xF5, 0xFF)]
    + [b"ok", b"\xef\xbf\xbd", "年".encode()]), max_size=12)


@settings(max_examples=500, deadline=None)
@given(pieces=st.lists(_UTF8_PIECES.map(b"".join), max_size=6))
def test_incremental_text_raw_offsets_split_the_bytes_where_the_text_splits(pieces):
    """The guard releases raw bytes: those up to a character's offset must be the text
    before it, however the bytes came in tokens."""
    text = IncrementalText(pieces)
    for t in range(len(pieces)):
        text.add(t)
    data = b"".join(pieces)[: text.raw_len]
    assert data.decode("utf-8", "replace") == text.text
    for i in range(len(text.text) + 1):
        offset = text.raw_offset(i)
        assert data[:offset].decode("utf-8", "replace") == text.text[:i]
        assert data[offset:].decode("utf-8", "replace") == text.text[i:]


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
     ({"FINSIEVE_ROLE": "gateway"}, "--engine"),
     ({"FINSIEVE_MAX_MESSAGE_BYTES": "300000"}, "FINSIEVE_MAX_MESSAGE_BYTES: at least 337872"),
     ({"FINSIEVE_MAX_MESSAGE_BYTES": "9000000"}, "FINSIEVE_MAX_MESSAGE_BYTES: at most 8388608"),
     ({"FINSIEVE_MIN_PING_INTERVAL_S": "90"}, "must not exceed FINSIEVE_KEEPALIVE_TIME_S"),
     ({"FINSIEVE_MAX_CONNECTION_AGE_S": "-1"}, "must not be negative"),
     ({"FINSIEVE_SLOW_READER_GRACE_S": "0"}, "FINSIEVE_SLOW_READER_GRACE_S: must be positive"),
     ({"FINSIEVE_PREPARE_WORKERS": "-1"}, "FINSIEVE_PREPARE_WORKERS: must not be negative"),
     ({"FINSIEVE_PREPARE_WORKERS": "65"}, "FINSIEVE_PREPARE_WORKERS: at most 64"),
     ({"FINSIEVE_MIXED_TOKENS": "-1"}, "FINSIEVE_MIXED_TOKENS: must not be negative"),
     ({"FINSIEVE_MIXED_TOKENS": "8"}, "FINSIEVE_MIXED_TOKENS: 0 .off., or from 16 to 2048"),
     ({"FINSIEVE_MIXED_TOKENS": "4096", "FINSIEVE_PREFILL_CHUNK": "8192"}, "from 16 to 2048"),
     ({"FINSIEVE_MIXED_TOKENS": "512", "FINSIEVE_PREFILL_CHUNK": "256"},
      "at most FINSIEVE_PREFILL_CHUNK")],
)
def test_bad_settings_name_the_setting(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Settings.load(env=env)


def test_the_redis_url_is_read_from_a_private_file(tmp_path):
    url = "rediss://:hunter2@redis:6380/0"
    path = tmp_path / "redis.url"
    path.write_text(url + "\n")
    path.chmod(0o600)
    assert Settings.load(env={"FINSIEVE_REDIS_URL_FILE": str(path)}).redis_url == url
    with pytest.raises(ConfigError, match="set it or FINSIEVE_REDIS_URL, not both"):
        Settings.load(env={"FINSIEVE_REDIS_URL_FILE": str(path), "FINSIEVE_REDIS_URL": url})
    path.chmod(0o644)
    with pytest.raises(ConfigError) as err:
        Settings.load(env={"FINSIEVE_REDIS_URL_FILE": str(path)})
    assert "FINSIEVE_REDIS_URL_FILE" in str(err.value) and "chmod 600" in str(err.value)
    assert "hunter2" not in str(err.value)
    path.write_bytes("redis://:pässword@redis/0".encode())
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="not a URL") as err:
        Settings.load(env={"FINSIEVE_REDIS_URL_FILE": str(path)})
    assert "pässword" not in str(err.value)


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


def test_what_validation_accepts_fits_the_frame_limit_and_the_engine_link():
    """By construction: a valid request at every limit is within largest_valid_request, and
    its forwarded copy (a longer internal id) within the gateway-engine link's limit."""
    from finsieve.grpc_server import ENGINE_MESSAGE_BYTES, MAX_MESSAGE_BYTES
    from finsieve.v1 import chat_pb2
    from gateway.validation import (
        MAX_METADATA_CHARS,
        MAX_METADATA_ENTRIES,
        MAX_REQUEST_ID,
        MAX_STOP_CHARS,
        MAX_STOP_STRINGS,
        Limits,
        largest_valid_request,
        validate,
    )

    for max_input, max_messages in [(262144, 256), (16384, 16), (7_000_000, 4096)]:
        wide = "😀"
        req = chat_pb2.ChatRequest(request_id=wide * MAX_REQUEST_ID)
        per = max_input // max_messages
        for _ in range(max_messages):
            req.messages.add(role="assistant", content="x" * per)
        p = req.params
        p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed = 1024, 2.0, 1.0, 1000, -(2**63)
        p.stop.extend([wide * MAX_STOP_CHARS] * MAX_STOP_STRINGS)
        for k in range(MAX_METADATA_ENTRIES):
            req.metadata[f"{k:03d}" + wide * (MAX_METADATA_CHARS - 3)] = wide * MAX_METADATA_CHARS
        validate(req, Limits(1024, max_input, max_messages))
        frame = chat_pb2.ChatClientMessage(request=req).ByteSize()
        assert frame <= largest_valid_request(max_input, max_messages)
        req.request_id = "r" + "9" * 20  # the longest internal id (a 64-bit counter)
        forwarded = chat_pb2.ChatClientMessage(request=req).ByteSize()
        assert forwarded <= frame + 64  # only the id differs
    assert MAX_MESSAGE_BYTES + 64 <= ENGINE_MESSAGE_BYTES  # so any accepted frame fits the link


def test_the_doorbell_wakes_its_loop_once_for_the_steps_of_every_stream_and_keeps_their_order():
    """The engine hands each gateway stream its step in a row: one wakeup of the asyncio
    loop for them all (each costs a self-pipe write and a GIL handoff), nothing lost, each
    stream's steps in order, also when handed over from another thread."""
    import threading

    from engine.server import Doorbell
    from finsieve.v1 import engine_pb2

    def step(n: int) -> engine_pb2.EngineStep:
        return engine_pb2.EngineStep(status=engine_pb2.EngineStatus(model=str(n)))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]  # type: ignore[method-assign]
        bell, queues = Doorbell(loop), [asyncio.Queue() for _ in range(4)]
        for n in range(2):  # two engine steps, from the loop's own thread: nothing runs between
            for q in queues:
                bell.put(q, step(n))
            await asyncio.sleep(0)
            assert len(wakeups) == n + 1
        worker = threading.Thread(target=lambda: [bell.put(q, step(n)) for n in range(2, 200)
                                                  for q in queues])
        worker.start()
        await asyncio.to_thread(worker.join)
        await asyncio.sleep(0)
        for q in queues:
            got = [q.get_nowait().status.model for _ in range(q.qsize())]
            assert got == [str(n) for n in range(200)]

    asyncio.run(main())
