"""Rule packs are untrusted input (issue 8): bounded loading, regular files only, bounded
regex cost per token, a rejected pack never changes what is in force, the watcher survives.

Loading on real files; hot reload through the real watcher and through a running server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from finsieve.app.client import chat_request
from finsieve.app.serve import ENGINE_SWITCH_INTERVAL_S
from finsieve.policy.guard import ACCEPT, Guard, Policy, Verdict
from finsieve.policy.matcher import (
    HELD_CHARS,
    MAX_WAIT_S,
    REGEX_TIMEOUTS,
    StreamMatcher,
    scan_text,
    within_cpu_budget,
)
from finsieve.policy.pack import Pack
from finsieve.policy.reload import MAX_REASON_CHARS, PolicyHolder, RulesWatcher
from finsieve.policy.schema import MAX_NESTED, MAX_REGEXES, MAX_SPAN, PackError
from finsieve.policy.sources import PackLimits
from finsieve.v1 import chat_pb2

from support.packs import apply, canary_halts
from support.processes import wait_for
from support.streams import ChatStream, kinds

RULE = """\
  - id: {id}
    description: test rule
    kind: {kind}
    patterns: [{pattern}]
    action: {action}
"""


def rule(id: str = "r1", pattern: str = "foo", kind: str = "literal", action: str = "block",
         extra: str = "") -> str:
    return "rules:\n" + RULE.format(id=id, kind=kind, pattern=pattern, action=action) + extra


def rejected(directory: Path, limits: PackLimits | None = None) -> list[str]:
    """Every problem of the pack, file paths relative to directory."""
    with pytest.raises(PackError) as err:
        Pack.load(directory, limits or PackLimits())
    return [str(p).replace(f"{directory}/", "") for p in err.value.problems]


# -- bounded parsing ---------------------------------------------------------------------------


def billion_laughs(levels: int) -> str:
    """A few hundred bytes whose aliases expand to 10**levels strings: a rule's description
    (anchors under `pack`, whose content is free)."""
    lines = ['pack:', '  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n" + rule().replace("test rule", f"*l{levels - 1}")


def test_alias_expansion_is_measured_not_built(tmp_path):
    """Old: the aliases were expanded before any type was checked (7 levels: ten million
    strings, about 100 MB; a few levels more: ~24 GB)."""
    text = billion_laughs(7)
    assert len(text) < 1000
    (tmp_path / "lol.yaml").write_text(text)
    tracemalloc.start()
    try:
        problems = rejected(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert any(p.startswith("lol.yaml:") and "once aliases are expanded" in p for p in problems), problems
    assert peak < 16 * 1024 * 1024


@pytest.mark.parametrize("case", ["flow", "block", "recursive alias", "deep through aliases"])
def test_deep_yaml_is_a_problem_with_a_line_not_a_recursion_error(tmp_path, case):
    """Old: deep nesting raised RecursionError out of the loader (and killed the watcher)."""
    text = {
        "flow": "rules: " + "[" * 20000 + "]" * 20000 + "\n",
        "block": "rules:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 400)) + "  " * 400 + "x\n",
        "recursive alias": "x: &a [*a]\n" + rule(),
        "deep through aliases": "a: &a " + "[" * 30 + "]" * 30 + "\nb: &b [[[[[[*a]]]]]]\n" + rule(),
    }[case]
    (tmp_path / "deep.yaml").write_text(text)
    problems = rejected(tmp_path)
    assert len(problems) == 1 and problems[0].startswith("deep.yaml:"), problems
    line = int(problems[0].split(":")[1])
    assert line >= 1
    assert "nested deeper than 32" in problems[0] or "refers to a node that contains it" in problems[0]


def test_definitions_that_use_themselves_or_grow_are_refused(tmp_path):
    """Old: expansion ran ten rounds: a self-reference grew ten-fold (or 2**10-fold) and was
    then accepted as a regex that still said ${a}."""
    (tmp_path / "defs.yaml").write_text(
        "definitions:\n"
        "  a: '${a}x'\n"
        "  b: '${c}'\n"
        "  c: '${b}'\n"
        "  d: '(?:${a})?y'\n"
        "  e: '${f}${f}${f}${f}${f}${f}${f}${f}'\n"
        "  f: '${g}${g}${g}${g}${g}${g}${g}${g}'\n"
        "  g: '" + "z" * 200 + "'\n"
        + rule(kind="regex", pattern="'${e}'", extra="    max_span: 10\n"))
    problems = rejected(tmp_path)
    assert "defs.yaml:2: -: definitions.a: uses itself (a -> a)" in problems
    assert "defs.yaml:3: -: definitions.b: uses itself (b -> c -> b)" in problems
    assert "defs.yaml:4: -: definitions.c: uses itself (c -> b -> c)" in problems \
        or "defs.yaml:4: -: definitions.c: uses itself (b -> c -> b)" in problems
    assert "defs.yaml:5: -: definitions.d: uses definition ${a}, which is invalid" in problems
    assert any(p.startswith("defs.yaml:6: -: definitions.e: expands to ") for p in problems), problems
    assert any(p.startswith("defs.yaml:13: r1: patterns: '${e}' uses definition ${e}") for p in problems)


@pytest.mark.parametrize(("pattern", "why"), [
    ("(" * 300 + "a" + ")" * 300, "nests groups 300 deep (at most 32)"),
    ("a" * 9000, "expands to 9000 characters (at most 8192)"),
])
def test_regex_size_and_nesting_are_bounded(tmp_path, pattern, why):
    """Old: 300 nested groups raised RecursionError out of the compiler."""
    (tmp_path / "re.yaml").write_text(rule(kind="regex", pattern=f"'{pattern}'", extra="    max_span: 10\n"))
    problems = rejected(tmp_path)
    assert len(problems) == 1 and problems[0].startswith("re.yaml:5: r1: patterns: ")
    assert why in problems[0] and len(problems[0]) < 600


def test_a_literal_past_the_bound_is_refused_and_one_at_it_still_matches(tmp_path):
    """Old: a literal had no bound but the pack's size. The automaton walks a pattern's
    failure links at each character, so a long periodic literal made every token of text
    following it cost in proportion to its length, on the decode loop that all streams share
    (4,001 characters: 1.8 ms a token)."""
    longest = "ab" * (MAX_SPAN // 2)
    (tmp_path / "a.yaml").write_text(rule(pattern=f"'{longest}'") + RULE.format(
        id="r2", kind="literal", pattern=f"'{longest}c'", action="block"))
    (problem,) = rejected(tmp_path)
    assert problem.startswith("a.yaml:10: r2: patterns: 'abab") and len(problem) < 600
    assert f"normalizes to {MAX_SPAN + 1} characters (at most {MAX_SPAN})" in problem
    (tmp_path / "a.yaml").write_text(rule(pattern=f"'{longest}'"))
    matcher = StreamMatcher(Pack.load(tmp_path).output)  # the longest a pack may hold
    assert matcher.feed(longest.encode())[0].rule.id == "r1"  # still found


@pytest.mark.parametrize(("pattern", "span", "why"), [
    (r"\d[\d ]*\d", MAX_SPAN + 1, f"max_span: must be a positive number of characters, at most {MAX_SPAN}"),
    (f"x{{1,{MAX_SPAN + 1}}}", None,
     f"max_span: required: a pattern can match up to {MAX_SPAN + 1} characters"),
    (f"x{{1,{MAX_SPAN}}}", None, ""),
    (r"\d[\d ]*\d", MAX_SPAN, ""),
])
def test_a_regex_looks_for_matches_of_at_most_the_bound(tmp_path, pattern, span, why):
    """Old: max_span had no bound. A match that its validators reject is searched again from
    the next character, each search and check as long as the span: a 1,000-digit run that
    Luhn rejects cost 70 ms in the token that ended it, on the loop all streams share."""
    extra = f"    max_span: {span}\n" if span else ""
    (tmp_path / "re.yaml").write_text(rule(kind="regex", pattern=f"'{pattern}'", extra=extra))
    if why:
        (problem,) = rejected(tmp_path)
        assert problem.startswith("re.yaml:") and why in problem, problem
    else:
        assert Pack.load(tmp_path).output.regexes[0].max_span == MAX_SPAN


def test_the_regex_patterns_of_a_pack_are_bounded(tmp_path):
    """Old: unbounded. Each regex that may begin at a new character is searched after every
    token: 1,000 that may begin at any letter cost 5.6 ms a token of every stream."""
    patterns = ", ".join(f"'w{i}\\w+'" for i in range(MAX_REGEXES))
    extra = "    max_span: 20\n"
    (tmp_path / "a.yaml").write_text(rule(kind="regex", pattern=patterns, extra=extra))
    assert len(Pack.load(tmp_path).output.regexes) == MAX_REGEXES
    (tmp_path / "b.yaml").write_text(rule(id="r2", kind="regex", pattern="'one more'"))
    assert rejected(tmp_path) == [
        f"b.yaml:2: r2: patterns: the pack has more than {MAX_REGEXES} regex patterns"]


def test_literals_that_end_one_another_are_bounded(tmp_path):
    """Old: unbounded. "x", "xx", … each add a match at every character of "xxxx…": 256 of
    them cost 9 ms a token. Each rule that holds a literal adds its own match, so a literal
    counts once per rule (found by review: sixteen rules of sixteen literals loaded)."""
    nested = ", ".join("x" * n for n in range(1, MAX_NESTED + 1))
    (tmp_path / "a.yaml").write_text(rule(pattern=nested))
    assert len(Pack.load(tmp_path).output.literals.keys) == MAX_NESTED
    (tmp_path / "b.yaml").write_text(rule(id="r2", pattern="'a " + "x" * MAX_NESTED + "'"))
    (problem,) = rejected(tmp_path)
    assert problem == (f"b.yaml:2: r2: patterns: 'a {'x' * MAX_NESTED}': {MAX_NESTED + 1} matches "
                       "end where it ends (it and the literals that end it, once per rule that "
                       f"holds each; at most {MAX_NESTED})")
    half = ", ".join("x" * n for n in range(1, MAX_NESTED // 2 + 1))
    (tmp_path / "a.yaml").write_text(rule(pattern=half))
    (tmp_path / "b.yaml").write_text(rule(id="r2", pattern=half))
    assert len(Pack.load(tmp_path).output.literals.keys) == MAX_NESTED // 2
    (tmp_path / "c.yaml").write_text(rule(id="r3", pattern="x"))
    assert [p.split(": ")[:2] for p in rejected(tmp_path)] == [["a.yaml:2", "r1"], ["b.yaml:2", "r2"]]


def test_control_characters_are_a_problem_with_a_line(tmp_path):
    """Found by the pack fuzzer: YAML's reader refuses them before parsing starts."""
    (tmp_path / "a.yaml").write_text(rule() + "# \x05\n")
    assert rejected(tmp_path) == ["a.yaml:7: -: yaml: not valid YAML: character U+0005 is not allowed"]


def test_values_quoted_in_problems_are_shortened(tmp_path):
    (tmp_path / "a.yaml").write_text(rule(action="z" * 100_000))
    (problem,) = rejected(tmp_path)
    assert problem.startswith("a.yaml:6: r1: action: unknown value 'zzz") and len(problem) < 600


def test_the_pack_size_is_bounded(tmp_path):
    (tmp_path / "a.yaml").write_text(rule())
    (tmp_path / "b.yaml").write_text("# padding\n" * 200 + rule(id="r2"))
    problems = rejected(tmp_path, PackLimits(max_bytes=1000))
    assert problems == ["b.yaml:0: -: file: the pack's files exceed 1000 bytes together "
                        "(FINSIEVE_RULES_MAX_BYTES)"]


# -- regular files only -----------------------------------------------------------------------


def test_fifos_and_devices_are_refused_without_blocking(tmp_path):
    """Old: reading a FIFO named *.yaml blocked the loader (and so the watcher) for good."""
    (tmp_path / "good.yaml").write_text(rule())
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    (tmp_path / "null.yaml").symlink_to("/dev/null")
    outcome: list = []
    loader = threading.Thread(target=lambda: outcome.append(rejected(tmp_path)), daemon=True)
    loader.start()
    loader.join(30)
    if loader.is_alive():  # release a blocked reader before failing
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome, "loading blocked on the FIFO"
    assert outcome[0] == ["null.yaml:0: -: file: not a regular file (a FIFO, device or directory)",
                          "pipe.yaml:0: -: file: not a regular file (a FIFO, device or directory)"]


def configmap(root: Path, files: dict[str, str], stamp: str) -> None:
    """Kubernetes' ConfigMap volume layout: x.yaml -> ..data/x.yaml, ..data -> ..<stamp>."""
    data = root / f"..{stamp}"
    data.mkdir()
    for name, text in files.items():
        (data / name).write_text(text)
        if not (root / name).is_symlink():
            (root / name).symlink_to(Path("..data") / name)
    tmp = root / "..data_tmp"
    tmp.symlink_to(data.name)
    os.replace(tmp, root / "..data")  # the kubelet's atomic swap


def test_a_configmap_mount_loads_once_and_its_updates_are_followed(tmp_path):
    """Old: every rule was found three times (x.yaml, ..data/x.yaml, ..<stamp>/x.yaml):
    duplicate ids stopped start-up."""
    configmap(tmp_path, {"a.yaml": rule("first"), "b.yaml": rule("second", "bar")}, "2026_11_30_01")
    pack = Pack.load(tmp_path)
    assert sorted(r.id for r in pack.rules) == ["first", "second"]
    holder = PolicyHolder(pack, pack.version)
    watcher = RulesWatcher(tmp_path, holder, lambda d: (p := Pack.load(d), p.version), 20)
    watcher.start()
    try:
        time.sleep(0.3)
        configmap(tmp_path, {"a.yaml": rule("first", "changed"), "b.yaml": rule("second", "bar")},
                  "2026_11_30_02")
        assert wait_for(lambda: holder.version != pack.version)
        assert holder.current.rule("first").patterns == ("changed",)
        assert holder.rejections == 0
    finally:
        watcher.stop()


# -- the watcher -------------------------------------------------------------------------------------


def test_the_watcher_survives_anything_a_pack_does_and_keeps_watching(tmp_path):
    """Old: RecursionError (deep YAML) escaped reload() and ended the watcher thread: hot
    reload stopped silently. MemoryError cannot be produced safely on a shared machine: the
    compile step raises it for one marked file (a fault injected into the real watcher)."""
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "a.yaml").write_text(rule("first"))

    def compile_pack(d: Path):
        if (d / "oom.yaml").exists():
            raise MemoryError
        pack = Pack.load(d)
        return pack, pack.version

    first = Pack.load(rules)
    holder = PolicyHolder(first, first.version)
    watcher = RulesWatcher(rules, holder, compile_pack, 20)
    watcher.start()
    try:
        time.sleep(0.3)
        for name, text in [("deep.yaml", "rules: " + "[" * 5000 + "]" * 5000), ("oom.yaml", rule("x"))]:
            before = holder.rejections
            (rules / name).write_text(text)
            assert wait_for(lambda before=before: holder.rejections > before)
            assert holder.version == first.version
            (rules / name).unlink()
        assert any("deep.yaml:1: -: yaml: not valid YAML: nested deeper than 32" in e.reason
                   for e in holder.events)
        assert "MemoryError" in holder.last_rejection
        shutil.rmtree(rules)  # even a directory that goes away and comes back
        time.sleep(0.3)
        rules.mkdir()
        (rules / "a.yaml").write_text(rule("second"))
        assert wait_for(lambda: holder.current.rule("second") is not None)
        assert watcher._thread.is_alive()
    finally:
        watcher.stop()


def test_a_stored_rejection_reason_is_bounded():
    holder = PolicyHolder(object(), "v1")
    holder.reject("x" * 10_000_000)
    assert len(holder.last_rejection) < MAX_REASON_CHARS + 100
    assert holder.events[-1].reason == holder.last_rejection


# -- regex cost per token ------------------------------------------------------------------------


@pytest.mark.parametrize(("pattern", "text"), [
    ("(a|aa)+b", "a" * 60 + "c"),
    ("(a|a)+b", "a" * 60 + "c"),
    ("x(aa|a)+b", "x" + "a" * 60 + "c"),
])
def test_a_backtracking_regex_times_out_and_counts_as_a_match(tmp_path, pattern, text):
    """Old: (a|aa)+b over 60 characters costs longer than the age of the universe, on the
    thread that decodes for every request. Now each search stops at the timeout and the rule
    counts as matched (fail closed)."""
    (tmp_path / "a.yaml").write_text(rule("slow", f"'{pattern}'", kind="regex", action="halt",
                                          extra="    max_span: 100\n"))
    pack = Pack.load(tmp_path, PackLimits(regex_timeout_s=0.02))
    before = REGEX_TIMEOUTS.labels("slow")._value.get()
    matcher = StreamMatcher(pack.output)
    found = []
    for i in range(0, len(text), 3):  # token by token, as decoding feeds it
        found += matcher.feed(text[i : i + 3].encode())
    found += matcher.finish()
    assert found and found[0].rule.id == "slow"
    assert REGEX_TIMEOUTS.labels("slow")._value.get() > before


def test_a_search_that_times_out_halts_the_stream_whatever_the_action(tmp_path):
    """Old: a search past its timeout counted as a match and nothing more: under a redact
    rule the answer went on, and each later token was searched again and timed out again
    (four such rules: ~16 ms a token on the loop that all streams share). Now the stream
    halts on the first, and the rules after it are not searched in that token."""
    slow = [RULE.format(id=f"slow{i}", kind="regex", pattern="'(a|aa)+b'", action="redact")
            + "    replacement: '[X]'\n    max_span: 100\n" for i in range(3)]
    (tmp_path / "a.yaml").write_text("rules:\n" + "".join(slow))
    pack = Pack.load(tmp_path, PackLimits(regex_timeout_s=0.02))

    def timeouts() -> float:
        return sum(REGEX_TIMEOUTS.labels(f"slow{i}")._value.get() for i in range(3))

    guard = Guard(Policy(pack, None, pack.version), [b"aaa"])
    before = timeouts()
    for _ in range(40):  # past ~20 a's, the partial search tries too many ways to cut them
        decision = guard.check(0)
        if decision is not ACCEPT:
            break
    assert timeouts() - before == 1
    assert decision.verdict is Verdict.HALT and decision.match.timed_out
    text, event = guard.halt(decision)
    # Which of the three searches first runs past 20 ms of CPU depends on the machine's speed
    assert (event.rule_id, event.action) == (decision.match.rule.id, "halt") and text == ""
    assert event.rule_id in {"slow0", "slow1", "slow2"}
    assert "FINSIEVE_REGEX_TIMEOUT_MS" in event.message


class _TimesOutAt:
    """A compiled regex whose searches raise TimeoutError, as `regex` does past its timeout,
    once `marker` is in the text searched: a timeout at a chosen token."""

    def __init__(self, pattern, marker: str) -> None:
        self.wrapped, self.pattern, self.marker = pattern, pattern.pattern, marker

    def _check(self, text: str, pos: int = 0) -> None:
        if self.marker in text[pos:]:
            raise TimeoutError("regex timed out")

    def search(self, text, **kwargs):
        self._check(text, kwargs.get("pos", 0))
        return self.wrapped.search(text, **kwargs)

    def fullmatch(self, text, **kwargs):
        self._check(text, kwargs.get("pos", 0))
        return self.wrapped.fullmatch(text, **kwargs)


SLOW = RULE.format(id="slow", kind="regex", pattern="'z+!?'", action="redact") + (
    "    replacement: '[S]'\n    max_span: 20\n")


def _guard_with_a_slow_rule(directory: Path, rules: str, tokens: list[bytes]) -> Guard:
    """A Guard over `rules`, in their order, with SLOW's search timing out at a "!"."""
    (directory / "a.yaml").write_text("rules:\n" + rules)
    pack = Pack.load(directory)
    slow = next(i for i, r in enumerate(pack.output.regexes) if r.rule.id == "slow")
    pack.output.regexes[slow] = dataclasses.replace(
        pack.output.regexes[slow], pattern=_TimesOutAt(pack.output.regexes[slow].pattern, "!"))
    return Guard(Policy(pack, None, pack.version), tokens)


@pytest.mark.parametrize("action", ["block", "halt"])
def test_a_span_that_acts_before_a_timeout_is_never_delivered(tmp_path, action):
    """Found by review: the halt on a timeout ignored the other matches of its token, and
    delivered up to where the timed-out search began, a card number completed by the same
    token included. A span that begins before it acts first."""
    card = RULE.format(id="card", kind="regex", pattern="'\\b\\d{4}-\\d{4}\\b'", action=action)
    guard = _guard_with_a_slow_rule(tmp_path, card + SLOW, [b"pay ", b"1234", b"-5678 z!"])
    assert [(guard.check(t), guard.release()) for t in (0, 1)] == [(ACCEPT, "pay "), (ACCEPT, "")]
    decision = guard.check(2)  # the card, in the making, is searched first
    assert decision.match.rule.id == "card"
    if action == "block":
        assert decision.verdict is Verdict.ROLLBACK and decision.keep == 1
    else:
        assert decision.verdict is Verdict.HALT and guard.halt(decision)[0] == ""


def test_a_timeout_keeps_what_the_other_regexes_hold(tmp_path):
    """Found by review: the searches after a timeout were skipped and their matches in the
    making forgotten, so the halt delivered the start of a card number being held."""
    card = RULE.format(id="card", kind="regex", pattern="'\\d{4} \\d{4} \\d{4}'",
                       action="redact") + "    replacement: '[CARD]'\n"
    guard = _guard_with_a_slow_rule(tmp_path, SLOW + card, [b"ok ", b"1234 5", b"678 9012 z!"])
    assert [(guard.check(t), guard.release()) for t in (0, 1)] == [(ACCEPT, "ok "), (ACCEPT, "")]
    decision = guard.check(2)
    assert decision.verdict is Verdict.HALT and decision.match.timed_out
    assert guard.halt(decision)[0] == ""


def test_a_regex_that_does_not_time_out_matches_as_before(tmp_path):
    (tmp_path / "a.yaml").write_text(rule("ok", "'(a|aa)+b'", kind="regex", action="halt",
                                          extra="    max_span: 100\n"))
    matcher = StreamMatcher(Pack.load(tmp_path).output)
    found = matcher.feed(b"xx aaab yy") + matcher.finish()
    assert [(m.rule.id, m.text) for m in found] == [("ok", "aaab")]


@contextlib.contextmanager
def busy_threads(n: int = 2):
    """Threads doing Python work in this process, as the engine's decode loop does."""
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
    threads = [threading.Thread(target=busy) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)


def test_a_search_slowed_by_other_threads_is_not_a_timeout(tmp_path):
    """`regex` counts its timeout on the process's CPU clock. Beside busy threads (the
    engine's decode loop) benign prompts' input scans went past it and were refused; only
    the search's own CPU time may count."""
    (tmp_path / "a.yaml").write_text(rule("card", r"'\b\d{4}[ -]\d{4}[ -]\d{4}[ -]\d{4}\b'",
                                          kind="regex", action="halt",
                                          extra="    scope: both\n    max_span: 40\n"))
    pack = Pack.load(tmp_path, PackLimits(regex_timeout_s=0.002))
    text = " ".join(f"note {i} on the client's 2024 savings plan and fees" for i in range(60))
    before = REGEX_TIMEOUTS.labels("card")._value.get()
    with busy_threads():
        found = [m for _ in range(20) for m in scan_text(pack.input, text)]
    assert found == [] and REGEX_TIMEOUTS.labels("card")._value.get() == before


def test_a_backtracking_input_scan_beside_busy_threads_fails_closed_in_bounded_time(tmp_path):
    (tmp_path / "a.yaml").write_text(rule("slow", "'(a|aa)+b'", kind="regex", action="halt",
                                          extra="    scope: both\n    max_span: 100\n"))
    pack = Pack.load(tmp_path, PackLimits(regex_timeout_s=0.02))
    with busy_threads(4):
        started = time.perf_counter()
        found = scan_text(pack.input, "x " * 20 + "a" * 60 + "c")
        took = time.perf_counter() - started
    assert [m.rule.id for m in found] == ["slow"]
    assert took < 1.5 * MAX_WAIT_S, took  # retries stop at the scan's deadline


def test_a_whole_text_scan_beside_busy_threads_keeps_its_pace():
    """`regex` takes the GIL back at every check of its timeout; a scan whose searches
    released it waited for every busy thread's switch at each one (a prompt's input scan:
    ~1.5 ms alone, ~200 ms beside three busy threads). Its searches hold it now."""
    pack = Pack.load(Path(__file__).resolve().parents[2] / "rules")
    text = " ".join(f"Client {i} asks how the savings plan's fees compare with an index fund "
                    "over ten years, and whether to rebalance quarterly." for i in range(12))

    def scan_ms() -> float:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            scan_text(pack.input, text)
            times.append(time.perf_counter() - started)
        return 1000 * sorted(times)[2]

    alone = scan_ms()
    with busy_threads(3):
        beside = scan_ms()
    assert beside < 10 * alone + 5, (alone, beside)  # held: ~3x; released: ~300x


def test_a_hostile_whole_text_scan_holds_the_gil_briefly(tmp_path):
    """A scan that backtracks holds the GIL for a few milliseconds at most, then releases it
    while it runs out its timeout: the decode loop beside it keeps going."""
    (tmp_path / "a.yaml").write_text(rule("slow", "'(a|aa)+b'", kind="regex", action="halt",
                                          extra="    scope: both\n    max_span: 100\n"))
    pack = Pack.load(tmp_path, PackLimits(regex_timeout_s=0.1))
    scan_text(pack.input, "x a b")  # what is built on first use (normalizer tables) is built
    stop, beats = threading.Event(), []

    def beat() -> None:
        while not stop.is_set():
            beats.append(time.perf_counter())
            sum(range(200))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
    thread = threading.Thread(target=beat)
    thread.start()
    try:
        time.sleep(0.05)
        started = time.perf_counter()
        found = scan_text(pack.input, "x " * 20 + "a" * 60 + "c")
        ended = time.perf_counter()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert [m.rule.id for m in found] == ["slow"]
    during = [b for b in beats if started <= b <= ended] + [ended]
    longest = max(b - a for a, b in zip([started, *during], during, strict=False))
    # Held for the whole timeout, the longest gap would be the scan itself (0.1 s or more).
    # Relative to the scan's own duration, so that a busy machine, which stretches both and
    # may deschedule the beating thread for tens of ms, does not decide it.
    assert ended - started >= 0.1 and longest < 0.5 * (ended - started), (longest, ended - started)


def test_a_long_text_is_searched_releasing_the_gil_and_a_held_search_counts_toward_the_timeout():
    """`regex` checks its timeout every 256 steps and a step can cross the whole text: a
    2 ms search of 250,000 characters ran 140 ms. So a text longer than HELD_CHARS is never
    searched holding the GIL; and the held attempt's CPU counts toward the timeout."""
    calls = []

    def search(text, timeout, concurrent):
        calls.append((len(text), concurrent))
        cpu = time.thread_time()
        while time.thread_time() - cpu < timeout:
            pass
        raise TimeoutError

    deadline = time.perf_counter() + 5
    with pytest.raises(TimeoutError):
        within_cpu_budget(search, 0.01, deadline, "a" * (HELD_CHARS + 1))
    assert calls == [(HELD_CHARS + 1, True)]
    calls.clear()
    with pytest.raises(TimeoutError):
        within_cpu_budget(search, 0.01, deadline, "a" * HELD_CHARS)
    assert calls == [(HELD_CHARS, False), (HELD_CHARS, True)]


# -- through a running server -----------------------------------------------------------------------


@contextlib.contextmanager
def pack_file(tight_server, name: str, text: str):
    path = tight_server.rules / name
    try:
        yield apply(tight_server, lambda: path.write_text(text))
    finally:
        apply(tight_server, path.unlink)


def test_a_backtracking_input_rule_fails_closed_on_a_running_server(tight_server):
    """Old: the input scan of 40 characters ran (a|aa)+b for hours on the engine."""
    pack = rule("backtracks", "'(a|aa)+b'", kind="regex", action="block",
                extra="    scope: input\n    max_span: 200\n")

    async def go():
        async with ChatStream(tight_server.target) as s:
            s.send(chat_request("attack", "a" * 40 + "c", max_tokens=4))
            s.send(chat_request("normal", "Say hello.", max_tokens=2))
            return await s.until_done("attack", "normal")

    with pack_file(tight_server, "backtracks.yaml", pack) as info:
        assert info.pack_rejections == 0 or "backtracks" not in info.last_rejection
        result = asyncio.run(go())
    attack = result["attack"]
    assert attack[-1].finished.finish_reason == chat_pb2.FINISH_REASON_CONTENT_FILTER
    assert any(e.policy_event.rule_id == "backtracks" for e in attack)
    assert kinds(result["normal"])[-1] == "finished"


def test_rejections_keep_the_pack_in_force_and_the_info_reply_small(tight_server):
    """Old: a rejection reason quoting a 9 MB pattern made the engine's Info reply exceed
    the message limit; deep YAML killed the watcher, so later edits were never loaded."""
    version = tight_server.engine_info().policy_version
    huge = rule("huge", "'(" + "a" * 9_000_000 + "'", kind="regex", extra="    max_span: 10\n")
    with pack_file(tight_server, "huge.yaml", huge) as info:
        assert info.policy_version == version
        assert "FINSIEVE_RULES_MAX_BYTES" in info.last_rejection
        assert len(info.last_rejection) <= MAX_REASON_CHARS + 100
    with pack_file(tight_server, "deep.yaml", "rules: " + "[" * 5000 + "]" * 5000) as info:
        assert info.policy_version == version
        assert "deep.yaml:1: -: yaml: not valid YAML: nested deeper than 32" in info.last_rejection
        assert canary_halts(tight_server)
    with pack_file(tight_server, "later.yaml", rule("later-edit", "'later edit'")) as info:
        assert info.policy_version != version  # the watcher still watches
