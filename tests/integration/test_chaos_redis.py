"""Redis failing under a real gateway with clients streaming through it (`make test-chaos`):
a primary killed (kill -9) with a replica promoted, under Sentinel and in a Cluster; the
gateway cut off from Redis, loudly (route prohibit) and silently (link down). For each:
every client gets its answer or UNAVAILABLE (fail closed while the trail cannot be
written), every audit id a client was given is in the trail (as written, or restored from
the gateway's spool), `finsieve audit verify` passes, and answers resume with no manual
step. Each prints a line for the chaos table (docs/operations.md; run with -s)."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from finsieve.auth import CHECK_UNAVAILABLE_MESSAGE
from finsieve.secretfiles import read_secret
from gateway.audit import HEAD

from support.chaos import CLEAR, Clients, cli, make_key, trail, unrecorded
from support.netns import Namespace, start_server_in
from support.processes import wait_for
from support.servers import Server, start_server
from support.topologies import Cluster, SentinelSet, stall_replicas, start_node, wait_replicated

pytestmark = pytest.mark.chaos

ENV = {
    "FINSIEVE_CACHE_TTL_S": "0",  # every request reaches the engine and the trail
    "FINSIEVE_TENANT_REQUESTS_PER_S": "0", "FINSIEVE_TENANT_TOKENS_PER_MIN": "0",
    "FINSIEVE_AUDIT_CHECK_INTERVAL_S": "1",
    "FINSIEVE_KEY_CACHE_S": "60",  # a verified key outlives a short outage of the key store
}


def serving(server: Server, url: str) -> tuple[str, str]:
    """An app key and an all-tenants officer key, made on the deployment's Redis."""
    return (make_key(url, str(server.state), "app"),
            make_key(url, str(server.state), "officer", "--all-tenants"))


def head_of(node) -> int:
    return int(node.call("HGET", HEAD, "seq") or 0)


def settle(clients: Clients, count: int = 5, timeout: float = 120) -> float:
    """Until `count` answers arrived after now; returns now."""
    since = time.monotonic()
    assert wait_for(lambda: clients.ok_since(since) >= count, timeout, 0.1), clients.outcomes[-5:]
    return since


def check(scenario: str, server: Server, url: str, officer: str, clients: Clients,
          prefix: tuple[str, ...] = ()) -> dict:
    statuses = Counter(o.status for o in clients.outcomes)
    assert set(statuses) <= CLEAR, [o for o in clients.outcomes if o.status not in CLEAR][:5]
    # Refused because the trail cannot be written, or the key store cannot be read.
    refusals = {o.message for o in clients.outcomes if o.status == "UNAVAILABLE"}
    assert refusals <= {"the audit trail is unavailable; the request was refused",
                        CHECK_UNAVAILABLE_MESSAGE}, refusals
    # A record acknowledged by a primary that was demoted after the last append is found
    # missing by the gateway's next check (FINSIEVE_AUDIT_CHECK_INTERVAL_S): wait for one.
    key = read_secret(server.state / "audit.key", "FINSIEVE_AUDIT_KEY_FILE")
    at_first = len(unrecorded(clients.outcomes, trail(url, key)))
    wait_for(lambda: not unrecorded(clients.outcomes, trail(url, key)), 15, 0.5)
    missing = unrecorded(clients.outcomes, trail(url, key))
    verified = cli("audit", "verify", "--target", server.audit_target, key=officer, prefix=prefix)
    log = server.log()
    row = {"scenario": scenario, "answered": statuses["OK"], "unavailable": statuses["UNAVAILABLE"],
           "missing_at_first": at_first, "lost": len(missing),
           "restored": log.count('"event": "audit record restored'),
           "recoveries": log.count('"event": "audit records restored from the spool"'),
           "verify": "intact" if verified.returncode == 0 else "BROKEN"}
    print(f"\nCHAOS {row}")
    assert not missing, missing[:5]
    assert verified.returncode == 0 and "audit trail intact" in verified.stdout, \
        verified.stdout + verified.stderr
    return row


def test_a_sentinel_primary_killed_mid_stream(tmp_path, default_model_dir):
    """Its replicas stalled first, so that the records it acknowledged (no WAIT) die with it:
    the gateway restores them from its spool."""
    with SentinelSet(tmp_path / "redis") as redis_set:
        url = redis_set.url()
        server = start_server(tmp_path, "--model", str(default_model_dir),
                              env={**ENV, "FINSIEVE_REDIS_URL": url})
        try:
            app, officer = serving(server, url)
            with Clients(server.target, app) as clients:
                settle(clients)
                old = redis_set.primary()
                wait_replicated(old)
                replicas = redis_set.data_replicas(old)
                stall_replicas(old, replicas)
                # Three records or more acknowledged that only `old` has.
                stalled_at = head_of(old)
                assert wait_for(lambda: head_of(old) >= stalled_at + 3, 60, 0.05)
                old.kill()
                for r in replicas:
                    r.thaw()
                redis_set.wait_promoted(old)
                settle(clients)  # no manual step
            row = check("sentinel: primary kill -9, replicas behind", server, url, officer, clients)
        finally:
            server.stop()
    assert row["restored"] >= 3


def test_a_cluster_primary_killed_mid_stream_with_waitaof(tmp_path, default_model_dir):
    """WAITAOF 1 1: a record is acknowledged once the primary and a replica fsynced it. While
    the chain's replica is stalled, requests are refused; the primary is killed, its replica
    promoted, the old primary restarted (as a pod would be) and made a replica: nothing
    acknowledged was lost, so there is nothing to restore."""
    with Cluster(tmp_path / "redis", appendfsync="always") as cluster:
        url = cluster.url()
        server = start_server(tmp_path, "--model", str(default_model_dir),
                              env={**ENV, "FINSIEVE_REDIS_URL": url, "FINSIEVE_AUDIT_WAIT_REPLICAS": "1",
                                   "FINSIEVE_AUDIT_WAITAOF_LOCAL": "true",
                                   "FINSIEVE_AUDIT_WAIT_TIMEOUT_MS": "2000"})
        try:
            app, officer = serving(server, url)
            with Clients(server.target, app) as clients:
                settle(clients)
                old = cluster.primary_for(HEAD)
                replicas = cluster.replicas_of(old)
                stall_replicas(old, replicas)
                stalled = time.monotonic()
                assert wait_for(lambda: any(o.status == "UNAVAILABLE" and o.at > stalled
                                            for o in clients.outcomes), 60, 0.1)
                old.kill()
                for r in replicas:
                    r.thaw()
                cluster.wait_promoted(old, HEAD)
                old.restart()
                settle(clients)
            row = check("cluster: primary kill -9, WAITAOF 1 1", server, url, officer, clients)
        finally:
            server.stop()
    assert row["restored"] == 0 and row["unavailable"] > 0


@pytest.mark.parametrize("how", ["prohibit", "silent"])
def test_a_gateway_cut_off_from_redis(tmp_path, default_model_dir, how):
    """The gateway in a network namespace of its own, Redis on this host: the link between
    them cut for a few seconds, by a prohibit route or with the link down (no error at all:
    each Redis call waits out its socket timeout)."""
    with Namespace() as ns:
        valkey = start_node(tmp_path, "valkey", ns.redis_host, "pw-" + ns.name,
                            ["appendonly yes", "protected-mode no"])
        url = f"redis://:pw-{ns.name}@{ns.redis_host}:{valkey.port}/0"
        try:
            server = start_server_in(ns, tmp_path, "--model", str(default_model_dir),
                                     env={**ENV, "FINSIEVE_REDIS_URL": url})
            try:
                app, officer = serving(server, url)
                with Clients(server.target, app) as clients:
                    settle(clients)
                    cut, heal = ((ns.prohibit_redis, ns.allow_redis) if how == "prohibit"
                                 else (ns.silence_redis, ns.restore_redis))
                    cut()
                    since = time.monotonic()
                    try:  # cut off for a while: refused again and again, never stuck
                        assert wait_for(lambda: sum(o.status == "UNAVAILABLE" and o.at > since
                                                    for o in clients.outcomes) >= 6, 90, 0.1)
                    finally:
                        heal()
                    settle(clients)
                row = check(f"partition gateway-Redis: {how}", server, url, officer, clients, ns.exec)
            finally:
                server.stop()
        finally:
            valkey.stop()
    assert row["unavailable"] > 0
