"""Request preparation: the chat template, the tokenizer and the input rules.

With `prepare_workers` > 0 it runs in worker processes, not on threads beside the decode
loop. On threads it held the engine process's GIL (~0.6 ms a request with rules off, ~1.7 ms
with the default packs and 10,000 literals, on a 2-core CPU), and each time the loop let go
of the GIL (every wait for the device) a preparing thread could keep it for a switch
interval: on an H200 at 128 streams with requests arriving steadily and rules on, steps
took 10.7 ms on threads and 7.6 ms with two workers (docs/benchmarks.md). vLLM's V1
front-end process takes this work off its engine core for the same reason.

A worker keeps the input rules of the policy versions it has seen; a request carries its
messages and its policy version, nothing more. The engine hands a version's rules to the
workers when it comes in force (`preload`: at start-up and on each reload), and again to a
worker that asks for them (one that missed them, or restarted). The prompt's length is
checked against the context before any rule scans it.

Failures stay with the requests they hit. A worker that dies fails the requests in flight
with UNAVAILABLE (they are not retried here: the one that killed it would take the engine
down) and a fresh pool serves the next ones; so does a request whose preparation has run
past TIMEOUT_S (a worker that hangs). Workers that cannot start at all are started afresh
(START_ATTEMPTS sets) before the engine prepares on its own threads. A request still queued
at its deadline fails alone: the pool is busy, not hung. At most QUEUED_PER_WORKER requests
per worker are in the pool. Workers get the tokenizer as a directory to load, not as a
pickle: spawning writes its arguments into a pipe, and a payload larger than the pipe would
block the spawning thread for good if the new worker died before reading it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc
import structlog

from finsieve.errors import RequestError, invalid
from finsieve.policy.inputs import InputVerdict, apply_input_rules
from finsieve.policy.matcher import REGEX_TIMEOUTS
from finsieve.policy.pack import RuleSet
from finsieve.policy.schema import Rule

if TYPE_CHECKING:  # the workers import transformers themselves, when they start
    from transformers import PreTrainedTokenizerBase

log = structlog.get_logger(__name__)

TIMEOUT_S = 30.0  # one request's preparation, queue included; its regex searches are bounded
QUEUED_PER_WORKER = 4
KEPT_VERSIONS = 4  # policy versions whose input rules a worker keeps (a reload adds one)
RETRY_MS = 1000
START_ATTEMPTS = 3  # sets of workers started before preparing on the engine's threads


class Message(NamedTuple):
    role: str
    content: str


@dataclass(frozen=True)
class Prepared:
    ids: list[int]  # the prompt the model reads: the input rules' spans replaced
    verdict: InputVerdict


def prepare(tokenizer: Any, max_context: int, rules: RuleSet, messages: list[Message]) -> Prepared:
    """Tokenize, check the length, apply the input rules (and tokenize again if they
    changed the text). Raises RequestError for the client."""
    ids = prompt_ids(tokenizer, max_context, messages)  # too long: refused before any scan
    verdict = apply_input_rules(rules, messages)
    if verdict.changed:
        ids = prompt_ids(tokenizer, max_context, [Message(**m) for m in verdict.messages])
    return Prepared(ids, verdict)


def prompt_ids(tokenizer: Any, max_context: int, messages: list[Message]) -> list[int]:
    try:
        prompt = tokenizer.apply_chat_template([m._asdict() for m in messages], tokenize=False,
                                               add_generation_prompt=True)
    except Exception as e:  # a template may reject e.g. a misplaced system message
        raise invalid("messages", f"the model's chat template rejected them: {e}") from None
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if len(ids) >= max_context:
        raise invalid("messages", f"the prompt is {len(ids)} tokens; the context holds "
                      f"{max_context} tokens for prompt and answer together")
    return ids


def _unavailable(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAVAILABLE, message, retry_after_ms=RETRY_MS)


class Preparer:
    """Prepares requests in `workers` processes (0: on the calling thread)."""

    def __init__(self, tokenizer: Any, max_context: int, workers: int) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.workers = workers
        self._lock = threading.Lock()
        self._room = threading.BoundedSemaphore(max(workers, 1) * QUEUED_PER_WORKER)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._saved: _TokenizerDir | None = None  # the live pool's tokenizer files
        # The policy version in force (its key and input rules) and its preload calls
        self._in_force: tuple[tuple[str, float], tuple[Rule, ...]] | None = None
        self._preloads: list[concurrent.futures.Future] = []
        if workers:
            with tempfile.TemporaryDirectory() as saved:
                tokenizer.save_pretrained(saved)
                self._tokenizer_files = {str(f.relative_to(saved)): f.read_bytes()
                                         for f in Path(saved).rglob("*") if f.is_file()}
            self._pool = self._new_pool()
            # They start while the caller goes on (the model loads).
            self._warming = self._warm(self._pool)

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        """A pool whose workers load the tokenizer from a fresh private directory. Not the
        last pool's: by the time a worker restarts, a temporary directory may be gone (tmp
        cleaners such as systemd-tmpfiles remove what is old), and a pool whose workers
        cannot load the tokenizer fails every request."""
        saved = _TokenizerDir(self._tokenizer_files)
        old, self._saved = self._saved, saved
        if old is not None:
            old.remove()
        # spawn: a fork of a process holding a CUDA context (and threads) is not safe.
        return concurrent.futures.ProcessPoolExecutor(
            self.workers, multiprocessing.get_context("spawn"), initializer=_start,
            initargs=(type(self.tokenizer), saved.path, self.max_context, os.getpid()))

    def _warm(self, pool: concurrent.futures.ProcessPoolExecutor) -> list[concurrent.futures.Future]:
        """A round of start-up calls, one per worker: each answers with its pid once its
        worker has started (loaded the tokenizer)."""
        return [pool.submit(_ready) for _ in range(self.workers)]

    def wait_ready(self) -> None:
        """Wait until every worker has started, starting a fresh set up to START_ATTEMPTS
        times (a worker killed while the model loads, e.g. by the kernel's OOM killer, is
        no reason to give them up); if they cannot start, prepare on the calling threads."""
        pool = self._pool
        if pool is None:
            return
        deadline = time.monotonic() + 3 * TIMEOUT_S  # for all the attempts together
        error: Exception | None = None
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._started(pool, self._warming, deadline)
                return
            except Exception as e:
                error = e
            if attempt == START_ATTEMPTS or time.monotonic() >= deadline:
                break
            log.warning("request preparation workers did not start; starting them again",
                        attempt=attempt, error=repr(error))
            try:
                fresh = self._swap(pool)
                if fresh is None:  # closed meanwhile
                    return
                pool, self._warming = fresh, self._warm(fresh)
            except (OSError, RuntimeError) as e:  # the files cannot be written, or no spawn
                error = e
                break
        log.error("request preparation workers did not start; preparing on the engine's "
                  "threads", error=repr(error))
        self.close()
        self.workers = 0

    def _started(self, pool: concurrent.futures.ProcessPoolExecutor,
                 warming: list[concurrent.futures.Future], deadline: float) -> None:
        """Returns once each worker has answered; raises if one cannot start, or by the
        deadline."""
        def answer(f: concurrent.futures.Future) -> int:
            return f.result(min(TIMEOUT_S, max(deadline - time.monotonic(), 0.0)))

        pids = {answer(f) for f in warming}
        while len(pids) < self.workers and time.monotonic() < deadline:
            pids |= {answer(f) for f in self._warm(pool)}
        if len(pids) < self.workers:
            raise TimeoutError(f"{len(pids)} of {self.workers} workers answered")

    def prepare(self, messages: list[Message], rules: RuleSet, version: str) -> Prepared:
        pool = self._pool
        if pool is None:
            return prepare(self.tokenizer, self.max_context, rules, messages)
        deadline = time.monotonic() + TIMEOUT_S
        key = (version, rules.regex_timeout_s)
        result = self._call(pool, deadline, messages, key, None)
        if isinstance(result, str):  # NEED_RULES: this worker has not seen the version
            result = self._call(pool, deadline, messages, key, rules.rules)
        outcome, timed_out = result
        for rule_id in timed_out:  # counted where the metrics are served, whatever the outcome
            REGEX_TIMEOUTS.labels(rule_id).inc()
        if isinstance(outcome, RequestError):
            raise outcome
        if isinstance(outcome, _Failed):
            log.error("a request preparation worker failed a request", error=outcome.error)
            raise RequestError(grpc.StatusCode.INTERNAL, "the engine could not prepare this request")
        return outcome

    def preload(self, rules: RuleSet, version: str) -> list[concurrent.futures.Future]:
        """Hand the input rules of the version now in force to the workers, one call per
        worker (and again to a fresh set of workers): else each worker's first request of
        the version waited while the worker compiled them (~25 ms with the default packs and
        10,000 literals on an H200 host). Best effort: a worker busy meanwhile may leave its
        call to another and compile them with its first request, as before. The calls, for a
        caller that waits for them (the serve path does not)."""
        with self._lock:
            self._in_force = ((version, rules.regex_timeout_s), rules.rules)
        return self._hand_rules()

    def _hand_rules(self) -> list[concurrent.futures.Future]:
        """The version in force to each worker of the live pool (none once closed); the
        calls of the one handed before are cancelled (not compiled if still queued). Under
        the lock: preload (the rules watcher's thread) and _replace (a request's) may both
        hand rules at once."""
        with self._lock:
            for call in self._preloads:
                call.cancel()
            self._preloads = []
            pool = self._pool
            if pool is None or self._in_force is None:
                return []
            # broken or closing (the next request says), or a worker cannot start
            with contextlib.suppress(RuntimeError, OSError):
                for _ in range(self.workers):
                    self._preloads.append(pool.submit(_preload, *self._in_force))
            return list(self._preloads)

    def _call(self, pool: concurrent.futures.ProcessPoolExecutor, deadline: float,
              *args: Any) -> Any:
        if not self._room.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise _unavailable("the engine's request preparation is saturated; retry")
        try:
            future = pool.submit(_prepare, *args)
        except BaseException as e:
            self._room.release()
            if isinstance(e, BrokenProcessPool):  # a worker died while none was busy
                self._replace(pool, "a request preparation worker died; workers restarted")
            elif not isinstance(e, RuntimeError | OSError):  # closed; a worker cannot start
                raise
            raise _unavailable("the engine's request preparation failed; retry") from None
        future.add_done_callback(lambda _: self._room.release())
        try:
            return future.result(max(deadline - time.monotonic(), 0))
        except concurrent.futures.TimeoutError:
            if future.cancel():  # still queued: the workers are busy, not hung
                raise _unavailable("the engine is busy preparing requests; retry") from None
            self._replace(pool, "a request preparation ran past its time; workers restarted")
            raise _unavailable("the engine could not prepare the request in time; retry") from None
        except BrokenProcessPool:
            self._replace(pool, "a request preparation worker died; workers restarted")
            raise _unavailable("the engine's request preparation failed; retry") from None
        except concurrent.futures.CancelledError:  # closed meanwhile
            raise _unavailable("the engine is not preparing requests now; retry") from None

    def _swap(self, old: concurrent.futures.ProcessPoolExecutor
              ) -> concurrent.futures.ProcessPoolExecutor | None:
        """A fresh pool in place of `old`, whose workers are killed; None if `old` is no
        longer the live pool (closed, or replaced by another thread first)."""
        with self._lock:
            if self._pool is not old:
                return None
            self._pool = fresh = self._new_pool()
        _end(old)
        return fresh

    def _replace(self, broken: concurrent.futures.ProcessPoolExecutor, why: str) -> None:
        """A fresh pool for the next requests (once, whichever thread sees the break first)."""
        fresh = self._swap(broken)
        if fresh is None:
            return
        log.error(why)
        # Its workers start now, on this (failed) request's thread, not on the next ones; closed
        # meanwhile, or unable to start: the next request says.
        with contextlib.suppress(RuntimeError, OSError):
            self._warm(fresh)
        self._hand_rules()  # to `fresh`, or to a pool that replaced it meanwhile

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            saved, self._saved = self._saved, None
        if pool is not None:
            _end(pool)
        if saved is not None:
            saved.remove()


class _TokenizerDir:
    """The tokenizer's files in a new private temporary directory (0700, a random name).
    Removed only while its path is still that directory: once a tmp cleaner has swept it,
    another local user may have taken the name, and the engine must neither delete their
    files nor fail on them. An open descriptor keeps the directory's inode from being
    reused while it lives, so (device, inode) tells the two apart."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.path = tempfile.mkdtemp(prefix="finsieve-tokenizer-")
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name, data in files.items():
                file = Path(self.path, name)
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_bytes(data)
        except OSError:
            self.remove()
            raise

    def remove(self) -> None:
        if self._fd < 0:
            return
        try:
            ours, now = os.fstat(self._fd), os.lstat(self.path)
            if (ours.st_dev, ours.st_ino) == (now.st_dev, now.st_ino):
                shutil.rmtree(self.path)
        except OSError as e:  # swept already, or not ours any more
            log.warning("a tokenizer directory of the preparation workers was not removed",
                        path=self.path, error=repr(e))
        finally:
            os.close(self._fd)
            self._fd = -1


def _end(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Shut a pool down without waiting for work that may never end: its workers are killed
    (Python 3.14's terminate_workers does this)."""
    processes = list((pool._processes or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        p.kill()


# -- in a worker process --------------------------------------------------------------------

NEED_RULES = "need-rules"


class _Failed(NamedTuple):
    error: str  # the exception's type: no text of the request, no trace


class _Worker:
    def __init__(self, tokenizer: Any, max_context: int) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.rules: OrderedDict[tuple[str, float], RuleSet] = OrderedDict()


_worker: _Worker | None = None  # this worker process's tokenizer and rules (set by _start)


def _start(tokenizer_class: type[PreTrainedTokenizerBase], tokenizer_dir: str, max_context: int,
           parent: int) -> None:
    global _worker
    # Ctrl-C and a service manager's SIGTERM to the whole group are the engine's to handle;
    # it ends its workers (or they follow it out).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_without, args=(parent,), daemon=True).start()
    _worker = _Worker(tokenizer_class.from_pretrained(tokenizer_dir), max_context)


def _exit_without(parent: int) -> None:
    """The engine may die without closing the pool (SIGKILL, a crash): its workers follow."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _ready() -> int:
    time.sleep(0.05)  # held a little, so that each worker answers one of a round
    return os.getpid()


def _prepare(messages: list[Message], key: tuple[str, float], rules: tuple[Rule, ...] | None
             ) -> tuple[Prepared | RequestError | _Failed, tuple[str, ...]] | str:
    """key: the policy version and the regex timeout its rules run under. The outcome and
    the rule ids whose searches timed out meanwhile (a refused request's too: its input
    scan ran before the refusal); NEED_RULES if this worker lacks the version's rules."""
    w = _worker
    assert w is not None
    if rules is not None:
        _preload(key, rules)
    compiled = w.rules.get(key)
    if compiled is None:
        return NEED_RULES
    w.rules.move_to_end(key)
    before = _timeouts()
    outcome: Prepared | RequestError | _Failed
    try:
        outcome = prepare(w.tokenizer, w.max_context, compiled, messages)
    except RequestError as e:
        outcome = e
    except Exception as e:
        outcome = _Failed(type(e).__name__)
    return outcome, tuple((_timeouts() - before).elements())


def _preload(key: tuple[str, float], rules: tuple[Rule, ...]) -> None:
    """This worker's input rules of a policy version, compiled once."""
    w = _worker
    assert w is not None
    if key not in w.rules:
        w.rules[key] = RuleSet(list(rules), key[1])
        while len(w.rules) > KEPT_VERSIONS:
            w.rules.popitem(last=False)
    w.rules.move_to_end(key)


def _timeouts() -> Counter[str]:
    """This process's regex timeouts per rule id, so far."""
    return Counter({s.labels["rule_id"]: int(s.value) for metric in REGEX_TIMEOUTS.collect()
                    for s in metric.samples if s.name.endswith("_total")})
