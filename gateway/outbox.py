"""A Chat stream's outgoing events, bounded. When the client reads slower than tokens arrive,
the deltas of a request that wait together go out as one message: Python gRPC moves a few
thousand messages per second per core, so a slow reader must not cost one per token.

Deltas merge as they arrive, so what waits is bounded by the other events (started, policy
events, finished, errors). More than `max_events` waiting means the client is not keeping up:
the outbox overflows, drops what follows, and the stream is ended (its requests are still
audited: the gateway records every event before it is queued here).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from finsieve.v1 import chat_pb2

Event = chat_pb2.ChatServerMessage


class Outbox:
    def __init__(self, max_events: int = 1024) -> None:
        self.max_events = max_events
        self.overflowed = False
        self.on_overflow: Callable[[], None] | None = None  # the writer ends the stream now
        self._items: list[Event | None] = []  # None: the stream ends here
        self._open: dict[str, int] = {}  # request id -> its delta in _items that may still grow
        self._copied: set[int] = set()  # merged deltas: our own copies, safe to extend
        self._ready = asyncio.Event()
        self._taken = asyncio.Event()

    def close(self) -> None:
        """The stream is over: what still arrives (requests being cancelled) is dropped."""
        self.overflowed, self.on_overflow = True, None
        self._items.clear()

    def put(self, event: Event | None) -> None:
        if self.overflowed:
            return
        if event is not None and event.WhichOneof("event") == "delta":
            i = self._open.get(event.request_id)
            if i is not None:
                self._merge(i, event)
                return
            self._open[event.request_id] = len(self._items)
        elif event is not None:
            self._open.pop(event.request_id, None)
        if event is not None and len(self._items) >= self.max_events:
            self.overflowed = True
            self._items.clear()
            self._open.clear()
            if self.on_overflow is not None:
                self.on_overflow()
        else:
            self._items.append(event)
        self._ready.set()

    async def take(self) -> list[Event | None]:
        """Everything waiting, in order (at least one item unless it overflowed)."""
        await self._ready.wait()
        items = self._items
        self._items, self._open, self._copied = [], {}, set()
        self._ready.clear()
        self._taken.set()
        return items

    async def room(self) -> None:
        """Wait while half the bound is waiting: the stream's reader calls this before each
        client message, so a client's own requests (and their errors) cannot overflow it."""
        while len(self._items) >= self.max_events // 2 and not self.overflowed:
            self._taken.clear()
            await self._taken.wait()

    def _merge(self, i: int, event: Event) -> None:
        if i not in self._copied:  # the original may also be held for the cache and audit
            original = self._items[i]
            assert original is not None  # an open delta, not the end of its stream
            copy = Event()
            copy.CopyFrom(original)
            self._items[i] = copy
            self._copied.add(i)
        merged = self._items[i]
        assert merged is not None
        merged.delta.text += event.delta.text
        merged.delta.tokens += event.delta.tokens
