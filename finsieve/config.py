"""All configuration in one typed object: defaults < FINSIEVE_* environment < CLI flags."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

import yaml

from finsieve.errors import ConfigError
from finsieve.secretfiles import read_secret
from finsieve.wire import MAX_MESSAGE_BYTES, largest_valid_request

Role = Literal["all", "engine", "gateway"]
Device = Literal["auto", "cpu", "cuda"]
CpuBackend = Literal["llama.cpp", "float32"]


def _setting(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True)
class Settings:
    role: Role = _setting("all", "what this process serves: engine, gateway, or both")
    host: str = _setting("127.0.0.1", "address the public gateway listens on")
    port: int = _setting(50051, "port of the public gateway (role all|gateway)")
    http_port: int = _setting(
        0, "port of the OpenAI-compatible HTTP endpoint (role all|gateway; docs/openai.md); 0 = off")
    http_host: str = _setting("127.0.0.1", "address the OpenAI-compatible HTTP endpoint listens on")
    audit_host: str = _setting("127.0.0.1", "address the officers' AuditService listens on")
    audit_port: int = _setting(50053, "port of the officers' AuditService (role all|gateway)")
    engine_port: int = _setting(50052, "port of the engine service (role engine; 0 = free port)")
    engines: tuple[str, ...] = _setting(
        (), "engine addresses host:port the gateway forwards to (role gateway)"
    )
    engines_file: str = _setting(
        "", "role gateway: file of engine addresses, one host:port a line (# comments), "
        "watched: engines added are used, engines removed drained, with no restart; a file "
        "with a bad line, or with none, is logged and the previous engines stay")
    engine_dns: str = _setting(
        "", "role gateway: NAME:PORT whose addresses are the engines (e.g. a headless "
        "Kubernetes Service), resolved again every FINSIEVE_ENGINE_DNS_INTERVAL_S; a failed "
        "resolution keeps the previous engines")
    engine_dns_interval_s: float = _setting(5.0, "how often FINSIEVE_ENGINE_DNS is resolved again")
    max_engines: int = _setting(
        256, "most engines a gateway serves (all sources together); a change that would pass "
        "it is logged and the previous engines stay")
    model: str = _setting("", "Hugging Face model directory; empty = embedded default model")
    rules: str = _setting("rules", "directory of YAML rule packs; empty = no rules (--no-rules)")
    luts: str = _setting("luts", "where token-mask tables are kept (generated)")
    max_rollbacks: int = _setting(8, "rollbacks (SAR) per request before it halts")
    state_dir: str = _setting(".finsieve", "state: converted model, embedded Valkey data")
    redis_url: str = _setting("", "Redis/Valkey URL; empty = start an embedded Valkey")
    redis_url_file: str = _setting(
        "", "file (mode 600) holding the Redis/Valkey URL, password included: read at start, so "
        "the password is in no process's environment (/proc/<pid>/environ keeps a variable "
        "even after the process unsets it); instead of FINSIEVE_REDIS_URL")
    audit_key_file: str = _setting(
        "", "file (mode 600, >= 32 bytes) holding the audit chain's HMAC key; empty = "
        "<state dir>/audit.key, made on first start")
    audit_fail_open: bool = _setting(
        False, "serve a request even if its audit record cannot be written (default: refuse)")
    redis_max_connections: int = _setting(
        512, "connections a process keeps to Redis (to each node of a Cluster); a command that "
        "finds them all busy waits for one, up to the socket timeout, instead of failing")
    appendfsync: Literal["always", "everysec", "no"] = _setting(
        "everysec", "embedded Valkey's AOF fsync policy (docs/operations.md: what each can lose)")
    cache_ttl_s: int = _setting(3600, "response cache entry lifetime; 0 = no cache")
    cache_max_bytes: int = _setting(262144, "largest response the cache keeps")
    cache_store_wait_ms: int = _setting(
        500, "a repeat of an answer still being stored waits this long for its cache entry "
        "(same gateway); 0 = no wait")
    audit_retention_days: float = _setting(
        0.0, "delete audit records older than this (behind a signed checkpoint); 0 = keep all")
    allow_insecure: bool = _setting(
        False, "allow plaintext listeners on non-loopback addresses and plaintext to remote engines")
    tls_cert: str = _setting("", "PEM certificate chain served on every listener (with tls_key)")
    tls_key: str = _setting("", "PEM private key of tls_cert (mode 600)")
    tls_client_ca: str = _setting(
        "", "PEM CA bundle: every listener requires a client certificate signed by it (mTLS)")
    client_cert_map: str = _setting(
        "", "YAML file mapping client-certificate subjects or SANs to tenant and role")
    engine_ca: str = _setting(
        "", "PEM CA bundle that signed the engines' certificates; set = TLS to engines")
    engine_secret_file: str = _setting(
        "", "shared secret gateways present to engines; empty = <state dir>/engine.secret, "
        "made on first start")
    engine_allowed_peers: tuple[str, ...] = _setting(
        (), "role engine with tls_client_ca (required there): the only client certificates "
        "it serves, comma-separated, each URI:<SAN URI> (or a bare spiffe://... id), "
        "DNS:<SAN DNS name> or CN:<subject CN>, matched exactly; any other certificate of "
        "the CA is UNAUTHENTICATED")
    engine_require_secret: bool = _setting(
        True, "role engine with tls_client_ca: an allowed gateway certificate must also send "
        "the engine secret; false = the certificate alone (a secret sent must still match)")
    keys_secret_file: str = _setting(
        "", "server key of the stored API-key hashes (the same on every gateway); empty = "
        "<state dir>/keys.secret, made on first start")
    key_cache_s: float = _setting(
        5.0, "verified API keys are cached this long: a revocation takes effect within it")
    key_cache_max: int = _setting(10000, "most verified keys, and tenants' limits, cached per gateway")
    limits_file: str = _setting("", "YAML file of per-tenant limits (docs/operations.md)")
    tenant_requests_per_s: float = _setting(50.0, "default requests per second per tenant; 0 = unlimited")
    tenant_tokens_per_min: int = _setting(
        200000, "default generated tokens per minute per tenant; 0 = unlimited")
    tenant_concurrent_streams: int = _setting(
        64, "default open Chat streams per tenant; 0 = unlimited")
    audit_anchor_interval_s: float = _setting(
        1.0, "while records are appended, anchor the chain head outside Redis this often")
    audit_wait_replicas: int = _setting(
        0, "acknowledge an audit record only once this many Redis replicas have it (WAIT; with "
        "FINSIEVE_AUDIT_WAITAOF_LOCAL, replicas that fsynced it to their AOF)")
    audit_waitaof_local: bool = _setting(
        False, "acknowledge an audit record only once the Redis primary fsynced it to its AOF "
        "(WAITAOF 1 <FINSIEVE_AUDIT_WAIT_REPLICAS>; the primary needs appendonly yes)")
    audit_wait_timeout_ms: int = _setting(
        1000, "how long an audit append waits for those replicas (or fsyncs) before it fails")
    audit_spool_max_records: int = _setting(
        200000, "audit records kept in the local spool (<state dir>/audit-spool) to restore "
        "what a Redis failover loses; 0 = no spool (docs/operations.md)")
    audit_spool_max_bytes: int = _setting(256 << 20, "bytes the local audit spool may hold")
    audit_spool_keep_s: float = _setting(
        300.0, "a spooled record is kept this long after a check found it in Redis (longer "
        "than replication can lag)")
    audit_check_interval_s: float = _setting(
        5.0, "how often a gateway checks that the audit records it acknowledged are still in "
        "Redis (every append checks the newest one too)")
    audit_page_bytes: int = _setting(
        4 << 20, "largest page of records an officer's query or export returns at once")
    audit_nice: int = _setting(10, "CPU niceness of the officers' process (0-19)")
    console_port: int = _setting(
        0, "port of the officers' web console (role all|gateway), served by the officers' process "
        "on FINSIEVE_AUDIT_HOST with the listeners' TLS; 0 = off")
    console_session_s: int = _setting(
        900, "an officer's console session ends this long after login (60 to 86400 seconds)")
    console_export_max: int = _setting(
        100000, "most records one console export, regulator package or re-scan reads")
    console_query_s: float = _setting(
        10.0, "longest one console page, export or re-scan reads the trail (seconds); a page cut "
        "short says where it stopped and links to the rest")
    audit_max_calls: int = _setting(
        100, "calls open at once on the officers' port (gRPC maximum_concurrent_rpcs); more "
        "get RESOURCE_EXHAUSTED")
    admin_backlog_max: int = _setting(
        1000, "admin audit records (rule packs loaded or rejected, start, stop) held while the "
        "trail refuses them; when full, rule pack loads wait to be recorded")
    device: Device = _setting("auto", "engine device: auto (cuda if present), cpu, cuda")
    cpu_backend: CpuBackend = _setting(
        "llama.cpp", "CPU: llama.cpp runs the model's GGUF (a model directory holding one, as "
        "the default's does), or float32: the engine's own float32 forward (the reference)")
    max_batch: int = _setting(8, "sequences decoded together (KV cache slots)")
    max_context: int = _setting(2048, "tokens per sequence, prompt + completion")
    batch_invariant: bool = _setting(
        True, "CPU: fixed 8-row matmul tiles so an answer never depends on the batch"
    )
    max_waiting: int = _setting(
        256, "requests waiting for a KV slot; beyond, RESOURCE_EXHAUSTED with a retry hint")
    prefill_chunk: int = _setting(
        2048, "prompt tokens prefilled per step (chunked prefill): the longest stall a burst of "
        "prompts causes the running streams")
    cpu_prefill_chunk: int = _setting(
        32, "CPU: prompt tokens prefilled per step, at most (and at most prefill_chunk): a "
        "step stays short, so running streams go on while long prompts arrive")
    mixed_tokens: int = _setting(
        256, "CUDA: while streams decode, at most this many prompt tokens a step are prefilled "
        "in the decode forward itself (a mixed step; 0: prefill runs a forward of its own)")
    prompt_batch_tokens: int = _setting(
        1024, "CUDA, mixed steps off: while streams decode, fresh prompts wait until together "
        "they fill this many tokens (0: never wait) or the oldest has waited "
        "FINSIEVE_PROMPT_WAIT_STEPS steps")
    prompt_wait_steps: int = _setting(
        16, "CUDA: the most decode steps a fresh prompt waits for others (0: never; see "
        "prompt_batch_tokens)")
    prepare_workers: int = _setting(
        2, "processes that prepare requests (chat template, tokenizer, input rules) off the "
        "engine's GIL; 0 = on the engine's own threads")
    gpu_memory_utilization: float = _setting(
        0.9, "CUDA: share of the device's memory the engine may fill (weights + KV slots)")
    compile: bool = _setting(True, "CUDA: torch.compile the decode step (fuses elementwise work)")
    cuda_graphs: bool = _setting(True, "CUDA: run decode steps as CUDA graphs per batch bucket")
    max_tokens_limit: int = _setting(1024, "largest max_tokens a request may ask for")
    default_max_tokens: int = _setting(256, "max_tokens when a request leaves it unset")
    max_input_bytes: int = _setting(262144, "largest total size of a request's messages")
    drain_seconds: float = _setting(20.0, "on SIGTERM, how long in-flight requests may finish")
    # Bounds on what one client or one rule pack can cost (docs/operations.md: "Limits and bounds").
    max_messages: int = _setting(256, "messages per request")
    max_message_bytes: int = _setting(
        1048576, "largest frame a client may send; bigger ends its call (RESOURCE_EXHAUSTED)")
    max_in_flight_per_stream: int = _setting(64, "requests in flight on one Chat stream")
    max_in_flight_per_connection: int = _setting(
        256, "requests in flight on one client connection (all its streams)")
    max_streams: int = _setting(1000, "calls open at once on the public port (gRPC "
                                "maximum_concurrent_rpcs); more get RESOURCE_EXHAUSTED")
    outbox_max_events: int = _setting(
        1024, "events waiting for a slow client on one stream (deltas merged); more ends it")
    slow_reader_grace_s: float = _setting(
        30.0, "a stream whose client reads nothing for this long is ended (gRPC; on HTTP and the "
        "officers' console, a connection whose socket takes no byte for this long is dropped)")
    http_max_body_bytes: int = _setting(
        2097152, "largest HTTP request body, counted as it is read (413 beyond); at least "
        "FINSIEVE_MAX_INPUT_BYTES, as JSON escapes make a body larger than its messages")
    http_max_header_bytes: int = _setting(
        16384, "largest HTTP request line and headers together (431 beyond, the connection closed)")
    http_max_connections: int = _setting(
        1000, "HTTP connections open at once; a request beyond gets 503 and its connection closes")
    http_read_timeout_s: float = _setting(
        30.0, "an HTTP client sends a request's line and headers, then its body, each within "
        "this long (the connection closed; 408 for a body); the officers' console's heads too")
    http_keepalive_s: float = _setting(5.0, "an idle HTTP keep-alive connection is closed after this long")
    http_sse_keepalive_s: float = _setting(
        15.0, "while a streamed HTTP answer has nothing to send (queued, a long prefill), an SSE "
        "comment this often keeps proxies from closing it")
    keepalive_time_s: float = _setting(60.0, "ping a silent peer (client, engine) after this long")
    keepalive_timeout_s: float = _setting(20.0, "drop a peer that does not answer a ping in time")
    min_ping_interval_s: float = _setting(
        10.0, "peers may ping at most this often (must not exceed keepalive_time_s)")
    max_connection_idle_s: float = _setting(900.0, "close a connection with no call for this long; 0 = never")
    max_connection_age_s: float = _setting(
        0.0, "close connections after this long (calls get drain_seconds to finish); 0 = never")
    handshake_timeout_s: float = _setting(
        10.0, "close a connection whose TLS or HTTP/2 handshake is not done within this long")
    engine_connect_timeout_s: float = _setting(
        3.0, "an engine not connected within this long is marked down (probed in the background)")
    engine_keepalive_time_s: float = _setting(
        5.0, "a gateway pings each engine this often (at least 1: gRPC pings a server at most "
        "once a second), so that one that hangs (stopped, or its link dead) is marked down "
        "within this plus FINSIEVE_ENGINE_KEEPALIVE_TIMEOUT_S; an engine accepts pings twice "
        "as often (set the same value on gateways and engines)")
    engine_keepalive_timeout_s: float = _setting(
        5.0, "an engine that does not answer a ping within this long is marked down, and its "
        "requests are moved or fail UNAVAILABLE")
    rules_max_bytes: int = _setting(4194304, "largest rule pack (all files together)")
    regex_timeout_ms: float = _setting(
        20.0, "one regex search of the rules; past it the rule counts as matched (fail closed)")
    rules_debounce_ms: int = _setting(100, "hot reload waits this long for edits to settle")
    mask_work_limit: int = _setting(
        250, "work units one exact token mask may cost (~2 us each on a laptop core; a pattern "
        "under the text's live suffix is one); past it the token is sampled under the base "
        "bans and checked exactly, a refused one banned there and drawn again; 0 = no limit")
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
    def load(cls, overrides: dict[str, Any] | None = None,
             env: Mapping[str, str] | None = None) -> Settings:
        """Defaults, then FINSIEVE_* variables, then explicit overrides (CLI flags)."""
        variables = os.environ if env is None else env
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = variables.get(cls.env_name(f.name))
            if raw is not None and raw != "":
                values[f.name] = _parse(f.name, hints[f.name], raw, cls.env_name(f.name))
        for name, value in (overrides or {}).items():
            if value is not None:
                values[name] = _parse(name, hints[name], value, f"--{name.replace('_', '-')}")
        if values.get("redis_url_file"):
            if values.get("redis_url"):
                raise ConfigError("FINSIEVE_REDIS_URL_FILE: set it or FINSIEVE_REDIS_URL, not both")
            # Resolved once: the settings hold the URL (as a child process gets them).
            values["redis_url"] = _read_url(Path(values.pop("redis_url_file")))
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        positive = ("max_batch", "max_context", "max_tokens_limit", "default_max_tokens",
                    "max_input_bytes", "max_rollbacks", "max_waiting", "prefill_chunk",
                    "cpu_prefill_chunk",
                    "max_messages", "max_message_bytes", "max_in_flight_per_stream",
                    "max_in_flight_per_connection", "max_streams", "outbox_max_events",
                    "slow_reader_grace_s", "keepalive_time_s", "keepalive_timeout_s",
                    "min_ping_interval_s", "engine_connect_timeout_s", "engine_keepalive_time_s",
                    "engine_keepalive_timeout_s", "engine_dns_interval_s", "max_engines",
                    "rules_max_bytes",
                    "regex_timeout_ms", "rules_debounce_ms", "audit_max_calls",
                    "admin_backlog_max", "handshake_timeout_s", "redis_max_connections",
                    "http_max_header_bytes", "http_max_connections", "http_read_timeout_s",
                    "http_keepalive_s", "http_sse_keepalive_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.env_name(name)}: must be positive")
        for name in ("key_cache_s", "tenant_requests_per_s", "tenant_tokens_per_min",
                     "tenant_concurrent_streams", "mixed_tokens", "prompt_batch_tokens",
                     "prompt_wait_steps",
                     "prepare_workers", "mask_work_limit", "cache_store_wait_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{self.env_name(name)}: must not be negative")
        if self.prepare_workers > 64:
            raise ConfigError(f"{self.env_name('prepare_workers')}: at most 64 (each is a process)")
        if self.mixed_tokens and not 16 <= self.mixed_tokens <= min(2048, self.prefill_chunk):
            # Each bucket of rows up to max_batch + mixed_tokens is a CUDA graph captured at
            # start; a budget of a few tokens would feed a prompt a few tokens a step.
            raise ConfigError(f"{self.env_name('mixed_tokens')}: 0 (off), or from 16 to 2048 and "
                              f"at most {self.env_name('prefill_chunk')} ({self.prefill_chunk})")
        if self.key_cache_max <= 0:
            raise ConfigError(f"{self.env_name('key_cache_max')}: must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("FINSIEVE_GPU_MEMORY_UTILIZATION: must be in (0, 1]")
        if self.audit_anchor_interval_s <= 0:
            raise ConfigError("FINSIEVE_AUDIT_ANCHOR_INTERVAL_S: must be positive")
        for name in ("audit_spool_max_records", "audit_spool_max_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{self.env_name(name)}: must not be negative (records: 0 = no spool)")
        if self.audit_spool_max_records and self.audit_spool_max_bytes < 1 << 20:
            raise ConfigError("FINSIEVE_AUDIT_SPOOL_MAX_BYTES: at least 1048576 (a record may be "
                              "hundreds of kilobytes)")
        for name in ("audit_spool_keep_s", "audit_check_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.env_name(name)}: must be positive")
        if self.audit_wait_replicas < 0 or self.audit_wait_timeout_ms <= 0:
            raise ConfigError("FINSIEVE_AUDIT_WAIT_REPLICAS / _TIMEOUT_MS: replicas must not be "
                              "negative, the timeout must be positive")
        if not 64 << 10 <= self.audit_page_bytes <= 6 << 20:
            raise ConfigError("FINSIEVE_AUDIT_PAGE_BYTES: must be between 65536 and 6291456 "
                              "(a page must fit a gRPC message)")
        if not 0 <= self.console_port <= 65535:
            raise ConfigError("FINSIEVE_CONSOLE_PORT: must be between 0 (off) and 65535")
        if not 60 <= self.console_session_s <= 86400:
            raise ConfigError("FINSIEVE_CONSOLE_SESSION_S: must be between 60 and 86400")
        if self.console_export_max <= 0 or self.console_query_s <= 0:
            raise ConfigError("FINSIEVE_CONSOLE_EXPORT_MAX / _QUERY_S: must be positive")
        if not 0 <= self.audit_nice <= 19:
            raise ConfigError("FINSIEVE_AUDIT_NICE: must be between 0 and 19")
        for name in ("max_connection_idle_s", "max_connection_age_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{self.env_name(name)}: must not be negative (0 = never)")
        if self.engine_keepalive_time_s < 1:
            raise ConfigError("FINSIEVE_ENGINE_KEEPALIVE_TIME_S: at least 1 (gRPC pings a server "
                              "at most once a second)")
        if self.min_ping_interval_s > self.keepalive_time_s:
            raise ConfigError("FINSIEVE_MIN_PING_INTERVAL_S: must not exceed FINSIEVE_KEEPALIVE_TIME_S "
                              "(gateways ping engines that often)")
        _validate_frame_limit(self)
        if not 0 <= self.http_port < 65536:
            raise ConfigError("FINSIEVE_HTTP_PORT: 0 (off) or a port from 1 to 65535")
        if self.http_max_body_bytes < self.max_input_bytes:
            raise ConfigError(f"FINSIEVE_HTTP_MAX_BODY_BYTES: at least FINSIEVE_MAX_INPUT_BYTES "
                              f"({self.max_input_bytes}): a valid request must fit")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ConfigError("FINSIEVE_DEFAULT_MAX_TOKENS: must not exceed max_tokens_limit")
        if self.role == "gateway" and not (self.engines or self.engines_file or self.engine_dns):
            raise ConfigError("--engine, --engines-file or --engine-dns: role gateway needs "
                              "engines (an address, a file of addresses, or a DNS name)")
        for address in self.engines:
            _check_address(address, "--engine")
        if self.engine_dns:
            _check_address(self.engine_dns, "--engine-dns")
        if len(self.engines) > self.max_engines:
            raise ConfigError(f"--engine: {len(self.engines)} engines, more than "
                              f"FINSIEVE_MAX_ENGINES ({self.max_engines})")

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def engine_address(text: str) -> str:
    """host:port, or [IPv6]:port, as given (spaces around it stripped); ValueError says why not."""
    text = text.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError("expected host:port")
    if any(c.isspace() or c in "/[]@" for c in host) or (":" in host and not text.startswith("[")):
        raise ValueError("expected host:port (an IPv6 address in brackets: [::1]:50052)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("the port must be a number from 1 to 65535")
    return text


def _check_address(text: str, flag: str) -> None:
    try:
        engine_address(text)
    except ValueError as e:
        raise ConfigError(f"{flag} {text!r}: {e}") from None


def _read_url(path: Path) -> str:
    data = read_secret(path, "FINSIEVE_REDIS_URL_FILE", min_bytes=1)
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(f"FINSIEVE_REDIS_URL_FILE {path}: not a URL (percent-encode "
                          "characters outside ASCII)") from None


def _validate_frame_limit(s: Settings) -> None:
    """Every request validation accepts must fit a frame, and every frame the engine link."""
    if s.max_message_bytes > MAX_MESSAGE_BYTES:
        raise ConfigError(f"FINSIEVE_MAX_MESSAGE_BYTES: at most {MAX_MESSAGE_BYTES}")
    need = largest_valid_request(s.max_input_bytes, s.max_messages)
    if s.max_message_bytes < need:
        raise ConfigError(f"FINSIEVE_MAX_MESSAGE_BYTES: at least {need} with these "
                          "FINSIEVE_MAX_INPUT_BYTES and FINSIEVE_MAX_MESSAGES (a valid request must fit)")


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


def load_yaml_file(path: Path, setting: str, max_bytes: int = 1 << 20) -> Any:
    """A configuration file's YAML document; ConfigError naming the setting, file and line."""
    where = f"{setting} {path}"
    try:
        if path.stat().st_size > max_bytes:
            raise ConfigError(f"{where}: larger than {max_bytes} bytes")
        return yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{where}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", -1) + 1
        raise ConfigError(f"{where}:{line}: not valid YAML") from None


def settings_table() -> list[tuple[str, str, str]]:
    """(environment variable, default, help) for docs/configuration.md and `--help`."""
    return [
        (Settings.env_name(f.name), repr(f.default), f.metadata["help"]) for f in fields(Settings)
    ]
