"""A Chat stream's outgoing events. When the client reads slower than tokens arrive, the
deltas of a request that wait together go out as one message: Python gRPC moves a few
thousand messages per second per core, so a slow reader must not cost one per token."""

from __future__ import annotations

import asyncio
from collections import deque

from finsieve.v1 import chat_pb2

Event = chat_pb2.ChatServerMessage


class Outbox:
    def __init__(self) -> None:
        self._items: deque[Event | None] = deque()  # None: the stream ends here
        self._ready = asyncio.Event()

    def put(self, event: Event | None) -> None:
        self._items.append(event)
        self._ready.set()

    async def take(self) -> list[Event | None]:
        """Everything waiting (at least one item), deltas coalesced."""
        await self._ready.wait()
        items = list(self._items)
        self._items.clear()
        self._ready.clear()
        return coalesce(items)


def coalesce(events: list[Event | None]) -> list[Event | None]:
    """Merge each request's consecutive deltas; the order of everything else is kept."""
    out: list[Event | None] = []
    open_delta: dict[str, int] = {}  # request id -> its delta in `out` that may still grow
    for e in events:
        kind = e.WhichOneof("event") if e is not None else None
        if kind == "delta" and e.request_id in open_delta:
            i = open_delta[e.request_id]
            merged = Event()
            merged.CopyFrom(out[i])  # the original may also be held for the cache and audit
            merged.delta.text += e.delta.text
            merged.delta.tokens += e.delta.tokens
            out[i] = merged
            continue
        if kind == "delta":
            open_delta[e.request_id] = len(out)
        elif e is not None:
            open_delta.pop(e.request_id, None)
        out.append(e)
    return out
