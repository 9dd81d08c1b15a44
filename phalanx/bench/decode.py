"""``phalanx bench decode``: steady decode speed per batch size, overlap on and off.

For each batch size b: b requests with short random prompts decode ``--steps`` tokens together
(``ignore_eos``). Reported per (overlap, b): inter-token latency (median gap between a request's
tokens, as the client sees them), decode throughput (tokens/s over the window where all b
decode), and — on a GPU — the share of the decode window the GPU sat idle between steps,
from CUDA events recorded around every step. Also measures the GPU's memory bandwidth in the
same run and, at batch 1, the fraction of the weights-read roofline reached (the weights a
one-token step reads: of a mixture of experts, top_k of the E experts a layer).

``--guided on|both``: the same batches with every request under a JSON-schema grammar
(``--schema FILE``, else SCHEMA below; needs a tokenizer: ``--tokenizer`` for a shape with
random weights), reported beside the free runs of the same engine with the grammar's host cost
per step. Random weights pick tokens blindly, so a request may close its JSON early; the window
is where all b still decode, and the tokens each request produced are reported.

``--lora-rank R``: the engine serves LoRA adapters (``lora_config``, rank R), and every batch runs
twice on it, its requests without an adapter and with one (random weights, rank R, on every
projection; ``--loras N`` adapters spread over the batch's requests); run the same command
without the flag for the engine without LoRA.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import time
from itertools import pairwise
from typing import Any

from phalanx.argtypes import POSITIVE
from phalanx.bench.metrics import emit_report, summarize
from phalanx.bench.throughput import make_prompts


def measure_bandwidth(gib: float = 4.0) -> dict[str, float]:
    """Device-to-device copy (read + write) and a read-only reduction, in TB/s."""
    import torch
    if not torch.cuda.is_available():
        return {}
    from phalanx.kernels.gemv_tuner import time_eager
    n = int(gib * 2**30) // 2
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    copy_s = time_eager(functools.partial(torch.Tensor.copy_, y, x), reps=10, warmup=1) / 1e3
    read_s = time_eager(functools.partial(torch.sum, x, dtype=torch.float32), reps=10, warmup=1) / 1e3
    del x, y   # free the memory before the engine starts
    torch.cuda.empty_cache()
    return {"copy_tb_s": 2 * n * 2 / copy_s / 1e12, "read_tb_s": n * 2 / read_s / 1e12}


# what --guided constrains every request to when no --schema is given: a record whose text
# fields take most of the tokens, as in the JSON answers of an API
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"enum": ["news", "science", "sport", "art"]}, "maxItems": 4},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "tags", "summary"],
}


def write_random_adapter(path: str, cfg: Any, rank: int, seed: int) -> None:
    """A PEFT directory of a LoRA of rank ``rank`` on every projection of a Llama-shaped model
    ``cfg`` (its ModelConfig), with random weights small enough to keep its outputs finite."""
    import os

    import torch
    from safetensors.torch import save_file

    from phalanx.config import LORA_TARGETS
    from phalanx.models.lora import config_shapes
    shapes = config_shapes(cfg)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in LORA_TARGETS:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}.lora_"
            fan_in, fan_out = shapes[module]
            tensors[key + "A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5).bfloat16()
            tensors[key + "B.weight"] = (torch.randn(fan_out, rank, generator=g) * 1e-3).bfloat16()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(LORA_TARGETS),
                   "bias": "none"}, f)


async def _decode(llm: Any, prompts: list[list[int]], steps: int, schema: dict | None = None,
                  loras: list[Any] | None = None) -> list[tuple[list[float], list[int]]]:
    from phalanx import GuidedDecodingParams, SamplingParams
    guided = GuidedDecodingParams(json=schema) if schema is not None else None
    sp = SamplingParams(max_tokens=steps, ignore_eos=guided is None, detokenize=False, guided_decoding=guided)

    async def one(i, p):
        times, tokens = [], []
        lora = loras[i % len(loras)] if loras else None
        async for out in llm.generate_async(p, sp, streaming=True, lora_request=lora):
            now = time.perf_counter()
            times += [now] * len(out.outputs[0].token_ids_diff)
            tokens += out.outputs[0].token_ids_diff
        return times, tokens

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def run_batch(llm: Any, batch: int, prompt_len: int, steps: int, schema: dict | None = None,
              loras: list[Any] | None = None) -> dict[str, Any]:
    prompts = make_prompts(batch, prompt_len, llm.vocab_size, seed=batch)
    # warm-up on other prompts of the same length: the timed prompts' prefill is then cold as
    # the warm-up's was (a cached prefix would run the extend kernels first inside the window)
    warm = make_prompts(max(1, batch // 4), prompt_len, llm.vocab_size, seed=batch + 100_000)
    asyncio.run(_decode(llm, warm, 4, schema, loras))
    before = _grammar_stats(llm)
    llm.control("timing:on")
    runs = asyncio.run(_decode(llm, prompts, steps, schema, loras))
    timing = json.loads(llm.control("timing").per_rank[0])
    llm.control("timing:off")
    after = _grammar_stats(llm)
    times = [t for t, _ in runs]
    start = max(t[0] for t in times)                 # every request is decoding from here on
    end = min(t[-1] for t in times)
    tokens = sum(sum(1 for x in t if start <= x <= end) for t in times)
    gaps = [b - a for t in times for a, b in pairwise(t) if a >= start]
    res = {"batch": batch, "itl_ms": summarize(gaps, 1e3),
           "decode_tok_s": tokens / (end - start) if end > start else None,
           "window_tokens": tokens, "gpu": timing, "guided": schema is not None, "adapters": len(loras or [])}
    if schema is not None:
        fills = after["fills"] - before["fills"]
        for what in ("fill", "accept"):   # host time per step: filling, advancing the matchers
            spent = after[what] - before[what]
            res[f"grammar_{what}_us_per_step"] = 1e6 * spent / fills if fills else None
        res["output_tokens"] = summarize([len(t) for _, t in runs])
        res["complete_json"] = sum(_valid_json(llm, t) for _, t in runs)
    return res


def _grammar_stats(llm: Any) -> dict[str, float]:
    """Fills so far on rank 0 and the seconds spent filling and accepting (from its
    per-step averages)."""
    st = json.loads(llm.control("stats").per_rank[0])
    n = st.get("grammar_fills", 0)
    return {"fills": n, **{what: st.get(f"grammar_{what}_us_per_step", 0.0) * n / 1e6
                           for what in ("fill", "accept")}}


def _valid_json(llm: Any, tokens: list[int]) -> bool:
    if llm.tokenizer is None:
        return False
    try:
        json.loads(llm.tokenizer.decode(tokens))
        return True
    except ValueError:
        return False


def weight_bytes(llm: Any) -> int | None:
    stats = llm.control("stats").per_rank
    return json.loads(stats[0]).get("weight_bytes_per_step")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="phalanx bench decode", description=__doc__)
    ap.add_argument("--model", default="shape:llama-3.1-8b", help="a model path, or shape:NAME for random weights")
    ap.add_argument("--batch", type=POSITIVE, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--prompt-len", type=POSITIVE, default=128)
    ap.add_argument("--steps", type=POSITIVE, default=128)
    ap.add_argument("--overlap", choices=["on", "off", "both"], default="both")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--orchestrator", default=None, choices=["mpi", "inprocess"])
    ap.add_argument("--tp", type=POSITIVE, default=1, help="tensor_parallel_size")
    ap.add_argument("--config", default=None, help="YAML of extra LLM arguments")
    ap.add_argument("--guided", choices=["off", "on", "both"], default="off",
                    help="every request under a JSON-schema grammar (on), or free then under it (both)")
    ap.add_argument("--schema", default=None, help="JSON schema file for --guided (default: SCHEMA)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (--guided with a shape:NAME model)")
    ap.add_argument("--lora-rank", type=POSITIVE, default=None,
                    help="serve LoRA adapters of this rank; each batch runs without and with them")
    ap.add_argument("--loras", type=POSITIVE, default=1, help="with --lora-rank: adapters spread over a batch")
    ap.add_argument("--output", default=None)
    a = ap.parse_args(argv)
    schema: dict | None = None
    if a.guided != "off":
        if a.schema:
            with open(a.schema) as f:
                schema = json.load(f)
        else:
            schema = SCHEMA
    schemas: list[dict | None] = [None] if a.guided in ("off", "both") else []
    if schema is not None:
        schemas.append(schema)
    from phalanx import LLM
    from phalanx.bench.shapes import resolve_model_arg, resolve_spec_shape
    from phalanx.config import merge_yaml
    model, dummy = resolve_model_arg(a.model)
    report: dict[str, Any] = {"settings": vars(a), "bandwidth": measure_bandwidth(), "runs": []}
    modes = {"on": [True], "off": [False], "both": [True, False]}[a.overlap]
    for overlap in modes:
        kwargs: dict[str, Any] = {
            "load_format": "dummy" if dummy else "auto", "skip_tokenizer_init": schema is None, "dtype": a.dtype,
            "tokenizer": a.tokenizer,
            "disable_overlap_scheduler": not overlap,
            "max_batch_size": max(a.batch), "orchestrator_type": a.orchestrator, "tensor_parallel_size": a.tp,
            "max_seq_len": a.prompt_len + a.steps + 64, "cuda_graph_config": {"batch_sizes": sorted(set(a.batch))}}
        if a.lora_rank:
            kwargs["lora_config"] = {"max_loras": a.loras, "max_lora_rank": a.lora_rank}
        if a.config:
            kwargs = resolve_spec_shape(merge_yaml(kwargs, a.config))
        t0 = time.perf_counter()
        llm = LLM(model, **kwargs)
        startup = time.perf_counter() - t0
        adapter_sets: list[list[Any] | None] = [None]
        if a.lora_rank:
            import tempfile

            from phalanx import LoRARequest
            root = tempfile.mkdtemp(prefix="phalanx-bench-lora-")
            adapters = []
            for i in range(a.loras):
                write_random_adapter(f"{root}/{i}", llm.source.config, a.lora_rank, seed=i)
                adapters.append(LoRARequest(f"bench{i}", i + 1, f"{root}/{i}"))
            adapter_sets.append(adapters)
        try:
            for b, sch, loras in itertools.product(a.batch, schemas, adapter_sets):
                res = run_batch(llm, b, a.prompt_len, a.steps, sch, loras)
                res.update({"overlap": overlap, "startup_s": startup, "engine_startup": llm.engine_info.startup})
                wb = weight_bytes(llm)
                if b == 1 and wb and report["bandwidth"] and res["decode_tok_s"]:
                    bw = report["bandwidth"]
                    res["weight_bytes_per_step"] = wb
                    res["roofline_tok_s_read"] = bw["read_tb_s"] * 1e12 / wb
                    res["roofline_tok_s_copy"] = bw["copy_tb_s"] * 1e12 / wb
                    res["fraction_of_roofline_read"] = res["decode_tok_s"] / res["roofline_tok_s_read"]
                    res["fraction_of_roofline_copy"] = res["decode_tok_s"] / res["roofline_tok_s_copy"]
                report["runs"].append(res)
                g = res["gpu"] or {}
                grammar = (f"  grammar: fill {res['grammar_fill_us_per_step'] or 0:.0f} us/step, "
                           f"accept {res['grammar_accept_us_per_step'] or 0:.0f} us/step, "
                           f"{res['complete_json']}/{b} complete JSON" if sch is not None else "")
                print(f"overlap={'on ' if overlap else 'off'} adapters {len(loras or [])} batch {b:4d}: "
                      f"ITL p50 {res['itl_ms']['median']:7.3f} ms  "
                      f"{res['decode_tok_s'] or 0:9.1f} tok/s  GPU idle {g.get('idle_fraction', float('nan')):.3%}"
                      + grammar + "\n    host ms/step: "
                      + " ".join(f"{k} {v:.3f}" for k, v in (g.get("host_ms_per_step") or {}).items()), flush=True)
        finally:
            llm.shutdown()
    emit_report(report, a.output, echo=False)
    return 0
