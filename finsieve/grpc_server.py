"""An asyncio gRPC server with standard health checking and reflection, and one rule for
every listener: an unexpected exception in a handler is `INTERNAL` with a correlation id
that the server's log line carries (type and traceback), never the exception's text."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from finsieve.config import Settings
from finsieve.wire import ENGINE_MESSAGE_BYTES, MAX_MESSAGE_BYTES

log = structlog.get_logger(__name__)

CHANNEL_OPTIONS = [  # clients' channels
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def server_options(settings: Settings, receive_bytes: int,
                   clients: bool = True) -> list[tuple[str, int]]:
    """A server's limits: frame size, handshake time, keepalive (a silent peer is dropped),
    idle, and for servers of clients (the public and the officers' port; not an engine's,
    whose gateways hold their stream open for good) age. Idle closes only a connection with
    no call open, so it never cuts a gateway's stream to an engine. An engine's listener
    accepts its gateways' pings (FINSIEVE_ENGINE_KEEPALIVE_TIME_S) twice as often as they
    come: gRPC counts a ping that comes sooner than its minimum interval after the last as a
    strike (timers drift), and past max_ping_strikes closes the connection with GOAWAY
    "too_many_pings", which would end every request on the gateway's stream. The idle limit also closes a
    connection that never opens a call, even one that sent only the HTTP/2 preface (or
    nothing): with grpcio 1.85 and a 2 s limit, 20 such connections closed 1.9-2.3 s after
    they opened. Without it, one that sent the whole preface (with its SETTINGS frame) stays
    open for good; the handshake timeout closes only those that did not."""
    options = [
        ("grpc.max_receive_message_length", receive_bytes),
        ("grpc.max_send_message_length", ENGINE_MESSAGE_BYTES),
        ("grpc.server_handshake_timeout_ms", _ms(settings.handshake_timeout_s)),
        ("grpc.keepalive_time_ms", _ms(settings.keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(settings.keepalive_timeout_s)),
        # Peers may ping (also with no call open), at most every min_ping_interval_s: more
        # often twice and the connection is closed (GOAWAY "too_many_pings"). The key is
        # gRPC's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS: an unknown key (the
        # macro's name spelled as a key) is ignored, and the default, 5 minutes, applies.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(
            settings.min_ping_interval_s if clients
            else min(settings.min_ping_interval_s, settings.engine_keepalive_time_s / 2))),
        ("grpc.http2.max_ping_strikes", 2),
    ]
    if settings.max_connection_idle_s > 0:
        options.append(("grpc.max_connection_idle_ms", _ms(settings.max_connection_idle_s)))
    if clients and settings.max_connection_age_s > 0:
        options += [("grpc.max_connection_age_ms", _ms(settings.max_connection_age_s)),
                    ("grpc.max_connection_age_grace_ms", _ms(settings.drain_seconds))]
    return options


def engine_channel_options(settings: Settings) -> list[tuple[str, int | str]]:
    """The gateway's channel to an engine: the link's limit, and keepalive pings so that an
    engine that stops answering (a stopped process, a dead link: TCP alone notices neither
    for minutes) breaks the stream within seconds: it is marked down, and its requests move
    to another engine or fail UNAVAILABLE."""
    return [
        ("grpc.max_receive_message_length", ENGINE_MESSAGE_BYTES),
        ("grpc.max_send_message_length", ENGINE_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", _ms(settings.engine_keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(settings.engine_keepalive_timeout_s)),
        # Any ping unanswered this long closes the connection. gRPC allows one ping in flight:
        # while its flow-control probe (BDP) waits for an answer from a stopped engine, no
        # keepalive ping goes out, and only this timeout (1 min by default; gRPC core's
        # internal GRPC_ARG_PING_TIMEOUT_MS) ends the wait: a SIGSTOPped engine was found
        # after 61 s with keepalive at 1 s, and after 2-3 s with this set.
        ("grpc.http2.ping_timeout_ms", _ms(settings.engine_keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Come back quickly after an engine restarts instead of gRPC's default backoff (minutes).
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


@dataclass
class Service:
    name: str  # full proto name, e.g. "finsieve.v1.Gateway"
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    names: list[str]

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.names]:
            await self.health.set(name, status)


async def start_server(address: str, services: list[Service], *,
                       options: list[tuple[str, int]] | None = None,
                       max_concurrent_rpcs: int | None = None,
                       credentials: grpc.ServerCredentials | None = None,
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> RunningServer:
    """Serve `services` (plus health and reflection) on `address`; TLS when credentials are
    given (plaintext otherwise: callers check that this is allowed, see finsieve.tls).
    max_concurrent_rpcs: calls beyond it are refused with RESOURCE_EXHAUSTED."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS if options is None else options,
                             maximum_concurrent_rpcs=max_concurrent_rpcs,
                             interceptors=[HideErrors(), *interceptors])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for s in services:
        s.add_to_server(s.servicer, server)
    names = [s.name for s in services]
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME],
        server,
    )
    port = (server.add_secure_port(address, credentials) if credentials is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    running = RunningServer(server, port, health_servicer, names)
    await running.set_serving(True)
    return running


class HideErrors(grpc.aio.ServerInterceptor):
    """The outermost interceptor of every listener: an exception that escapes a handler (or
    another interceptor) becomes INTERNAL "internal error (id …)". grpc.aio would otherwise
    answer UNKNOWN with the exception's type and text. Statuses set on purpose
    (context.abort) and cancellation pass through."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        return wrap_handler(handler, lambda b: _unary(b, method), lambda b: _streaming(b, method))


Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def wrap_handler(handler: grpc.RpcMethodHandler, unary: Callable[[Behavior], Behavior],
                 streaming: Callable[[Behavior], Behavior]) -> grpc.RpcMethodHandler:
    """`handler` with its behavior wrapped, for an interceptor: by `unary` where the call
    answers once, by `streaming` where it answers with a stream."""
    de, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming(_set(handler.stream_stream)), de, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming(_set(handler.unary_stream)), de, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary(_set(handler.stream_unary)), de, ser)
    return grpc.unary_unary_rpc_method_handler(unary(_set(handler.unary_unary)), de, ser)


def _set(behavior: Callable[..., Any] | None) -> Behavior:
    """The behavior of the kind a handler's flags name, which it always has (grpc's stubs
    type the synchronous server's handler: every kind optional, a synchronous context)."""
    assert behavior is not None
    return behavior


def responses(result: Any) -> AsyncIterator[Any]:
    """A streaming behavior's answers: what it yields, or nothing for one that writes them
    through context.write (awaited to its end)."""
    return result if hasattr(result, "__aiter__") else _written(result)


async def _written(result: Awaitable[Any]) -> AsyncIterator[Any]:
    await result
    return
    yield  # an async generator that yields nothing


def _unary(behavior: Behavior, method: str) -> Behavior:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _internal(context, method, e)
    return call


def _streaming(behavior: Behavior, method: str) -> Behavior:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in responses(behavior(request, context)):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _internal(context, method, e)
    return call


async def _internal(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    error_id = secrets.token_hex(4)
    log.error("call failed: unexpected error", method=method, error_id=error_id,
              error_type=type(error).__name__,
              exc_info=(type(error), error, error.__traceback__))
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"internal error (id {error_id}); the operator can look it up in the log")
