"""Where a mixed step's time goes: requests decoding, then one prompt arrives and is computed in
the same steps as their decode rows. Prints every loop iteration around the arrival — the host
phases from rank 0's HostClock trace (schedule, prepare, forward, launch, wait, update, respond)
and the GPU time of each step (CUDA events) — then the kernels of the steps that carry the
prompt under the torch profiler, on the Llama-3.1-8B-shaped dummy model.

    python tools/profile_mixed.py --decoders 96 --prompt-len 1000 --output mixed.json
    python tools/profile_mixed.py --decoders 8 --prompts 8 --prompt-len 1000   # a full prompt step
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

from phalanx import LLM, SamplingParams
from phalanx.bench.shapes import TINY_OVERRIDES, profiling_engine_args, shape_dir
from phalanx.pyexecutor.host_clock import IDLE_COLLECT, PHASES


async def _drain(llm: LLM, prompt: list[int], sp: SamplingParams, seen: list[int], i: int) -> None:
    async for out in llm.generate_async(prompt, sp, streaming=True):
        seen[i] = len(out.outputs[0].token_ids)


async def _first(llm: LLM, prompt: list[int], t0: float) -> float:
    async for _ in llm.generate_async(prompt, SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False),
                                      streaming=True):
        return time.monotonic() - t0
    raise RuntimeError("no output")


async def _arrive(llm: LLM, prompts: list[list[int]]) -> float:
    """Seconds from sending ``prompts`` together to the last one's first token."""
    t0 = time.monotonic()
    return max(await asyncio.gather(*(_first(llm, p, t0) for p in prompts)))


async def run(llm: LLM, a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1000, a.vocab) for _ in range(n)]  # noqa: E731
    sp = SamplingParams(max_tokens=a.decode_tokens, ignore_eos=True, detokenize=False)
    seen = [0] * a.decoders
    tasks = [asyncio.ensure_future(_drain(llm, ids(a.context), sp, seen, i)) for i in range(a.decoders)]
    deadline = time.monotonic() + 300
    while min(seen) < 8:                          # every decoder past its prompt
        if time.monotonic() > deadline or any(t.done() for t in tasks):
            raise RuntimeError(f"the decoders did not all start decoding: tokens so far {sorted(seen)[:8]}")
        await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()
    ctl = lambda op: loop.run_in_executor(None, llm.control, op)  # noqa: E731
    # a first arrival, untraced: the forms of the kernels a mixed step needs are compiled (or
    # loaded) then, so the traced arrival shows the steady state
    arrivals = lambda: [ids(a.prompt_len) for _ in range(a.prompts)]  # noqa: E731
    ttft_first = await _arrive(llm, arrivals()) if a.warmup else None
    await asyncio.sleep(0.05)
    await ctl("trace:on")
    await ctl("timing:on")
    await asyncio.sleep(0.05)
    t_arrive = time.monotonic()
    ttft = await _arrive(llm, arrivals())
    await asyncio.sleep(0.1)
    timing = json.loads((await ctl("timing")).per_rank[0])
    await ctl("timing:off")
    marks = json.loads((await ctl("trace:off")).per_rank[0])
    await ctl("profile:start")                  # a second arrival under the profiler
    ttft_profiled = await _arrive(llm, arrivals())
    await asyncio.sleep(0.05)
    kernels = json.loads((await loop.run_in_executor(
        None, lambda: llm.control("profile:stop", timeout=120))).per_rank[0])
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # iterations: phase -> ms, from consecutive marks
    iters: dict[int, dict[str, float]] = {}
    prev = None
    for it, phase, t in marks:
        if prev is not None:
            iters.setdefault(it, {})
            iters[it][phase] = iters[it].get(phase, 0.0) + (t - prev) * 1e3
        prev = t
    first = min((it for it, _, t in marks if t >= t_arrive), default=None)
    return {"ttft_ms": ttft * 1e3, "ttft_first_ms": ttft_first and ttft_first * 1e3,
            "ttft_profiled_ms": ttft_profiled * 1e3, "arrival_iteration": first,
            "iterations": {str(k): v for k, v in iters.items()}, "gpu_step_ms": timing.get("last_steps_ms", []),
            "host_ms_per_step": timing.get("host_ms_per_step"), "kernels": kernels}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--decoders", type=int, default=96)
    ap.add_argument("--context", type=int, default=1000, help="the decoders' prompt length")
    ap.add_argument("--decode-tokens", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=1, help="prompts arriving together (the TTFT is the last one's)")
    ap.add_argument("--config", default="tools/gpu_engine.yaml")
    ap.add_argument("--orchestrator", default="mpi", choices=["inprocess", "mpi"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer shape (checks the tool on a CPU)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="trace the first arrival (kernel forms compiled or loaded inside it)")
    ap.add_argument("--prefill-cap", type=int, default=None,
                    help="scheduler_config.max_prefill_tokens_while_decoding")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    args = profiling_engine_args(a.orchestrator, a.config)
    if a.prefill_cap is not None:
        args["scheduler_config"] = {**(args.get("scheduler_config") or {}),
                                    "max_prefill_tokens_while_decoding": a.prefill_cap}
    a.vocab = 1024 if a.tiny else 120000
    with LLM(shape_dir(a.model, **(TINY_OVERRIDES if a.tiny else {})), **args) as llm:
        # the loop stays open: the aborted decoders' last responses may still come back to it
        report = asyncio.new_event_loop().run_until_complete(run(llm, a))
    it0 = report["arrival_iteration"]
    print(f"TTFT of {a.prompts} arriving {a.prompt_len}-token prompt(s) among {a.decoders} decoders: "
          f"{report['ttft_ms']:.1f} ms "
          f"({report['ttft_profiled_ms']:.1f} under the profiler"
          + (f", {report['ttft_first_ms']:.1f} for the untraced first arrival" if report["ttft_first_ms"] else "")
          + f"); arrival at iteration {it0}")
    phases = (*PHASES, IDLE_COLLECT)   # the total includes an idle full collection, so it gets its column
    print("iteration " + " ".join(f"{p:>8s}" for p in phases) + "   total (host ms)")
    for k, v in report["iterations"].items():
        if it0 is not None and it0 - 4 <= int(k) <= it0 + 8:
            print(f"{k:>9s} " + " ".join(f"{v.get(p, 0.0):8.2f}" for p in phases) + f"   {sum(v.values()):7.2f}")
    print("GPU ms of the last steps:", " ".join(f"{x:.1f}" for x in report["gpu_step_ms"][-24:]))
    print("kernels of the profiled steps (us per step):")
    for k in report["kernels"][:20]:
        print(f"  {k['us_per_step']:9.1f} {k['calls_per_step']:7.1f}  {k['kernel'][:80]}")
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"settings": vars(a), **report}, f, indent=1)


if __name__ == "__main__":
    main()
