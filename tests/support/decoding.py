"""Several answers of the in-process engine decoded in one batch, each under its own policy."""

from __future__ import annotations

from engine.engine import NO_POLICY, LLMEngine
from finsieve.app.client import chat_request
from finsieve.policy.guard import Policy


def decode_together(engine: LLMEngine, asks: list[tuple[Policy, str]], max_tokens: int = 40) -> list[list]:
    """Each (policy, prompt)'s events, as ask() gives them, all decoded in one batch (the
    engine takes max_batch at a time, the rest wait for a slot). A sequence keeps the policy
    it was prepared under, as a served request keeps the pack it started with."""
    from engine.engine import CollectingSink

    sinks = [CollectingSink() for _ in asks]
    try:
        for i, ((policy, prompt), sink) in enumerate(zip(asks, sinks, strict=True)):
            engine.policy = lambda policy=policy: policy
            engine.submit(engine.prepare(chat_request(f"z{i}", prompt, max_tokens=max_tokens), sink))
        while not all(s.finished for s in sinks):
            engine.step()
    finally:
        engine.policy = lambda: NO_POLICY
    return [s.events for s in sinks]
