"""Speculative decoding against plain decoding, from one run.

Speed (``--model shape:NAME``, random weights): for each batch size, the same prompts decode
``--steps`` tokens without and with NGram speculation (``--draft-len`` drafts); greedy, the
overlap loop on, CUDA graphs as configured. Two prompt sets:

  echo        P + O + P, where O is the model's own greedy continuation of P: if the model
              answers the second P as it answered the first, the history predicts every token
              (the proposer is right whenever the model repeats itself)
  constant    one token repeated: what a model with random weights answers to that tends to
              repeat too (a case where the history predicts the output)
  fresh       the prompts alone: random weights continue where nothing predicts them
              (acceptance near 0: the cost of speculating when it does not pay)

``--token-map`` (a proposer that is always right on the same shape): every engine's attention
and MLP output projections (o_proj, down_proj) are zeroed after loading, so the model maps each
token to the next by its embedding alone and greedy output falls into a cycle; the prompt set
``cycle`` is each prompt followed by 1,024 tokens of its continuation (long enough to be inside
the cycle), so the history predicts every next token. The step reads the same weights and runs
the same kernels as with the projections intact: only the values differ.

Reported: decode tok/s over the window where the whole batch decodes, inter-token latency, the
acceptance rate and mean accepted length, and the speed-up over plain decoding.

Acceptance on the bundled model (``--copy-heavy``): chat prompts that make the model copy or
edit a given text, greedy, NGram speculation; acceptance, mean accepted length, and tokens/s
beside plain decoding on this machine.

    python tools/bench_speculative.py --model shape:llama-3.1-8b --batch 1 64 --output spec.json
    python tools/bench_speculative.py --copy-heavy --output spec_smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from phalanx import LLM, SamplingParams
from phalanx.bench.decode import _decode
from phalanx.bench.metrics import summarize
from phalanx.bench.shapes import resolve_model_arg
from phalanx.bench.throughput import make_prompts

TEXT = ("Speculative decoding lets a large language model produce several tokens per forward pass. A cheap "
        "proposer guesses the next few tokens, and the large model checks all of the guesses at once; every "
        "guess that matches what the large model would have produced is kept, and the first mismatch is "
        "replaced by the large model's own token. When the guesses are often right, as when a text is copied "
        "or lightly edited, the model reads its weights far fewer times per generated token.")
COPY_PROMPTS = [
    f"Copy the following text exactly, word for word:\n\n{TEXT}",
    f"Fix any spelling mistakes in this text and return it in full:\n\n{TEXT.replace('the', 'teh', 3)}",
    f"Rewrite this text replacing the word 'model' with 'network', changing nothing else:\n\n{TEXT}",
    "Write the sentence 'The cat sat on the mat.' ten times, one per line.",
    "Write a Python function that returns the nth Fibonacci number, then the same function with type hints.",
]


def zero_mixing(llm: LLM) -> None:
    """--token-map: zero every row-parallel projection (o_proj, down_proj) of the in-process rank's
    model, in place (captured CUDA graphs keep reading the same tensors)."""
    import torch

    from phalanx.models.layers import RowParallelLinear
    model = llm._executor.engine.runner.model
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RowParallelLinear):
                m.weight.zero_()


def spec_stats(llm: LLM) -> dict[str, int]:
    st = json.loads(llm.control("stats").per_rank[0])
    return {k: st[k] for k in ("spec_verify_rows", "spec_draft_tokens", "spec_accepted_drafts")}


def acceptance(before: dict[str, int], after: dict[str, int]) -> dict[str, float | None]:
    d = {k: after[k] - before[k] for k in after}
    if not d["spec_draft_tokens"]:
        return {"acceptance_rate": None, "mean_accepted_length": None}
    return {"acceptance_rate": d["spec_accepted_drafts"] / d["spec_draft_tokens"],
            "mean_accepted_length": 1 + d["spec_accepted_drafts"] / d["spec_verify_rows"],
            "verify_rows": d["spec_verify_rows"]}


def window(runs: list[tuple[list[float], list[int]]]) -> dict:
    times = [t for t, _ in runs]
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    tokens = sum(sum(1 for x in t if start <= x <= end) for t in times)
    gaps = [b - a for t in times for a, b in zip(t, t[1:], strict=False) if a >= start and b > a]
    return {"decode_tok_s": tokens / (end - start) if end > start else None, "window_tokens": tokens,
            "itl_ms": summarize(gaps, 1e3)}


def speed(a: argparse.Namespace) -> dict:
    path, dummy = resolve_model_arg(a.model)
    base = {"load_format": "dummy" if dummy else "auto", "skip_tokenizer_init": True,
            "orchestrator_type": "inprocess", "max_batch_size": max(a.batch), "max_seq_len": 4096,
            "cuda_graph_config": {"batch_sizes": sorted({1, 2, 4, 8, 16, 32, 64, *a.batch})}}
    prompts: dict[int, dict[str, list[list[int]]]] = {}
    report: dict = {"model": a.model, "draft_len": a.draft_len, "steps": a.steps, "runs": []}
    ngram = {"decoding_type": "NGram", "max_draft_len": a.draft_len}
    engines = {"plain": None, "ngram": ngram, "ngram_always": {**ngram, "adaptive": False}}
    for name, spec in ((n, engines[n]) for n in ["plain", *[e for e in a.engines if e != "plain"]]):
        t0 = time.monotonic()
        llm = LLM(path, **base, speculative_config=spec)
        startup = time.monotonic() - t0
        if a.token_map:
            zero_mixing(llm)
        try:
            for b in a.batch:
                if b not in prompts:   # the plain engine builds the prompt sets
                    fresh = make_prompts(b, a.prompt_len, llm.vocab_size, seed=b)
                    cont = llm.generate(fresh, SamplingParams(max_tokens=a.prompt_len, ignore_eos=True,
                                                              detokenize=False), use_tqdm=False)
                    prompts[b] = {"fresh": fresh,
                                  "echo": [p + o.outputs[0].token_ids + p for p, o in zip(fresh, cont, strict=True)],
                                  "constant": [[p[0]] * a.prompt_len for p in fresh]}
                    if "cycle" in a.prompt_sets:
                        long = llm.generate(fresh, SamplingParams(max_tokens=1024, ignore_eos=True, detokenize=False),
                                            use_tqdm=False)
                        prompts[b]["cycle"] = [p + o.outputs[0].token_ids for p, o in zip(fresh, long, strict=True)]
                for kind, ps in prompts[b].items():
                    if kind not in a.prompt_sets:
                        continue
                    asyncio.run(_decode(llm, ps, 16))       # warm-up: this batch's kernels compiled
                    before = spec_stats(llm)
                    runs = asyncio.run(_decode(llm, ps, a.steps))
                    row = {"engine": name, "batch": b, "prompts": kind, **window(runs),
                           **acceptance(before, spec_stats(llm)), "startup_s": startup}
                    report["runs"].append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "itl_ms"}), flush=True)
        finally:
            llm.shutdown()
    plain = {(r["batch"], r["prompts"]): r["decode_tok_s"] for r in report["runs"] if r["engine"] == "plain"}
    report["speedup_over_plain"] = {
        f"{r['engine']}_batch{r['batch']}_{r['prompts']}": r["decode_tok_s"] / plain[r["batch"], r["prompts"]]
        for r in report["runs"] if r["engine"] != "plain" and r["decode_tok_s"]}
    return report


def copy_heavy(a: argparse.Namespace) -> dict:
    """Each prompt alone (batch 1), greedy, plain and NGram; per prompt: tokens/s, acceptance."""
    report: dict = {"model": "bundled SmolLM2-135M-Instruct", "draft_len": a.draft_len, "runs": []}
    texts = {}
    for name, spec in (("plain", None), ("ngram", {"decoding_type": "NGram", "max_draft_len": a.draft_len})):
        with LLM(orchestrator_type="inprocess", speculative_config=spec) as llm:
            llm.generate(llm.apply_chat_template([{"role": "user", "content": "Hi"}]), SamplingParams(max_tokens=8),
                         use_tqdm=False)
            texts[name] = []
            for i, c in enumerate(COPY_PROMPTS):
                prompt = llm.apply_chat_template([{"role": "user", "content": c}])
                before = spec_stats(llm)
                t0 = time.perf_counter()
                out = llm.generate(prompt, SamplingParams(max_tokens=200, temperature=0.0), use_tqdm=False)
                wall = time.perf_counter() - t0
                n = len(out.outputs[0].token_ids)
                texts[name].append(out.outputs[0].text)
                row = {"engine": name, "prompt": i, "output_tokens": n, "tok_s": n / wall,
                       **acceptance(before, spec_stats(llm))}
                report["runs"].append(row)
                print(json.dumps(row), flush=True)
    report["same_text"] = texts["plain"] == texts["ngram"]
    report["prompts"] = COPY_PROMPTS
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shape:llama-3.1-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--engines", nargs="+", default=["plain", "ngram", "ngram_always"],
                    choices=["plain", "ngram", "ngram_always"], help="plain always runs (the baseline)")
    ap.add_argument("--prompt-sets", nargs="+", default=["fresh", "echo", "constant"],
                    choices=["fresh", "echo", "constant", "cycle"])
    ap.add_argument("--token-map", action="store_true",
                    help="zero the attention and MLP output projections: output cycles (see above)")
    ap.add_argument("--copy-heavy", action="store_true", help="acceptance on the bundled model's copy/edit prompts")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    report = copy_heavy(a) if a.copy_heavy else speed(a)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
