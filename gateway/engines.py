"""The gateway's side of the Engine contract: one long-lived stream per engine.

Each engine is kept connected by its own background task: it opens the stream, reads it
until it breaks, and reconnects. An engine that cannot be reached, or whose stream broke, is
marked down once (one log line) and probed in the background; a request never waits for a
down engine, and requests never wait for each other to connect. Only before an engine's
first connection attempt has finished may a request wait for it, and only when no engine
is up yet.

Engines come and go at run time (gateway/discovery.py calls `EnginePool.update`): a new
address gets its client and stream at once; a removed one is drained (no new request; those
in flight may finish for the drain deadline), then its stream and channel close. Each request
goes to the engine that is least busy by the load it reports on its stream (EngineLoad),
counting what this gateway sent it since that report; engines that are down come last.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import grpc
import structlog

from finsieve import supervise
from finsieve.errors import RequestError
from finsieve.v1 import chat_pb2, engine_pb2, engine_pb2_grpc
from finsieve.wire import ENGINE_MESSAGE_BYTES

log = structlog.get_logger(__name__)

EventHandler = Callable[[chat_pb2.ChatServerMessage], None]
TERMINAL = ("finished", "error")
RETRY_AFTER_MS = 1000  # hint to a client when no engine is up
RECONNECT_PAUSE_S = 0.5  # after a stream broke on a connection that still looks fine
DRAIN_POLL_S = 0.05
ChannelOptions = list[tuple[str, int | str]]


@dataclass(frozen=True)
class EngineCredentials:
    """How a gateway proves itself to engines: the shared secret, over TLS when configured."""

    secret: bytes = b""
    tls: grpc.ChannelCredentials | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.secret.decode()}"),) if self.secret else ()


class EngineClient:
    def __init__(self, address: str, connect_timeout: float = 3.0,
                 options: ChannelOptions | None = None,
                 credentials: EngineCredentials | None = None) -> None:
        self.address = address
        self._connect_timeout = connect_timeout
        credentials = credentials or EngineCredentials()
        self._metadata = credentials.metadata
        self._channel = (grpc.aio.secure_channel(address, credentials.tls, options=options)
                         if credentials.tls is not None
                         else grpc.aio.insecure_channel(address, options=options))
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._handlers: dict[str, EventHandler] = {}
        self._write_lock = asyncio.Lock()  # grpc.aio allows one write at a time
        self._task: asyncio.Task[None] | None = None
        self.probed = asyncio.Event()  # the first connection attempt has an outcome
        self.down = False  # marked down (logged once), until the next connection
        self.down_reason = "not connected yet"
        # What a request submitted now would run under, as the engine last said on its stream.
        self.status: engine_pb2.EngineStatus | None = None
        # Its load as it last reported it (running + waiting, KV slots, draining); None
        # before its stream's first report (or from an engine that reports none).
        self.load: tuple[int, int, bool] | None = None
        self._unreported = 0  # requests sent to it since that report
        self.removed = False  # taken out of the pool: it drains, then closes

    @property
    def up(self) -> bool:
        return self._call is not None

    @property
    def in_flight(self) -> int:
        return len(self._handlers)

    @property
    def accepting(self) -> bool:
        """In the pool, and not shutting down by its own report."""
        return not self.removed and not (self.load is not None and self.load[2])

    def busy(self) -> float:
        """How full it would be with one more request: its requests running and waiting as
        reported, plus those this gateway sent since, over its KV slots (engines of different
        sizes compare by how full they are). Before its first report: this gateway's requests
        on it, as if it had one slot."""
        if self.load is None or self.load[1] <= 0:
            return float(self.in_flight + 1)
        return (self.load[0] + self._unreported + 1) / self.load[1]

    def start(self) -> None:
        if self._task is None:
            self._task = supervise.start(f"engine-stream {self.address}", self._keep_connected)

    async def submit(self, request: chat_pb2.ChatRequest, handler: EventHandler) -> None:
        """Send a request; its events go to handler until a terminal one. Raises RequestError."""
        call = self._call
        if call is None:
            raise self._unavailable(self.down_reason)
        message = chat_pb2.ChatClientMessage(request=request)
        if message.ByteSize() > ENGINE_MESSAGE_BYTES:  # cannot happen with valid settings
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               "the request is too large to forward to an engine", "messages")
        self._handlers[request.request_id] = handler
        self._unreported += 1
        try:
            async with self._write_lock:
                await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            if self._handlers.pop(request.request_id, None) is None:
                return  # the stream's end already failed this request: one terminal event only
            raise self._unavailable(f"the stream to it broke ({_status(e)})") from None

    async def cancel(self, request_id: str) -> None:
        call = self._call
        if call is None or request_id not in self._handlers:
            return
        try:
            async with self._write_lock:
                await call.write(chat_pb2.ChatClientMessage(cancel=chat_pb2.Cancel(request_id=request_id)))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the stream is gone; _read fails the request

    async def info(self, timeout: float = 2.0) -> engine_pb2.EngineInfo | None:
        if not self.up:
            return None
        try:
            return await self._stub.Info(engine_pb2.InfoRequest(), timeout=timeout,
                                         metadata=self._metadata)
        except grpc.aio.AioRpcError:
            return None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._call is not None:
            self._call.cancel()
        await self._channel.close()

    async def _keep_connected(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._until_ready(loop)
            call = self._stub.Generate(metadata=self._metadata)
            self._call, self.down = call, False
            self.probed.set()
            log.info("engine up", engine=self.address)
            self._mark_down(await self._read(call))
            await asyncio.sleep(RECONNECT_PAUSE_S)

    async def _until_ready(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait for a connection, marking the engine down as soon as it refuses one or does
        not answer within the connect timeout (gRPC keeps retrying with backoff meanwhile)."""
        ready, failed = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE
        deadline = loop.time() + self._connect_timeout
        state = self._channel.get_state(try_to_connect=True)
        while state != ready:
            if state == failed:
                self._mark_down("it is unreachable (it refused or dropped the connection)")
            elif loop.time() >= deadline:
                self._mark_down(f"it is unreachable (no connection within {self._connect_timeout:g} s)")
            wait = None if self.down else deadline - loop.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._channel.wait_for_state_change(state), wait)
            state = self._channel.get_state(try_to_connect=True)

    def _mark_down(self, reason: str) -> None:
        self.down_reason = reason
        self.probed.set()
        if not self.down:  # once per outage
            self.down = True
            log.warning("engine marked down; probing it in the background", engine=self.address,
                        reason=reason)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> str:
        """Relay the stream's events until it ends; fail what was in flight; say why it ended."""
        reason = "the engine closed the stream"
        try:
            async for step in call:
                if step.HasField("status"):
                    self.status = step.status
                if step.HasField("load"):
                    load = step.load
                    self.load = (load.running + load.waiting, load.max_batch, load.draining)
                    self._unreported = 0
                for event in step.events:
                    handler = self._handlers.get(event.request_id)
                    if handler is None:
                        continue
                    if event.WhichOneof("event") in TERMINAL:
                        del self._handlers[event.request_id]
                    try:
                        handler(event)
                    except Exception:  # one request's fault never ends the shared stream
                        log.exception("relaying an engine event failed", engine=self.address)
        except grpc.aio.AioRpcError as e:
            reason = f"lost the stream to it ({_status(e)})"
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                log.error("engine refused this gateway's credential: the engine secret "
                          "differs, or this gateway's certificate (--tls-cert) carries no name "
                          "on the engine's FINSIEVE_ENGINE_ALLOWED_PEERS", engine=self.address)
        except asyncio.CancelledError:
            reason = "the gateway closed the stream"
            raise
        finally:  # nothing is left waiting
            self._call = None
            self.status = self.load = None
            self._unreported = 0
            lost, self._handlers = self._handlers, {}
            if lost:
                log.warning("engine stream lost", engine=self.address, requests=len(lost))
            err = self._unavailable(reason)
            for request_id, handler in lost.items():
                try:
                    handler(err.to_event(request_id))
                except Exception:  # the others are still failed, and the engine reconnects
                    log.exception("failing a request of a lost engine stream failed",
                                  engine=self.address)
        return reason

    def _unavailable(self, what: str) -> RequestError:
        return RequestError(grpc.StatusCode.UNAVAILABLE, f"engine {self.address}: {what}",
                            retry_after_ms=RETRY_AFTER_MS)


class EnginePool:
    """The engines in service: requests go to the least busy that is up and accepting, the
    next on failure. Call start() once a loop runs."""

    def __init__(self, addresses: list[str], connect_timeout: float = 3.0,
                 options: ChannelOptions | None = None,
                 credentials: EngineCredentials | None = None, drain_s: float = 20.0) -> None:
        self._connect_timeout = connect_timeout
        self._options = options or []
        self._credentials = credentials or EngineCredentials()
        self._drain_s = drain_s
        self._clients: dict[str, EngineClient] = {a: self._client(a, "") for a in addresses}
        self._draining: dict[str, tuple[EngineClient, asyncio.Task[None]]] = {}
        self._started = False
        self._ids = itertools.count()

    @property
    def clients(self) -> list[EngineClient]:
        """The engines in service (not those being drained)."""
        return list(self._clients.values())

    def start(self) -> None:
        self._started = True
        for c in self._clients.values():
            c.start()

    def new_id(self) -> str:
        return f"r{next(self._ids)}"

    def update(self, wanted: Mapping[str, str]) -> None:
        """Serve exactly the engines `wanted` names (address -> the name its TLS certificate
        must carry, "" for the address's own host): new ones are connected, missing ones
        drained and closed, one being drained that is wanted again is back in service."""
        for address, tls_name in wanted.items():
            if address in self._clients:
                continue
            if address in self._draining:
                client, task = self._draining.pop(address)
                task.cancel()  # still waiting for its requests: it never closed
                client.removed = False
                log.info("engine back in service", engine=address)
            else:
                client = self._client(address, tls_name)
                if self._started:
                    client.start()
                log.info("engine added", engine=address)
            self._clients[address] = client
        for address in [a for a in self._clients if a not in wanted]:
            client = self._clients.pop(address)
            client.removed = True
            log.info("engine removed; draining it", engine=address, in_flight=client.in_flight)
            task = asyncio.create_task(self._drain(client), name=f"engine-drain {address}")
            task.add_done_callback(supervise.log_failure)
            self._draining[address] = (client, task)

    async def submit(self, request: chat_pb2.ChatRequest, handler: EventHandler,
                     avoid: Collection[str] = ()) -> EngineClient:
        """Send the request to the least busy engine (none in `avoid`); RequestError
        UNAVAILABLE when no engine takes it."""
        self.start()
        await self._first_probes()
        errors = []
        for client in self._ranked(avoid):
            try:
                await client.submit(request, handler)
                return client
            except RequestError as e:
                errors.append(e.message)
        if not errors:
            errors.append("none is in service" if not self._clients
                          else "none is accepting requests")
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "no engine available: " + "; ".join(errors),
                           retry_after_ms=RETRY_AFTER_MS)

    def status(self) -> engine_pb2.EngineStatus | None:
        """What a request submitted now would run under, as the engine it would go to last
        said on its stream (None before an engine's stream is open)."""
        ranked = self._ranked(())
        return ranked[0].status if ranked and ranked[0].up else None

    async def close(self) -> None:
        for _, task in self._draining.values():
            task.cancel()
        everyone = [*self._clients.values(), *(c for c, _ in self._draining.values())]
        self._clients, self._draining = {}, {}
        await asyncio.gather(*(c.close() for c in everyone))

    def _client(self, address: str, tls_name: str) -> EngineClient:
        options = self._options
        if tls_name and self._credentials.tls is not None:
            options = [*options, ("grpc.ssl_target_name_override", tls_name)]
        return EngineClient(address, self._connect_timeout, options, self._credentials)

    def _ranked(self, avoid: Collection[str]) -> list[EngineClient]:
        """The engines a request may go to, the best first: up before down, then the least busy."""
        return sorted((c for c in self._clients.values() if c.accepting and c.address not in avoid),
                      key=lambda c: (not c.up, c.busy()))

    async def _drain(self, client: EngineClient) -> None:
        """A removed engine's requests in flight may finish for the drain deadline; then its
        stream closes (those still running fail UNAVAILABLE, or move if nothing reached their
        client)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self._drain_s
        while client.in_flight and loop.time() < end:
            await asyncio.sleep(DRAIN_POLL_S)
        del self._draining[client.address]
        log.info("engine closed", engine=client.address, unfinished=client.in_flight)
        await client.close()

    async def _first_probes(self) -> None:
        """Right after start-up, with no engine up yet: wait (all requests together, at most
        the connect timeout) until one is up or every first attempt has an outcome."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout
        while not any(c.up for c in self._clients.values()) and loop.time() < deadline:
            waiting = [asyncio.ensure_future(c.probed.wait())
                       for c in self._clients.values() if not c.probed.is_set()]
            if not waiting:
                return
            _, pending = await asyncio.wait(waiting, timeout=deadline - loop.time(),
                                            return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()


def _status(e: Exception) -> str:
    return e.code().name if isinstance(e, grpc.aio.AioRpcError) else type(e).__name__
