"""Transport security: TLS on every listener, mTLS when asked, plaintext only on loopback."""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from finsieve.config import Settings
from finsieve.errors import ConfigError
from finsieve.secretfiles import read_secret

MAX_PEM_BYTES = 1 << 20
REMOTE_PLAINTEXT = ("refusing plaintext to a remote engine: give --engine-ca (the CA of the "
                    "engines' certificates), or --allow-insecure")
ALLOWED_PEERS = "--engine-allowed-peers"
ALLOWED_PEERS_ENV = "FINSIEVE_ENGINE_ALLOWED_PEERS"
# Which of gRPC's auth-context properties holds each kind of name: the SANs by type, so
# that a subject CN or a DNS name never passes for an allowed SAN URI (Envoy's
# match_typed_subject_alt_names; Istio matches the SPIFFE URI).
PEER_NAME_KINDS = {"URI": "peer_uri", "DNS": "peer_dns", "CN": "x509_common_name"}
MAX_PEER_NAMES = 32  # of each kind looked at (and logged) per certificate
MAX_PEER_NAME_CHARS = 256  # of each name logged


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
    _check_engine_peers(s)
    if s.allow_insecure:
        return
    why = ("prompts, answers and credentials would cross the network unencrypted: give "
           "--tls-cert and --tls-key, or --allow-insecure to accept that")
    listeners = []
    if s.role in ("all", "gateway"):
        listeners += [("--host", s.host), ("--audit-host", s.audit_host)]
        if s.http_port:
            listeners.append(("--http-host", s.http_host))
    if s.role == "engine":
        listeners.append(("--host", s.host))
    for flag, host in listeners:
        if not s.tls_cert and not is_loopback(host):
            raise ConfigError(f"{flag} {host}: refusing plaintext on a non-loopback address: {why}")
    if s.role == "gateway" and not s.engine_ca:
        for flag, address in [*(("--engine", a) for a in s.engines), ("--engine-dns", s.engine_dns)]:
            if address and not is_loopback(host_of(address)):
                raise ConfigError(f"{flag} {address}: {REMOTE_PLAINTEXT}")


def _check_engine_peers(s: Settings) -> None:
    """An engine with mTLS must name the gateways it serves: its CA also signs the apps'
    certificates, and a caller that reaches the engine directly has no audit record, no
    tenant and no limits. No list is a start-up error, not an engine that refuses everyone
    (or no one) at run time."""
    peers = PeerAllowList.parse(s.engine_allowed_peers)  # a bad entry is refused in any role
    if s.role != "engine":
        return
    if s.tls_client_ca and not peers:
        raise ConfigError(
            f"{ALLOWED_PEERS}: an engine with --tls-client-ca needs the list of the gateway "
            f"certificates it serves ({ALLOWED_PEERS_ENV}, e.g. URI:spiffe://bank-a/gateway): "
            "every other certificate the CA signed, an app's too, would reach the engine "
            "directly, past the gateway's audit, tenants and limits")
    if peers and not s.tls_client_ca:
        raise ConfigError(f"{ALLOWED_PEERS}: client certificates are only verified with "
                          "--tls-client-ca")
    if not s.engine_require_secret and not s.tls_client_ca:
        raise ConfigError("FINSIEVE_ENGINE_REQUIRE_SECRET: false needs --tls-client-ca and "
                          f"{ALLOWED_PEERS}: without a verified certificate the engine secret "
                          "is a gateway's only credential")


@dataclass(frozen=True)
class PeerCertificate:
    """The names of a caller's certificate that the TLS handshake verified."""

    uris: tuple[str, ...]
    dns: tuple[str, ...]
    common_names: tuple[str, ...]

    @classmethod
    def of(cls, auth_context: Mapping[str, Iterable[bytes]]) -> PeerCertificate | None:
        """None when the call came without a verified certificate (plaintext, or TLS
        without mTLS)."""
        if list(auth_context.get("transport_security_type", ())) != [b"ssl"] \
                or not auth_context.get("x509_pem_cert"):
            return None

        def names(kind: str) -> tuple[str, ...]:
            values = list(auth_context.get(PEER_NAME_KINDS[kind], ()))[:MAX_PEER_NAMES]
            return tuple(v.decode(errors="replace") for v in values)

        return cls(names("URI"), names("DNS"), names("CN"))

    def log_fields(self) -> dict[str, list[str]]:
        """For a log line: certificate names are not secret, but bounded."""
        def cut(names: tuple[str, ...]) -> list[str]:
            return [n[:MAX_PEER_NAME_CHARS] for n in names]
        return {"peer_uris": cut(self.uris), "peer_dns_names": cut(self.dns),
                "peer_common_names": cut(self.common_names)}


@dataclass(frozen=True)
class PeerAllowList:
    """FINSIEVE_ENGINE_ALLOWED_PEERS: certificate names matched exactly, each by its kind
    (DNS names case-insensitively, as DNS compares them)."""

    uris: frozenset[str] = frozenset()
    dns: frozenset[str] = frozenset()
    common_names: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.uris or self.dns or self.common_names)

    @classmethod
    def parse(cls, entries: Iterable[str]) -> PeerAllowList:
        found: dict[str, set[str]] = {kind: set() for kind in PEER_NAME_KINDS}
        for entry in entries:
            kind, _, value = entry.partition(":")
            if kind.upper() not in PEER_NAME_KINDS and "://" in entry:
                kind, value = "URI", entry  # a bare URI: spiffe://bank-a/gateway
            if kind.upper() not in PEER_NAME_KINDS or not value.strip():
                raise ConfigError(
                    f"{ALLOWED_PEERS} {entry}: expected URI:<SAN URI>, DNS:<SAN DNS name> or "
                    "CN:<subject common name>, e.g. URI:spiffe://bank-a/gateway")
            value = value.strip()
            found[kind.upper()].add(value.lower() if kind.upper() == "DNS" else value)
        return cls(frozenset(found["URI"]), frozenset(found["DNS"]), frozenset(found["CN"]))

    def match(self, peer: PeerCertificate) -> str | None:
        """The allowed name the certificate carries (as KIND:value), or None."""
        for uri in peer.uris:
            if uri in self.uris:
                return f"URI:{uri}"
        for dns in peer.dns:
            if dns.lower() in self.dns:
                return f"DNS:{dns}"
        for cn in peer.common_names:
            if cn in self.common_names:
                return f"CN:{cn}"
        return None


def engine_peers(s: Settings) -> PeerAllowList | None:
    """The gateways an engine serving this process's listener accepts by certificate; None
    where it verifies no client certificates (the engine secret alone then)."""
    return PeerAllowList.parse(s.engine_allowed_peers) if s.tls_client_ca else None


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


def server_ssl_context(s: Settings) -> ssl.SSLContext | None:
    """The same TLS for an HTTP listener (asyncio's): certificate, key and client CA as
    server_credentials checks them; TLS 1.2 at least. None: plaintext."""
    if not s.tls_cert:
        return None
    read_secret(Path(s.tls_key), "FINSIEVE_TLS_KEY")  # its mode and size, as for gRPC
    _pem(s.tls_cert, "FINSIEVE_TLS_CERT")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(s.tls_cert, s.tls_key)
        if s.tls_client_ca:
            context.load_verify_locations(cadata=_pem(s.tls_client_ca, "FINSIEVE_TLS_CLIENT_CA")
                                          .decode("ascii", errors="replace"))
            context.verify_mode = ssl.CERT_REQUIRED  # as on gRPC: a certificate is required
    except ssl.SSLError as e:
        raise ConfigError(f"--tls-cert/--tls-key/--tls-client-ca: cannot be used for TLS: "
                          f"{e.reason or e}") from None
    return context


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
