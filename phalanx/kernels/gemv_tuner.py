"""The GEMV tuner: picks each projection's plan by timing, once, when the engine is built.

Which plan is fastest — a tile, launched with or without programmatic dependent launch, or
cuBLAS — depends on the weight's shape, on the kernel in front of it (timed with it: the norm
kernel in front, the SiLU fused or its own kernel) and on the GPU. So every candidate is timed
per (shape, dtype, neighbour) at each row bucket's upper bound (a bucket of many rows up to
``SAMPLED_UP_TO`` at four row counts spread over it: ``many_bucket_samples``), replaying a CUDA graph over
several copies of the weight (together larger than L2, so weights are read from memory as in a
real step). Results are memoised per process by (shape, dtype, neighbour, device), so layers of
one shape are tuned once; the memo is consulted only here, never while the engine runs.

The one-token MLP path (gate ‖ up with SiLU as its epilogue, then down on the ready input) is
chosen per (gate ‖ up, down) pair by timing both chains as they run in a step — the norm, gate ‖
up and down with SiLU in front, against the norm, the fused kernel and down — because configs
that tie when timed alone differ by several percent in a step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator

import torch

from phalanx.kernels import cutlass_gemm, fp8_block_gemm, gemv, pdl, triton_ops
from phalanx.kernels import fp8 as f8
from phalanx.kernels.linear_plan import (
    BLOCK_GEMM,
    CUBLAS,
    CUBLAS_BLOCK,
    MANY_ROW_BUCKETS,
    ROW_BUCKETS,
    GateUpSiluPlan,
    LinearPlan,
    Neighbour,
    OneRowTile,
    Plan,
    QkvRopePlan,
    RowsTile,
    launcher,
)

L2_BYTES = 256 << 20
_MEMO: dict[tuple, tuple[Plan, float]] = {}   # (N, K, dtype, neighbour, rows, device) -> (plan, ms)
_PAIR_MEMO: dict[tuple, GateUpSiluPlan | None] = {}
_MANY_MEMO: dict[tuple, tuple[Plan, float]] = {}   # (N, K, "fp8"/"bf16", bucket bound, device) -> (plan, ms)
logger = logging.getLogger("phalanx")


def time_graph(fn: Callable[[int], object], copies: int, reps: int = 24) -> float:
    """Milliseconds per call of fn(i) (i picks one of ``copies`` weight copies), replayed from a
    CUDA graph as decode runs, so launch overhead does not hide the kernel's own speed."""
    for i in range(3):
        fn(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i % copies)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * reps)


def time_eager(fn: Callable[[], object], reps: int = 8, warmup: int = 3) -> float:
    """Milliseconds per call of fn launched eagerly (after ``warmup`` calls), for work whose
    launches take far less than its kernels, or that a graph cannot capture."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def weight_copies(w: torch.Tensor, l2_bytes: int = L2_BYTES) -> list[torch.Tensor]:
    """w and random copies of it, together larger than L2: timing reads them from memory."""
    nbytes = w.numel() * w.element_size()
    def copy() -> torch.Tensor:   # FP8 has no random generator of its own
        return torch.randn_like(w) if w.element_size() > 1 else torch.randn_like(w, dtype=torch.bfloat16).to(w.dtype)
    return [w] + [copy() for _ in range(min(31, -(-l2_bytes // nbytes) - 1))]


def candidates(neighbour: Neighbour, x: torch.Tensor, r: torch.Tensor, g: torch.Tensor,
               ws: list[torch.Tensor], scale: torch.Tensor | None = None,
               block: f8.Block | None = None) -> Iterator[tuple[Plan, Callable[[int], object]]]:
    """Each Plan for a projection behind ``neighbour``, as fn(i) over the weight copies, the
    neighbour included. One row: every tile with and without PDL; more: every tile whole and
    split over K, with PDL where the GPU has it (fewer compiles at start-up). ``scale``: the
    weights are FP8 (their launches take it), scaled per ``block`` where given (whose GEMM, the
    block GEMM's default tile, stands where cuBLAS does); with more rows the Triton FP8 GEMM's
    narrow tiles (kernels/fp8_block_gemm.py) are tried too."""
    if x.shape[0] == 1:
        launches = (False, True) if pdl.enabled(x) else (False,)
        tiles = gemv.ONE_ROW_TILES if scale is None else gemv.ONE_ROW_TILES_FP8
        plans = [Plan("gemv", t, p) for t in tiles for p in launches]
    else:
        N, K = ws[0].shape
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        plans = [Plan("gemv", RowsTile(*t[:4], k), pdl.enabled(x)) for t in gemv.ROWS_TILES
                 for k in sorted({1, gemv.auto_splits(N, K, t, sms)})]
        if neighbour is Neighbour.SILU:
            plans = []   # with more rows every column tile recomputes SiLU over [rows, K]: far slower
        if scale is not None:   # the FP8 GEMM's narrow tiles, whole and split over K
            plans = [Plan("triton", t._replace(splits=k)) for t in fp8_block_gemm.FEW_ROW_TILES
                     for k in sorted({1, fp8_block_gemm.auto_splits(x.shape[0], N, K, t, block, sms)})] + plans
        if f8.block_scaled_mm_fits(ws[0], block):
            plans.append(CUBLAS_BLOCK)
    if neighbour is Neighbour.NORM:
        def front() -> torch.Tensor:
            return triton_ops.fused_add_rms_norm(x, r, g, 1e-6)[0]
    else:
        def front() -> torch.Tensor:
            return x
    for plan in [CUBLAS if block is None else BLOCK_GEMM, *plans]:
        yield plan, functools.partial(_timed_call, launcher(plan, neighbour, scale is not None, block), front, ws,
                                      scale)


def _timed_call(run: Callable[..., torch.Tensor], front: Callable[[], torch.Tensor], ws: list[torch.Tensor],
                scale: torch.Tensor | None, i: int) -> torch.Tensor:
    return run(front(), ws[i]) if scale is None else run(front(), ws[i], None, scale)


def tune_one(w: torch.Tensor, neighbour: Neighbour, rows: int, l2_bytes: int = L2_BYTES,
             fp8: bool = False, act_dtype: torch.dtype | None = None,
             block: f8.Block | None = None) -> tuple[Plan, float]:
    """The fastest Plan for one weight shape behind ``neighbour`` at ``rows`` rows, and its time.
    ``fp8``: w is FP8 (scaled per output channel, or per ``block``); ``act_dtype``: the
    activations' dtype (the weight's by default)."""
    act = act_dtype or w.dtype
    key = (*w.shape, w.dtype, act, neighbour, rows, str(w.device), block)
    if key in _MEMO:
        return _MEMO[key]
    ws = weight_copies(w, l2_bytes)
    N, K = w.shape
    x = torch.randn(rows, 2 * K if neighbour is Neighbour.SILU else K, dtype=act, device=w.device)
    r = torch.randn(rows, K, dtype=act, device=w.device)
    g = torch.ones(K, dtype=act, device=w.device)
    scale = _timing_scale(N, K, fp8, block, w.device)
    best, best_ms = CUBLAS if block is None else BLOCK_GEMM, float("inf")
    for plan, fn in candidates(neighbour, x, r, g, ws, scale, block):
        try:
            ms = time_graph(fn, len(ws))
        except Exception:  # a config the compiler rejects on this GPU
            continue
        if ms < best_ms:
            best, best_ms = plan, ms
    _MEMO[key] = (best, best_ms)
    return best, best_ms


def _timing_scale(N: int, K: int, fp8: bool, block: f8.Block | None, device: torch.device) -> torch.Tensor | None:
    """Scales to time an FP8 weight's candidates with: one a row, or one a ``block``."""
    if not fp8:
        return None
    shape = (N,) if block is None else (-(-N // block[0]), -(-K // block[1]))
    return torch.full(shape, 1e-3, device=device)


def tune_linear(w: torch.Tensor, neighbour: Neighbour, report: dict[str, float] | None = None,
                fp8: bool = False, act_dtype: torch.dtype | None = None,
                block: f8.Block | None = None) -> LinearPlan:
    """The plan of one projection: the fastest Plan at each row bucket, and for FP8 and bf16
    weights at each bucket of many rows (``tune_many``). ``report`` collects the bandwidth each skinny plan
    reaches (GB/s of weight) and the TFLOP/s of each many-row plan, for the log. ``fp8``: the
    weight is FP8 (scaled per ``block`` where given), the activations ``act_dtype``."""
    plans = []
    for rows in ROW_BUCKETS:
        plan, ms = tune_one(w, neighbour, rows, fp8=fp8, act_dtype=act_dtype, block=block)
        plans.append(plan)
        if report is not None:
            report[f"{w.shape[0]}x{w.shape[1]}/{neighbour.value}/rows={rows}:{plan}"] = \
                w.numel() * w.element_size() / ms / 1e6
    many = tune_many(w, act_dtype or w.dtype, report, fp8=fp8, block=block)
    return LinearPlan(neighbour, tuple(plans), fp8, many, block=block)


def tune_many(w: torch.Tensor, act_dtype: torch.dtype, report: dict[str, float] | None = None,
              l2_bytes: int = L2_BYTES, fp8: bool = True, block: f8.Block | None = None) -> tuple[Plan, ...]:
    """At each bucket of many rows (MANY_ROW_BUCKETS, at the rows ``many_bucket_samples`` gives):
    cuBLAS or the CUTLASS tile that multiplies the same rows faster. For an FP8 weight (``fp8``)
    that is cuBLASLt's FP8 GEMM against the FP8 tiles on the same quantized rows (the row
    quantization in front is the same for both, so only the GEMM is timed); for a bf16 weight
    F.linear against the bf16 tiles; for an FP8 weight scaled per ``block``, the block GEMM's
    tiles (``fp8_block_gemm.TILES``) and cuBLASLt's block-scaled GEMM where it takes the weight. cuBLAS
    everywhere for other weights, where CUTLASS does not run here (kernels/cutlass_gemm.py
    ``why_unavailable``), or where its build failed (logged once)."""
    dtype = "fp8" if fp8 else "bf16"
    N, K = w.shape
    gemms: list[tuple[Plan, Callable[..., torch.Tensor]]]
    if block is not None:
        if not f8.takes_fp8_rows(w, act_dtype, block):
            return (BLOCK_GEMM,) * len(MANY_ROW_BUCKETS)
        dtype = f"fp8 {block[0]}x{block[1]}"
        gemms = [(Plan("triton", t), fp8_block_gemm.rows_gemm(t, block)) for t in fp8_block_gemm.TILES]
        if f8.block_scaled_mm_fits(w, block):
            gemms.append((CUBLAS_BLOCK, f8.block_scaled_mm))
    else:
        usable = f8.takes_fp8_rows(w, act_dtype) if fp8 else (w.dtype == act_dtype == torch.bfloat16
                                                               and cutlass_gemm.fits(*w.shape))
        tiles = _cutlass_kernels(w.device, dtype) if usable else ()
        if not tiles:
            return (CUBLAS,) * len(MANY_ROW_BUCKETS)
        gemms = [(CUBLAS, f8.scaled_mm if fp8 else _linear)]
        gemms += [(Plan("cutlass", k.tile), k) for k in tiles]
    ws: list[torch.Tensor] = []
    scale = _timing_scale(N, K, fp8, block, w.device)
    plans = []
    for i, bound in enumerate(MANY_ROW_BUCKETS):
        key = (N, K, dtype, bound, str(w.device))
        points = many_bucket_samples(i)
        if key not in _MANY_MEMO:
            ws = ws or weight_copies(w, l2_bytes)
            inputs = []
            for rows in points:
                x = torch.randn(rows, K, dtype=act_dtype, device=w.device)
                inputs.append(f8.quantize_rows(x)[:2] if fp8 else (x, None))
            best, best_ms = gemms[0][0], float("inf")
            for plan, gemm in gemms:
                try:
                    ms = sum(time_graph(functools.partial(_rows_gemm, gemm, a, a_scale, ws, scale), len(ws), reps=8)
                             for a, a_scale in inputs)
                except Exception:   # a tile CUTLASS cannot run for this shape, or Triton cannot compile here
                    continue
                if ms < best_ms:
                    best, best_ms = plan, ms
            _MANY_MEMO[key] = (best, best_ms)
        plan, ms = _MANY_MEMO[key]
        plans.append(plan)
        if report is not None:
            report[f"{N}x{K}/{dtype}/rows={bound}:{plan} TFLOP/s"] = 2 * sum(points) * N * K / ms / 1e9
    return tuple(plans)


def many_bucket_samples(i: int) -> tuple[int, ...]:
    """The row counts at which the candidates of many-row bucket ``i`` are timed (their times
    summed): four spread over a bucket of up to SAMPLED_UP_TO rows (multiples of 8, the bound
    last), the bound alone above. cuBLAS picks its kernel per row count, and one pick inside a
    bucket can be far off those around it: bf16 gate ‖ up (28,672 × 4,096) on an H200 takes 155 µs
    at 512 rows and 268 µs at 448 (docs/results/gpu27_gemm_forms.txt), so timing at the bound
    alone would keep it for the ~445-row decode steps of 512 in flight."""
    bound = MANY_ROW_BUCKETS[i]
    if bound > SAMPLED_UP_TO:
        return (bound,)
    lo = MANY_ROW_BUCKETS[i - 1] if i else ROW_BUCKETS[-1]
    return tuple(-(-(lo + (bound - lo) * j // 4) // 8) * 8 for j in range(1, 5))


SAMPLED_UP_TO = 1024   # many-row buckets up to this bound are timed at four row counts each


def _linear(x: torch.Tensor, x_scale: None, w: torch.Tensor, w_scale: None) -> torch.Tensor:
    """F.linear in the form of a CUTLASS kernel's call (the bf16 candidates' cuBLAS)."""
    return torch.nn.functional.linear(x, w)


def _rows_gemm(gemm: Callable[..., torch.Tensor], a: torch.Tensor, a_scale: torch.Tensor | None,
               ws: list[torch.Tensor], scale: torch.Tensor | None, i: int) -> torch.Tensor:
    return gemm(a, a_scale, ws[i], scale)


@functools.cache
def _cutlass_kernels(device: torch.device, dtype: str) -> tuple[cutlass_gemm.Kernel, ...]:
    """The CUTLASS tiles of ``dtype`` ("fp8" or "bf16") built and loaded for ``device`` (none where
    CUTLASS is unavailable): only the tiles a model's weights take are built."""
    why = cutlass_gemm.why_unavailable(device)
    if why is not None:
        logger.info("%s GEMMs of many rows take cuBLAS only (CUTLASS: %s)", dtype, why)
        return ()
    try:
        return cutlass_gemm.load_all(cutlass_gemm.TILES if dtype == "fp8" else cutlass_gemm.TILES_BF16)
    except Exception as e:  # noqa: BLE001 - CUTLASS is a choice, never a reason for the engine not to start
        logger.warning("%s GEMMs of many rows take cuBLAS only (CUTLASS: %s)", dtype, e)
        return ()


def qkv_rope_plan(qkv: LinearPlan, head_dim: int) -> QkvRopePlan | None:
    """The one-token q/k/v + rotary + K/V write kernel, where the q/k/v projection's one-row plan
    is the skinny kernel with a tile that holds whole rotary pairs of a head."""
    one = qkv.one_row()
    if one.kernel != "gemv" or not isinstance(one.tile, OneRowTile) or not QkvRopePlan.fits(one.tile, head_dim):
        return None
    return QkvRopePlan(one.tile, one.pdl, qkv.block)


def gate_up_silu_plan(gu: torch.Tensor, gu_plan: LinearPlan, down: torch.Tensor, down_plan: LinearPlan,
                      report: dict[str, float] | None = None, l2_bytes: int = L2_BYTES,
                      scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                      act_dtype: torch.dtype | None = None) -> GateUpSiluPlan | None:
    """For one token: the fused gate ‖ up + SiLU path where it measured faster than the two
    projections apart (each as tuned), with the gate ‖ up tile that won; None otherwise (and
    where one weight is scaled per block and the other is not). ``scales``: both weights are
    FP8 (their scales per row, or per their plans' block), the activations ``act_dtype``."""
    act = act_dtype or gu.dtype
    block = gu_plan.block
    if block != down_plan.block:
        return None
    key = (*gu.shape, *down.shape, gu.dtype, act, str(gu.device), block)
    if key in _PAIR_MEMO:
        return _PAIR_MEMO[key]
    s_gu, s_down = scales
    fp8 = s_gu is not None and s_down is not None
    down_ready, _ = tune_one(down, Neighbour.PLAIN, 1, l2_bytes, fp8=fp8, act_dtype=act, block=block)
    gus, downs = weight_copies(gu, l2_bytes), weight_copies(down, l2_bytes)
    n = max(len(gus), len(downs))
    K = gu.shape[1]
    x, r = (torch.randn(1, K, dtype=act, device=gu.device) for _ in range(2))
    g = torch.ones(K, dtype=act, device=gu.device)

    def norm() -> torch.Tensor:
        return triton_ops.fused_add_rms_norm(x, r, g, 1e-6)[0]

    def apart(i: int) -> None:
        down_plan(gu_plan(norm(), gus[i % len(gus)], None, s_gu), downs[i % len(downs)], None, s_down)

    best, best_ms = None, time_graph(apart, n)
    for tile in [t for t in (gemv.ONE_ROW_TILES_FP8 if fp8 else gemv.ONE_ROW_TILES) if t.block_n % 2 == 0]:
        for use_pdl in (False, True) if pdl.enabled(x) else (False,):
            plan = GateUpSiluPlan(tile, use_pdl, down_ready, fp8, block)

            def fused(i: int, plan: GateUpSiluPlan = plan) -> None:
                plan.down_proj(plan.gate_up_silu(norm(), gus[i % len(gus)], None, s_gu), downs[i % len(downs)],
                               s_down)
            try:
                ms = time_graph(fused, n)
            except Exception:  # a config the compiler rejects on this GPU
                continue
            if ms < best_ms:
                best, best_ms = plan, ms
    _PAIR_MEMO[key] = best
    if report is not None:
        nbytes = (gu.numel() + down.numel()) * gu.element_size()
        name = str(Plan("gemv", best.tile, best.pdl)) if best else "apart"
        report[f"{gu.shape[0]}x{gu.shape[1]}+{down.shape[0]}x{down.shape[1]}/mlp/rows=1:{name}"] = \
            nbytes / best_ms / 1e6
    return best

