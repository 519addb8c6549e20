"""Background work that no exception ends: `supervise` runs a long-lived coroutine again
after each failure (logged with its traceback, counted in
`finsieve_background_failures_total{task}`), after a backoff that doubles up to a cap. A
task that returns is done; one that is cancelled ends (shutdown). `log_failure` is for the
one-shot tasks of a request: their exception is logged, never lost in a task nobody awaits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import Counter

log = structlog.get_logger(__name__)

FAILURES = Counter("finsieve_background_failures", "Exceptions that ended a run of a "
                   "supervised background task (it is started again after a backoff)", ["task"])


@dataclass(frozen=True)
class Backoff:
    """Waits between attempts: first_s, doubling, at most max_s."""
    first_s: float = 0.1
    max_s: float = 30.0

    def delay(self, failures: int) -> float:
        return min(self.max_s, self.first_s * 2 ** max(0, min(failures - 1, 32)))


def in_a_row(failures: int, ran_s: float, backoff: Backoff) -> int:
    """Failures in a row after one more that ended a run of ran_s: a run longer than the
    backoff's cap had recovered, so the count starts again."""
    return 1 if ran_s > backoff.max_s else failures + 1


class GaveUp(RuntimeError):
    """A supervised task failed `give_up_after` times in a row."""


async def supervise(name: str, run: Callable[[], Awaitable[object]], backoff: Backoff = Backoff(),
                    give_up_after: int = 0) -> None:
    """Await `run()` until it returns, starting it again after each exception. The count of
    failures in a row is reset by a run that lasted longer than the cap (it had recovered).
    give_up_after > 0: raise GaveUp after that many failures in a row (for work whose
    failure must end the process, so that its own supervisor restarts it)."""
    loop = asyncio.get_running_loop()
    failures = 0
    while True:
        started = loop.time()
        try:
            await run()
            return
        except Exception as e:  # CancelledError is a BaseException: shutdown passes through
            failures = in_a_row(failures, loop.time() - started, backoff)
            FAILURES.labels(name).inc()
            if give_up_after and failures >= give_up_after:
                log.exception("background task failed; giving up", task=name, failures=failures)
                raise GaveUp(f"{name} failed {failures} times in a row") from e
            delay = backoff.delay(failures)
            log.exception("background task failed; starting it again", task=name,
                          failures=failures, retry_in_s=delay)
        await asyncio.sleep(delay)


def start(name: str, run: Callable[[], Awaitable[object]], backoff: Backoff = Backoff(),
          give_up_after: int = 0) -> asyncio.Task[None]:
    """`supervise` as a task of the running loop (named, for debugging)."""
    return asyncio.create_task(supervise(name, run, backoff, give_up_after), name=name)


def log_failure(task: asyncio.Future[Any]) -> None:
    """A done callback for one-shot tasks: an exception they end with is logged."""
    if task.cancelled():
        return
    error = task.exception()
    if error is None:
        return
    name = task.get_name() if isinstance(task, asyncio.Task) else "task"
    log.error("task failed", task=name, error_type=type(error).__name__,
              exc_info=(type(error), error, error.__traceback__))
