"""engine/server.py: the doorbell that hands each gateway stream its engine step."""

from __future__ import annotations

import asyncio


def test_the_doorbell_wakes_its_loop_once_for_the_steps_of_every_stream_and_keeps_their_order():
    """The engine hands each gateway stream its step in a row: one wakeup of the asyncio
    loop for them all (each costs a self-pipe write and a GIL handoff), nothing lost, each
    stream's steps in order, also when handed over from another thread."""
    import threading

    from engine.server import Doorbell
    from finsieve.v1 import engine_pb2

    def step(n: int) -> engine_pb2.EngineStep:
        return engine_pb2.EngineStep(status=engine_pb2.EngineStatus(model=str(n)))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]  # type: ignore[method-assign]
        bell, queues = Doorbell(loop), [asyncio.Queue() for _ in range(4)]
        for n in range(2):  # two engine steps, from the loop's own thread: nothing runs between
            for q in queues:
                bell.put(q, step(n))
            await asyncio.sleep(0)
            assert len(wakeups) == n + 1
        worker = threading.Thread(target=lambda: [bell.put(q, step(n)) for n in range(2, 200)
                                                  for q in queues])
        worker.start()
        await asyncio.to_thread(worker.join)
        await asyncio.sleep(0)
        for q in queues:
            got = [q.get_nowait().status.model for _ in range(q.qsize())]
            assert got == [str(n) for n in range(200)]

    asyncio.run(main())
