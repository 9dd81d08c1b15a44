"""What each kind of short kernel costs a decode step (batch 1 by default) where it runs: the
step timed as served (in-process engine, CUDA graphs, overlap scheduler), then again with the
decode attention (or only its merge kernel), the RMSNorm kernels, or both left out of the
forward (their callers get their input back, so the graph holds every other kernel as before
and the tokens are garbage). The difference is what those kernels cost on the critical path,
PDL hand-overs included, which timing them alone cannot tell; without both, what is left is
the bound of the projections, the output layer and the rest as they are. ``splits=N`` runs the
decode attention over N key slices instead.

Each variant runs in a process of its own (the kernels are captured at start-up):

    python tools/ablate_decode.py --skip none attention norms attention+norms --config tools/gpu_fp8.yaml
    python tools/ablate_decode.py --skip none splits=2 splits=32 --prompt-len 1024
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch


def skip(what: set[str]) -> None:
    """Leave the named kernels out of every forward from here on (``splits=N``: decode attention
    over N key slices instead of ``num_splits``'s choice, a what-if rather than a removal)."""
    from phalanx.kernels import ops, triton_attention
    for w in what:
        if w.startswith("splits="):
            n = int(w.split("=")[1])
            triton_attention.num_splits = lambda *args, n=n, **kwargs: n
    if "merge" in what:
        class NoLaunch:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: None
        triton_attention._decode_merge_kernel = NoLaunch()
    if "attention" in what:
        def no_attention(q, k_cache, v_cache, meta, scale, window=None, kv_of_q=None, out=None, kv_scale=None):
            return q if out is None else out
        ops.paged_attention = no_attention
    if "norms" in what:
        ops.rms_norm = lambda x, weight, eps: x
        ops.fused_add_rms_norm = lambda x, residual, weight, eps: (x, residual)


def check(variant: str, batch: int) -> None:
    """Refuse a variant this tool cannot run as asked, naming the part and the limit."""
    from phalanx.kernels.linear_plan import ROW_BUCKETS
    from phalanx.kernels.triton_attention import MAX_SPLITS
    parts = variant.split("+")
    bad = {w for w in parts if not w.startswith("splits=")} - {"none", "attention", "norms", "merge"}
    if bad:
        raise SystemExit(f"--skip: unknown {sorted(bad)} in {variant!r} (attention, norms, merge, splits=N)")
    for w in parts:
        n = w.removeprefix("splits=")
        if w.startswith("splits=") and not (n.isdigit() and 0 < int(n) <= MAX_SPLITS and not int(n) & (int(n) - 1)):
            raise SystemExit(f"--skip {w}: N must be a power of two from 1 to {MAX_SPLITS} (the compiled forms)")
    if "norms" in parts and batch > ROW_BUCKETS[-1]:
        raise SystemExit(f"--skip norms: up to --batch {ROW_BUCKETS[-1]} (got {batch}); above that an FP8 model's "
                         "norms also quantize the rows (ops.rms_norm_fp8), which this tool does not leave out")


def one(variant: str, config: str | None, prompt_len: int, steps: int, batch: int) -> dict:
    from phalanx import LLM
    from phalanx.bench.decode import measure_bandwidth, run_batch, weight_bytes
    from phalanx.bench.shapes import resolve_model_arg
    from phalanx.config import merge_yaml
    skip(set(variant.split("+")) - {"none"})
    model, _ = resolve_model_arg("shape:llama-3.1-8b")
    kwargs: dict = {"load_format": "dummy", "skip_tokenizer_init": True, "max_batch_size": batch,
                    "orchestrator_type": "inprocess", "max_seq_len": prompt_len + steps + 64,
                    "cuda_graph_config": {"batch_sizes": [batch]}}
    if config:
        kwargs = merge_yaml(kwargs, config)
    bw = measure_bandwidth()
    llm = LLM(model, **kwargs)
    try:
        res = run_batch(llm, batch, prompt_len, steps)
        wb = weight_bytes(llm)
    finally:
        llm.shutdown()
    roof = bw["copy_tb_s"] * 1e12 / wb if wb else None
    return {"variant": variant, "batch": batch, "decode_tok_s": res["decode_tok_s"],
            "itl_ms_p50": res["itl_ms"]["median"],
            "weight_bytes_per_step": wb, "copy_tb_s": bw["copy_tb_s"], "roofline_tok_s_copy": roof,
            "fraction_of_roofline_copy": res["decode_tok_s"] / roof if roof and res["decode_tok_s"] and batch == 1
            else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", nargs="+", default=["none", "attention", "norms", "attention+norms"],
                    help="variants: none, or kernels to leave out joined by '+' (attention, norms, the attention's "
                         "merge; splits=N: decode attention over N key slices)")
    ap.add_argument("--config", default=None, help="YAML of extra LLM arguments (tools/gpu_fp8.yaml: FP8 weights)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together (the roofline is batch 1's)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(one(a.child, a.config, a.prompt_len, a.steps, a.batch)))
        return
    for variant in a.skip:
        check(variant, a.batch)
    if not torch.cuda.is_available():
        raise SystemExit("ablate_decode needs a GPU")
    rows = []
    for variant in a.skip:
        cmd = [sys.executable, __file__, "--child", variant, "--prompt-len", str(a.prompt_len), "--steps", str(a.steps),
               "--batch", str(a.batch)]
        if a.config:
            cmd += ["--config", a.config]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"variant {variant} failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{variant:18s} {row['decode_tok_s']:8.1f} tok/s  ITL p50 {row['itl_ms_p50']:.3f} ms  "
              f"{row['fraction_of_roofline_copy'] or 0:.1%} of the copy roofline ({row['copy_tb_s']:.2f} TB/s)",
              flush=True)
    base = rows[0]["itl_ms_p50"]
    for row in rows[1:]:
        print(f"  {row['variant']}: {(base - row['itl_ms_p50']) * 1e3:.0f} us a step less than {rows[0]['variant']}")
    if a.output:
        with open(a.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
