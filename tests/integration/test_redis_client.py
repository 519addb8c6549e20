"""The Redis client finsieve connects with, against a real valkey-server."""

from __future__ import annotations

import asyncio

from finsieve.valkey import connect


def test_a_burst_beyond_the_pool_waits_for_a_connection_instead_of_failing(valkey):
    # redis-py's default pool raises MaxConnectionsError once every connection is busy; under
    # a burst of requests that refused audit appends (so the requests) and skipped tenant
    # limits. Ten commands that each hold a connection for 0.2 s, on a pool of two.
    async def main() -> list[object]:
        client = await connect(valkey.url, password=valkey.password, max_connections=2)
        try:
            return await asyncio.gather(*(client.blpop([f"empty-{i}"], timeout=0.2)
                                          for i in range(10)))
        finally:
            await client.aclose()

    assert asyncio.run(main()) == [None] * 10
