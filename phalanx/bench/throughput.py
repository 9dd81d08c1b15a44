"""``phalanx bench throughput``: offline throughput through ``LLM.generate_async``.

Fixed input/output lengths (random token prompts, ``ignore_eos``; several pairs: one workload
each, one engine), at most ``--concurrency`` requests in flight. Reports what trtllm-bench
reports: request/s, output tok/s, per-user tok/s, TTFT / TPOT / E2E percentiles, with every
setting, as JSON. ``--hf-baseline`` also runs
Hugging Face transformers' ``generate`` on the same prompts in batches of ``--concurrency``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import platform
import time
from collections.abc import Iterator
from typing import Any

from phalanx.argtypes import NON_NEGATIVE, POSITIVE
from phalanx.bench.metrics import emit_report, per_user_rate, request_latencies, summarize


def make_prompts(num: int, isl: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    lo = min(1000, vocab // 4)  # stay clear of the special tokens at the start of most vocabularies
    return [[rng.randrange(lo, vocab) for _ in range(isl)] for _ in range(num)]


async def _run(llm: Any, prompts: list[list[int]], osl: int, concurrency: int) -> list[dict]:
    """Stream every prompt through ``llm.generate_async``, at most ``concurrency`` at a time.

    What this client's process holds before the run (the prompts, the engine's client) is frozen
    out of garbage collection for the run, as the ranks freeze what start-up made: the full
    collections that a run's allocations trigger would otherwise walk it, and a pause here at a
    wave's end delays the next wave's requests while the engine idles."""
    with frozen_heap():
        return await _stream_all(llm, prompts, osl, concurrency)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """What the process holds now, collected once and frozen out of garbage collection until the
    block ends; nothing is done where something is frozen already (a process that froze objects
    itself keeps its own, and ``_run`` inside a ``frozen_heap`` block does not collect again)."""
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()


async def _stream_all(llm: Any, prompts: list[list[int]], osl: int, concurrency: int) -> list[dict]:
    """Every prompt streamed, ``concurrency`` workers each sending its next prompt the moment its
    last request finishes. (With a semaphore and a task a prompt, the next request's task ran only
    after every other request that finished in the same step had run its own end: at a wave's end
    the engine waited for all of them before the first new request came.) A request's latencies
    are computed after the run, so nothing but its final pull stands between one request's end
    and the next one's start."""
    from phalanx import SamplingParams
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    sp = SamplingParams(max_tokens=osl, ignore_eos=True, temperature=0.0, detokenize=False)
    runs: list[tuple[float, list[float], int]] = [(0.0, [], 0)] * len(prompts)
    pending = iter(enumerate(prompts))   # shared by the workers (one thread: each next() is whole)

    async def worker() -> None:
        for i, p in pending:
            start = time.perf_counter()
            times: list[float] = []
            cached = 0
            async for out in llm.generate_async(p, sp, streaming=True):
                now = time.perf_counter()
                times += [now] * len(out.outputs[0].token_ids_diff)
                cached = out.cached_tokens
            runs[i] = (start, times, cached)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    results = []
    for start, times, cached in runs:
        lat = request_latencies(start, times)
        lat["num_output_tokens"] = len(times)
        lat["cached_tokens"] = cached
        lat["start"], lat["end"] = start, times[-1] if times else start
        results.append(lat)
    return results


def run_phalanx(llm: Any, isl: int, osl: int, concurrency: int, num_requests: int, warmup: int = 2,
                step_times: bool = False) -> dict:
    """One point: ``num_requests`` prompts at ``concurrency`` in flight, from an empty prefix cache
    (every point sends the same prompts: without the reset, a point after another would find
    prompts of the last one cached and skip part of their prefill). ``step_times``: rank 0's
    GPU time of every step (CUDA events), split by what the steps carried (a GPU only)."""
    prompts = make_prompts(num_requests + warmup, isl, llm.vocab_size)
    if warmup:
        asyncio.run(_run(llm, prompts[:warmup], min(osl, 8), concurrency))
    llm.reset_prefix_cache()
    before = _counters(llm)
    extra_steps = {}
    if step_times:
        llm.control("timing:on")
    try:
        with frozen_heap():   # its collection before the clock starts
            t0 = time.perf_counter()
            results = asyncio.run(_run(llm, prompts[warmup:], osl, concurrency))
            elapsed = time.perf_counter() - t0
        if step_times:
            steps = json.loads(llm.control("timing", timeout=300).per_rank[0])
            steps.pop("last_steps_ms", None)
            extra_steps = {"steps": steps}
    finally:
        if step_times:
            llm.control("timing:off")
    out_tokens = sum(r["num_output_tokens"] for r in results)
    tpots = [r["tpot"] for r in results if r["tpot"] == r["tpot"]]
    after = _counters(llm)
    extra: dict[str, Any] = {"num_preemptions": after["num_preemptions"] - before["num_preemptions"]}
    if llm.args.speculative_config is not None:   # the run's verify rows, drafts and accepted drafts
        rows, drafts, accepted = (after[k] - before[k] for k in SPEC_COUNTERS)
        extra.update({"spec_acceptance_rate": accepted / drafts if drafts else None,
                      "spec_mean_accepted_length": 1 + accepted / rows if rows else None, "spec_verify_rows": rows})
    return {
        "duration_s": elapsed,
        "request_throughput": len(results) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (out_tokens + isl * len(results)) / elapsed,
        "per_user_output_throughput": per_user_rate(tpots),
        "ttft_ms": summarize([r["ttft"] for r in results], 1000),
        "tpot_ms": summarize(tpots, 1000),
        "itl_ms": summarize([x for r in results for x in r["itl"]], 1000),
        "e2e_ms": summarize([r["e2e"] for r in results], 1000),
        "num_output_tokens": out_tokens,
        "prefix_hit_tokens": sum(r["cached_tokens"] for r in results),
        **extra, **extra_steps,
    }


SPEC_COUNTERS = ("spec_verify_rows", "spec_draft_tokens", "spec_accepted_drafts")


def _counters(llm: Any) -> dict[str, int]:
    """Rank 0's preemption and speculative counters (every rank of a tensor-parallel engine has
    the same)."""
    st = json.loads(llm.control("stats").per_rank[0])
    return {k: st[k] for k in ("num_preemptions", *SPEC_COUNTERS)}


_HF_CACHE: dict = {}


def run_hf(model: str | None, isl: int, osl: int, batch: int, num_requests: int, dtype: str, device: str,
           dummy: bool = False) -> dict:
    """transformers ``generate`` on the same prompts, ``batch`` at a time (random weights
    made on the device when ``dummy``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from phalanx.models.source import bundled_model_path, resolve_model
    dev = torch.device(device)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    source = resolve_model(model)
    if (model, dtype) in _HF_CACHE:
        hf = _HF_CACHE[(model, dtype)]
    elif dummy:
        with torch.device(dev):
            hf = AutoModelForCausalLM.from_config(source.hf_config, dtype=tdtype)
    elif source.kind == "gguf":
        import os
        path = bundled_model_path() if model is None else model
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=tdtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=tdtype)
    hf = _HF_CACHE[(model, dtype)] = hf.to(dev).eval()
    prompts = make_prompts(num_requests, isl, source.config.vocab_size)
    ids = torch.tensor(prompts, device=dev)
    with torch.no_grad():
        hf.generate(ids[:batch], attention_mask=torch.ones_like(ids[:batch]), max_new_tokens=4, min_new_tokens=4,
                    do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        for i in range(0, num_requests, batch):
            chunk = ids[i:i + batch]
            hf.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=osl, min_new_tokens=osl,
                        do_sample=False, pad_token_id=0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    return {"duration_s": elapsed, "output_throughput": num_requests * osl / elapsed,
            "request_throughput": num_requests / elapsed}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="phalanx bench throughput", description=__doc__)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--isl", type=POSITIVE, nargs="+", default=[128],
                    help="input tokens per request; several values: one workload each, paired with --osl's")
    ap.add_argument("--osl", type=POSITIVE, nargs="+", default=[128], help="output tokens per request")
    ap.add_argument("--concurrency", type=POSITIVE, nargs="+", default=[1], help="one run per value (and workload)")
    ap.add_argument("--num-requests", type=NON_NEGATIVE, nargs="+", default=None,
                    help="default (or 0): 2 × concurrency (at least 4); one value, or one per workload")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--config", default=None, help="YAML of extra LLM arguments")
    ap.add_argument("--disable-overlap", action="store_true")
    ap.add_argument("--orchestrator", default=None, choices=["mpi", "inprocess"],
                    help="mpi: proxy + MPI ranks (default); inprocess: the engine in a thread of this process")
    ap.add_argument("--tp", type=POSITIVE, default=1, help="tensor_parallel_size")
    ap.add_argument("--hf-baseline", action="store_true", help="also time transformers' generate")
    ap.add_argument("--hf-max-new-tokens", type=POSITIVE, default=None,
                    help="cap the baseline's output length (its throughput is then over that many tokens)")
    ap.add_argument("--max-batch-size", type=POSITIVE, default=None)
    ap.add_argument("--step-times", action="store_true",
                    help="rank 0's GPU time per step, split into decode-only steps and steps with prompt tokens, "
                         "the decode steps also by their rows (bins of 64); the slowest steps and the "
                         "kernels compiled meanwhile (in the JSON report)")
    ap.add_argument("--output", default=None, help="write the JSON report here")
    a = ap.parse_args(argv)
    if len(a.isl) != len(a.osl):
        ap.error(f"--isl has {len(a.isl)} values and --osl {len(a.osl)}: one output length per input length")
    if a.num_requests is not None and len(a.num_requests) not in (1, len(a.isl)):
        ap.error(f"--num-requests has {len(a.num_requests)} values: one, or one per workload ({len(a.isl)})")

    from phalanx import LLM
    from phalanx.bench.shapes import resolve_model_arg
    from phalanx.config import merge_yaml
    shape_name = a.model
    a.model, dummy = resolve_model_arg(a.model)
    if dummy:
        a.load_format = "dummy"
    kwargs: dict[str, Any] = {"dtype": a.dtype, "load_format": a.load_format, "max_batch_size": a.max_batch_size,
                              "disable_overlap_scheduler": a.disable_overlap, "orchestrator_type": a.orchestrator,
                              "tensor_parallel_size": a.tp}
    if a.config:
        kwargs = merge_yaml(kwargs, a.config)
    t0 = time.perf_counter()
    llm = LLM(a.model, skip_tokenizer_init=a.load_format == "dummy", **kwargs)
    startup = time.perf_counter() - t0
    report: dict[str, Any] = {
        "settings": {"model": shape_name or "SmolLM2-135M-Instruct (bundled GGUF)", "isl": a.isl, "osl": a.osl,
                     "dtype": a.dtype, "load_format": a.load_format, "llm_args": llm.args.model_dump(mode="json"),
                     "machine": platform.machine(), "python": platform.python_version()},
        "startup_s": startup, "engine_startup": llm.engine_info.startup,
        "num_kv_blocks": llm.engine_info.num_kv_blocks, "runs": [],
    }
    report["settings"]["device"] = _device_name()

    def save() -> None:   # after every point: a run cut short still leaves its figures
        if a.output:
            emit_report(report, a.output, echo=False)

    try:
        for w, (isl, osl) in enumerate(zip(a.isl, a.osl, strict=True)):
            for c in a.concurrency:
                n = (a.num_requests[min(w, len(a.num_requests) - 1)] if a.num_requests else 0) or max(4, 2 * c)
                res = run_phalanx(llm, isl, osl, c, n, step_times=a.step_times)
                res["isl"], res["osl"], res["concurrency"], res["num_requests"] = isl, osl, c, n
                report["runs"].append(res)
                save()
                _print_point(res)
    finally:
        llm.shutdown()
    if a.hf_baseline:
        import torch
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = "float32" if dev == "cpu" else "bfloat16"
        for run in report["runs"]:
            osl = min(run["osl"], a.hf_max_new_tokens or run["osl"])
            hf = run_hf(a.model, run["isl"], osl, run["concurrency"], run["concurrency"], dtype, dev, dummy)
            hf["osl"] = osl
            run["hf_generate"] = hf
            run["speedup_vs_hf"] = run["output_throughput"] / hf["output_throughput"]
            save()
            print(f"concurrency {run['concurrency']:4d}: HF generate {hf['output_throughput']:9.1f} out tok/s "
                  f"-> phalanx ×{run['speedup_vs_hf']:.2f}", flush=True)
    emit_report(report, a.output, echo=False)
    return 0


def _print_point(res: dict) -> None:
    rate = res.get("spec_acceptance_rate")
    print(f"{res['isl']}/{res['osl']} concurrency {res['concurrency']:4d}: {res['output_throughput']:9.1f} out tok/s  "
          f"TTFT p50 {res['ttft_ms']['median']:8.1f} ms  TPOT p50 {res['tpot_ms']['median']:7.2f} ms"
          + (f"  drafts accepted {rate:.2f}" if rate is not None else "")
          + (f"  preemptions {res['num_preemptions']}" if res.get("num_preemptions") else ""), flush=True)
    if "steps" in res:
        print(_steps_line(res["steps"]), flush=True)


def _steps_line(steps: dict) -> str:
    """A point's step times in one line: per kind, the steps, their GPU seconds and ms a step,
    the decode rows and prompt tokens a step; then the GPU's idle time between steps."""
    parts = []
    for kind, k in sorted(steps.get("by_kind", {}).items()):
        n = max(1, k["steps"])
        parts.append(f"{kind}: {k['steps']} steps {k['gpu_ms'] / 1e3:.1f} s GPU ({k['gpu_ms'] / n:.1f} ms a step, "
                     f"{k['decode_rows'] / n:.0f} decode rows + {k['prompt_tokens'] / n:.0f} prompt tokens)")
    gaps = f"idle between steps {steps['gap_ms'] / 1e3:.1f} s" if "gap_ms" in steps else "no step times"
    if "gc" in steps:   # rank 0's garbage-collector pauses over the point
        gc = steps["gc"]
        gaps += f"; rank 0's GC paused {sum(gc['ms']):.0f} ms (longest {gc['max_ms']:.0f})"
    line = "    " + "; ".join(parts + [gaps])
    bins = sorted(steps.get("decode_by_rows", {}).items(), key=lambda kv: int(kv[0]))
    if bins:
        line += "\n    decode steps by rows: " + "; ".join(
            f"{lo}+: {k['steps']} x {k['gpu_ms'] / k['steps']:.1f} ms "
            f"({1e3 * k['gpu_ms'] / max(1, k['decode_rows']):.0f} us a row, "
            f"context {k['context_tokens'] / max(1, k['decode_rows']):.0f})" for lo, k in bins)
    return line


def _device_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return platform.processor() or "cpu"
