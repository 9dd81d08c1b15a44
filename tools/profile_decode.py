"""Where a decode step spends its GPU time: kernels of the Llama-3.1-8B-shaped dummy model under
the torch profiler, per step, with CUDA graphs (as served) and without, at a batch of sequences
of 128-token prompts (1 by default; ``--prompt-len`` for longer contexts). Only decode steps are
profiled: the profiler starts once every sequence has its first token and stops after
``--steps`` more, before any sequence finishes. With ``--tp 2`` the
ranks run in an MPI job and each profiles itself (the ``profile:start`` / ``profile:stop``
control ops); ``--allreduce AUTO NCCL`` profiles the custom all-reduce against NCCL in one run.

    python tools/profile_decode.py --batch 64 --output profile.json
    python tools/profile_decode.py --batch 256 448 --prompt-len 1500 --config tools/gpu_engine_512.yaml
    python tools/profile_decode.py --tp 2 --batch 1 64 --allreduce NCCL AUTO --output profile_tp2.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence

import torch

from phalanx import LLM, RequestOutput, SamplingParams
from phalanx.bench.shapes import TINY_OVERRIDES, resolve_spec_shape, shape_dir
from phalanx.config import merge_yaml

TINY = {k: v for k, v in TINY_OVERRIDES.items() if k != "vocab_size"}   # the prompts use ids up to 40k


def profile_steps(llm: LLM, batch: int, steps: int, prompt_len: int = 128) -> dict:
    rng = random.Random(batch)     # prompts apart from their first block on: no sequence shares another's KV
    prompt = [[rng.randrange(1000, 40_000) for _ in range(prompt_len)] for _ in range(batch)]
    llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
    wall, decoded, per_rank_text = asyncio.run(_decode_window(llm, prompt, steps))
    per_rank = [json.loads(r) for r in per_rank_text]
    ranks = []
    for rows in per_rank:
        ranks.append({"kernel_us_per_step": sum(r["us_per_step"] for r in rows),
                      "kernels_per_step": sum(r["calls_per_step"] for r in rows), "kernels": rows})
    return {"wall_ms_per_step_profiled": wall * 1e3 / decoded, "decode_steps_profiled": decoded, "ranks": ranks}


def decode_tokens(steps: int, batch: int, prompt_len: int) -> int:
    """Each request's max_tokens: the window's steps twice over, plus the tokens the first
    sequences decode while the last ones' prompts are still being computed (a step computes at
    least 2,048 prompt tokens), so that none finishes before the window closes."""
    return 2 * steps + 16 + -(-batch * prompt_len // 2048)


async def _follow(out: RequestOutput, seen: list[int], i: int) -> None:
    async for update in out:
        seen[i] = len(update.outputs[0].token_ids)


async def _until(cond: Callable[[], bool], tasks: Sequence[asyncio.Future], what: str) -> None:
    deadline = time.monotonic() + 600
    while not cond():
        for t in tasks:
            if t.done():
                t.result()      # a request refused or failed: its own error
                raise RuntimeError(f"a sequence finished before the profiled steps ({what})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the sequences did not {what} within 600 s")
        await asyncio.sleep(0.001)


def _control(llm: LLM, op: str) -> list[str]:
    result = llm.control(op, timeout=120)
    if not result.ok:
        raise RuntimeError(f"{op}: {result.per_rank}")
    return result.per_rank


async def _decode_window(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[float, int, list[str]]:
    """The profiler around decode steps only: started once every sequence has its first token (its
    prompt computed), stopped once each has ``steps`` more, before any finishes — so the engine's
    per-step figures (its kernel time over the iterations in between) are those of full decode
    steps, not averaged with the steps that computed the prompts. The requests are aborted then.
    Returns (wall seconds, tokens the slowest sequence decoded in the window, each rank's kernel
    table)."""
    sp = SamplingParams(max_tokens=decode_tokens(steps, len(prompts), len(prompts[0])), ignore_eos=True,
                        detokenize=False)
    seen = [0] * len(prompts)
    outs = [llm.generate_async(p, sp, streaming=True) for p in prompts]
    tasks = [asyncio.ensure_future(_follow(o, seen, i)) for i, o in enumerate(outs)]
    loop = asyncio.get_running_loop()
    profiling = False
    try:
        await _until(lambda: min(seen) >= 2, tasks, "all start decoding")
        await loop.run_in_executor(None, _control, llm, "profile:start")
        profiling = True
        before, t0 = list(seen), time.perf_counter()
        await _until(lambda: min(s - b for s, b in zip(seen, before, strict=True)) >= steps, tasks,
                     f"decode {steps} tokens each")
        wall = time.perf_counter() - t0
        decoded = min(s - b for s, b in zip(seen, before, strict=True))
        tables = await loop.run_in_executor(None, _control, llm, "profile:stop")
        profiling = False
    finally:
        for o in outs:
            o.abort()
        await asyncio.gather(*tasks, return_exceptions=True)
        if profiling:   # an error inside the window: the profiler is not left running
            await loop.run_in_executor(None, llm.control, "profile:stop")
    return wall, decoded, tables


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-len", type=int, default=128, help="each sequence's prompt (the decode's context)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--allreduce", nargs="+", default=["AUTO"], choices=["AUTO", "NCCL"])
    ap.add_argument("--eager", action="store_true", help="also profile without CUDA graphs")
    ap.add_argument("--config", default=None, help="YAML of extra LLM arguments (e.g. attention DP)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer shape (checks the tool on a CPU)")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    if a.steps < 1:
        ap.error("--steps must be at least 1")
    report: dict = {"model": a.model, "tp": a.tp, "config": a.config, "runs": []}
    for strategy in a.allreduce if a.tp > 1 else ["AUTO"]:
        for graphs in (True, False) if a.eager else (True,):
            kwargs = {"load_format": "dummy", "skip_tokenizer_init": True, "tensor_parallel_size": a.tp,
                      "orchestrator_type": "inprocess" if a.tp == 1 else None, "allreduce_strategy": strategy,
                      "max_batch_size": max(8, *a.batch),
                      "max_seq_len": max(512, a.prompt_len + decode_tokens(a.steps, max(a.batch), a.prompt_len) + 64),
                      "cuda_graph_config": {"batch_sizes": sorted(set(a.batch))} if graphs else None}
            if a.config:
                kwargs = resolve_spec_shape(merge_yaml(kwargs, a.config))
            if a.tiny:
                kwargs.update(orchestrator_type="inprocess", cuda_graph_config=None)
            llm = LLM(shape_dir(a.model, **(TINY if a.tiny else {})), **kwargs)
            try:
                for batch in a.batch:
                    run = {"allreduce": strategy, "graphs": graphs, "batch": batch,
                           **profile_steps(llm, batch, a.steps, a.prompt_len)}
                    report["runs"].append(run)
                    r0 = run["ranks"][0]
                    print(f"allreduce={strategy} graphs={graphs} batch={batch}: {run['wall_ms_per_step_profiled']:.2f} "
                          f"ms/step wall over {run['decode_steps_profiled']} decode steps, rank 0 "
                          f"{r0['kernel_us_per_step']:.0f} us of kernels in {r0['kernels_per_step']:.0f} kernels; top:",
                          flush=True)
                    for r in r0["kernels"][:12]:
                        print(f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.1f}  {r['kernel']}")
            finally:
                llm.shutdown()
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
