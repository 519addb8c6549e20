"""Transport security: TLS on every listener, mTLS when asked, plaintext only on loopback."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import grpc

from finsieve.config import ConfigError, Settings
from finsieve.secretfiles import read_secret

MAX_PEM_BYTES = 1 << 20


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def host_of(address: str) -> str:
    """The host part of host:port, [v6]:port, or a bare host."""
    if address.startswith("["):
        return address[1:].split("]", 1)[0]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def check_transport(s: Settings) -> None:
    """Refuse a configuration that would carry prompts, answers or keys in plaintext over a
    network, or whose TLS files are incomplete. The message says which setting and why."""
    if bool(s.tls_cert) != bool(s.tls_key):
        raise ConfigError("--tls-cert and --tls-key: give both or neither")
    if s.tls_client_ca and not s.tls_cert:
        raise ConfigError("--tls-client-ca: mTLS needs the server's own --tls-cert and --tls-key")
    if s.client_cert_map and not s.tls_client_ca:
        raise ConfigError("--client-cert-map: client certificates are only verified with "
                          "--tls-client-ca")
    if s.allow_insecure:
        return
    why = ("prompts, answers and credentials would cross the network unencrypted: give "
           "--tls-cert and --tls-key, or --allow-insecure to accept that")
    listeners = []
    if s.role in ("all", "gateway"):
        listeners += [("--host", s.host), ("--audit-host", s.audit_host)]
    if s.role == "engine":
        listeners.append(("--host", s.host))
    for flag, host in listeners:
        if not s.tls_cert and not is_loopback(host):
            raise ConfigError(f"{flag} {host}: refusing plaintext on a non-loopback address: {why}")
    if s.role == "gateway" and not s.engine_ca:
        for address in s.engines:
            if not is_loopback(host_of(address)):
                raise ConfigError(
                    f"--engine {address}: refusing plaintext to a remote engine: give "
                    "--engine-ca (the CA of the engines' certificates), or --allow-insecure")


def _pem(path: str, setting: str) -> bytes:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_PEM_BYTES:
            raise ConfigError(f"{setting} {p}: larger than {MAX_PEM_BYTES} bytes")
        data = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{setting} {p}: cannot read: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{setting} {p}: not a PEM file")
    return data


def server_credentials(s: Settings) -> grpc.ServerCredentials | None:
    """TLS for every listener (mTLS with --tls-client-ca); None: plaintext."""
    if not s.tls_cert:
        return None
    key = read_secret(Path(s.tls_key), "FINSIEVE_TLS_KEY")
    cert = _pem(s.tls_cert, "FINSIEVE_TLS_CERT")
    ca = _pem(s.tls_client_ca, "FINSIEVE_TLS_CLIENT_CA") if s.tls_client_ca else None
    # gRPC has no "verify if presented": with a client CA, a certificate is required.
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def engine_channel_credentials(s: Settings) -> grpc.ChannelCredentials | None:
    """TLS from the gateway to remote engines (with our certificate for engines that require
    mTLS); None: plaintext (loopback, or --allow-insecure)."""
    if not s.engine_ca:
        return None
    ca = _pem(s.engine_ca, "FINSIEVE_ENGINE_CA")
    if s.tls_cert:
        return grpc.ssl_channel_credentials(ca, read_secret(Path(s.tls_key), "FINSIEVE_TLS_KEY"),
                                            _pem(s.tls_cert, "FINSIEVE_TLS_CERT"))
    return grpc.ssl_channel_credentials(ca)
