"""A network namespace for a gateway, with two links to this host: one its clients reach it
by, one it reaches Redis by. The Redis link can be cut loudly (a `prohibit` route: every
packet refused at once) or silently (the host's end of the link down: packets vanish, as
behind a dead switch). Needs root (CAP_NET_ADMIN); the test creates and deletes its own.

    with Namespace() as ns:
        valkey listens on ns.redis_host; the gateway runs under ns.exec, on ns.gateway_host
        ns.prohibit_redis() / ns.allow_redis(); ns.silence_redis() / ns.restore_redis()
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from pathlib import Path

from finsieve.app.client import wait_ready

from support.servers import _STATE_DIRS, Server, free_port


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Namespace:
    def __init__(self) -> None:
        tag = f"{random.randrange(16**6):06x}"  # other test runs may hold namespaces too
        self.name = f"fs{tag}"
        a, b = random.randrange(200, 250), random.randrange(0, 250)
        self.gateway_host, self._client_side = f"10.{a}.{b}.2", f"10.{a}.{b}.1"
        self.redis_host, self._redis_side = f"10.{a}.{b + 1}.1", f"10.{a}.{b + 1}.2"
        self._links = (f"fs{tag}c", f"fs{tag}r")  # host ends; the namespace's end with a '-'
        self.exec = ("ip", "netns", "exec", self.name)

    def __enter__(self) -> Namespace:
        ip("netns", "add", self.name)
        try:
            self._run("ip", "link", "set", "lo", "up")
            for link, host, inside in ((self._links[0], self._client_side, self.gateway_host),
                                       (self._links[1], self.redis_host, self._redis_side)):
                ip("link", "add", link, "type", "veth", "peer", "name", f"{link}-")
                ip("link", "set", f"{link}-", "netns", self.name)
                ip("addr", "add", f"{host}/24", "dev", link)
                ip("link", "set", link, "up")
                self._run("ip", "addr", "add", f"{inside}/24", "dev", f"{link}-")
                self._run("ip", "link", "set", f"{link}-", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)

    def _run(self, *cmd: str) -> None:
        subprocess.run([*self.exec, *cmd], check=True, capture_output=True, timeout=10)

    def prohibit_redis(self) -> None:
        """Every packet to Redis refused at once (ICMP administratively prohibited)."""
        self._run("ip", "route", "add", "prohibit", f"{self.redis_host}/32")

    def allow_redis(self) -> None:
        self._run("ip", "route", "del", "prohibit", f"{self.redis_host}/32")

    def silence_redis(self) -> None:
        """The host's end of the Redis link down: the gateway's packets vanish, no error."""
        ip("link", "set", self._links[1], "down")

    def restore_redis(self) -> None:
        ip("link", "set", self._links[1], "up")


def start_server_in(ns: Namespace, tmp: Path, *args: str, env: dict[str, str]) -> Server:
    """`finsieve serve` inside the namespace, its public port on ns.gateway_host (plaintext:
    a test link), its officers' port on the namespace's loopback (reach it under ns.exec)."""
    port, audit_port = free_port(), free_port()
    log_path = tmp / f"serve-{port}.log"
    cmd = [*ns.exec, sys.executable, "-m", "finsieve.app.cli", "serve", "--host", ns.gateway_host,
           "--port", str(port), "--audit-port", str(audit_port), "--state-dir", str(tmp / "state"),
           *args]
    full_env = {**os.environ, "FINSIEVE_LOG_FORMAT": "json", "FINSIEVE_ALLOW_INSECURE": "true", **env}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = Server(proc, f"{ns.gateway_host}:{port}", f"127.0.0.1:{audit_port}", log_path, tmp / "state")
    _STATE_DIRS[server.target] = server.state
    if not asyncio.run(wait_ready(server.target, 180)):
        server.stop()
        raise RuntimeError(f"server did not come up:\n{server.log()}")
    return server
