"""One decoder layer's four one-row FP8 products streamed by the engine's kernels, and by one
persistent kernel that waits on a counter between them.

At batch 1 with FP8 weights the products alone come to 88 % of the copy roofline (thirty-sixth
round): q/k/v and o read at 2.7–3.1 TB/s because each kernel's ramp and tail weigh on 6–8 µs of
work, and each hand-over between kernels costs ~1.9 µs (``bench_handover``). One persistent
kernel per layer keeps the weights streaming across the products: every program walks its
share of each product's row tiles with the loads pipelined, counts itself in when its share is
stored, and spins until all have before it reads the product's output (``bench_handover._product``). This measures that
stream against the engine's kernels before anything of the kind goes into the engine.

A layer here is its products only (Llama-3.1-8B's by default): x -> q/k/v [6,144 x 4,096] -> o
[4,096 x 4,096] over the q part (where the attention would be) -> gate ‖ up [28,672 x 4,096] with
silu(gate) * up as its epilogue -> down [4,096 x 14,336] -> the next layer's x. No norms, no
residual, no attention: the weights' stream and its hand-overs are what is timed. The ``mlp``
part is gate ‖ up and down alone (176 MB a layer), the pair the engine runs as two kernels
(``GateUpSiluPlan``) and the first place one persistent kernel could go. L layers are chained
(each its own weights, larger than L2), from CUDA graphs:

- ``kernels``: the engine's one-row kernels as the tuner picks them for these shapes (q/k/v and
  o with ``gemv_tuner.tune_one``, the MLP with ``gemv_tuner.gate_up_silu_plan``), PDL as tuned;
- ``persistent``: one launch of ``_layers_kernel``, G programs (1 or 2 an SM; their registers
  capped so that all are resident, and a form whose shared memory does not fit is refused);
  each product's row tiles are [BLOCK_N, all of K] with x held in registers, program p taking
  tiles p, p + G, ... in a loop whose loads are pipelined ``--stages`` deep; ``prefetch``: a
  program loads the first weight tile of the next product after counting itself in and before
  its wait, so the stream does not stop at the hand-over.

Time per layer is the slope of each form's time over L; against the layer's bytes at the read
bandwidth of the same run (a sum over 2 GiB) it gives each form's share of the copy rate. The
outputs are checked against the float32 chain of the dequantized weights.

    python tools/bench_layer_stream.py [--parts layer mlp] [--layers 1 2 4] [--programs-per-sm 1 2]
                                       [--tile-kb 16 32] [--warps 4 8] [--stages 3] [--output F]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bench_handover import _product, dump, fit_resident, read_bandwidth, slope
from phalanx.kernels import fp8 as f8
from phalanx.kernels.gemv_tuner import gate_up_silu_plan, time_graph, tune_one
from phalanx.kernels.linear_plan import CUBLAS, MANY_ROW_BUCKETS, ROW_BUCKETS, LinearPlan, Neighbour, Plan, launcher
from phalanx.kernels.reference import silu_and_mul_ref as silu_and_mul


class Shape(NamedTuple):
    hidden: int = 4096
    qkv: int = 6144
    inter: int = 14336


@triton.jit(do_not_specialize=["L", "G"])     # L = 1 runs the binary of every other L
def _layers_kernel(x_ptr, qkv_ptr, o_ptr, act_ptr, wq_ptr, sq_ptr, wo_ptr, so_ptr, wg_ptr, sg_ptr, wd_ptr, sd_ptr,
                   ctr_ptr, err_ptr, L, G, H: tl.constexpr, NQ: tl.constexpr, I: tl.constexpr,  # noqa: E741
                   KP_I: tl.constexpr, BN_H: tl.constexpr, BN_I: tl.constexpr, STAGES: tl.constexpr,
                   PREFETCH: tl.constexpr, MLP_ONLY: tl.constexpr):
    """L layers' products: x [L + 1, H] (x[l + 1] = layer l's output), qkv [L, NQ], o [L, H], act
    [L, I]; FP8 weights [L, N, K] with float32 scales [L, N]. BN_H: the row tile's rows of the
    products over K = H; BN_I: of down (K = I). MLP_ONLY: gate ‖ up takes x itself (no q/k/v, no o)."""
    pid = tl.program_id(0)
    for layer in range(L):
        l64 = tl.cast(layer, tl.int64)
        x_l = x_ptr + l64 * H
        q_l = qkv_ptr + l64 * NQ
        o_l = o_ptr + l64 * H
        a_l = act_ptr + l64 * I
        if MLP_ONLY:
            o_l = x_l
        else:
            _product(wq_ptr + l64 * NQ * H, sq_ptr + l64 * NQ, x_l, q_l, ctr_ptr, err_ptr, pid, G, NQ, H, H, BN_H,
                     False, STAGES, PREFETCH)
            _product(wo_ptr + l64 * H * H, so_ptr + l64 * H, q_l, o_l, ctr_ptr, err_ptr, pid, G, H, H, H, BN_H,
                     False, STAGES, PREFETCH)
        _product(wg_ptr + l64 * 2 * I * H, sg_ptr + l64 * 2 * I, o_l, a_l, ctr_ptr, err_ptr, pid, G, 2 * I, H, H,
                 BN_H, True, STAGES, PREFETCH)
        _product(wd_ptr + l64 * H * I, sd_ptr + l64 * H, a_l, x_l + H, ctr_ptr, err_ptr, pid, G, H, I, KP_I, BN_I,
                 False, STAGES, PREFETCH)


class Layers:
    """L layers' FP8 weights and scales (``w["q"]`` [L, NQ, H], ...), and their activations.
    ``mlp_only``: gate ‖ up and down alone, gate ‖ up on the layer's input."""

    def __init__(self, shape: Shape, L: int, device: torch.device, gen: torch.Generator | None = None,
                 mlp_only: bool = False) -> None:
        H, NQ, I = shape  # noqa: E741
        self.shape, self.L, self.mlp_only = shape, L, mlp_only
        self.w: dict[str, torch.Tensor] = {}
        self.s: dict[str, torch.Tensor] = {}
        products = {"q": (NQ, H), "o": (H, H), "gu": (2 * I, H), "d": (H, I)}
        for name, (n, k) in products.items():
            if mlp_only and name in ("q", "o"):
                continue
            qs, ss = zip(*(f8.quantize_weight(torch.randn(n, k, generator=gen, device=gen.device if gen else device)
                                              .to(device) * k ** -0.5)
                           for _ in range(L)), strict=True)
            self.w[name], self.s[name] = torch.stack(qs), torch.stack(ss)
        self.x = torch.zeros(L + 1, H, dtype=torch.bfloat16, device=device)
        self.qkv = torch.zeros(L, NQ, dtype=torch.bfloat16, device=device)
        self.o = torch.zeros(L, H, dtype=torch.bfloat16, device=device)
        self.act = torch.zeros(L, I, dtype=torch.bfloat16, device=device)

    @property
    def bytes_per_layer(self) -> int:
        return sum(w[0].numel() for w in self.w.values())

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 chain of the dequantized weights, rounded to bf16 where the kernels store,
        silu(gate) * up as the engine's reference computes it."""
        H, _, I = self.shape  # noqa: E741

        def mm(v: torch.Tensor, name: str, layer: int) -> torch.Tensor:
            w = self.w[name][layer].float() * self.s[name][layer][:, None].float()
            return (v.float() @ w.t()).to(torch.bfloat16)
        y = x.to(torch.bfloat16)
        for layer in range(self.L):
            o = y if self.mlp_only else mm(mm(y, "q", layer)[:H], "o", layer)
            gu = mm(o, "gu", layer)
            y = mm(silu_and_mul(gu), "d", layer)
        return y


class Tile(NamedTuple):
    programs: int
    bn_h: int           # rows of a tile over K = hidden
    bn_i: int           # rows of a tile over K = intermediate
    warps: int
    stages: int
    prefetch: bool

    def __str__(self) -> str:
        return (f"persistent G={self.programs} rows {self.bn_h}/{self.bn_i} warps {self.warps} stages {self.stages}"
                f"{' prefetch' if self.prefetch else ''}")


def rows_for(tile_bytes: int, K: int, least: int) -> int:
    """The power of two of rows whose [rows, K] FP8 tile is nearest ``tile_bytes`` from below (at least ``least``)."""
    rows = least
    while rows * 2 * K <= tile_bytes:
        rows *= 2
    return rows


class Persistent:
    """One launch of ``_layers_kernel`` over ``layers``: x (layers.x[0]) in, layers.x[L] out."""

    def __init__(self, layers: Layers, tile: Tile) -> None:
        H, NQ, I = layers.shape  # noqa: E741
        over_h = (2 * I,) if layers.mlp_only else (NQ, H, 2 * I)     # rows of the products over K = H
        if any(n % tile.bn_h for n in over_h) or H % tile.bn_i or tile.bn_h % 2:
            raise ValueError(f"rows {tile.bn_h}/{tile.bn_i} do not divide the products' rows {over_h} and {H}")
        if min(over_h) // tile.bn_h < tile.programs or H // tile.bn_i < tile.programs:
            raise ValueError(f"{tile.programs} programs: a product has fewer row tiles")
        self.layers, self.tile = layers, tile
        dev = layers.x.device
        self.ctr = torch.zeros(1, dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        ly = layers
        wq, sq, wo, so = (ly.w["gu"], ly.s["gu"]) * 2 if ly.mlp_only else (ly.w["q"], ly.s["q"], ly.w["o"], ly.s["o"])
        self.args = (ly.x, ly.qkv, ly.o, ly.act, wq, sq, wo, so, ly.w["gu"], ly.s["gu"], ly.w["d"], ly.s["d"],
                     self.ctr, self.err, ly.L, tile.programs)
        self.launch = {"H": H, "NQ": NQ, "I": I, "KP_I": triton.next_power_of_2(I), "BN_H": tile.bn_h,
                       "BN_I": tile.bn_i, "STAGES": tile.stages, "PREFETCH": tile.prefetch, "MLP_ONLY": ly.mlp_only,
                       "num_warps": tile.warps, "num_stages": 1}
        self.resources = fit_resident(_layers_kernel, self.args, self.launch, tile.programs, tile.warps, dev) \
            if dev.type == "cuda" else {}

    def __call__(self) -> torch.Tensor:
        _layers_kernel[(self.tile.programs,)](*self.args, **self.launch)
        return self.layers.x[self.layers.L]


def one_row_plan(plan: Plan, neighbour: Neighbour) -> LinearPlan:
    """An FP8 LinearPlan behind ``neighbour`` that runs ``plan`` at one row (cuBLAS beyond: unused here)."""
    return LinearPlan(neighbour, (plan,) + (CUBLAS,) * (len(ROW_BUCKETS) - 1), True,
                      (CUBLAS,) * len(MANY_ROW_BUCKETS))


class Kernels:
    """The engine's one-row kernels over ``layers``, as the tuner picks them for these shapes."""

    def __init__(self, layers: Layers) -> None:
        self.layers = layers
        act = torch.bfloat16
        w = layers.w
        if not layers.mlp_only:
            self.q_plan, _ = tune_one(w["q"][0], Neighbour.PLAIN, 1, fp8=True, act_dtype=act)
            self.o_plan, _ = tune_one(w["o"][0], Neighbour.PLAIN, 1, fp8=True, act_dtype=act)
            self.q_run = launcher(self.q_plan, Neighbour.PLAIN, fp8=True)
            self.o_run = launcher(self.o_plan, Neighbour.PLAIN, fp8=True)
        gu_plan, _ = tune_one(w["gu"][0], Neighbour.PLAIN, 1, fp8=True, act_dtype=act)
        d_plan, _ = tune_one(w["d"][0], Neighbour.SILU, 1, fp8=True, act_dtype=act)
        self.gu_lp, self.d_lp = one_row_plan(gu_plan, Neighbour.PLAIN), one_row_plan(d_plan, Neighbour.SILU)
        self.mlp = gate_up_silu_plan(w["gu"][0], self.gu_lp, w["d"][0], self.d_lp,
                                     scales=(layers.s["gu"][0], layers.s["d"][0]), act_dtype=act)

    def __str__(self) -> str:
        mlp = (f"gate_up_silu{tuple(self.mlp.tile)}{'+pdl' if self.mlp.pdl else ''} then {self.mlp.down}"
               if self.mlp else f"{self.gu_lp.one_row()} then {self.d_lp.one_row()}")
        return f"kernels: {mlp}" if self.layers.mlp_only else f"kernels: q/k/v {self.q_plan}, o {self.o_plan}, {mlp}"

    def __call__(self) -> torch.Tensor:
        ly = self.layers
        H = ly.shape.hidden
        y = ly.x[:1]
        for layer in range(ly.L):
            if ly.mlp_only:
                o = y
            else:
                q = self.q_run(y, ly.w["q"][layer], None, ly.s["q"][layer])
                o = self.o_run(q[:, :H], ly.w["o"][layer], None, ly.s["o"][layer])
            if self.mlp is not None:
                y = self.mlp.down_proj(self.mlp.gate_up_silu(o, ly.w["gu"][layer], None, ly.s["gu"][layer]),
                                       ly.w["d"][layer], ly.s["d"][layer])
            else:
                y = self.d_lp(self.gu_lp(o, ly.w["gu"][layer], None, ly.s["gu"][layer]), ly.w["d"][layer], None,
                              ly.s["d"][layer])
        return y[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tile-kb", type=int, nargs="+", default=[16, 32], help="bytes of FP8 weight a row tile holds")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[3])
    ap.add_argument("--prefetch", choices=["off", "on", "both"], default="both")
    ap.add_argument("--parts", nargs="+", choices=["layer", "mlp"], default=["layer", "mlp"],
                    help="a layer's four products, or gate ‖ up and down alone")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shape = Shape()
    H, _, I = shape  # noqa: E741
    prefetches = {"off": [False], "on": [True], "both": [False, True]}[a.prefetch]
    tiles = [Tile(per_sm * sms, rows_for(kb << 10, H, 2), rows_for(kb << 10, I, 1), warps, stages, pf)
             for per_sm, kb, warps, stages, pf in itertools.product(a.programs_per_sm, a.tile_kb, a.warps, a.stages,
                                                                     prefetches)]
    x = torch.randn(H, device=dev)
    rows: list[dict] = []
    summary: dict = {"read_tb_s": read_bandwidth(dev) / 1e12}
    bw = summary["read_tb_s"] * 1e12
    print(f"read bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for part in a.parts:
        mlp_only = part == "mlp"
        for L in a.layers:
            sets = [Layers(shape, L, dev, mlp_only=mlp_only)]
            if L * sets[0].bytes_per_layer < 512 << 20:   # more weight than L2 between one replay and the next
                sets.append(Layers(shape, L, dev, mlp_only=mlp_only))
            for s in sets:
                s.x[0] = x
            ref = sets[0].reference(x).float()
            forms: dict[str, list[Callable[[], torch.Tensor]]] = {}
            try:
                kernels = [Kernels(s) for s in sets]
                forms[f"{part} {kernels[0]}"] = list(kernels)
            except Exception as e:  # noqa: BLE001 - the persistent forms still run
                rows.append({"part": part, "layers": L, "form": f"{part} kernels", "error": f"{type(e).__name__}: {e}"})
            for tile in tiles:
                try:
                    forms[f"{part} {tile}"] = [Persistent(s, tile) for s in sets]
                except Exception as e:  # noqa: BLE001 - a grid that cannot be resident, a compile that fails
                    rows.append({"part": part, "layers": L, "form": f"{part} {tile}",
                                 "error": f"{type(e).__name__}: {e}"})
            for name, fns in forms.items():
                line: dict = {"part": part, "layers": L, "form": name, "bytes": L * sets[0].bytes_per_layer,
                              **getattr(fns[0], "resources", {})}
                rows.append(line)
                try:
                    y = fns[0]().float()
                    torch.cuda.synchronize()
                    if isinstance(fns[0], Persistent) and fns[0].err.item():
                        line["error"] = "a program gave up waiting: the grid was not resident at once"
                    else:
                        line["rel_err"] = float((y - ref).norm() / ref.norm())
                        ms = time_graph(lambda j, fns=fns: fns[j](), len(fns))
                        if isinstance(fns[0], Persistent) and any(f.err.item() for f in fns):
                            line["error"] = "a program gave up waiting while timed"
                        else:
                            line["us"] = ms * 1e3
                            line["tb_s"] = line["bytes"] / (ms * 1e-3) / 1e12
                except Exception as e:  # noqa: BLE001 - a form that does not compile or run is reported
                    line["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                told = line["error"] if "error" in line else \
                    f"{line['us']:8.1f} us {line['tb_s']:4.2f} TB/s err {line['rel_err']:.1e}"
                print(f"{L} x {name}: {told}", flush=True)
            layer_bytes = sets[0].bytes_per_layer
            del sets, forms
            torch.cuda.empty_cache()
            dump(a.output, sms, rows, summary)     # what a run cut off by its time limit has measured
        stream_us = layer_bytes / bw * 1e6
        summary[part] = {"bytes_per_layer": layer_bytes, "stream_us_per_layer": stream_us}
        print(f"{part}: {layer_bytes / 1e6:.1f} MB a layer, streamed in {stream_us:.1f} us at the read bandwidth")
        for name in dict.fromkeys(r["form"] for r in rows if r["part"] == part):
            points = [(r["layers"], r["us"]) for r in rows if r["form"] == name and "us" in r]
            if len(points) < 2:
                continue
            per = slope(points)
            summary[part][name] = {"us_per_layer": per, "of_read_bandwidth": stream_us / per}
            print(f"  {name:100s} {per:6.1f} us a layer, {100 * stream_us / per:5.1f} % of the read bandwidth")
    dump(a.output, sms, rows, summary)


if __name__ == "__main__":
    main()
