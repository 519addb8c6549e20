"""Request preparation: the chat template, the tokenizer and the input rules.

With `prepare_workers` > 0 it runs in worker processes, not on threads beside the decode
loop. On threads it held the engine process's GIL (~0.6 ms a request with rules off, ~1.7 ms
with the default packs and 10,000 literals, on a 2-core CPU), and each time the loop let go
of the GIL (every wait for the device) a preparing thread could keep it for a switch
interval: on an H200 at 128 streams with requests arriving steadily, a step took 10.9 ms
with rules on against 7.0 off. vLLM's V1 front-end process takes this work off its engine
core for the same reason.

A worker keeps the input rules of the policy versions it has seen; the engine sends a
version's rules only to a worker that asks for them, so a request carries its messages and
its policy version, nothing more. The prompt's length is checked against the context before
any rule scans it.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading
from collections import OrderedDict
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
import structlog

from finsieve.errors import RequestError, invalid
from finsieve.policy.inputs import InputVerdict, apply_input_rules
from finsieve.policy.pack import RuleSet
from finsieve.policy.schema import Rule

log = structlog.get_logger(__name__)

TIMEOUT_S = 30.0  # a request's preparation; its regex searches are bounded far below this
KEPT_VERSIONS = 4  # policy versions whose input rules a worker keeps (a reload adds one)


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


class Preparer:
    """Prepares requests in `workers` processes (0: on the calling thread)."""

    def __init__(self, tokenizer: Any, max_context: int, workers: int) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        if workers > 0:
            # spawn: a fork of a process holding a CUDA context (and threads) is not safe.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                workers, multiprocessing.get_context("spawn"), initializer=_start,
                initargs=(tokenizer, max_context))
            self._warming = [self._pool.submit(_ready) for _ in range(workers)]

    @property
    def workers(self) -> int:
        return self._pool._max_workers if self._pool is not None else 0  # type: ignore[attr-defined]

    def wait_ready(self) -> None:
        """Wait for the workers to start; if they cannot, prepare on the calling threads."""
        if self._pool is None:
            return
        try:
            for f in self._warming:
                f.result(timeout=TIMEOUT_S)
        except Exception as e:
            log.error("request preparation workers did not start; preparing on the engine's "
                      "threads", error=repr(e))
            self.close()

    def prepare(self, messages: list[Message], rules: RuleSet, version: str) -> Prepared:
        pool = self._pool
        if pool is None:
            return prepare(self.tokenizer, self.max_context, rules, messages)
        try:
            result = pool.submit(_prepare, messages, version, None).result(TIMEOUT_S)
            if isinstance(result, str):  # NEED_RULES: this worker has not seen the version: send its rules
                result = pool.submit(_prepare, messages, version,
                                     (rules.rules, rules.regex_timeout_s)).result(TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the engine could not prepare the "
                               "request in time; retry", retry_after_ms=1000) from None
        except BrokenProcessPool as e:  # a worker died: this request and later ones go inline
            log.error("a request preparation worker died; preparing on the engine's threads",
                      error=repr(e))
            self.close()
            return prepare(self.tokenizer, self.max_context, rules, messages)
        if isinstance(result, _Refused):
            raise invalid(result.field, result.message)
        return result

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


# -- in a worker process --------------------------------------------------------------------

NEED_RULES = "need-rules"


class _Refused(NamedTuple):
    field: str
    message: str


class _Worker:
    def __init__(self, tokenizer: Any, max_context: int) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.rules: OrderedDict[str, RuleSet] = OrderedDict()


_worker: _Worker | None = None  # this worker process's tokenizer and rules (set by _start)


def _start(tokenizer: Any, max_context: int) -> None:
    global _worker
    _worker = _Worker(tokenizer, max_context)


def _ready() -> bool:
    return _worker is not None


def _prepare(messages: list[Message], version: str,
             rules: tuple[tuple[Rule, ...], float] | None) -> Prepared | _Refused | str:
    w = _worker
    assert w is not None
    if rules is not None:
        w.rules[version] = RuleSet(list(rules[0]), rules[1])
        while len(w.rules) > KEPT_VERSIONS:
            w.rules.popitem(last=False)
    compiled = w.rules.get(version)
    if compiled is None:
        return NEED_RULES
    w.rules.move_to_end(version)
    try:
        return prepare(w.tokenizer, w.max_context, compiled, messages)
    except RequestError as e:
        return _Refused(e.field, e.message.removeprefix(f"{e.field}: "))
