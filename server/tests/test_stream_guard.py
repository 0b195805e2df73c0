"""The streaming guard alone (no server): when the consumer of a stream is cancelled at the
moment the engine-side step finishes, the step's outcome is retrieved, so asyncio never logs
"Task exception was never retrieved" (a soak run with random disconnects caught one)."""

from __future__ import annotations

import asyncio
import gc

from radixserve_server.http_io import guarded


class _NeverDisconnects:
    async def receive(self):
        await asyncio.Event().wait()


def _run_and_collect_unretrieved(scenario) -> list[str]:
    """Run ``scenario(loop)`` on a fresh loop; the messages of exceptions asyncio reports as
    never retrieved once the finished tasks are garbage-collected."""
    reported: list[str] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx["message"]))
    try:
        loop.run_until_complete(scenario())
        gc.collect()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    gc.collect()
    return reported


def _ending_stream(ev: asyncio.Event):
    async def agen():
        await ev.wait()
        return
        yield  # an async generator that ends once ev is set

    return agen()


async def _cancel_as_the_step_ends(consume) -> None:
    ev = asyncio.Event()
    consumer = asyncio.ensure_future(consume(ev))
    for _ in range(5):  # the consumer now waits on the step and the disconnect watcher
        await asyncio.sleep(0)
    ev.set()
    await asyncio.sleep(0)  # the step finishes (StopAsyncIteration); the consumer has not resumed
    consumer.cancel()
    try:
        await consumer
    except asyncio.CancelledError:
        pass


def test_guarded_retrieves_a_step_that_ended_while_it_was_cancelled():
    async def consume(ev):
        async for _ in guarded(_NeverDisconnects(), _ending_stream(ev)):
            pass

    assert _run_and_collect_unretrieved(lambda: _cancel_as_the_step_ends(consume)) == []


def test_guarded_streams_and_ends_normally():
    async def scenario():
        async def agen():
            for i in range(3):
                yield i

        return [x async for x in guarded(_NeverDisconnects(), agen())]

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(scenario()) == [0, 1, 2]
    finally:
        loop.close()
