"""Clients that vanish mid-stream are aborted on every rank; SIGTERM drains and exits 0; what is
still running when the drain time is over is aborted and answered in full."""

import asyncio
import json
import time

import httpx
import psutil

from serve_helpers import KEY, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
H = {"Authorization": f"Bearer {KEY}"}


async def _stream_then_drop(url: str, i: int) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Write a long story number {i}."}],
            "max_tokens": 400, "stream": True, "temperature": 0.7}
    got = 0
    async with httpx.AsyncClient(timeout=60) as c, c.stream("POST", url + "/v1/chat/completions", json=body,
                                                           headers=H) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                got += 1
            if got >= 3:
                break                      # leave mid-stream
    return got


def test_twenty_clients_disconnect_mid_stream(server):
    async def main():
        return await asyncio.gather(*(_stream_then_drop(server, i) for i in range(20)))
    assert all(n >= 3 for n in asyncio.run(main()))
    deadline = time.time() + 30     # left as soon as idle: the bound only stops a hang
    while time.time() < deadline:
        stats = httpx.get(server + "/debug/stats", headers=H, timeout=30).json()
        if all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats):
            break
        time.sleep(0.2)
    assert all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats), stats
    assert all(s["num_available_blocks"] == s["num_blocks"] for s in stats)
    r = httpx.get(server + "/debug/check_integrity", headers=H)
    assert r.status_code == 200 and r.json()["ok"]


def test_sigterm_with_requests_in_flight_exits_zero_and_leaves_nothing():
    proc, url = start_server("--drain_timeout", "5")
    children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert children

    async def inflight():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Write an essay."}], "max_tokens": 300}
            return await asyncio.gather(*(c.post(url + "/v1/chat/completions", json=body, headers=H)
                                          for _ in range(4)), return_exceptions=True)

    async def main():
        task = asyncio.ensure_future(inflight())
        await asyncio.sleep(1.5)
        import os
        import signal
        os.kill(proc.pid, signal.SIGTERM)
        return await task

    asyncio.run(main())
    assert proc.wait(60) == 0
    deadline = time.time() + 15
    while time.time() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                         for p in children):
        time.sleep(0.2)
    assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    stop_server(proc)


def test_requests_left_when_the_drain_time_is_over_are_aborted_and_answered_in_full():
    """Past the drain time the requests still running are aborted, not their handlers cancelled:
    a plain completion answers 200 with its tokens so far and finish reason "abort", a stream
    ends with that finish reason and ``[DONE]``; a request whose body arrives after that is
    refused (503) rather than started; the log names the aborts and holds no traceback, and the
    server exits 0 (uvicorn cancelled the handlers mid-response: a 500 in plain text, a stream
    cut short, an ASGI traceback each). The engine is paused (requests kept) once both have
    tokens, so that neither can finish first however fast this machine is."""
    proc, url = start_server("--drain_timeout", "1")
    body = {"model": MODEL, "prompt": "Write an essay.", "max_tokens": 400, "ignore_eos": True}
    started = asyncio.Event()

    async def plain(c: httpx.AsyncClient) -> httpx.Response:
        return await c.post(url + "/v1/completions", json=body, headers=H)

    async def streamed(c: httpx.AsyncClient) -> list[str]:
        events = []
        async with c.stream("POST", url + "/v1/completions", json=dict(body, stream=True), headers=H) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 5:
                        started.set()
        return events

    late_body = json.dumps(body).encode()
    arrived = asyncio.Event()

    async def slowly():   # half the body before SIGTERM, the rest after the drain time
        yield late_body[:10]
        await arrived.wait()
        yield late_body[10:]

    async def late(c: httpx.AsyncClient) -> httpx.Response:
        return await c.post(url + "/v1/completions", content=slowly(),
                            headers={**H, "Content-Type": "application/json"})

    async def main():
        import os
        import signal
        async with httpx.AsyncClient(timeout=60) as c:
            tasks = [asyncio.ensure_future(plain(c)), asyncio.ensure_future(streamed(c))]
            await asyncio.wait_for(started.wait(), 120)
            paused = await c.post(url + "/pause_generation", json={"mode": "keep"}, headers=H)
            assert paused.status_code == 200, paused.text
            tasks.append(asyncio.ensure_future(late(c)))
            await asyncio.sleep(0.5)
            os.kill(proc.pid, signal.SIGTERM)
            await asyncio.sleep(2.5)          # past the drain time (1 s): the two are aborted by now
            arrived.set()
            return await asyncio.gather(*tasks)

    r, events, refused = asyncio.run(main())
    assert proc.wait(60) == 0
    log = proc.stdout.read()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < r.json()["usage"]["completion_tokens"] < 400 and choice["text"]
    assert events[-1] == "[DONE]"
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]]
    assert finishes[-1] == "abort" and len(finishes) >= 5
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"], refused.text
    assert "2 requests in flight aborted" in log and "Traceback" not in log, log[-3000:]
