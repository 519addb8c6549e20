"""Hot reload: watch the rules directory, compile a new pack off the hot path, swap atomically.

Whoever took the old policy keeps it (requests in flight finish under the version they
started with); an invalid pack is rejected with its exact reason and the old one stays.
"""

from __future__ import annotations

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

from .schema import PackError

log = structlog.get_logger(__name__)

RELOADS = Counter("finsieve_rule_pack_reloads", "Rule pack reloads", ["result"])

T = TypeVar("T")


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
        self.events.append(AdminEvent("rule_pack_rejected", self.version, reason))
        self.rejections += 1
        self.last_rejection = reason


class RulesWatcher(Generic[T]):
    """Recompiles with `compile(directory) -> (policy, version)` whenever a file changes."""

    def __init__(self, directory: Path, holder: PolicyHolder[T],
                 compile: Callable[[Path], tuple[T, str]], debounce_ms: int = 100) -> None:
        self.directory = Path(directory)
        self.holder = holder
        self.compile = compile
        self.debounce_ms = debounce_ms
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
            RELOADS.labels("rejected").inc()
            self.holder.reject(str(e))
            log.warning("rule pack rejected; the previous one stays in force",
                        version=self.holder.version, problems=[str(p) for p in e.problems])
            return False
        if version == self.holder.version:
            return False
        self.holder.swap(policy, version)
        RELOADS.labels("loaded").inc()
        log.info("rule pack loaded", version=version)
        return True

    def _run(self) -> None:
        for _changes in watchfiles.watch(self.directory, debounce=self.debounce_ms, step=20,
                                         stop_event=self._stop, raise_interrupt=False):
            self.reload()
