"""Hot reload: watch the rules directory, compile a new pack off the hot path, swap atomically.

Whoever took the old policy keeps it (requests in flight finish under the version they
started with); an invalid pack is rejected with its exact reason and the old one stays.
Whatever a pack does to the compiler (any exception, RecursionError and MemoryError too)
is a rejection, and the watcher thread keeps watching.
"""

from __future__ import annotations

import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import structlog
import watchfiles
from prometheus_client import Counter

from finsieve.supervise import FAILURES

from .schema import PackError

log = structlog.get_logger(__name__)

RELOADS = Counter("finsieve_rule_pack_reloads", "Rule pack reloads", ["result"])

T = TypeVar("T")

# A rejection reason is stored (the engine's Info reply, the admin audit record) and logged:
# bounded, so no pack can make a reply exceed its message limit.
MAX_REASON_CHARS = 4000
MAX_LOGGED_PROBLEMS = 50
RETRY_WATCH_S = 1.0


@dataclass(frozen=True)
class AdminEvent:
    """A rule pack loaded or rejected: kept for the audit trail."""

    kind: str  # "rule_pack_loaded" | "rule_pack_rejected"
    version: str
    reason: str = ""
    at: float = field(default_factory=time.time)


class PolicyHolder(Generic[T]):
    """The policy in force. Reading `current` is one attribute load: the swap is atomic."""

    def __init__(self, initial: T, version: str) -> None:
        self.current = initial
        self.version = version
        self.events: deque[AdminEvent] = deque(maxlen=1000)
        self.events.append(AdminEvent("rule_pack_loaded", version))
        self.loads, self.rejections, self.last_rejection = 1, 0, ""

    def swap(self, policy: T, version: str) -> None:
        self.current, self.version = policy, version
        self.events.append(AdminEvent("rule_pack_loaded", version))
        self.loads += 1

    def reject(self, reason: str) -> None:
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[:MAX_REASON_CHARS] + f"… ({len(reason) - MAX_REASON_CHARS} more characters)"
        self.events.append(AdminEvent("rule_pack_rejected", self.version, reason))
        self.rejections += 1
        self.last_rejection = reason


class RulesWatcher(Generic[T]):
    """Recompiles with `compile(directory) -> (policy, version)` whenever a file changes."""

    def __init__(self, directory: Path, holder: PolicyHolder[T],
                 compile: Callable[[Path], tuple[T, str]], debounce_ms: int = 100,
                 on_swap: Callable[[], None] = lambda: None) -> None:
        self.directory = Path(directory)
        self.holder = holder
        self.compile = compile
        self.debounce_ms = debounce_ms
        self.on_swap = on_swap  # after a new pack is in force (serve.py: preload, settle the heap)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rules-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def reload(self) -> bool:
        """Compile the directory now; True if a new version is in force."""
        try:
            policy, version = self.compile(self.directory)
        except PackError as e:
            self._reject(str(e), [str(p) for p in e.problems[:MAX_LOGGED_PROBLEMS]],
                         len(e.problems))
            return False
        except Exception as e:  # a bound the loader missed, or a bug: never the watcher's end
            log.exception("rule pack could not be compiled")
            self._reject(f"{self.directory}:0: -: pack: could not be compiled ({type(e).__name__}: "
                         f"{str(e)[:200]})", [], 1)
            return False
        if version == self.holder.version:
            return False
        self.holder.swap(policy, version)
        RELOADS.labels("loaded").inc()
        log.info("rule pack loaded", version=version)
        self.on_swap()
        return True

    def _reject(self, reason: str, problems: list[str], count: int) -> None:
        RELOADS.labels("rejected").inc()
        self.holder.reject(reason)
        log.warning("rule pack rejected; the previous one stays in force",
                    version=self.holder.version, problems=problems, count=count)

    def _run(self) -> None:
        resumed = False
        while not self._stop.is_set():
            identity = _identity(self.directory)
            if identity is None:  # not there (yet): look again shortly
                self._stop.wait(RETRY_WATCH_S)
                continue
            try:
                if resumed:
                    self.reload()  # what changed while nothing watched
                resumed = True
                for _changes in watchfiles.watch(self.directory, debounce=self.debounce_ms, step=20,
                                                 stop_event=self._stop, raise_interrupt=False):
                    self.reload()
                    if _identity(self.directory) != identity:
                        break  # deleted or replaced: watch what is there now
                else:
                    return  # stopped
            except Exception:
                FAILURES.labels("rules-watcher").inc()
                log.exception("rules watcher failed; watching again", directory=str(self.directory))
                self._stop.wait(RETRY_WATCH_S)


def _identity(directory: Path) -> tuple[int, int] | None:
    try:
        st = directory.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None
