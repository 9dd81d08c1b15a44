"""``phalanx bench overhead``: what the proxy + MPI rank layout costs per request and per
streamed token, against the same engine in-process (same model, same prompts)."""

from __future__ import annotations

import argparse
import time

from phalanx.argtypes import POSITIVE
from phalanx.bench.metrics import emit_report, summarize


def _latencies(llm, n: int, max_tokens: int) -> dict:
    from phalanx import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    per_request, per_token = [], []
    for i in range(n):
        t0 = time.perf_counter()
        last, gaps = t0, []
        for out in llm.generate_async([1 + i % 7, 2, 3], sp, streaming=True):
            now = time.perf_counter()
            gaps += [now - last] if out.outputs[0].token_ids_diff else []
            last = now
        per_request.append(last - t0)
        per_token += gaps[1:]
    return {"request_us": summarize(per_request, 1e6), "token_us": summarize(per_token, 1e6)}


def ipc_ping(n: int = 2000) -> dict:
    """A signed msgpack message over a ZMQ PAIR socket pair and back (two hops)."""
    import threading

    from phalanx.executor import ipc
    from phalanx.executor.messages import Response
    d = ipc.private_dir()
    key = ipc.new_key()
    a_addr, b_addr = ipc.ipc_addresses(d)
    out_a, in_b = ipc.IpcQueue(a_addr, key, bind=True), ipc.IpcQueue(a_addr, key, bind=False)
    in_a, out_b = ipc.IpcQueue(b_addr, key, bind=True), ipc.IpcQueue(b_addr, key, bind=False)

    def echo():
        for _ in range(n):
            out_b.put(in_b.get(timeout_ms=5000))

    th = threading.Thread(target=echo)
    th.start()
    msg = [Response(7, [123], None, None, None, 0, 10)]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        out_a.put(msg)
        in_a.get(timeout_ms=5000)
        times.append(time.perf_counter() - t0)
    th.join()
    return {"round_trip_us": summarize(times, 1e6)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="phalanx bench overhead", description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=POSITIVE, default=30)
    ap.add_argument("--tokens", type=POSITIVE, default=32)
    ap.add_argument("--output", default=None)
    a = ap.parse_args(argv)
    from phalanx import LLM
    report = {"settings": vars(a), "ipc": ipc_ping()}
    for mode in ("inprocess", "mpi"):
        with LLM(a.model, orchestrator_type=mode, skip_tokenizer_init=a.model is not None) as llm:
            _latencies(llm, 3, a.tokens)  # warm-up
            report[mode] = {"one_token": _latencies(llm, a.requests, 1),
                            "stream": _latencies(llm, a.requests, a.tokens)}
    for what in ("one_token", "stream"):
        for k in ("request_us", "token_us"):
            mi, mp = report["inprocess"][what][k]["median"], report["mpi"][what][k]["median"]
            report.setdefault("proxy_overhead_us", {})[f"{what}.{k}.median"] = mp - mi
    emit_report(report, a.output)
    return 0
