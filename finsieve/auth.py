"""Who is calling, and may they call this: one gate in front of every servicer.

`AuthInterceptor` authenticates every call except gRPC health checking (load balancers and
probes call it without a credential), checks the caller's role against the service, and
hands the `Principal` to the handler through a context variable (gRPC's servicer context
cannot carry it). A service missing from the role table is refused: a new service is
closed until someone decides who may call it. Failures say only UNAUTHENTICATED or
PERMISSION_DENIED; the reason goes to the log, never to the caller.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2

from finsieve.grpc_server import Behavior, responses, wrap_handler

log = structlog.get_logger(__name__)

ROLES = ("app", "officer", "admin")
GATEWAY_ROLE = "gateway"  # what an engine calls the gateways it trusts
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION = ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")
UNAUTHENTICATED_MESSAGE = "missing or invalid credentials"
DENIED_MESSAGE = "permission denied"
CHECK_UNAVAILABLE_MESSAGE = "credentials cannot be checked now; retry later"


@dataclass(frozen=True)
class Principal:
    key_id: str  # an API key's id, "cert:<subject>" for a client certificate, or "gateway"
    tenant: str
    role: str
    all_tenants: bool = False
    name: str = ""
    # The verified credential's keyed hash, to check it again later (revocation, expiry).
    credential: str = field(default="", repr=False)

    def may_see(self, tenant: str) -> bool:
        return self.all_tenants or tenant == self.tenant


class Unauthenticated(Exception):
    """No usable credential. The message is for the log only."""


class CheckUnavailable(Exception):
    """The credential cannot be checked now (its store is unreachable): UNAVAILABLE, so the
    caller retries instead of discarding a good key. The message is for the log only."""


Authenticate = Callable[[Mapping[str, str], Mapping[str, Iterable[bytes]]], Awaitable[Principal]]

# Set by AuthInterceptor for the task serving one call (and the tasks it creates).
_CALLER: contextvars.ContextVar[Principal] = contextvars.ContextVar("finsieve_caller")


def caller() -> Principal:
    """The authenticated caller of the call being served. Outside an authenticated call this
    raises LookupError: a handler reached without the interceptor fails, it never runs open."""
    return _CALLER.get()


def bearer(metadata: Mapping[str, str]) -> str | None:
    value = metadata.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, authenticate: Authenticate, roles: Mapping[str, frozenset[str]]) -> None:
        """roles: full service name -> roles that may call it (health needs no entry)."""
        self._authenticate = authenticate
        self._roles = dict(roles)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        service = details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service == HEALTH:
            return handler
        allowed = self._roles.get(service, frozenset())
        return wrap_handler(handler, lambda b: self._unary(b, allowed),
                            lambda b: self._streaming(b, allowed))

    def _unary(self, behavior: Behavior, allowed: frozenset[str]) -> Behavior:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._admit(context, allowed)
            return await behavior(request, context)
        return call

    def _streaming(self, behavior: Behavior, allowed: frozenset[str]) -> Behavior:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await self._admit(context, allowed)
            async for response in responses(behavior(request, context)):
                yield response
        return call

    async def _admit(self, context: grpc.aio.ServicerContext, allowed: frozenset[str]) -> None:
        metadata = {k.lower(): v for k, v in context.invocation_metadata() or ()
                    if isinstance(v, str)}
        try:
            principal = await self._authenticate(metadata, context.auth_context())
        except Unauthenticated as e:
            log.info("authentication failed", reason=str(e), peer=context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        except CheckUnavailable as e:
            log.warning("credentials cannot be checked", reason=str(e))
            await context.abort(grpc.StatusCode.UNAVAILABLE, CHECK_UNAVAILABLE_MESSAGE)
        if principal.role not in allowed:
            log.info("permission denied", key_id=principal.key_id, role=principal.role,
                     peer=context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, DENIED_MESSAGE)
        _CALLER.set(principal)


def roles_for(services: Mapping[str, str]) -> dict[str, frozenset[str]]:
    """The role table of a listener: each service's one role; reflection for any of them."""
    table = {name: frozenset({role}) for name, role in services.items()}
    every = frozenset(services.values())
    return {**table, **{name: every for name in REFLECTION}}

