"""What uvicorn leaves unbounded on a connection, bounded: shared by the gateway's two HTTP
listeners (the OpenAI door and the officers' console).

uvicorn waits for ever once a request's first byte came (its keep-alive timer stops there),
so a head sent a byte at a time would hold a connection for ever; and it waits for ever on
a client that reads nothing. Here a request's line and headers must arrive within the read
timeout, and a connection whose socket takes no byte for the write timeout is aborted. Its
warnings and errors go to the structured log.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ListenerBounds:
    max_header_bytes: int = 16384
    max_connections: int = 1000
    read_timeout_s: float = 30.0  # a request's line and headers
    write_timeout_s: float = 30.0  # a socket that takes no byte
    keepalive_s: float = 5.0  # an idle keep-alive connection


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head and on a stalled
    socket; a listener subclasses it with its BOUNDS (see `bounded`)."""

    BOUNDS = ListenerBounds()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stalled: asyncio.TimerHandle | None = None
        self._head: asyncio.TimerHandle | None = None  # waiting for a request's whole head
        self._head_after: object = None  # the request cycle before the awaited head

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def on_response_complete(self) -> None:
        self._await_head()  # first: a pipelined head already received is taken just below
        super().on_response_complete()

    def handle_events(self) -> None:
        super().handle_events()
        if self._head is not None and self.cycle is not self._head_after:  # a head came
            self._head.cancel()
            self._head = None

    def _await_head(self) -> None:
        if self._head is not None:
            self._head.cancel()
        self._head_after = self.cycle
        self._head = self.loop.call_later(self.BOUNDS.read_timeout_s, self._no_head)

    def _no_head(self) -> None:
        self._head = None
        if self.transport.get_write_buffer_size():  # close() would wait to flush, for ever
            self.transport.abort()
        elif not self.transport.is_closing():
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.BOUNDS.write_timeout_s, self._drop)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def connection_lost(self, exc: Exception | None) -> None:
        self._unstall()
        if self._head is not None:
            self._head.cancel()
            self._head = None
        super().connection_lost(exc)

    def _unstall(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _drop(self) -> None:
        """The client read nothing for the write timeout: the connection is aborted (close
        would wait for ever to flush), which ends its response and cancels its request."""
        self._stalled = None
        self.dropped()
        self.transport.abort()

    def dropped(self) -> None:
        log.warning("http connection dropped", reason="slow_reader",
                    seconds=self.BOUNDS.write_timeout_s)


def bounded(protocol: type[BoundedH11], bounds: ListenerBounds) -> type[BoundedH11]:
    """The protocol class a uvicorn.Config takes (`http=`), with these bounds."""
    return type(protocol.__name__, (protocol,), {"BOUNDS": bounds})


class _ToStructlog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        log.log(record.levelno, "http server", message=record.getMessage())


def route_uvicorn_logs() -> None:
    """uvicorn logs through the standard library: its warnings and errors (its own texts,
    never a request's content) become structured lines."""
    logger = logging.getLogger("uvicorn")
    if not any(isinstance(h, _ToStructlog) for h in logger.handlers):
        logger.addHandler(_ToStructlog())
        logger.setLevel(logging.WARNING)
        logger.propagate = False
