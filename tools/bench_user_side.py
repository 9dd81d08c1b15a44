"""The user process's side of an offline run, alone: what ``LLM.generate_async`` with streaming
costs the caller's process per request and per output token, and how fast it refills the
engine when a wave of requests finishes together.

    python tools/bench_user_side.py                          # 2,048 requests of 128/128, 512 in flight
    python tools/bench_user_side.py --baseline-rev HEAD~1    # the same on another revision first
    python tools/bench_user_side.py --serve --concurrency 64 --num-requests 256 --osl 512

The client is ``phalanx bench throughput``'s own (``throughput._run``: ``--concurrency`` workers,
each streaming its requests one after another with ``LLM.generate_async``) on a real ``LLM`` whose
proxy attaches, as under ``phalanx launch``, to a scripted rank 0 in another process. That rank
speaks the real protocol over the real signed ZMQ sockets (``Init``/``Ready``, ``GenerationRequest``,
one ``TokenBatch`` a step) but runs no model: every ``--step-ms`` it sends one token to each
request it holds (the first with the request's ``FirstToken`` row, the ``--osl``-th with its
``Finished`` row) and takes in what arrived. So the figures are the user side's own:

- CPU seconds of the client's process (its caller and dispatch threads) per request and per token;
- the refill lag: for each request sent after the first ``--concurrency``, the time from the step
  that finished the request whose place it takes to its arrival at rank 0. With equal requests
  a whole wave finishes in one step, and the engine idles until the next wave's requests arrive:
  this lag is what a GPU would wait for at every wave's end;
- the run's wall time against the steps' own (``--step-ms`` × the steps a perfect client allows).

``--serve`` puts ``phalanx serve``'s server in front: the same ``LLM`` (of the bundled model, so
that its tokenizer detokenizes every token, as a server does) behind ``OpenAIServer`` on uvicorn
in this process, and the requests come from a client process over HTTP, each a streamed
``/v1/completions`` of ``--isl`` prompt ids. The CPU figures are then the server process's (its
event loop, dispatch thread and tokenizer threads); the client's own CPU is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any


def responder(step_ms: float, osl: int, vocab: int, max_seq_len: int, out_path: str) -> None:
    """The scripted rank 0 (a process of its own): runs until Shutdown, then writes its timings."""
    from phalanx.executor import ipc
    from phalanx.executor.messages import (
        Finished,
        FirstToken,
        GenerationRequest,
        Heartbeat,
        Init,
        Ready,
        Shutdown,
        TokenBatch,
    )
    key = bytes.fromhex(os.environ[ipc.KEY_ENV])
    inbox = ipc.IpcQueue(os.environ[ipc.REQUEST_ADDR_ENV], key, bind=False)
    outbox = ipc.IpcQueue(os.environ[ipc.RESPONSE_ADDR_ENV], key, bind=False)
    while not isinstance(inbox.get(timeout_ms=1000), Init):
        pass
    outbox.put(Ready({"max_seq_len": max_seq_len, "vocab_size": vocab, "rank_processes": []}))
    live: dict[int, int] = {}          # request id -> tokens sent
    new: list[tuple[int, int]] = []    # (request id, prompt tokens) arrived since the last step
    arrivals: list[float] = []         # monotonic time of each request's arrival
    finish_steps: list[float] = []     # monotonic time of the step that finished each request, in order
    step = 0
    next_step = time.monotonic()
    stop = False
    while not stop:
        timeout = max(0.0, next_step - time.monotonic())
        msg = inbox.get(timeout_ms=int(timeout * 1000) if live or new else 200)
        while msg is not None:
            if isinstance(msg, GenerationRequest):
                arrivals.append(time.monotonic())
                new.append((msg.request_id, len(msg.prompt_token_ids)))
            elif isinstance(msg, Shutdown):
                stop = True
            msg = inbox.get_nowait()
        if time.monotonic() < next_step or not (live or new):
            if not (live or new):
                next_step = time.monotonic()
            continue
        now = time.monotonic()
        for rid, _ in new:
            live[rid] = 0
        first = [FirstToken(rid, 0, n, now, 0) for rid, n in new]
        new = []
        ids = list(live)
        finished = []
        for rid in ids:
            live[rid] += 1
            if live[rid] >= osl:
                finished.append(Finished(rid, "length", None))
                del live[rid]
                finish_steps.append(now)
        outbox.put(TokenBatch(ids, [1000 + (rid % (vocab - 1000)) for rid in ids], None, finished, first))
        step += 1
        if step % 10 == 0:
            outbox.put(Heartbeat(0, step))
        next_step = now + step_ms / 1000.0
    with open(out_path, "w") as f:
        json.dump({"arrivals": arrivals, "finish_steps": finish_steps, "steps": step}, f)


def serve_client(port: int, isl: int, osl: int, concurrency: int, num_requests: int, vocab: int) -> None:
    """The HTTP client of ``--serve`` (a process of its own): streamed completions, ``concurrency``
    at a time; exits non-zero if a stream did not end with its ``osl`` tokens and ``[DONE]``."""
    import httpx

    from phalanx.bench.throughput import make_prompts
    prompts = make_prompts(num_requests, isl, vocab)

    async def main() -> int:
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=600) as client:
            async def one(p: list[int]) -> bool:
                body = {"model": "bench", "prompt": p, "max_tokens": osl, "stream": True, "return_token_ids": True}
                tokens, done = 0, False
                async with sem, client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            tokens += sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
                return done and tokens == osl
            ok = await asyncio.gather(*(one(p) for p in prompts))
        return 0 if all(ok) else 1
    raise SystemExit(asyncio.run(main()))


def run_serve(llm: Any, a: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """Serve ``llm`` on a free local port and run the client process against it."""
    import socket
    import threading

    import uvicorn

    from phalanx.serve.openai_server import OpenAIServer
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(OpenAIServer(llm, "bench").app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        client = subprocess.run([sys.executable, os.path.abspath(__file__), "--client", str(port), str(a.isl),
                                 str(a.osl), str(a.concurrency), str(a.num_requests), str(vocab)])
        if client.returncode != 0:
            raise RuntimeError("a streamed completion did not end with all its tokens")
    finally:
        server.should_exit = True
        thread.join(30)
    return [{"num_output_tokens": a.osl}] * a.num_requests


def run_point(a: argparse.Namespace) -> dict[str, Any]:
    from phalanx import LLM
    from phalanx.bench.throughput import _run, make_prompts
    from phalanx.executor import ipc
    from phalanx.executor.proxy import LAUNCH_ENV
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_host_loop import one_layer_model
    d = ipc.private_dir()
    key = ipc.new_key()
    req, resp = ipc.ipc_addresses(d)
    timings = os.path.join(d, "timings.json")
    env = {**os.environ, ipc.KEY_ENV: key.hex(), ipc.REQUEST_ADDR_ENV: req, ipc.RESPONSE_ADDR_ENV: resp}
    os.environ.update({LAUNCH_ENV: "1", ipc.KEY_ENV: key.hex(), ipc.REQUEST_ADDR_ENV: req,
                       ipc.RESPONSE_ADDR_ENV: resp})
    vocab, max_seq_len = (49152 if a.serve else 128256), a.isl + a.osl + 64
    # the proxy binds the addresses as it starts; the scripted rank connects and waits for Init
    rank = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--responder", str(a.step_ms), str(a.osl),
                             str(vocab), str(max_seq_len), timings], env=env)
    try:
        if a.serve and a.tokenizer:   # a saved copy of that tokenizer over a one-layer model of its vocabulary
            llm = LLM(one_layer_model(vocab_size=vocab, bos_token_id=1, eos_token_id=2), tokenizer=a.tokenizer,
                      load_format="dummy", max_batch_size=a.concurrency, max_seq_len=max_seq_len)
        elif a.serve:   # the bundled model's tokenizer (the scripted rank loads no weights)
            llm = LLM(None, max_batch_size=a.concurrency, max_seq_len=max_seq_len)
        else:
            llm = LLM(one_layer_model(), skip_tokenizer_init=True, load_format="dummy",
                      max_batch_size=a.concurrency, max_seq_len=max_seq_len)
        if a.serve:   # the client draws ids from the bundled model's vocabulary
            assert llm.vocab_size == vocab, llm.vocab_size
        prompts = make_prompts(a.num_requests, a.isl, vocab)
        t0, c0 = time.perf_counter(), time.process_time()
        results = run_serve(llm, a, vocab) if a.serve else asyncio.run(_run(llm, prompts, a.osl, a.concurrency))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        llm.shutdown()
        rank.wait(30)
        with open(timings) as f:
            t = json.load(f)
    finally:
        if rank.poll() is None:
            rank.kill()
        shutil.rmtree(d, ignore_errors=True)
    tokens = sum(r["num_output_tokens"] for r in results)
    lags = [arr - fin for arr, fin in zip(t["arrivals"][a.concurrency:], t["finish_steps"], strict=False)]
    waves = -(-a.num_requests // a.concurrency)
    ideal = waves * a.osl * a.step_ms / 1000.0
    q = statistics.quantiles(lags, n=10) if len(lags) >= 2 else [0.0] * 9
    return {"num_requests": a.num_requests, "output_tokens": tokens, "wall_s": wall, "steps_s": ideal,
            "steps": t["steps"], "cpu_s": cpu, "cpu_us_per_request": cpu / a.num_requests * 1e6,
            "cpu_us_per_token": cpu / max(1, tokens) * 1e6,
            "refill_lag_ms": {"min": min(lags, default=0.0) * 1e3,
                              "p50": statistics.median(lags) * 1e3 if lags else 0.0, "p90": q[8] * 1e3,
                              "max": max(lags, default=0.0) * 1e3}}


def print_report(title: str, r: dict[str, Any]) -> None:
    lag = r["refill_lag_ms"]
    print(f"== {title}: {r['num_requests']} requests, {r['output_tokens']} tokens, {r['steps']} steps")
    print(f"wall {r['wall_s']:.2f} s (the steps alone: {r['steps_s']:.2f} s)   user process CPU {r['cpu_s']:.2f} s: "
          f"{r['cpu_us_per_request']:.0f} us a request, {r['cpu_us_per_token']:.1f} us a token")
    print(f"refill lag (a finished request's step to its successor's arrival): min {lag['min']:.1f} ms  "
          f"p50 {lag['p50']:.1f}  p90 {lag['p90']:.1f}  max {lag['max']:.1f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--responder":
        step_ms, osl, vocab, max_seq_len, out = argv[1:6]
        responder(float(step_ms), int(osl), int(vocab), int(max_seq_len), out)
        return 0
    if argv and argv[0] == "--client":
        serve_client(*map(int, argv[1:7]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--num-requests", type=int, default=2048)
    ap.add_argument("--step-ms", type=float, default=18.0,
                    help="the scripted rank's step (default: a 512-row step at 128/128 FP8 on an H200)")
    ap.add_argument("--serve", action="store_true",
                    help="through phalanx serve's server, from an HTTP client process (the bundled model's tokenizer)")
    ap.add_argument("--tokenizer", default=None,
                    help="with --serve: the bundled model's tokenizer saved as a directory "
                         "(tools/export_tokenizer.py), for machines without the bundled model")
    ap.add_argument("--baseline-rev", default=None, help="first run the same point on this git revision")
    ap.add_argument("--output", default=None, help="write the report(s) as JSON here")
    a = ap.parse_args(argv)
    for name in ("isl", "osl", "concurrency", "num_requests"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.tokenizer and not a.serve:
        ap.error("--tokenizer is for --serve (the scripted rank's plain run detokenizes nothing)")
    if a.step_ms <= 0:
        ap.error(f"--step-ms must be positive, got {a.step_ms}")
    passed = [f"--{name.replace('_', '-')}={getattr(a, name)}" for name in
              ("isl", "osl", "concurrency", "num_requests", "step_ms")] + (["--serve"] if a.serve else []) \
        + ([f"--tokenizer={os.path.abspath(a.tokenizer)}"] if a.tokenizer else [])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_host_loop import compare
    return compare(a.baseline_rev, passed, __file__, lambda: run_point(a), print_report, a.output)


if __name__ == "__main__":
    raise SystemExit(main())
