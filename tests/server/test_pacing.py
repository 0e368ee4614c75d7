"""Streams stay alive through long silences (a long prefill) and cancel the generation when the client leaves."""

from __future__ import annotations

import asyncio

from freetoken.server.requests import paced


def test_silence_becomes_keepalives_and_events_pass_through():
    async def slow():
        await asyncio.sleep(0.25)
        yield "first"
        yield "second"

    async def run():
        return [ev async for ev in paced(slow(), keepalive_s=0.05)]

    out = asyncio.run(run())
    assert out[-2:] == ["first", "second"] and out[:-2] and all(ev is None for ev in out[:-2])


def test_leaving_early_cancels_the_pending_read():
    state = {"cancelled": False}

    async def endless():
        try:
            yield "one"
            await asyncio.sleep(60)
            yield "never"
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    async def run():
        stream = paced(endless(), keepalive_s=0.05)
        async for ev in stream:
            if ev is None:  # the first keep-alive: the client gives up
                break
        await stream.aclose()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert state["cancelled"]
