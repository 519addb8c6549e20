"""The guard's answer per sampled token (Guard.judge): one complete action the engine carries
out (engine/enforce.py) without reading the guard's state. A small pack, no model."""

from __future__ import annotations

from pathlib import Path

from finsieve.policy.guard import ACCEPTED, Accept, Guard, Halt, Policy, Redo, Resample, RollBack
from finsieve.policy.pack import Pack

TOKENS = [b"ok ", b"my secret", b"sec", b"ret", b" fine", b"stop", b"pay", b" now"]
OK, SECRET_IN_ONE, SEC, RET, FINE, STOP, PAY, NOW = range(len(TOKENS))


def _guard(tmp_path: Path, max_resamples: int = 32) -> Guard:
    """block 'secret', halt on 'stop', rewrite 'pay now' as '[paid]'."""
    (tmp_path / "a.yaml").write_text(
        "rules:\n"
        "  - {id: b, description: t, kind: literal, patterns: [secret], action: block}\n"
        "  - {id: h, description: t, kind: literal, patterns: [stop], action: halt, message: m}\n"
        "  - {id: w, description: t, kind: literal, patterns: [pay now], action: rewrite,"
        " replacement: '[paid]'}\n")
    pack = Pack.load(tmp_path)
    return Guard(Policy(pack, None, pack.version), TOKENS, max_resamples=max_resamples)


def _judge(guard: Guard, token: int, first: int | None = None, bans: list[int] | None = None):
    """A token sampled under its exact bans (an empty list: the pack has no mask tables)."""
    return guard.judge(token, token if first is None else first, [] if bans is None else bans,
                       True, False)


def test_a_clean_token_is_accepted_and_its_text_taken_once(tmp_path):
    guard = _guard(tmp_path)
    assert _judge(guard, OK) is ACCEPTED
    assert guard.take(None, False) == ("ok ", 1)
    assert guard.take(None, False) == ("", 1)
    assert guard.take_events() == []


def test_no_token_allowed_halts_with_nothing_to_deliver(tmp_path):
    action = _judge(_guard(tmp_path), -1)
    assert isinstance(action, Halt) and action.text == ""
    assert action.intervention.message == "no allowed continuation"


def test_an_optimistic_token_banned_since_its_row_launched_is_decoded_again(tmp_path):
    guard = _guard(tmp_path)
    assert isinstance(_judge(guard, SECRET_IN_ONE), Resample)  # now banned at position 0
    assert guard.judge(SECRET_IN_ONE, SECRET_IN_ONE, None, True, False) == Redo(1)
    assert _judge(guard, OK) is ACCEPTED  # the position is still open: nothing was fed


def test_a_block_span_inside_the_token_resamples_then_halts_past_the_bound(tmp_path):
    guard = _guard(tmp_path, max_resamples=2)
    action = _judge(guard, SECRET_IN_ONE)
    assert isinstance(action, Resample)
    [event] = action.events
    assert (event.rule_id, event.action, event.suppressed) == ("b", "block", "secret")
    assert guard.next_bans() == ([SECRET_IN_ONE], True)  # banned at this position
    halted = _judge(guard, SECRET_IN_ONE)
    assert isinstance(halted, Halt) and [e.rule_id for e in halted.events] == ["b"]


def test_a_block_span_across_tokens_rolls_back_to_its_start_and_bans_it_there(tmp_path):
    guard = _guard(tmp_path)
    assert [_judge(guard, t) for t in (OK, SEC)] == [ACCEPTED, ACCEPTED]
    action = _judge(guard, RET)
    assert isinstance(action, RollBack) and (action.keep, action.forced) == (1, None)
    assert action.intervention.rolled_back and action.intervention.tokens_recomputed == 2
    assert guard.next_bans() == ([SEC], True)  # the span's first token, at its position
    assert _judge(guard, FINE) is ACCEPTED
    assert guard.take(None, True) == ("ok  fine", 2)


def test_a_rewrite_rolls_back_and_forces_its_text(tmp_path):
    guard = _guard(tmp_path)
    assert [_judge(guard, t) for t in (OK, PAY)] == [ACCEPTED, ACCEPTED]
    action = _judge(guard, NOW)
    assert isinstance(action, RollBack) and action.keep == 1
    assert action.forced == "[paid]"


def test_a_halt_rule_delivers_only_the_safe_text(tmp_path):
    guard = _guard(tmp_path)
    assert _judge(guard, OK) is ACCEPTED
    action = _judge(guard, STOP)
    assert isinstance(action, Halt) and action.text == "ok "
    assert (action.intervention.rule_id, action.intervention.message) == ("h", "m")


def test_a_masked_first_choice_is_told_with_the_accepted_token(tmp_path):
    """The model preferred a token the bans removed: the accept carries the rule it broke."""
    guard = _guard(tmp_path)
    action = _judge(guard, OK, first=SECRET_IN_ONE, bans=[SECRET_IN_ONE])
    assert isinstance(action, Accept)
    [event] = action.events
    assert (event.rule_id, event.action) == ("b", "block")
    assert guard.take(None, False) == ("ok ", 1)  # the first choice left nothing behind


def test_settle_accepts_a_clean_end(tmp_path):
    guard = _guard(tmp_path)
    assert _judge(guard, OK) is ACCEPTED
    assert guard.settle() is ACCEPTED
