"""FINSIEVE_REDIS_URL's forms (finsieve/valkey.py): a Sentinel set, a Cluster's seeds, and the
errors of a wrong one, which name the setting and never show a password."""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import pytest

from finsieve.valkey import RedisUnavailable, connect, parse_topology

SECRET = "s3cr#t@p/ss?w:rd"  # every character a URL parser trips on
ENCODED = quote(SECRET, safe="")  # as a query value must be written


def test_a_sentinel_url_names_its_sentinels_master_database_and_both_passwords():
    t = parse_topology(f"redis+sentinel://app:{SECRET}@s1:26380,s2,[::1]:26381/bank-primary/2"
                       "?sentinel_password=watch%26pw&socket_keepalive=true")
    assert t.kind == "sentinel" and t.master == "bank-primary"
    assert t.hosts == (("s1", 26380), ("s2", 26379), ("::1", 26381))
    assert t.options == {"username": "app", "password": SECRET, "db": 2, "socket_keepalive": True}
    assert t.sentinel_auth == {"password": "watch&pw"}  # the sentinels' own, not the data nodes'


def test_a_tls_url_asks_for_tls_with_its_ca():
    t = parse_topology("rediss+sentinel://:pw@s1/m?ssl_ca_certs=/etc/ca.pem")
    assert t.options == {"password": "pw", "ssl": True, "ssl_ca_certs": "/etc/ca.pem"}
    c = parse_topology("rediss+cluster://n1:7000,n2:7001")
    assert c.kind == "cluster" and c.hosts == (("n1", 7000), ("n2", 7001)) and c.options == {"ssl": True}


def test_a_cluster_url_takes_seed_nodes_and_database_0_only():
    t = parse_topology(f"redis+cluster://ops:{SECRET}@10.0.0.1:7000,10.0.0.2:7001/")
    assert t.hosts == (("10.0.0.1", 7000), ("10.0.0.2", 7001)) and t.master == ""
    assert t.options == {"username": "ops", "password": SECRET}


@pytest.mark.parametrize(("url", "why"), [
    (f"redis+sentinel://:{SECRET}@s1:26379", "the path must be /<master-name>"),
    (f"redis+sentinel://:{SECRET}@s1:26379/m/one", "database 'one' is not a number"),
    (f"redis+sentinel://:{SECRET}@s1:port/m", "'s1:port' is not host:port"),
    (f"redis+sentinel://:{SECRET}@/m", "no sentinel host:port"),
    (f"redis+cluster://:{SECRET}@n1:7000/3", "a Cluster has database 0 only"),
    (f"redis+cluster://:{SECRET}@n1:70000", "'n1:70000' is not host:port"),
    (f"redis+cluster://:{SECRET}@n1?sentinel_password={ENCODED}", "only for a Sentinel URL"),
    (f"redis+sentinel://:{SECRET}@s1/m?socket_timeout=soon", "Invalid value for 'socket_timeout'"),
    (f"valkey://:{SECRET}@h:6379", "unknown scheme 'valkey' (forms: redis://"),
])
def test_a_wrong_url_is_refused_naming_the_setting_and_never_the_password(url, why):
    with pytest.raises(RedisUnavailable) as e:
        asyncio.run(connect(url))  # refused before any connection is tried
    message = str(e.value)
    assert message.startswith("FINSIEVE_REDIS_URL ") and why in message
    assert SECRET not in message and "s3cr" not in message and "p/ss" not in message
