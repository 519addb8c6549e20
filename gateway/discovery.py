"""Where a gateway's engines come from, at run time: the static list (`--engine`), a watched
file (`--engines-file`, one host:port a line) and a DNS name re-resolved on a timer
(`--engine-dns NAME:PORT`, e.g. a headless Kubernetes Service, whose name resolves to the
ready pods' addresses). Each source keeps its own set; the pool serves their union. A source
that fails (a bad line, an empty file, a failed resolution) keeps its previous set and says
so once; a change that would pass FINSIEVE_MAX_ENGINES is refused the same way.
"""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import structlog
import watchfiles

from finsieve import supervise
from finsieve.config import Settings, engine_address
from finsieve.errors import ConfigError
from finsieve.tls import REMOTE_PLAINTEXT, host_of, is_loopback

from .engines import EnginePool

log = structlog.get_logger(__name__)

MAX_FILE_BYTES = 1 << 20
RESOLVE_TIMEOUT_S = 5.0  # one resolution of the engines' DNS name; then the round is skipped
FILE_DEBOUNCE_MS = 100
# The file is read again at least this often even if no change was reported (a file system
# whose changes are not notified, an event lost).
FILE_RECHECK_S = 5.0

Engines = dict[str, str]  # address -> the name its TLS certificate must carry ("" = its host)
STATIC, FILE, DNS = "--engine", "--engines-file", "--engine-dns"  # the sources, by their flags


def read_engines_file(path: Path, plaintext_ok: bool) -> list[str]:
    """The addresses a file lists (blank lines and `#` comments skipped, duplicates once);
    ConfigError naming FILE:LINE for a line that is not host:port, or that names a remote
    engine when the link would be plaintext."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    addresses: dict[str, None] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            address = engine_address(line)
        except ValueError as e:
            raise ConfigError(f"{path}:{number}: {line[:100]!r}: {e}") from None
        if not plaintext_ok and not is_loopback(host_of(address)):
            raise ConfigError(f"{path}:{number}: {address}: {REMOTE_PLAINTEXT}")
        addresses[address] = None
    return list(addresses)


@dataclass(frozen=True)
class Sources:
    static: tuple[str, ...] = ()
    file: Path | None = None
    dns: str = ""  # NAME:PORT
    dns_interval_s: float = 5.0
    max_engines: int = 256
    plaintext_ok: bool = False  # TLS to engines, or --allow-insecure: remote addresses allowed

    @classmethod
    def of(cls, settings: Settings) -> Sources:
        return cls(settings.engines, Path(settings.engines_file) if settings.engines_file else None,
                   settings.engine_dns, settings.engine_dns_interval_s, settings.max_engines,
                   bool(settings.engine_ca) or settings.allow_insecure)


class Discovery:
    """Keeps `pool` serving the union of the sources' engines."""

    def __init__(self, sources: Sources) -> None:
        self.pool: EnginePool | None = None
        self.sources = sources
        self._sets: dict[str, Engines] = {STATIC: dict.fromkeys(sources.static, "")}
        self._tasks: list[asyncio.Task[None]] = []
        self._file_problem = ""  # logged once until it changes
        self._dns_failing = False  # logged once per outage
        self._resolver = ThreadPoolExecutor(1, thread_name_prefix="engine-dns")
        self._resolving: asyncio.Future[list] | None = None

    def load(self) -> None:
        """Read the file now: a bad one stops start-up (ConfigError naming FILE:LINE)."""
        path = self.sources.file
        if path is None:
            return
        found = dict.fromkeys(read_engines_file(path, self.sources.plaintext_ok), "")
        if (count := len(self.engines() | found)) > self.sources.max_engines:
            raise ConfigError(f"{path}: {count} engines (with --engine), more than "
                              f"FINSIEVE_MAX_ENGINES ({self.sources.max_engines})")
        self._sets[FILE] = found

    async def start(self, pool: EnginePool) -> None:
        """Resolve the name once, hand the pool every source's engines, then watch the file
        and the name in the background."""
        self.pool = pool
        if self.sources.dns:
            await self._resolve()
        pool.update(self.engines())
        path = self.sources.file
        if path is not None:
            self._tasks.append(supervise.start("engines-file", lambda: self._watch_file(path)))
        if self.sources.dns:
            self._tasks.append(supervise.start("engine-dns", self._resolve_forever))

    def engines(self) -> Engines:
        """The union of the sources' engines."""
        merged: Engines = {}
        for found in self._sets.values():
            merged.update(found)
        return merged

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._resolver.shutdown(wait=False, cancel_futures=True)

    def _apply(self, source: str, found: Engines) -> None:
        """Make `found` the source's set and the pool serve the union; refused (logged, the
        previous set stays) if the union would pass the bound."""
        previous = self._sets.get(source)
        self._sets[source] = found
        merged = self.engines()
        if len(merged) > self.sources.max_engines:
            self._sets[source] = previous if previous is not None else {}
            log.error("engines not updated: more than FINSIEVE_MAX_ENGINES; the previous engines "
                      "stay", source=source, engines=len(merged), max_engines=self.sources.max_engines)
            return
        assert self.pool is not None  # sources change only once started
        self.pool.update(merged)

    # -- the file -------------------------------------------------------------------------

    async def _watch_file(self, path: Path) -> None:
        """Read the file again on any change in its directory (a Kubernetes ConfigMap
        replaces a link to a new directory, not the file), and every FILE_RECHECK_S."""
        async for _ in watchfiles.awatch(path.parent, watch_filter=None, debounce=FILE_DEBOUNCE_MS,
                                         step=20, rust_timeout=int(FILE_RECHECK_S * 1000),
                                         yield_on_timeout=True, recursive=False):
            await self._read_file(path)

    async def _read_file(self, path: Path) -> None:
        try:
            addresses = await asyncio.to_thread(read_engines_file, path, self.sources.plaintext_ok)
            if not addresses:
                raise ConfigError(f"{path}: lists no engine (a file being written?)")
        except ConfigError as e:
            if str(e) != self._file_problem:
                self._file_problem = str(e)
                log.error("engines file refused; the previous engines stay", problem=str(e))
            return
        if self._file_problem:
            self._file_problem = ""
            log.info("engines file accepted again", file=str(path), engines=len(addresses))
        found = dict.fromkeys(addresses, "")
        if found != self._sets.get(FILE):
            self._apply(FILE, found)

    # -- DNS ------------------------------------------------------------------------------

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sources.dns_interval_s)
            await self._resolve()

    async def _resolve(self) -> None:
        """Resolve the name on a thread of its own (a resolver that hangs holds no other
        work up), for RESOLVE_TIMEOUT_S at most; a round that finds one still running waits
        for it again instead of starting another."""
        name, port = self.sources.dns.rsplit(":", 1)
        host = name.strip("[]")
        if self._resolving is None or self._resolving.done():
            loop = asyncio.get_running_loop()
            self._resolving = loop.run_in_executor(
                self._resolver, socket.getaddrinfo, host, int(port), 0, socket.SOCK_STREAM)
        try:
            infos = await asyncio.wait_for(asyncio.shield(self._resolving), RESOLVE_TIMEOUT_S)
            found = {_address(info[4]): host for info in infos}
        except OSError as e:  # socket.gaierror, and TimeoutError
            if not self._dns_failing:
                self._dns_failing = True
                log.warning("engine DNS name did not resolve; the previous engines stay",
                            name=self.sources.dns,
                            error="timed out" if isinstance(e, TimeoutError) else str(e))
            return
        if self._dns_failing:
            self._dns_failing = False
            log.info("engine DNS name resolves again", name=self.sources.dns, engines=len(found))
        if found != self._sets.get(DNS):
            self._apply(DNS, found)


def _address(sockaddr: tuple) -> str:
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
