"""Many-row products (a prompt step's projections): bf16 against the FP8 forms, for the
projections of a Llama-3.1-8B layer at prompt-step sizes. TFLOP/s per form, CUDA-graph timing
(a prompt step's GEMMs are compute-bound: weight copies only keep L2 from flattering the small
sizes).

Forms:
- ``bf16``: ``F.linear`` (cuBLAS);
- ``bf16_lt``: ``torch.addmm`` with a zero bias, which torch hands to cuBLASLt with a bias
  epilogue (its own heuristics' pick);
- ``bf16_cublaslt``: ``F.linear`` with torch's preferred BLAS library set to cuBLASLt;
- ``bf16_halves``: ``F.linear``'s GEMM on each half of the rows (two calls, the weight read twice);
- ``fp8``: what ``fp8.linear`` ships — the Triton per-token quantization of x, then
  ``torch._scaled_mm`` with a scale per row of x and per column of W (with fast accumulation
  since ``fp8.FAST_ACCUM``; docs/results/gpu19_gemm.txt was measured before, with the promotion);
- ``fp8_mm``: that ``_scaled_mm`` alone (x quantized outside the timing), the sums promoted to
  float32 every few K steps (``use_fast_accum=False``);
- ``fp8_fast``: the same with ``use_fast_accum=True`` (Hopper's FP8 accumulation without the
  periodic promotion; ``fp8`` less ``fp8_fast`` is now what the quantization costs);
- ``fp8_tensor``: one scale for x and one for W (cuBLASLt's plain FP8 GEMM, the fastest form
  cuBLASLt has; not what per-channel weights can use as it is);
- ``cutlass``: CUTLASS's FP8 GEMM with the same scales and fast accumulation
  (kernels/cutlass_gemm.py), x quantized outside the timing as for ``fp8_fast``: one form per tile
  (``cutlass_<tile>``), built first where not on disk;
- ``cutlass_bf16``: CUTLASS's bf16 GEMM, one form per bf16 tile (the candidates the tuner times
  against ``bf16`` for a bf16 weight's many-row buckets).

With ``--check`` each FP8 form's error against the float32 product of the same FP8 values is
printed (relative Frobenius norm).

    python tools/bench_gemm.py [--rows 512 2048 8192] [--forms bf16 fp8 fp8_mm fp8_fast cutlass] [--check]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from phalanx.kernels import cutlass_gemm, fp8
from phalanx.kernels.gemv_tuner import time_graph, weight_copies

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (49152, 4096)}   # the output layer over the bundled tokenizer's vocabulary
FORMS = ("bf16", "bf16_lt", "bf16_cublaslt", "bf16_halves", "fp8", "fp8_mm", "fp8_fast", "fp8_tensor", "cutlass",
         "cutlass_bf16")
CUTLASS = {f"cutlass_{t.name}": t for t in cutlass_gemm.TILES + cutlass_gemm.TILES_BF16}


def _form(name: str, x: torch.Tensor, ws: list[torch.Tensor], qs: list[torch.Tensor],
          scale: torch.Tensor) -> Callable[[int], object]:
    xq, xs, _ = fp8.quantize_rows(x)
    one = torch.ones((), device=x.device)
    if name == "bf16":
        return lambda i: F.linear(x, ws[i])
    if name == "bf16_lt":
        zero = torch.zeros(ws[0].shape[0], device=x.device, dtype=x.dtype)
        return lambda i: torch.addmm(zero, x, ws[i].t())
    if name == "bf16_cublaslt":
        def lt(i: int) -> torch.Tensor:
            before = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                return F.linear(x, ws[i])
            finally:
                torch.backends.cuda.preferred_blas_library(before)
        return lt
    if name == "bf16_halves":
        out = torch.empty(x.shape[0], ws[0].shape[0], device=x.device, dtype=x.dtype)
        h = x.shape[0] // 2

        def halves(i: int) -> torch.Tensor:
            torch.mm(x[:h], ws[i].t(), out=out[:h])
            torch.mm(x[h:], ws[i].t(), out=out[h:])
            return out
        return halves
    if name == "fp8":
        return lambda i: fp8.linear(x, qs[i], None, scale)
    if name == "fp8_mm":
        return lambda i: torch._scaled_mm(xq, qs[i].t(), scale_a=xs, scale_b=scale[None, :], out_dtype=x.dtype)
    if name == "fp8_fast":
        return lambda i: torch._scaled_mm(xq, qs[i].t(), scale_a=xs, scale_b=scale[None, :], out_dtype=x.dtype,
                                          use_fast_accum=True)
    if name == "fp8_tensor":
        return lambda i: torch._scaled_mm(xq, qs[i].t(), scale_a=one, scale_b=one, out_dtype=x.dtype,
                                          use_fast_accum=True)
    if name in CUTLASS and CUTLASS[name].dtype == "bf16":
        run = cutlass_gemm.kernel(CUTLASS[name])
        return lambda i: run(x, None, ws[i], None)
    if name in CUTLASS:
        run = cutlass_gemm.kernel(CUTLASS[name])
        return lambda i: run(xq, xs, qs[i], scale)
    raise ValueError(name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--check", action="store_true", help="each FP8 form's error against float32")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    fp8.check_device(dev, "bench")
    for form, tiles in (("cutlass", cutlass_gemm.TILES), ("cutlass_bf16", cutlass_gemm.TILES_BF16)):
        if form in a.forms:
            why = cutlass_gemm.why_unavailable(dev)
            if why:
                raise SystemExit(f"cutlass: {why}")
            loaded = cutlass_gemm.load_all(tiles)     # the tiles that built and loaded (each failure logged)
            a.forms = [f for f in a.forms if f != form] + [f"cutlass_{k.tile.name}" for k in loaded]
    rows_out = []
    for shape in a.shapes:
        N, K = SHAPES[shape]
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5
        q, scale = fp8.quantize_weight(w)
        ws = weight_copies(w)
        qs = [q] + [fp8.quantize_weight(c)[0] for c in ws[1:]]
        for M in a.rows:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            line = {"shape": shape, "N": N, "K": K, "rows": M}
            for name in a.forms:
                ms = time_graph(_form(name, x, ws, qs, scale), len(ws), reps=8)
                line[name] = {"us": ms * 1e3, "tflops": 2 * M * N * K / (ms * 1e-3) / 1e12}
                if a.check and not (name.startswith("bf16") or "_bf16_" in name):
                    xq, xs, _ = fp8.quantize_rows(x)
                    exact = (xq.float() * xs) @ (q.float() * scale[:, None]).t()
                    y = _form(name, x, [w], [q], scale)(0).float()
                    if name == "fp8_tensor":
                        y = y * xs * scale[None, :]
                    line[name]["rel_err"] = float((y - exact).norm() / exact.norm())
            rows_out.append(line)
            print(f"{shape:8s} {N:6d}x{K:<6d} rows {M:5d}  " + "  ".join(
                f"{n.replace('cutlass_', 'c_')} {line[n]['us']:8.1f} us {line[n]['tflops']:6.0f} TF"
                + (f" err {line[n]['rel_err']:.1e}" if "rel_err" in line[n] else "") for n in a.forms), flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out}, f,
                      indent=1)


if __name__ == "__main__":
    main()
