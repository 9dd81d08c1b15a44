"""``phalanx bench kv``: the CPU cost of the radix tree — match, admit/free — per block."""

from __future__ import annotations

import argparse
import random
import time

from phalanx.argtypes import POSITIVE
from phalanx.bench.metrics import emit_report
from phalanx.kv_manager import KVCacheManager


def measure(num_blocks: int = 4096, tokens_per_block: int = 32, prompt_blocks: int = 64,
            num_prompts: int = 32, repeats: int = 20, seed: int = 0) -> dict:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, tokens_per_block)
    B = tokens_per_block
    prompts = [[rng.randrange(50_000) for _ in range(prompt_blocks * B + 1)] for _ in range(num_prompts)]
    for i, p in enumerate(prompts):       # cache every prompt
        kv.admit(i, kv.match(p), len(p))
        kv.commit(i, p, len(p) - 1)
        kv.free(i)
    t = time.perf_counter()
    for _ in range(repeats):
        for p in prompts:
            m = kv.match(p)
    match_s = (time.perf_counter() - t) / (repeats * num_prompts)
    assert m.num_tokens == prompt_blocks * B
    misses = [[rng.randrange(50_000) for _ in range(prompt_blocks * B + 1)] for _ in range(num_prompts)]
    t = time.perf_counter()
    for p in misses:
        kv.match(p)
    miss_s = (time.perf_counter() - t) / num_prompts
    t = time.perf_counter()
    for r in range(repeats):
        for i, p in enumerate(prompts):
            rid = 10_000 + r * num_prompts + i
            kv.admit(rid, kv.match(p), len(p))
            kv.free(rid)
    cycle_s = (time.perf_counter() - t) / (repeats * num_prompts)
    kv.check_integrity()
    return {
        "tokens_per_block": B, "prompt_blocks": prompt_blocks, "cached_blocks": len(kv.tree),
        "match_hit_us_per_block": match_s / prompt_blocks * 1e6,
        "match_miss_us_per_block": miss_s / prompt_blocks * 1e6,
        "match_admit_free_us_per_block": cycle_s / prompt_blocks * 1e6,
        "match_hit_us_per_request": match_s * 1e6,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="phalanx bench kv", description=__doc__)
    ap.add_argument("--prompt-blocks", type=POSITIVE, default=64)
    ap.add_argument("--num-prompts", type=POSITIVE, default=32)
    ap.add_argument("--output", default=None, help="write the JSON here too")
    a = ap.parse_args(argv)
    res = measure(prompt_blocks=a.prompt_blocks, num_prompts=a.num_prompts)
    emit_report(res, a.output)
    return 0
