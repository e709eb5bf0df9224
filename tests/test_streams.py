"""A stream's keep-alive comments: `: keepalive N/M` for prefill progress (as
mlx_lm.server writes them), `: keepalive` while no event comes, and the
request cancelled when the client leaves (no model: a stand-in engine)."""

from __future__ import annotations

import asyncio

from mlx_kvq.engine import FinishEvent, FinishReason, GenerationRequest, PromptProgress, Usage
from mlx_kvq.engine.requests import SamplingParams
from mlx_kvq.server.chat.generation import IDLE, Generation
from mlx_kvq.server.openai.bodies import keepalive


class StandInEngine:
    def __init__(self):
        self.sink = None
        self.cancelled = []

    def submit(self, request, sink):
        self.sink = sink

    def cancel(self, request_id):
        self.cancelled.append(request_id)


def test_keepalive_comments():
    assert keepalive(PromptProgress(64, 300)) == ": keepalive 64/300\n\n"
    assert keepalive(IDLE) == ": keepalive\n\n"


def test_events_yield_idle_while_nothing_comes_then_the_events():
    async def run():
        engine = StandInEngine()
        request = GenerationRequest([1, 2], SamplingParams(max_tokens=1), progress=True)
        generation = Generation(engine, request)
        await generation.start()
        seen = []
        async for ev in generation.events(idle_s=0.02):
            seen.append(ev)
            if len(seen) == 2:
                engine.sink(PromptProgress(2, 2))
                engine.sink(FinishEvent(FinishReason.STOP, Usage(2, 1)))
        return engine, seen

    engine, seen = asyncio.run(run())
    assert seen[:2] == [IDLE, IDLE]
    assert seen[2:] == [PromptProgress(2, 2), FinishEvent(FinishReason.STOP, Usage(2, 1))]
    assert engine.cancelled == []  # it ended: nothing to cancel


def test_a_stream_left_early_cancels_its_request():
    async def run():
        engine = StandInEngine()
        request = GenerationRequest([1, 2], SamplingParams(max_tokens=1))
        generation = Generation(engine, request)
        await generation.start()
        events = generation.events(idle_s=0.02)
        assert await anext(events) is IDLE
        await events.aclose()  # the client went away
        return engine, request

    engine, request = asyncio.run(run())
    assert engine.cancelled == [request.id]
