"""Hot reload on real files: new packs swap in, holders keep theirs, bad packs are refused."""

from __future__ import annotations

import time
from pathlib import Path

from finsieve.policy.pack import Pack
from finsieve.policy.reload import RELOADS, PolicyHolder, RulesWatcher

RULE = """\
rules:
  - id: {id}
    description: test rule
    kind: literal
    patterns: [{pattern}]
    action: block
"""


def compile_pack(directory: Path) -> tuple[Pack, str]:
    pack = Pack.load(directory)
    return pack, pack.version


def wait_for(condition, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_edits_swap_the_pack_and_a_bad_pack_leaves_the_old_one_in_force(tmp_path):
    (tmp_path / "a.yaml").write_text(RULE.format(id="first", pattern="foo"))
    first, version = compile_pack(tmp_path)
    holder = PolicyHolder(first, version)
    watcher = RulesWatcher(tmp_path, holder, compile_pack)
    watcher.start()
    try:
        time.sleep(0.3)  # the watcher is up
        held = holder.current  # a request in flight took this pack
        (tmp_path / "b.yaml").write_text(RULE.format(id="second", pattern="bar"))
        assert wait_for(lambda: holder.version != version)
        assert holder.current.rule("second") is not None
        assert held.version == version and held.rule("second") is None  # the holder keeps its own

        rejected = RULES_REJECTED()
        good_version = holder.version
        (tmp_path / "c.yaml").write_text(RULE.format(id="second", pattern="[]").replace(
            "action: block", "action: explode"))
        assert wait_for(lambda: holder.events[-1].kind == "rule_pack_rejected")
        assert holder.version == good_version
        reason = holder.events[-1].reason
        assert "c.yaml:6: second: action: unknown value 'explode'" in reason
        assert "c.yaml:2: second: id: duplicate id" in reason
        assert RULES_REJECTED() == rejected + 1

        (tmp_path / "c.yaml").unlink()  # fixing the pack brings reloads back
        (tmp_path / "b.yaml").write_text(RULE.format(id="second", pattern="baz"))
        assert wait_for(lambda: holder.version not in (version, good_version))
        assert holder.current.rule("second").patterns == ("baz",)
    finally:
        watcher.stop()


def RULES_REJECTED() -> float:
    return RELOADS.labels("rejected")._value.get()


def test_a_swap_is_announced_and_the_replaced_policy_goes_without_the_cyclic_collector(tmp_path):
    """Serving processes freeze their heap after each swap (gc.freeze): a replaced pack and
    its masks must be freed by reference counting alone, once the last request using them
    ends, or every reload would leak the pack it replaced."""
    import gc
    import weakref

    from finsieve.policy.guard import Guard, compile_policy
    from finsieve.policy.masks import TokenTable

    vocab = [bytes([b]) for b in range(256)] + [b" foo", b" bar"]
    tokens = TokenTable.build(vocab)
    (tmp_path / "a.yaml").write_text(RULE.format(id="first", pattern="foo"))
    policy, version = compile_policy(tmp_path, tokens, None)
    holder = PolicyHolder(policy, version)
    swaps: list[str] = []
    watcher = RulesWatcher(tmp_path, holder, lambda d: compile_policy(d, tokens, None),
                           on_swap=lambda: swaps.append(holder.version))
    guard = Guard(policy, vocab, 8)  # a request under the first pack fills its memos
    for token in (257, 32, 102, 111):
        guard.banned()
        guard.check(token)
    refs = [weakref.ref(o) for o in (policy.pack, policy.pack.output, policy.pack.output.literals,
                                     policy.masks)]
    del policy
    gc.disable()
    try:
        watcher.start()
        time.sleep(0.3)  # the watcher is up
        (tmp_path / "b.yaml").write_text(RULE.format(id="second", pattern="bar"))
        assert wait_for(lambda: bool(swaps))
        assert swaps == [holder.version] and holder.version != version
        assert all(r() is not None for r in refs)  # the request still holds it
        del guard
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()
        watcher.stop()
