"""``bench throughput``'s client (``throughput._stream_all``): at most ``concurrency`` requests in
flight, every prompt streamed once, results in prompt order, and at a wave's end each finished
request's worker sends the next prompt before the next finished request is taken up.

The engine here is a stand-in that streams one token a step to every open request, all requests
woken by the same step as a real engine's TokenBatch wakes them; the client is the real one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from phalanx.bench.throughput import _stream_all


class _Lockstep:
    """Every open stream gets one token a step; ``log`` records each request's send and end."""

    def __init__(self, osl: int) -> None:
        self.osl, self.log, self.open, self.most_open = osl, [], 0, 0
        self.tick: asyncio.Future | None = None

    def generate_async(self, prompt, params, streaming):
        assert streaming and params.max_tokens == self.osl
        rid = prompt[0]
        self.log.append(("send", rid))
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        return self._stream(rid)

    async def _stream(self, rid):
        for k in range(self.osl):
            await self.tick
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids_diff=[k])], cached_tokens=3)
        self.open -= 1
        self.log.append(("end", rid))

    async def drive(self, done: asyncio.Future) -> None:
        loop = asyncio.get_running_loop()
        while not done.done():
            self.tick, fired = loop.create_future(), self.tick
            if fired is not None:
                fired.set_result(None)
            for _ in range(20):   # let every woken stream run to its next wait
                await asyncio.sleep(0)


def test_workers_refill_at_once_and_every_prompt_streams_once():
    engine = _Lockstep(osl=3)
    prompts = [[i, 1, 2] for i in range(10)]

    async def main():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        driver = asyncio.ensure_future(engine.drive(done))
        try:
            return await _stream_all(engine, prompts, 3, 4)
        finally:
            done.set_result(None)
            await driver

    results = asyncio.run(main())
    assert engine.most_open == 4                                   # never more than the concurrency
    assert sorted(r for k, r in engine.log if k == "send") == list(range(10))   # each prompt once
    assert [r["num_output_tokens"] for r in results] == [3] * 10 and all(r["cached_tokens"] == 3 for r in results)
    assert all(r["end"] >= r["start"] and r["ttft"] >= 0 for r in results)
    # the first wave (0-3) ends in one step: each end is followed at once by its worker's next send
    first_end = engine.log.index(("end", 0))
    assert engine.log[first_end:first_end + 8] == [
        ("end", 0), ("send", 4), ("end", 1), ("send", 5), ("end", 2), ("send", 6), ("end", 3), ("send", 7)]
