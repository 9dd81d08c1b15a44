"""What the KV cache's host tier buys: time to first token of a prompt whose long prefix the
device pool has evicted, with the host tier (the prefix is onboarded) against an engine without
it (the prefix is computed again), beside the same prompt cold and with the prefix still on the
device. One engine each, one after the other, the same prompts; each request streamed alone on
an idle engine (tools/profile_ttft.py's measure). Llama-3.1-8B-shaped dummy model by default.

Per repeat, with a fresh random prefix P of ``--prefix`` tokens:
  cold         P + 32 new tokens, nothing cached
  device hit   P + 32 other new tokens (P's blocks still on the device)
  (churn)      distinct prompts filling more than the device pool, so P's blocks are evicted
  evicted hit  P + 32 more new tokens: onboarded from the host tier, or computed again

    python tools/bench_host_cache.py --output host_cache.json
    python tools/bench_host_cache.py --tiny --orchestrator inprocess   # checks the tool on a CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import torch

from phalanx import LLM, SamplingParams
from phalanx.bench.shapes import TINY_OVERRIDES, profiling_engine_args, shape_dir

SP = SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)
CHURN = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)


async def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Time to the first streamed output, and the tokens the request found cached (it runs to
    its end, so that the next request finds the engine idle)."""
    t0 = time.perf_counter()
    first, last = None, None
    async for out in llm.generate_async(prompt, SP, streaming=True):
        first, last = first or time.perf_counter() - t0, out
    if first is None or last is None:
        raise RuntimeError("no output")
    return first, last.cached_tokens


def measure(llm: LLM, a: argparse.Namespace, host: bool) -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    g = torch.Generator().manual_seed(a.seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1000, a.vocab, (n,), generator=g).tolist()

    kinds = ("cold", "device_hit", "evicted_hit")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    cached: dict[str, list[int]] = {k: [] for k in kinds}
    churn_prompts = -(-a.device_tokens // a.prefix) + 2
    for r in range(a.repeats + 1):        # repeat 0 compiles what new shapes need; not counted
        prefix = ids(a.prefix)
        for kind in kinds:
            if kind == "evicted_hit":
                llm.generate([ids(a.prefix) for _ in range(churn_prompts)], CHURN, use_tqdm=False)
            prompt = prefix + ids(a.new)
            t, hit = loop.run_until_complete(ttft(llm, prompt))
            if r:
                times[kind].append(t * 1e3)
                cached[kind].append(hit)
    stats = llm.stats()[0]
    result: dict[str, Any] = {kind: {"p50_ms": statistics.median(v), "min_ms": min(v), "all_ms": v,
                                     "cached_tokens": cached[kind]} for kind, v in times.items()}
    result["stats"] = {k: v for k, v in stats.items() if k.startswith("kv_") or k.startswith("prefix_")}
    label = "host tier" if host else "no host tier"
    print(f"{label}: " + ", ".join(f"{k} TTFT p50 {result[k]['p50_ms']:.1f} ms (min {result[k]['min_ms']:.1f}, "
                                   f"cached {statistics.median(cached[k]):.0f})" for k in kinds), flush=True)
    print(f"    {result['stats']}", flush=True)
    return result


def link(prefix_tokens: int, block_tokens: int, block_bytes: int) -> dict[str, float]:
    """The PCIe link's host → device rate for a prefix's blocks (pinned memory): one copy of
    them all, and one copy a block (an onboard copies one run of consecutive host blocks)."""
    n = -(-prefix_tokens // block_tokens)
    host = torch.empty(n, block_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    out = {}
    for name, parts in (("one_copy", [slice(0, n)]), ("per_block", [slice(i, i + 1) for i in range(n)])):
        for _ in range(3):
            t0 = time.perf_counter()
            for p in parts:
                dev[p].copy_(host[p], non_blocking=True)
            torch.cuda.synchronize()
            t = time.perf_counter() - t0
        out[f"{name}_ms"] = t * 1e3
        out[f"{name}_gb_per_s"] = n * block_bytes / t / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--config", default="tools/gpu_engine.yaml")
    ap.add_argument("--orchestrator", default="mpi", choices=["inprocess", "mpi"])
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--device-tokens", type=int, default=16384, help="the device pool's tokens (kv max_tokens)")
    ap.add_argument("--host-bytes", type=int, default=8 << 30, help="kv_cache_config.host_cache_size")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer shape (checks the tool on a CPU)")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    if a.tiny:
        a.prefix, a.new, a.repeats, a.device_tokens, a.host_bytes = 96, 8, 2, 256, 4 << 20
        base_len = {"max_seq_len": 256}
    a.vocab = 120000 if not a.tiny else TINY_OVERRIDES["vocab_size"]
    base = {**profiling_engine_args(a.orchestrator, a.config if not a.tiny else None),
            **(base_len if a.tiny else {})}
    model = shape_dir(a.model, **(TINY_OVERRIDES if a.tiny else {}))
    report: dict[str, Any] = {"settings": vars(a), "runs": {}}
    for host in (True, False):
        kvc = {**(base.get("kv_cache_config") or {}), "max_tokens": a.device_tokens,
               "host_cache_size": a.host_bytes if host else None}
        with LLM(model, **{**base, "kv_cache_config": kvc}) as llm:
            report["runs"]["host_tier" if host else "no_host_tier"] = measure(llm, a, host)
    if torch.cuda.is_available():
        from transformers import AutoConfig

        from phalanx.models.config import ModelConfig
        block = 32 * ModelConfig.from_hf(AutoConfig.from_pretrained(model)).kv_bytes_per_token(2)   # bf16, 32 tokens
        report["link"] = link(a.prefix, 32, block)
        print(f"the link, pinned host → device, {a.prefix} tokens' blocks: {report['link']}", flush=True)
    on, off = report["runs"]["host_tier"], report["runs"]["no_host_tier"]
    onboarded, again = on["evicted_hit"]["p50_ms"], off["evicted_hit"]["p50_ms"]
    print(f"evicted {a.prefix}-token prefix + {a.new}: {onboarded:.1f} ms onboarded against {again:.1f} ms computed "
          f"again ({again / onboarded:.2f}×); device hit {on['device_hit']['p50_ms']:.1f} ms, cold "
          f"{on['cold']['p50_ms']:.1f} ms", flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
