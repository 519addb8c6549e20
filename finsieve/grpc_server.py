"""An asyncio gRPC server with standard health checking and reflection."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Room for a request at the input limit plus protobuf framing; bigger is refused by gRPC.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
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
                       credentials: grpc.ServerCredentials | None = None,
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> RunningServer:
    """Serve `services` (plus health and reflection) on `address`; TLS when credentials are
    given (plaintext otherwise: callers check that this is allowed, see finsieve.tls)."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=list(interceptors))
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
