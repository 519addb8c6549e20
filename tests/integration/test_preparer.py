"""Request preparation in worker processes (engine/preparer.py) against the same work done on
the calling thread: the default model's tokenizer and chat template, the default packs."""

from __future__ import annotations

import copy
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine import preparer as preparer_module
from engine.preparer import Message, Preparer
from finsieve.errors import RequestError
from finsieve.policy.matcher import REGEX_TIMEOUTS
from finsieve.policy.pack import Pack
from finsieve.policy.sources import PackLimits

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    [Message("user", "What is an index fund?")],
    [Message("system", "You answer briefly."), Message("user", "My card is 4111 1111 1111 1111.")],
    [Message("user", "Can you give me insider tips on ACME before the merger?")],  # halts
    [Message("user", "Mail me at jane.doe@example.com and call +44 20 7946 0958.")],
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def pool(tokenizer):
    preparer = Preparer(tokenizer, 512, workers=2)
    preparer.wait_ready()
    assert preparer.workers == 2
    yield preparer
    preparer.close()


def _pack(tmp: Path, word: str) -> Pack:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "p.yaml").write_text(
        "rules:\n  - id: secret-word\n    description: a word the model may not read\n"
        "    kind: literal\n    scope: input\n    action: redact\n    replacement: '[W]'\n"
        f"    patterns: ['{word}']\n")
    return Pack.load(tmp)


def test_workers_prepare_what_the_calling_thread_would(tokenizer, pool) -> None:
    pack = Pack.load(REPO / "rules")
    inline = Preparer(tokenizer, 512, workers=0)
    for messages in PROMPTS:
        here = inline.prepare(messages, pack.input, pack.version)
        there = pool.prepare(messages, pack.input, pack.version)
        assert there.ids == here.ids
        assert there.verdict == here.verdict
    verdicts = [pool.prepare(m, pack.input, pack.version).verdict for m in PROMPTS]
    assert [v.halted for v in verdicts] == [False, False, True, False]
    assert {i.rule_id for i in verdicts[1].events} == {"payment-card-number"}
    assert "4111" not in verdicts[1].messages[1]["content"]


def test_a_new_policy_version_reaches_every_worker(tokenizer, pool, tmp_path: Path) -> None:
    messages = [Message("user", "Tell me about the alpha fund and the gamma fund, not the zeta one.")]
    # More versions than a worker keeps; the last, one it held and let go of
    for word in ("alpha", "gamma", "zeta", "one", "about", "gamma", "alpha"):
        pack = _pack(tmp_path / word, word)
        for _ in range(4):  # more requests than workers: each worker answers some
            verdict = pool.prepare(messages, pack.input, pack.version).verdict
            assert [i.suppressed for i in verdict.events] == [word]
            assert word not in verdict.messages[0]["content"]


def test_a_preloaded_version_needs_no_hand_over_with_its_first_request(tokenizer, tmp_path: Path,
                                                                      monkeypatch) -> None:
    """preload (start-up, each reload) hands a version's input rules to the workers before
    any request: its first request is prepared in one call, where a version the worker has
    not seen is handed over by a second, and both as on the calling thread. A fresh worker
    (after one died) is handed the version in force too."""
    messages = [Message("user", "Tell me about the alpha fund.")]
    preloaded, unseen = _pack(tmp_path / "a", "alpha"), _pack(tmp_path / "f", "fund")
    preparer = Preparer(tokenizer, 512, workers=1)
    try:
        preparer.wait_ready()
        calls: list[bool] = []  # per call to the pool: did it carry the rules?
        real_call = preparer._call

        def counted_call(pool, deadline, *args):
            calls.append(args[-1] is not None)
            return real_call(pool, deadline, *args)

        monkeypatch.setattr(preparer, "_call", counted_call)
        preparer.preload(preloaded.input, preloaded.version)
        inline = Preparer(tokenizer, 512, workers=0)
        for pack, handed_over in ((preloaded, [False]), (unseen, [False, True])):
            calls.clear()
            there = preparer.prepare(messages, pack.input, pack.version)
            assert calls == handed_over
            assert there == inline.prepare(messages, pack.input, pack.version)
            assert there.verdict.events  # the rules ran
        (pid,) = preparer._pool._processes  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)
        with pytest.raises(RequestError):  # the pool found broken, and replaced
            preparer.prepare(messages, preloaded.input, preloaded.version)
        calls.clear()
        there = preparer.prepare(messages, preloaded.input, preloaded.version)
        assert calls == [False] and there == inline.prepare(messages, preloaded.input, preloaded.version)
    finally:
        preparer.close()


def test_refusals_name_the_field_as_on_the_calling_thread(tokenizer) -> None:
    pack = Pack.load(REPO / "rules")
    strict = copy.deepcopy(tokenizer)  # a template that refuses, as many do for a misplaced role
    strict.chat_template = "{{ raise_exception('system messages must come first') }}"
    cases = [(tokenizer, [Message("user", "word " * 2000)], "the prompt is"),
             (strict, PROMPTS[0], "the model's chat template rejected them")]
    for tok, messages, says in cases:
        pool = Preparer(tok, 512, workers=1)
        pool.wait_ready()
        errors = []
        for preparer in (Preparer(tok, 512, workers=0), pool):
            with pytest.raises(RequestError) as e:
                preparer.prepare(messages, pack.input, pack.version)
            errors.append((e.value.code, e.value.field, e.value.message))
        pool.close()
        assert errors[0] == errors[1]
        assert errors[1][1] == "messages" and says in errors[1][2]


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0]
    return state != "Z"


def test_a_dead_worker_fails_only_the_requests_in_flight(tokenizer) -> None:
    pack = Pack.load(REPO / "rules")
    preparer = Preparer(tokenizer, 512, workers=1)
    preparer.wait_ready()
    expected = Preparer(tokenizer, 512, workers=0).prepare(PROMPTS[1], pack.input, pack.version)
    assert preparer.prepare(PROMPTS[1], pack.input, pack.version) == expected
    (pid,) = _children(os.getpid()) & set(preparer._pool._processes)  # type: ignore[union-attr]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RequestError) as e:  # not retried in the engine: it may be what killed it
        preparer.prepare(PROMPTS[1], pack.input, pack.version)
    assert e.value.code is grpc.StatusCode.UNAVAILABLE and e.value.retry_after_ms > 0
    for _ in range(3):  # a fresh worker serves the next ones
        assert preparer.prepare(PROMPTS[1], pack.input, pack.version) == expected
    assert pid not in preparer._pool._processes  # type: ignore[union-attr]
    # A worker that dies idle: the pool is found broken at the next request, and replaced
    (pid,) = preparer._pool._processes  # type: ignore[union-attr]
    os.kill(pid, signal.SIGKILL)
    time.sleep(1.0)
    with pytest.raises(RequestError) as e:
        preparer.prepare(PROMPTS[1], pack.input, pack.version)
    assert e.value.code is grpc.StatusCode.UNAVAILABLE
    assert preparer.prepare(PROMPTS[1], pack.input, pack.version) == expected
    preparer.close()


def test_workers_killed_while_they_start_are_started_again(tokenizer) -> None:
    """A worker killed during its start-up (e.g. by the OOM killer while the model loads)
    does not send the engine to its threads for good: a fresh set of workers is started."""
    pack = Pack.load(REPO / "rules")
    preparer = Preparer(tokenizer, 512, workers=2)
    try:
        first = set(preparer._pool._processes)  # type: ignore[union-attr]
        assert len(first) == 2
        for pid in first:  # spawned, still importing: far from ready
            os.kill(pid, signal.SIGKILL)
        preparer.wait_ready()
        assert preparer.workers == 2 and preparer._pool is not None
        assert first.isdisjoint(preparer._pool._processes)
        expected = Preparer(tokenizer, 512, workers=0).prepare(PROMPTS[1], pack.input, pack.version)
        assert preparer.prepare(PROMPTS[1], pack.input, pack.version) == expected
    finally:
        preparer.close()


class _Unloadable(PreTrainedTokenizerFast):
    """A tokenizer that no worker can load (its class refuses to)."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        raise OSError("this tokenizer cannot be loaded here")


def test_workers_that_never_start_leave_preparation_to_the_engine_threads(tokenizer) -> None:
    """Three sets of workers fail to start: the engine prepares on its own threads, and
    every worker process and directory is gone."""
    pack = Pack.load(REPO / "rules")
    unloadable = copy.copy(tokenizer)
    unloadable.__class__ = _Unloadable
    preparer = Preparer(unloadable, 512, workers=1)
    try:
        directories = []
        real = preparer._new_pool

        def recorded():
            pool = real()
            directories.append(Path(preparer._saved.path))  # type: ignore[union-attr]
            return pool

        preparer._new_pool = recorded  # type: ignore[method-assign]
        directories.append(Path(preparer._saved.path))  # type: ignore[union-attr]
        preparer.wait_ready()
        assert preparer.workers == 0 and preparer._pool is None
        assert len(directories) == preparer_module.START_ATTEMPTS
        assert not any(d.exists() for d in directories)
        expected = Preparer(tokenizer, 512, workers=0).prepare(PROMPTS[1], pack.input, pack.version)
        assert preparer.prepare(PROMPTS[1], pack.input, pack.version) == expected
    finally:
        preparer.close()


def test_fresh_workers_start_after_a_tmp_cleaner_removed_the_tokenizer_files(tokenizer) -> None:
    """A long-running engine's temporary directory may be swept (systemd-tmpfiles and other
    cleaners remove old files): workers started after that still load the tokenizer, from
    a new private directory, instead of failing every request from then on."""
    pack = Pack.load(REPO / "rules")
    preparer = Preparer(tokenizer, 512, workers=1)
    try:
        preparer.wait_ready()
        expected = Preparer(tokenizer, 512, workers=0).prepare(PROMPTS[0], pack.input, pack.version)
        assert preparer._saved is not None
        swept = Path(preparer._saved.path)
        shutil.rmtree(swept)
        swept.mkdir()  # the name taken again, as another local user could: theirs, not ours
        (swept / "theirs").write_text("kept")
        (pid,) = preparer._pool._processes  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)
        with pytest.raises(RequestError) as e:  # the pool is found broken, and replaced
            preparer.prepare(PROMPTS[0], pack.input, pack.version)
        assert e.value.code is grpc.StatusCode.UNAVAILABLE
        assert preparer.prepare(PROMPTS[0], pack.input, pack.version) == expected
        saved = Path(preparer._saved.path)
        assert saved != swept and stat.S_IMODE(saved.stat().st_mode) == 0o700
        assert (swept / "theirs").read_text() == "kept"  # not removed with the old pool
    finally:
        preparer.close()
        shutil.rmtree(swept, ignore_errors=True)
    assert not saved.exists()


def test_a_hung_worker_times_out_its_request_and_is_replaced(tokenizer, monkeypatch) -> None:
    served_timeout = preparer_module.TIMEOUT_S
    pack = Pack.load(REPO / "rules")
    preparer = Preparer(tokenizer, 512, workers=1)
    preparer.wait_ready()  # under the served timeout: a worker's start-up is not a hang
    monkeypatch.setattr(preparer_module, "TIMEOUT_S", 2.0)
    (pid,) = preparer._pool._processes  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(RequestError) as e:
        preparer.prepare(PROMPTS[0], pack.input, pack.version)
    assert e.value.code is grpc.StatusCode.UNAVAILABLE and time.monotonic() - start < 5
    # The next request waits for the fresh worker's start-up (spawn, imports, tokenizer, then
    # the rules it has not seen): more than 2 s on a busy 2-core CI machine, well within the
    # served timeout.
    monkeypatch.setattr(preparer_module, "TIMEOUT_S", served_timeout)
    assert preparer.prepare(PROMPTS[0], pack.input, pack.version).ids  # a fresh worker
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid)  # the hung one was killed, not left behind
    preparer.close()


def test_closing_while_requests_are_prepared_fails_them_cleanly(tokenizer) -> None:
    pack = Pack.load(REPO / "rules")
    preparer = Preparer(tokenizer, 512, workers=2)
    preparer.wait_ready()
    outcomes: list[str] = []

    def one() -> None:
        try:
            preparer.prepare(PROMPTS[3], pack.input, pack.version)
            outcomes.append("ok")
        except RequestError as e:
            outcomes.append(e.code.name)

    with ThreadPoolExecutor(16) as threads:
        futures = [threads.submit(one) for _ in range(64)]
        time.sleep(0.05)
        preparer.close()
        for f in futures:
            f.result()  # nothing but RequestError escapes
    assert set(outcomes) <= {"ok", "UNAVAILABLE"} and len(outcomes) == 64
    assert preparer.prepare(PROMPTS[0], pack.input, pack.version).ids  # closed: on this thread


def test_regex_timeouts_in_a_worker_are_counted_here(tokenizer, tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "rules:\n  - id: slow-input\n    description: backtracks on a run of a\n"
        "    kind: regex\n    scope: input\n    action: redact\n    replacement: '[X]'\n"
        "    max_span: 100\n    patterns: ['(?:a|aa)+c']\n")
    pack = Pack.load(tmp_path, PackLimits(regex_timeout_s=0.001))
    preparer = Preparer(tokenizer, 512, workers=1)
    preparer.wait_ready()

    def count() -> float:
        return REGEX_TIMEOUTS.labels("slow-input")._value.get()

    before = count()
    prepared = preparer.prepare([Message("user", "a" * 60 + "b")], pack.input, pack.version)
    assert count() > before
    assert [i.rule_id for i in prepared.verdict.events] == ["slow-input"]  # failed closed
    # Refused after its scan (the redacted prompt no longer fits the context): still counted.
    (tmp_path / "p.yaml").write_text((tmp_path / "p.yaml").read_text().replace(
        "'[X]'", "'" + "[X] " * 400 + "'"))
    pack = Pack.load(tmp_path, PackLimits(regex_timeout_s=0.001))
    before = count()
    with pytest.raises(RequestError, match="the context holds 512 tokens"):
        preparer.prepare([Message("user", "a" * 60 + "b")], pack.input, pack.version)
    assert count() > before
    preparer.close()


def test_workers_do_not_outlive_a_killed_engine(tmp_path: Path, default_model_dir: Path) -> None:
    script = tmp_path / "engine_process.py"
    script.write_text(
        "import os, sys, time\n"
        "from transformers import AutoTokenizer\n"
        "from engine.preparer import Preparer\n"
        "if __name__ == '__main__':\n"
        f"    p = Preparer(AutoTokenizer.from_pretrained({str(default_model_dir)!r}), 512, 2)\n"
        "    p.wait_ready()\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        workers = _children(proc.pid)
        assert len(workers) >= 2  # the two workers (and multiprocessing's resource tracker)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.2)
    assert not [w for w in workers if _alive(w)]
