"""Rule packs on the running tight server: change its rules directory and wait for the
engine to show the outcome."""

from __future__ import annotations

import asyncio

from finsieve.app.client import chat_request
from finsieve.policy.pack import Pack
from finsieve.policy.schema import PackError
from finsieve.policy.sources import PackLimits
from finsieve.v1 import chat_pb2, engine_pb2

from support.processes import wait_for
from support.servers import TIGHT_ENV, TightServer
from support.streams import ChatStream

TIGHT_LIMITS = PackLimits(max_bytes=int(TIGHT_ENV["FINSIEVE_RULES_MAX_BYTES"]))


def apply(tight_server: TightServer, change) -> engine_pb2.EngineInfo:
    """Change the running server's rules directory and wait until its engine shows the outcome
    the same loader gives here: the new version in force, or one more rejection."""
    return reload(tight_server, change)[0]


def reload(tight_server: TightServer, change,
           before: engine_pb2.EngineInfo | None = None) -> tuple[engine_pb2.EngineInfo, str | None]:
    """apply(), given the engine's Info from before the change if the caller has it; also
    returns the version the loader here gives the directory (None: it rejects it)."""
    before = before or tight_server.engine_info()
    change()
    try:
        expected = Pack.load(tight_server.rules, TIGHT_LIMITS).version
    except PackError:
        expected = None

    def seen() -> bool:
        info = tight_server.engine_info()
        if expected is None:
            return info.pack_rejections > before.pack_rejections
        return info.policy_version == expected

    # Polled often: the outcome is there ~30 ms after the change (the watcher's 20 ms step,
    # then the compile), and the fuzzer waits for a thousand of them.
    assert wait_for(seen, 60, every=0.005)
    return tight_server.engine_info(), expected


def canary_halts(tight_server) -> bool:
    """The input rule in canary.yaml is in force: a message containing it is not decoded."""
    async def go():
        async with ChatStream(tight_server.target) as s:
            s.send(chat_request("canary", "say: canary phrase", max_tokens=2))
            return (await s.until_done("canary"))["canary"]

    events = asyncio.run(go())
    return (events[-1].finished.finish_reason == chat_pb2.FINISH_REASON_CONTENT_FILTER
            and any(e.policy_event.rule_id == "canary" for e in events))
