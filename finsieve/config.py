"""All configuration in one typed object: defaults < FINSIEVE_* environment < CLI flags."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

Role = Literal["all", "engine", "gateway"]
Device = Literal["auto", "cpu", "cuda"]


class ConfigError(ValueError):
    """A setting has a value that cannot be used; the message names the setting."""


def _setting(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True)
class Settings:
    role: Role = _setting("all", "what this process serves: engine, gateway, or both")
    host: str = _setting("127.0.0.1", "address the public gateway listens on")
    port: int = _setting(50051, "port of the public gateway (role all|gateway)")
    audit_host: str = _setting("127.0.0.1", "address the officers' AuditService listens on")
    audit_port: int = _setting(50053, "port of the officers' AuditService (role all|gateway)")
    engine_port: int = _setting(50052, "port of the engine service (role engine; 0 = free port)")
    engines: tuple[str, ...] = _setting(
        (), "engine addresses host:port the gateway forwards to (role gateway)"
    )
    model: str = _setting("", "Hugging Face model directory; empty = embedded default model")
    rules: str = _setting("rules", "directory of YAML rule packs; empty = no rules (--no-rules)")
    luts: str = _setting("luts", "where token-mask tables are kept (generated)")
    max_rollbacks: int = _setting(8, "rollbacks (SAR) per request before it halts")
    state_dir: str = _setting(".finsieve", "state: converted model, embedded Valkey data")
    redis_url: str = _setting("", "Redis/Valkey URL; empty = start an embedded Valkey")
    audit_key: str = _setting("", "HMAC key of the audit chain (secret); empty = audit_key_file")
    audit_key_file: str = _setting(
        "", "file holding the HMAC key; empty = <state dir>/audit.key, made on first start")
    audit_fail_open: bool = _setting(
        False, "serve a request even if its audit record cannot be written (default: refuse)")
    appendfsync: Literal["always", "everysec", "no"] = _setting(
        "everysec", "embedded Valkey's AOF fsync policy (see README: what each can lose)")
    cache_ttl_s: int = _setting(3600, "response cache entry lifetime; 0 = no cache")
    cache_max_bytes: int = _setting(262144, "largest response the cache keeps")
    audit_retention_days: float = _setting(
        0.0, "delete audit records older than this (behind a signed checkpoint); 0 = keep all")
    audit_anchor_interval_s: float = _setting(
        1.0, "while records are appended, anchor the chain head outside Redis this often")
    audit_wait_replicas: int = _setting(
        0, "acknowledge an audit record only once this many Redis replicas have it (WAIT)")
    audit_wait_timeout_ms: int = _setting(
        1000, "how long an audit append waits for those replicas before it fails")
    audit_page_bytes: int = _setting(
        4 << 20, "largest page of records an officer's query or export returns at once")
    audit_nice: int = _setting(10, "CPU niceness of the officers' process (0-19)")
    device: Device = _setting("auto", "engine device: auto (cuda if present), cpu, cuda")
    max_batch: int = _setting(8, "sequences decoded together (KV cache slots)")
    max_context: int = _setting(2048, "tokens per sequence, prompt + completion")
    batch_invariant: bool = _setting(
        True, "CPU: fixed 8-row matmul tiles so an answer never depends on the batch"
    )
    max_tokens_limit: int = _setting(1024, "largest max_tokens a request may ask for")
    default_max_tokens: int = _setting(256, "max_tokens when a request leaves it unset")
    max_input_bytes: int = _setting(262144, "largest total size of a request's messages")
    drain_seconds: float = _setting(20.0, "on SIGTERM, how long in-flight requests may finish")
    metrics_port: int = _setting(0, "serve Prometheus metrics on this port (0 = off)")
    log_format: Literal["auto", "json", "console"] = _setting(
        "auto", "log rendering: auto = console on a terminal, JSON otherwise"
    )
    log_level: str = _setting("info", "debug, info, warning or error")

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser().resolve()

    @classmethod
    def env_name(cls, name: str) -> str:
        return f"FINSIEVE_{name.upper()}"

    @classmethod
    def load(cls, overrides: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> Settings:
        """Defaults, then FINSIEVE_* variables, then explicit overrides (CLI flags)."""
        env = os.environ if env is None else env
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(cls.env_name(f.name))
            if raw is not None and raw != "":
                values[f.name] = _parse(f.name, hints[f.name], raw, cls.env_name(f.name))
        for name, value in (overrides or {}).items():
            if value is not None:
                values[name] = _parse(name, hints[name], value, f"--{name.replace('_', '-')}")
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        positive = ("max_batch", "max_context", "max_tokens_limit", "default_max_tokens",
                    "max_input_bytes", "max_rollbacks")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.env_name(name)}: must be positive")
        if self.audit_anchor_interval_s <= 0:
            raise ConfigError("FINSIEVE_AUDIT_ANCHOR_INTERVAL_S: must be positive")
        if self.audit_wait_replicas < 0 or self.audit_wait_timeout_ms <= 0:
            raise ConfigError("FINSIEVE_AUDIT_WAIT_REPLICAS / _TIMEOUT_MS: replicas must not be "
                              "negative, the timeout must be positive")
        if not 64 << 10 <= self.audit_page_bytes <= 6 << 20:
            raise ConfigError("FINSIEVE_AUDIT_PAGE_BYTES: must be between 65536 and 6291456 "
                              "(a page must fit a gRPC message)")
        if not 0 <= self.audit_nice <= 19:
            raise ConfigError("FINSIEVE_AUDIT_NICE: must be between 0 and 19")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ConfigError("FINSIEVE_DEFAULT_MAX_TOKENS: must not exceed max_tokens_limit")
        if self.role == "gateway" and not self.engines:
            raise ConfigError("--engine: role gateway needs at least one engine address")

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _parse(name: str, hint: Any, value: Any, source: str) -> Any:
    """Turn a CLI or environment value into the field's type, or say which setting is wrong."""
    choices = get_args(hint) if getattr(hint, "__origin__", None) is Literal else ()
    try:
        if choices:
            if value not in choices:
                raise ValueError(f"expected one of {', '.join(choices)}")
            return value
        if hint is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if hint in (int, float, str):
            return hint(value)
        if hint == tuple[str, ...]:
            items = value if isinstance(value, (list, tuple)) else str(value).split(",")
            return tuple(s.strip() for s in items if s.strip())
    except ValueError as e:
        raise ConfigError(f"{source}: {value!r}: {e}") from None
    raise TypeError(f"unsupported setting type for {name}: {hint}")


def settings_table() -> list[tuple[str, str, str]]:
    """(environment variable, default, help) for the README and `--help`."""
    return [
        (Settings.env_name(f.name), repr(f.default), f.metadata["help"]) for f in fields(Settings)
    ]
