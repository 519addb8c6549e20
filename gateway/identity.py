"""Client identity on the gateway's listeners: an API key, or a mapped client certificate.

A bearer key, when sent, decides. Without one, a client certificate verified during the
TLS handshake (FINSIEVE_TLS_CLIENT_CA) identifies the caller if FINSIEVE_CLIENT_CERT_MAP
maps its subject or one of its subject alternative names to a tenant and role. Nothing
else, and never a request's metadata, decides a tenant.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finsieve.auth import ROLES, Principal, Unauthenticated, bearer
from finsieve.config import Settings, load_yaml_file
from finsieve.errors import ConfigError

from .keys import MAX_NAME, TENANT_RE, KeyStore

MAX_MAP_ENTRIES = 10000
_FIELDS = {"subject", "san", "tenant", "role", "name", "all_tenants"}


@dataclass(frozen=True)
class CertMap:
    by_subject: dict[str, Principal]
    by_san: dict[str, Principal]

    @classmethod
    def load(cls, path: Path, setting: str = "FINSIEVE_CLIENT_CERT_MAP") -> CertMap:
        """Read and check the mapping; a problem stops start-up naming file, entry and field."""
        where = f"{setting} {path}"
        doc = load_yaml_file(path, setting)
        entries = doc.get("certificates") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or len(entries) > MAX_MAP_ENTRIES:
            raise ConfigError(f"{where}: expected `certificates:` with a list of at most "
                              f"{MAX_MAP_ENTRIES} entries")
        by_subject: dict[str, Principal] = {}
        by_san: dict[str, Principal] = {}
        for i, entry in enumerate(entries):
            at = f"{where}: certificates[{i}]"
            field, value, principal = _entry(entry, at)
            table = by_subject if field == "subject" else by_san
            if value in table:
                raise ConfigError(f"{at}.{field}: {value!r} is mapped twice")
            table[value] = principal
        return cls(by_subject, by_san)

    def lookup(self, auth_context: Mapping[str, Iterable[bytes]]) -> Principal | None:
        for subject in auth_context.get("x509_subject", []):
            if (p := self.by_subject.get(subject.decode(errors="replace"))) is not None:
                return p
        for san in auth_context.get("x509_subject_alternative_name", []):
            if (p := self.by_san.get(san.decode(errors="replace"))) is not None:
                return p
        return None


def _entry(entry: Any, at: str) -> tuple[str, str, Principal]:
    if not isinstance(entry, dict):
        raise ConfigError(f"{at}: expected a mapping with subject or san, tenant and role")
    if unknown := sorted(set(map(str, entry)) - _FIELDS):
        raise ConfigError(f"{at}.{unknown[0]}: unknown field")
    keys = [k for k in ("subject", "san") if k in entry]
    if len(keys) != 1:
        raise ConfigError(f"{at}: give exactly one of subject or san")
    value = entry[keys[0]]
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{at}.{keys[0]}: expected a non-empty string")
    tenant, role, name = entry.get("tenant"), entry.get("role"), entry.get("name", "")
    all_tenants = entry.get("all_tenants", False)
    if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
        raise ConfigError(f"{at}.tenant: expected 1-64 letters, digits, '.', '_' or '-'")
    if role not in ROLES:
        raise ConfigError(f"{at}.role: expected one of {', '.join(ROLES)}")
    if not isinstance(name, str) or len(name) > MAX_NAME:
        raise ConfigError(f"{at}.name: expected a string of at most {MAX_NAME} characters")
    if not isinstance(all_tenants, bool) or (all_tenants and role == "app"):
        raise ConfigError(f"{at}.all_tenants: true or false; only officer and admin may have it")
    # Subjects and SANs are not secret; the key id says which one identified the caller.
    return keys[0], value, Principal(f"cert:{value}", tenant, role, all_tenants, name)


class ClientAuthenticator:
    """What the gateway's AuthInterceptor asks: who is this caller?"""

    def __init__(self, keys: KeyStore, certs: CertMap | None = None) -> None:
        self.keys = keys
        self.certs = certs

    @classmethod
    def from_settings(cls, settings: Settings, keys: KeyStore) -> ClientAuthenticator:
        return cls(keys, CertMap.load(Path(settings.client_cert_map))
                   if settings.client_cert_map else None)

    async def __call__(self, metadata: Mapping[str, str],
                       auth_context: Mapping[str, Iterable[bytes]]) -> Principal:
        token = bearer(metadata)
        if token is not None:
            return await self.keys.verify(token)
        if self.certs is not None and (p := self.certs.lookup(auth_context)) is not None:
            return p
        raise Unauthenticated("no API key, and no mapped client certificate")

    async def still_valid(self, principal: Principal) -> bool:
        """Checked again for each request of a long-lived stream: a revoked or expired key
        stops being served within the key cache's lifetime. A certificate was checked at
        the handshake and stays valid for the connection."""
        if principal.key_id.startswith("cert:"):
            return True
        return await self.keys.check_again(principal)
