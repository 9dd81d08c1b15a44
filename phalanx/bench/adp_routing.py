"""``phalanx bench adp``: cache-aware vs load-only placement under attention data parallelism.

A shared-prefix workload — G groups, each with a system prompt of S tokens shared by its P
requests, each request adding a Q-token question — arrives in two waves: one request per group
(which computes the group's prefix somewhere), then all the others at once. Reported per
routing mode: prefix hit rate (cached tokens / prompt tokens, second wave and overall) and the
requests each rank served.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from phalanx.argtypes import NON_NEGATIVE, POSITIVE
from phalanx.bench.metrics import emit_report


def workload(groups: int, per_group: int, system: int, question: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    lo = min(1000, vocab // 4)
    out = []
    for _ in range(groups):
        sys_prompt = [rng.randrange(lo, vocab) for _ in range(system)]
        out.append([sys_prompt + [rng.randrange(lo, vocab) for _ in range(question)] for _ in range(per_group)])
    return out


def run_mode(model: str | None, routing: str, waves, osl: int, tp: int, dummy: bool) -> dict[str, Any]:
    from phalanx import LLM, SamplingParams
    sp = SamplingParams(max_tokens=osl, ignore_eos=True, detokenize=False)
    with LLM(model, tensor_parallel_size=tp, enable_attention_dp=True, skip_tokenizer_init=True,
             load_format="dummy" if dummy else "auto",
             attention_dp_config={"routing": routing}) as llm:
        first = llm.generate([g[0] for g in waves], sp, use_tqdm=False)
        rest = llm.generate([p for g in waves for p in g[1:]], sp, use_tqdm=False)
        stats = llm.stats()
    outs = list(first) + list(rest)
    served = [0] * tp
    for o in outs:
        served[o.metrics["rank"]] += 1

    def hit(os):
        return sum(o.cached_tokens for o in os) / max(1, sum(len(o.prompt_token_ids) for o in os))

    return {"routing": routing, "hit_rate_second_wave": hit(rest), "hit_rate_overall": hit(outs),
            "requests_per_rank": served, "dummy_steps_per_rank": [s.get("num_dummy_steps", 0) for s in stats]}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="phalanx bench adp", description=__doc__)
    ap.add_argument("--model", default=None, help="a MoE or dense model; shape:NAME for random weights")
    ap.add_argument("--tp", type=POSITIVE, default=2)
    ap.add_argument("--groups", type=POSITIVE, default=8)
    ap.add_argument("--per-group", type=POSITIVE, default=6)
    ap.add_argument("--system", type=NON_NEGATIVE, default=192)
    ap.add_argument("--question", type=POSITIVE, default=24)
    ap.add_argument("--osl", type=POSITIVE, default=8)
    ap.add_argument("--output", default=None)
    a = ap.parse_args(argv)
    from phalanx.bench.shapes import resolve_model_arg
    from phalanx.models.source import resolve_model
    model, dummy = resolve_model_arg(a.model)
    vocab = resolve_model(model).config.vocab_size
    waves = workload(a.groups, a.per_group, a.system, a.question, vocab)
    report = {"settings": vars(a), "modes": [run_mode(model, r, waves, a.osl, a.tp, dummy)
                                             for r in ("cache_aware", "load")]}
    emit_report(report, a.output)
    return 0
