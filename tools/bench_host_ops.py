"""Host microseconds of the operations a step's staging and graph launch are made of, timed in
a tight loop on this machine (median of 300 calls after 20 warm-up calls), beside a pure Python
loop to compare the machine's Python speed with another's. In the engine the same operations
run once per step on a cold path and take longer (docs/gpu_notes.md, fifteenth round).

    python tools/bench_host_ops.py
    python tools/bench_host_ops.py --after-idle     # the same calls after the thread slept or spun
    python tools/bench_host_ops.py --request-hop    # a request from the user's process to rank 0's loop (no GPU)
    python tools/bench_host_ops.py --wire           # a prompt's ids through check, pack and unpack (no GPU)
    python tools/bench_host_ops.py --detokenize     # a streamed token's text in the user's process (no GPU)

``--after-idle`` times one Python call and one copy + event record after the thread has been idle
for 0-100 ms, sleeping or spinning: whether a cold path is slow for all host work after a sleep
(the core's power state, its caches) or for the CUDA calls alone; and after sleeping with a touch
of the device every 0.5 ms (an event query, a one-element copy, a one-element kernel): what keeps
the first call after an idle spell fast.

``--request-hop`` times a request from its send in another process to the moment an idle loop
thread holds it, over the IPC queue (ZMQ PAIR, signed msgpack): read by the loop itself, as rank
0 does (``worker.Rank0Link.fetch``), against a reader thread handing it over through a
``RequestQueue`` (a thread in between). Both in turn, twice, for a short and a 2,080-id prompt.

``--wire`` times the size-dependent work of a request on each side of the socket, in one
process: the user's side (check the ids, pack, sign) and the rank's (verify, unpack, check, the
Request's list), with the ids crossing as uint32 bytes (``messages.ids_to_wire``) against a
msgpack list of ints (how they crossed before; still the form of ids that do not fit).

``--detokenize`` times a streamed token's text (``IncrementalDetokenizer.add``, one token a call,
what the dispatch thread does for every token of a request that detokenizes) with the bundled
tokenizer, through tokenizers' native stream decoder and through the two-decode window, over
English, accented and CJK text, after a chat prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from phalanx.executor import ipc
from phalanx.executor.messages import GenerationRequest
from phalanx.pyexecutor.model_runner import Staging
from phalanx.pyexecutor.py_executor import RequestQueue


def median_us(fn: Callable[[], object], n: int = 300) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def after_idle(gaps_ms: list[float], trials: int = 40) -> None:
    ids = list(range(1000, 3080))
    host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(4096, dtype=torch.uint8, device="cuda")
    event = torch.cuda.Event()

    def copy_record() -> None:
        buf[:1024].copy_(host[:1024], non_blocking=True)
        event.record()
    for _ in range(20):
        copy_record()
        min(ids)
    torch.cuda.synchronize()
    small = torch.zeros(1, device="cuda")
    touches: dict[str, Callable[[], object]] = {
        "sleep": lambda: None, "spin": lambda: None, "sleep, event query every 0.5 ms": event.query,
        "sleep, 1-element copy every 0.5 ms": lambda: buf[:8].copy_(host[:8], non_blocking=True),
        "sleep, 1-element kernel every 0.5 ms": lambda: small.add_(1)}
    for how, touch in touches.items():
        for gap in gaps_ms:
            py, cu = [], []
            for _ in range(trials):
                end = time.perf_counter() + gap / 1e3
                if how == "spin":
                    while time.perf_counter() < end:
                        pass
                elif how == "sleep":
                    time.sleep(gap / 1e3)
                else:
                    while (left := end - time.perf_counter()) > 0:
                        time.sleep(min(left, 5e-4))
                        touch()
                t0 = time.perf_counter()
                min(ids)
                t1 = time.perf_counter()
                copy_record()
                t2 = time.perf_counter()
                py.append(t1 - t0)
                cu.append(t2 - t1)
            print(f"after {gap:5.1f} ms of {how}: min() of 2,080 ids {statistics.median(py) * 1e6:7.1f} us, "
                  f"copy_ + event record {statistics.median(cu) * 1e6:7.1f} us", flush=True)


HOPS = 300


def _send_requests(addr: str, key: bytes, n_ids: int) -> None:
    """The user's side: a request every 10 ms, its send time in its sampling params."""
    q = ipc.IpcQueue(addr, key, bind=True)
    time.sleep(0.5)
    for i in range(HOPS):
        q.put(GenerationRequest(i, list(range(1000, 1000 + n_ids)), {"t_send": time.monotonic()}))
        time.sleep(0.01)
    time.sleep(0.5)


def request_hop(n_ids: int, through_thread: bool) -> tuple[float, float]:
    """(p50, p90) µs from the send to the loop thread holding the request."""
    d, key = ipc.private_dir(), ipc.new_key()
    addr = ipc.ipc_addresses(d)[0]
    sender = multiprocessing.get_context("spawn").Process(target=_send_requests, args=(addr, key, n_ids))
    sender.start()
    q = ipc.IpcQueue(addr, key, bind=False)
    lat: list[float] = []
    if through_thread:
        local = RequestQueue()

        def reader() -> None:
            while len(lat) < HOPS:
                m = q.get(timeout_ms=50)
                if m is not None:
                    local.put_request(m)
        t = threading.Thread(target=reader, daemon=True)
        t.start()
        while len(lat) < HOPS:
            inp = local.fetch(True)
            now = time.monotonic()
            lat += [now - m.sampling_params["t_send"] for m in inp.new]
        t.join()
    else:
        while len(lat) < HOPS:
            m = q.get(timeout_ms=50)
            now = time.monotonic()
            if m is not None:
                lat.append(now - m.sampling_params["t_send"])
    sender.join()
    q.close()
    kept = sorted(lat[20:])
    return statistics.median(kept) * 1e6, kept[int(0.9 * len(kept))] * 1e6


def wire(n_ids: int) -> None:
    """µs a side for an n_ids prompt: ids as uint32 bytes against a msgpack list."""
    import msgpack

    from phalanx.executor import messages
    from phalanx.llmapi.sampling_params import SamplingParams, check_prompt
    ids = [1000 + (7919 * i) % 120000 for i in range(n_ids)]
    msg = GenerationRequest(1, ids, SamplingParams(max_tokens=2).to_dict(), [2])
    key, vocab = ipc.new_key(), 128256

    def as_list(m: GenerationRequest) -> bytes:   # the wire form without the ids' codec
        body = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        return msgpack.packb({"t": "req", "b": {**body, "prompt_token_ids": list(m.prompt_token_ids)}},
                             use_bin_type=True)

    for form, pack in (("uint32 bytes", messages.pack), ("msgpack list", as_list)):
        def user(pack=pack) -> bytes:
            check_prompt(ids, vocab, 1 << 20)
            return ipc.sign(key, pack(msg))
        frame = user()

        def rank(frame=frame) -> list[int]:
            got = messages.unpack(ipc.verify(key, frame))
            check_prompt(got.prompt_token_ids, vocab, 1 << 20)
            p = got.prompt_token_ids
            return p.tolist() if hasattr(p, "tolist") else list(p)
        assert rank() == ids
        print(f"{n_ids:5d} ids as {form}: user side {median_us(user, 1000):6.1f} us, rank side "
              f"{median_us(rank, 1000):6.1f} us, frame {len(frame)} bytes", flush=True)


def detokenize() -> None:
    """µs a token for a request's streamed text, native stream against the window."""
    from phalanx.llmapi.tokenizer import IncrementalDetokenizer, load_tokenizer
    from phalanx.models.source import resolve_model
    tok = load_tokenizer(resolve_model(None))
    context = tok.encode_chat([{"role": "user", "content": "Write something."}])
    texts = {"English": "The quick brown fox jumps over the lazy dog, and then it naps. " * 30,
             "accents and CJK": "Ünïcödé façade, naïve café. 日本語のテキスト、漢字とひらがな。 " * 20}
    for name, text in texts.items():
        ids = tok.encode(text, add_special_tokens=False)
        for native in (True, False):
            def run(native=native, ids=ids) -> str:
                d = IncrementalDetokenizer(tok, True, context, native=native)
                return "".join(d.add([t]) for t in ids) + d.flush()
            assert run() == tok.decode(ids)
            how = "native stream" if native else "two-decode window"
            print(f"{name:16s} {how:18s} {median_us(run, 7) / len(ids):6.2f} us a token ({len(ids)} tokens)",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--after-idle", action="store_true")
    ap.add_argument("--request-hop", action="store_true")
    ap.add_argument("--wire", action="store_true")
    ap.add_argument("--detokenize", action="store_true")
    a = ap.parse_args()
    if a.detokenize:
        return detokenize()
    if a.after_idle:
        return after_idle([0, 1, 5, 20])
    if a.wire:
        for n_ids in (32, 2080, 8192):
            wire(n_ids)
        return
    if a.request_hop:
        for n_ids in (32, 2080):
            for through in (True, False, True, False):
                p50, p90 = request_hop(n_ids, through)
                how = "a thread in between" if through else "read by the loop"
                print(f"{n_ids:5d} ids, {how:20s} p50 {p50:6.1f} us  p90 {p90:6.1f} us", flush=True)
        return
    ids = list(range(1000, 3080))
    print(f"python loop sum(range(200k))  {median_us(lambda: sum(range(200_000)), 30):8.1f} us")
    print(f"min() of a 2,080-id list      {median_us(lambda: min(ids)):8.1f} us")
    dev = torch.device("cuda")
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    # the arrays of a prefix hit's step: 32 new tokens over 2,048 cached, one sequence
    arrays = [np.arange(32, dtype=np.int64), np.arange(2, dtype=np.int32), np.array([2080], np.int32),
              np.arange(66, dtype=np.int32).reshape(1, 66), np.arange(32, dtype=np.int64),
              np.arange(2048, 2080, dtype=np.int64), np.array([31], np.int64), np.array([0], np.int64)]
    stage = Staging(dev)
    host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(4096, dtype=torch.uint8, device=dev)
    event = torch.cuda.Event()
    x = torch.zeros(64, dtype=torch.int64, device=dev)
    y = torch.ones(32, dtype=torch.int64, device=dev)
    ops = {
        "Staging call (a hit's 8 arrays)": lambda: stage(arrays),
        "copy_ 1 KB pinned -> device": lambda: buf[:1024].copy_(host[:1024], non_blocking=True),
        "event record": event.record,
        "event synchronize (reached)": event.synchronize,
        "slice": lambda: buf[:1024],
        "view as int64": lambda: buf.view(torch.int64),
        "split in 4": lambda: buf.view(torch.int64).split([100, 100, 100, 212]),
        "pinned torch.empty": lambda: torch.empty(4096, dtype=torch.uint8, pin_memory=True),
        "device torch.empty": lambda: torch.empty(4096, dtype=torch.uint8, device=dev),
        "device copy_ of 32 ids": lambda: x[:32].copy_(y),
        "device fill_": lambda: x[32:].fill_(0),
        "stream wait_stream": lambda: stream.wait_stream(torch.cuda.default_stream()),
    }
    for name, fn in ops.items():
        print(f"{name:32s} {median_us(fn):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
