"""Where a decode step spends its GPU time: kernels of the Llama-3.1-8B-shaped dummy model under
the torch profiler, per step, with CUDA graphs (as served) and without, at a batch of sequences
of 128-token prompts (1 by default).

    python tools/profile_decode.py --batch 64 --output profile.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from phalanx import LLM, SamplingParams
from phalanx.bench.shapes import shape_dir


def kernel_table(prof, steps: int) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.count and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            rows.append({"kernel": e.key[:90], "calls_per_step": e.count / steps, "us_per_step": t / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    report = {"batch": a.batch}
    for graphs in (True, False):
        llm = LLM(shape_dir(a.model), load_format="dummy", skip_tokenizer_init=True, orchestrator_type="inprocess",
                  max_batch_size=max(8, a.batch), max_seq_len=512,
                  cuda_graph_config={"batch_sizes": [a.batch]} if graphs else None)
        try:
            prompt = [list(range(1000 + 128 * i, 1128 + 128 * i)) for i in range(a.batch)]
            llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
            torch.cuda.synchronize()
            sp = SamplingParams(max_tokens=a.steps + 1, ignore_eos=True, detokenize=False)
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                llm.generate(prompt, sp, use_tqdm=False)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            rows = kernel_table(prof, a.steps)
            gpu_us = sum(r["us_per_step"] for r in rows)
            report["graphs" if graphs else "eager"] = {
                "wall_ms_per_step_profiled": wall * 1e3 / a.steps, "kernel_us_per_step": gpu_us,
                "kernels_per_step": sum(r["calls_per_step"] for r in rows), "kernels": rows[:40],
                "gemv_choices": llm.engine_info.startup.get("gemv_gb_per_s")}
            print(f"{'graphs' if graphs else 'eager'}: {gpu_us:.0f} us of kernels per step, "
                  f"{report['graphs' if graphs else 'eager']['kernels_per_step']:.0f} kernels; top:")
            for r in rows[:16]:
                print(f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.1f}  {r['kernel']}")
        finally:
            llm.shutdown()
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
