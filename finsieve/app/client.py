"""A small client of finsieve's services: credentials, channels, one Chat stream."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from finsieve.grpc_server import CHANNEL_OPTIONS
from finsieve.tls import host_of, is_loopback
from finsieve.v1 import chat_pb2, chat_pb2_grpc

MAX_KEY_FILE_BYTES = 4096


class CredentialError(ValueError):
    """The client's own credentials cannot be used; the message names the file or variable."""


class _Bearer:
    """Adds `authorization: Bearer <key>` to every call of a channel. (gRPC's own call
    credentials refuse plaintext channels, which loopback development uses.)"""

    def __init__(self, key: str) -> None:
        self._entry = ("authorization", f"Bearer {key}")

    async def _forward(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return await continuation(grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready),
            request)


# grpc.aio files an interceptor under its first matching kind only: one object per kind.
class _BearerUU(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                                    request: Any) -> Any:
        return await self._forward(continuation, client_call_details, request)


class _BearerUS(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                                     request: Any) -> Any:
        return await self._forward(continuation, client_call_details, request)


class _BearerSU(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                                     request_iterator: Any) -> Any:
        return await self._forward(continuation, client_call_details, request_iterator)


class _BearerSS(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        return await self._forward(continuation, client_call_details, request_iterator)


@dataclass(frozen=True)
class Credentials:
    api_key: str = field(default="", repr=False)
    tls_ca: bytes | None = None  # set: TLS, verifying the server against this CA
    tls_cert: bytes | None = None  # set with tls_key: our client certificate (mTLS)
    tls_key: bytes | None = field(default=None, repr=False)

    def channel(self, target: str, options: list | None = None) -> grpc.aio.Channel:
        """A channel whose every call carries these credentials."""
        options = CHANNEL_OPTIONS if options is None else options
        interceptors = ([kind(self.api_key) for kind in (_BearerUU, _BearerUS, _BearerSU, _BearerSS)]
                        if self.api_key else None)
        if self.tls_ca is None:
            return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        creds = grpc.ssl_channel_credentials(self.tls_ca, self.tls_key, self.tls_cert)
        return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)


def dev_key_path(state_dir: str | Path, role: str) -> Path:
    """Where `serve` keeps the development key of a role (embedded default only)."""
    return Path(state_dir).expanduser() / "keys" / f"{role}.key"


def read_key_file(path: Path, source: str) -> str:
    try:
        if path.stat().st_size > MAX_KEY_FILE_BYTES:
            raise CredentialError(f"{source} {path}: larger than {MAX_KEY_FILE_BYTES} bytes")
        key = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CredentialError(f"{source} {path}: cannot read: "
                              f"{getattr(e, 'strerror', None) or 'not text'}") from None
    if not key or any(c.isspace() for c in key):
        raise CredentialError(f"{source} {path}: expected one API key on one line")
    return key


def resolve_credentials(target: str, role: str, *, key_file: str = "", state_dir: str = ".finsieve",
                        tls_ca: str = "", tls_cert: str = "", tls_key: str = "",
                        env: Mapping[str, str] | None = None) -> Credentials:
    """A command's credentials: --key-file, else FINSIEVE_API_KEY, else, for a loopback
    target, the development key of `role` that `serve` wrote under --state-dir."""
    env = os.environ if env is None else env
    transport = transport_credentials(tls_ca, tls_cert, tls_key)
    if key_file:
        key = read_key_file(Path(key_file), "--key-file")
    elif env.get("FINSIEVE_API_KEY", "").strip():
        key = env["FINSIEVE_API_KEY"].strip()
    elif is_loopback(host_of(target)) and dev_key_path(state_dir, role).exists():
        key = read_key_file(dev_key_path(state_dir, role), "development key")
    elif transport.tls_cert is not None:
        key = ""  # the client certificate may identify us
    else:
        raise CredentialError(
            f"no credentials for {target}: give --key-file FILE or set FINSIEVE_API_KEY (an "
            f"{role} key), or for a local server the --state-dir where `serve` wrote "
            f"keys/{role}.key")
    return replace(transport, api_key=key)


def transport_credentials(tls_ca: str = "", tls_cert: str = "", tls_key: str = "") -> Credentials:
    """TLS settings alone (enough for health checks, which need no key)."""
    if bool(tls_cert) != bool(tls_key):
        raise CredentialError("--tls-cert and --tls-key: give both or neither")
    if tls_cert and not tls_ca:
        raise CredentialError("--tls-cert: a client certificate needs --tls-ca (TLS)")
    ca, cert, key = (_read_pem(path, flag) if path else None for path, flag in
                     ((tls_ca, "--tls-ca"), (tls_cert, "--tls-cert"), (tls_key, "--tls-key")))
    return Credentials(tls_ca=ca, tls_cert=cert, tls_key=key)


def _read_pem(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CredentialError(f"{flag} {path}: cannot read: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise CredentialError(f"{flag} {path}: not a PEM file")
    return data


def chat_request(
    request_id: str,
    question: str,
    *,
    max_tokens: int = 0,
    temperature: float = 0.0,
    seed: int | None = None,
    stop: Iterable[str] = (),
) -> chat_pb2.ChatRequest:
    params = chat_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, stop=list(stop)
    )
    if seed is not None:
        params.seed = seed
    return chat_pb2.ChatRequest(
        request_id=request_id,
        messages=[chat_pb2.Message(role="user", content=question)],
        params=params,
    )


# While a server starts, its port refuses connections, and a channel waits out gRPC's
# reconnect backoff (1 s, then x1.6 each time, up to 120 s) before it tries again: a check
# every READY_POLL_S would see a server that had come up ~15 s into its start-up ~5 s late
# (measured: `finsieve serve` SERVING at 10.4 s, seen at 15.2 s). Reconnecting as often as
# we poll makes a check see it at once.
READY_POLL_S = 0.2
_READY_BACKOFF_MS = int(READY_POLL_S * 1000)
READY_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS,
                         ("grpc.initial_reconnect_backoff_ms", _READY_BACKOFF_MS),
                         ("grpc.min_reconnect_backoff_ms", _READY_BACKOFF_MS),
                         ("grpc.max_reconnect_backoff_ms", _READY_BACKOFF_MS)]


async def wait_ready(target: str, timeout: float, credentials: Credentials | None = None) -> bool:
    """Wait until the server's health check says SERVING; False after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with (credentials or Credentials()).channel(target, READY_CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while loop.time() < deadline:
            try:
                # types-grpcio-health-checking declares none of the stub's methods (set in __init__)
                reply = await stub.Check(  # type: ignore[attr-defined]
                    health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(READY_POLL_S)
    return False


def is_terminal(event: chat_pb2.ChatServerMessage) -> bool:
    return event.WhichOneof("event") in ("finished", "error")


async def stream_one(
    target: str, request: chat_pb2.ChatRequest, timeout: float | None = None,
    credentials: Credentials | None = None,
) -> AsyncIterator[chat_pb2.ChatServerMessage]:
    """Send one request on a fresh stream; yield its events up to the terminal one."""
    credentials = credentials or Credentials()
    async with credentials.channel(target) as channel:
        stub = chat_pb2_grpc.GatewayStub(channel)
        outbox: asyncio.Queue[chat_pb2.ChatClientMessage | None] = asyncio.Queue()
        outbox.put_nowait(chat_pb2.ChatClientMessage(request=request))

        async def requests() -> AsyncIterator[chat_pb2.ChatClientMessage]:
            while (msg := await outbox.get()) is not None:
                yield msg

        call = stub.Chat(requests(), timeout=timeout)
        try:
            async for event in call:
                yield event
                if is_terminal(event):
                    break
        finally:
            outbox.put_nowait(None)
            call.cancel()
