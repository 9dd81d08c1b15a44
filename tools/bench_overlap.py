"""Can a decode step's compute-bound projections and its memory-bound attention share one GPU?

A bf16 decode step over a few hundred sequences of ~1,500 tokens runs its projections near the
tensor cores' peak and its attention near the memory's read bandwidth, one after the other, so
the step costs their sum. Split the batch into nano-batches on their own streams, one started a
projection behind the other, and one nano-batch's attention may run while the other's
projections do. This measures, over layers of one model shape (no norms, rotary or residual:
the four projections, SiLU ‖ mul, and paged decode attention over a pool per layer), replayed
from a CUDA graph:

  gemms       the projections alone, the whole batch
  attention   the attention alone, the whole batch
  serial      both, one stream, the whole batch (what a decode step does today)
  split       both, one stream, nano-batch after nano-batch (what splitting alone costs)
  overlap     both, a stream per nano-batch, each started one projection after the one before

    python tools/bench_overlap.py --batch 256 512 --context 1500 --nano 2 3 --output overlap.json

  pipeline    both, the projections on one stream and the attention on another, nano-batches
              interleaved as NanoFlow does: while one nano-batch's attention runs, the other's
              projections (this layer's o and MLP, the next layer's q/k/v) do

The figure to read is serial / overlap (and serial / pipeline): the most a step could gain from
running nano-batches side by side with today's kernels. ``--carveout K`` leaves K SMs out of the
projections' cuBLAS(Lt) kernels (torch's experimental SM carveout; ``--cublaslt`` sends bf16
GEMMs there, where the carveout applies), ``--priority`` gives the projections' stream the higher
priority (its blocks go first onto SMs the attention frees) and ``--attention-sms`` sizes the
attention's split grid for that many SMs.

  green       the pipeline again, each stream in a CUDA green context of its own: ``--green N``
              gives the attention's stream N SMs and the projections' stream the rest (a true
              split of the SMs, which carveouts and priorities only approximate), and times each
              side alone on its share (``attention_gN``, ``gemms_gN``) and both together
              (``pipeline_gN``). Green contexts need cuda-bindings (cuda-python) and CUDA 12.4+;
              they are timed from eager launches, so ``serial_eager`` is their baseline (the
              pipeline also from a CUDA graph where the driver captures it); ``concurrent_gN``
              runs both sides at once with no dependencies between them, what sharing costs each;
              ``--balanced`` gives each context work queues of its own. The usual decode config
              is the one the engine picks for the grid on the whole GPU. ``--attention-config`` tries
              decode configs (keys a step, warps, stages) on the attention's share besides the usual one.

    python tools/bench_overlap.py --batch 256 512 --green 64 80 96 --attention-config 32,2,2 64,4,4
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from phalanx.bench.shapes import SHAPES
from phalanx.kernels import gemv_tuner, triton_attention


class Shape:
    """The few numbers of a model shape this bench needs."""

    def __init__(self, cfg: dict) -> None:
        self.hidden_size, self.intermediate_size = cfg["hidden_size"], cfg["intermediate_size"]
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]


class Layer:
    """One layer's weights (bf16, random) and its KV pool of S sequences of ``context`` tokens."""

    def __init__(self, shape, S: int, context: int, B: int, gen: torch.Generator) -> None:
        hidden, inter = shape.hidden_size, shape.intermediate_size
        H, Hkv, D = shape.num_heads, shape.num_kv_heads, shape.head_dim
        dev, dt = "cuda", torch.bfloat16
        self.qkv = torch.randn((H + 2 * Hkv) * D, hidden, device=dev, dtype=dt) * hidden ** -0.5
        self.o = torch.randn(hidden, H * D, device=dev, dtype=dt) * (H * D) ** -0.5
        self.gate_up = torch.randn(2 * inter, hidden, device=dev, dtype=dt) * hidden ** -0.5
        self.down = torch.randn(hidden, inter, device=dev, dtype=dt) * inter ** -0.5
        per = -(-context // B)
        nb = S * per
        self.k = torch.randn(nb, B, Hkv, D, device=dev, dtype=dt)
        self.v = torch.randn(nb, B, Hkv, D, device=dev, dtype=dt)
        self.tables = torch.randperm(nb, generator=gen).view(S, per).to(torch.int32).to(dev)
        self.lens = torch.full((S,), context, dtype=torch.int32, device=dev)


class Model:
    def __init__(self, shape, layers: int, S: int, context: int, nano: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.shape, self.S, self.nano = shape, S, nano
        self.layers = [Layer(shape, S, context, 32, gen) for _ in range(layers)]
        self.x = torch.randn(S, shape.hidden_size, device="cuda", dtype=torch.bfloat16)
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.attention_sms = self.sms
        self.attention_config: tuple[int, int, int] | None = None
        self.streams = [torch.cuda.Stream() for _ in range(nano)]
        self.gemm_stream = torch.cuda.Stream(priority=-1)     # lower is sooner; 0 is the default
        self.attention_stream = torch.cuda.Stream(priority=0)

    def qkv(self, L: Layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, L.qkv)

    def attention(self, L: Layer, qkv: torch.Tensor, rows: slice) -> torch.Tensor:
        s = self.shape
        n = qkv.shape[0]
        q = qkv[:, :s.num_heads * s.head_dim].reshape(n, s.num_heads, s.head_dim)
        splits = triton_attention.num_splits(n, s.num_kv_heads, 131072, 32, self.attention_sms)
        out = triton_attention.decode_attention(q, L.k, L.v, L.tables[rows], L.lens[rows], s.head_dim ** -0.5,
                                                None, splits, self.attention_config)
        return out.reshape(n, -1)

    def after_attention(self, L: Layer, h: torch.Tensor) -> torch.Tensor:
        s = self.shape
        gu = F.linear(F.linear(h, L.o), L.gate_up)
        return F.linear(F.silu(gu[:, :s.intermediate_size]) * gu[:, s.intermediate_size:], L.down)

    def nano_forward(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        for L in self.layers:
            x = self.after_attention(L, self.attention(L, self.qkv(L, x), rows))
        return x

    def run(self, mode: str) -> None:
        S, n = self.S, self.nano
        if mode == "gemms":
            x = self.x
            for L in self.layers:
                x = self.after_attention(L, self.qkv(L, x)[:, :self.shape.num_heads * self.shape.head_dim])
        elif mode == "attention":
            for L in self.layers:
                self.attention(L, self.x.new_empty(S, L.qkv.shape[0]), slice(0, S))
        elif mode == "serial":
            self.nano_forward(self.x, slice(0, S))
        elif mode == "split":
            for i in range(n):
                rows = slice(i * S // n, (i + 1) * S // n)
                self.nano_forward(self.x[rows], rows)
        elif mode == "overlap":
            main = torch.cuda.current_stream()
            done = []
            ahead = torch.cuda.Event()
            ahead.record(main)
            for i, st in enumerate(self.streams):
                rows = slice(i * S // n, (i + 1) * S // n)
                st.wait_event(ahead)
                with torch.cuda.stream(st):
                    x = self.x[rows]
                    first = True
                    for L in self.layers:
                        qkv = self.qkv(L, x)
                        if first:   # the next nano-batch starts once this one's first projection is done
                            ahead = torch.cuda.Event()
                            ahead.record(st)
                            first = False
                        x = self.after_attention(L, self.attention(L, qkv, rows))
                    ev = torch.cuda.Event()
                    ev.record(st)
                    done.append(ev)
            for ev in done:
                main.wait_event(ev)
        elif mode == "pipeline":
            self.pipeline()
        else:
            raise ValueError(mode)

    def pipeline(self) -> None:
        """Projections on ``gemm_stream``, attention on ``attention_stream``; nano-batch i's
        attention of layer l waits for its q/k/v, its o and MLP wait for that attention. The
        projections' stream runs o+MLP(i, l) then q/k/v(i, l+1) in nano-batch order, so the
        attention of the next nano-batch has something beside it."""
        S, n = self.S, self.nano
        main, g, a = torch.cuda.current_stream(), self.gemm_stream, self.attention_stream
        g.wait_stream(main)
        a.wait_stream(main)
        rows = [slice(i * S // n, (i + 1) * S // n) for i in range(n)]
        qkv, ready = [], []
        with torch.cuda.stream(g):
            for i in range(n):
                qkv.append(self.qkv(self.layers[0], self.x[rows[i]]))
                ready.append(torch.cuda.Event())
                ready[i].record(g)
        for li, L in enumerate(self.layers):
            outs, done = [], []
            with torch.cuda.stream(a):
                for i in range(n):
                    a.wait_event(ready[i])
                    outs.append(self.attention(L, qkv[i], rows[i]))
                    done.append(torch.cuda.Event())
                    done[i].record(a)
            with torch.cuda.stream(g):
                for i in range(n):
                    g.wait_event(done[i])
                    x = self.after_attention(L, outs[i])
                    if li + 1 < len(self.layers):
                        qkv[i] = self.qkv(self.layers[li + 1], x)
                        ready[i] = torch.cuda.Event()
                        ready[i].record(g)
        main.wait_stream(g)
        main.wait_stream(a)


def cuda_driver():
    """cuda-bindings' driver module, which ``--green`` needs."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise SystemExit("--green needs cuda-bindings (pip install cuda-bindings)") from e
    return driver


_GREEN: dict[tuple[int, bool], tuple[torch.cuda.Stream, torch.cuda.Stream, int, int]] = {}


def green_streams(attention_sms: int, balanced: bool) -> tuple[torch.cuda.Stream, torch.cuda.Stream, int, int]:
    """Two streams, each in a CUDA green context of its own: the first on ``attention_sms`` SMs
    (rounded up to the GPU's granularity, 8 on Hopper), the second on the SMs left. ``balanced``:
    each context also gets work queues of its own (a workqueue configuration resource with the
    green-context-balanced sharing scope, CUDA 13), so that one stream's launches cannot queue
    behind the other's. Returns the streams and their SM counts; made once per split and kept
    for the rest of the run."""
    if (attention_sms, balanced) in _GREEN:
        return _GREEN[attention_sms, balanced]
    cu = cuda_driver()

    def ok(call: str, *args):
        res = getattr(cu, call)(*args)
        if res[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{call}: CUDA driver error {res[0]!r}")
        return res[1] if len(res) == 2 else res[1:]

    torch.cuda.init()
    dev = ok("cuDeviceGet", torch.cuda.current_device())
    whole = ok("cuDeviceGetDevResource", dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
    groups, _, rest = ok("cuDevSmResourceSplitByCount", 1, whole, 0, attention_sms)
    streams = []
    for part in (groups[0], rest):
        parts = [part]
        if balanced:
            wq = ok("cuDeviceGetDevResource", dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_WORKQUEUE_CONFIG)
            wq.wqConfig.sharingScope = cu.CUdevWorkqueueConfigScope.CU_WORKQUEUE_SCOPE_GREEN_CTX_BALANCED
            parts.append(wq)
        desc = ok("cuDevResourceGenerateDesc", parts, len(parts))
        ctx = ok("cuGreenCtxCreate", desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
        handle = ok("cuGreenCtxStreamCreate", ctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0)
        streams.append(torch.cuda.ExternalStream(int(handle)))
    _GREEN[attention_sms, balanced] = (streams[0], streams[1], groups[0].sm.smCount, rest.sm.smCount)
    return _GREEN[attention_sms, balanced]


def on_streams(*work: tuple[torch.cuda.Stream, Callable[[], object]]) -> Callable[[], None]:
    """Each (stream, fn) pair run on its stream, all started after the current stream's work and
    joined back into it: one pair times a side alone, two run both sides at once."""
    def run() -> None:
        main = torch.cuda.current_stream()
        for st, fn in work:
            st.wait_stream(main)
            with torch.cuda.stream(st):
                fn()
        for st, _ in work:
            main.wait_stream(st)
    return run


def green_rows(m: Model, shares: list[int], configs: list[tuple[int, int, int] | None], layers: int,
               balanced: bool) -> dict:
    """On each green split, µs a layer: each side alone on its share, both at once with nothing
    between them (``concurrent``: what sharing the GPU costs each), and the pipeline, eager and
    (where the driver lets streams of two contexts into one capture) from a CUDA graph."""
    res: dict[str, float] = {"serial_eager": gemv_tuner.time_eager(lambda: m.run("serial")) * 1e3 / layers}
    streams = m.gemm_stream, m.attention_stream
    for n in shares:
        try:
            a_st, g_st, a_sms, g_sms = green_streams(n, balanced)
        except (RuntimeError, AttributeError) as e:
            print(f"  green {n} (balanced={balanced}): {e}", flush=True)
            continue
        m.attention_sms = a_sms
        m.gemm_stream, m.attention_stream = g_st, a_st
        attention = (a_st, lambda: m.run("attention"))
        gemms = (g_st, lambda: m.run("gemms"))
        for c in configs:
            m.attention_config = c
            tag = f"g{a_sms}" + (f"_{'-'.join(map(str, c))}" if c else "")
            res[f"attention_{tag}"] = gemv_tuner.time_eager(on_streams(attention)) * 1e3 / layers
            res[f"gemms_{tag}"] = gemv_tuner.time_eager(on_streams(gemms)) * 1e3 / layers
            res[f"concurrent_{tag}"] = gemv_tuner.time_eager(on_streams(attention, gemms)) * 1e3 / layers
            res[f"pipeline_{tag}"] = gemv_tuner.time_eager(m.pipeline) * 1e3 / layers
            try:
                res[f"pipeline_graph_{tag}"] = gemv_tuner.time_graph(lambda i: m.pipeline(), 1, reps=2) * 1e3 / layers
            except RuntimeError as e:
                print(f"  pipeline over green streams in a CUDA graph: {str(e).splitlines()[0]}", flush=True)
                torch.cuda.synchronize()
        print(f"  green: attention {a_sms} SMs, projections {g_sms} SMs, balanced work queues {balanced}", flush=True)
    m.attention_sms, m.attention_config = m.sms, None
    m.gemm_stream, m.attention_stream = streams
    return res


def set_carveout(sms: int) -> None:
    """Leave ``sms`` SMs out of cuBLAS(Lt) kernels launched from now on (0: none)."""
    if hasattr(torch._C, "_set_sm_carveout_experimental"):
        torch._C._set_sm_carveout_experimental(sms or None)
    elif sms:
        raise SystemExit("this torch has no SM carveout")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--context", type=int, nargs="+", default=[1500])
    ap.add_argument("--nano", type=int, nargs="+", default=[2])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--carveout", type=int, nargs="+", default=[0],
                    help="SMs left out of the projections' cuBLAS kernels in the pipeline mode (one run each)")
    ap.add_argument("--attention-sms", type=int, default=0, help="size the attention's split grid for this many SMs")
    ap.add_argument("--priority", action="store_true", help="the projections' stream first")
    ap.add_argument("--cublaslt", action="store_true", help="bf16 GEMMs on cuBLASLt (where the carveout applies)")
    ap.add_argument("--green", type=int, nargs="*", default=[],
                    help="SMs of the attention's green context (the projections take the rest), one run each")
    ap.add_argument("--balanced", action="store_true",
                    help="green contexts with work queues of their own (CUDA 13's balanced workqueue scope)")
    ap.add_argument("--attention-config", nargs="*", default=[],
                    help="decode configs 'keys,warps,stages' tried on the attention's green share (default: the usual)")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    if a.green:
        cuda_driver()
    configs: list[tuple[int, int, int] | None] = [None]
    for c in a.attention_config:
        keys, warps, stages = (int(v) for v in c.split(","))
        configs.append((keys, warps, stages))
    if a.cublaslt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    shape = Shape(SHAPES[a.model])
    rows = []
    for S in a.batch:
        for ctx in a.context:
            for n in a.nano:
                m = Model(shape, a.layers, S, ctx, n)
                if not a.priority:
                    m.gemm_stream = torch.cuda.Stream()
                def timed(mode: str, m: Model = m) -> float:
                    return gemv_tuner.time_graph(lambda i: m.run(mode), 1, reps=4) * 1e3 / a.layers
                res = {mode: timed(mode) for mode in ("gemms", "attention", "serial", "split", "overlap")}
                for c in a.carveout:
                    set_carveout(c)
                    m.attention_sms = a.attention_sms or m.sms
                    res[f"gemms_c{c}"], res[f"pipeline_c{c}"] = timed("gemms"), timed("pipeline")
                    m.attention_sms = m.sms
                    set_carveout(0)
                if a.green:
                    res.update(green_rows(m, a.green, configs, a.layers, a.balanced))
                flop = 2 * S * (m.layers[0].qkv.numel() + m.layers[0].o.numel() + m.layers[0].gate_up.numel()
                                + m.layers[0].down.numel())
                kv = 2 * S * ctx * shape.num_kv_heads * shape.head_dim * 2
                row = {"batch": S, "context": ctx, "nano": n, **{k + "_us": v for k, v in res.items()},
                       "gemm_tflop_s": flop / res["gemms"] / 1e6, "attention_tb_s": kv / res["attention"] / 1e6,
                       "serial_over_overlap": res["serial"] / res["overlap"],
                       **{f"serial_over_pipeline_c{c}": res["serial"] / res[f"pipeline_c{c}"] for c in a.carveout},
                       "sum_over_serial": (res["gemms"] + res["attention"]) / res["serial"]}
                for k in [k for k in res if k.startswith("attention_g")]:
                    row[k + "_tb_s"] = kv / res[k] / 1e6
                for k in [k for k in res if k.startswith(("pipeline_g", "concurrent_g"))]:
                    row["serial_eager_over_" + k] = res["serial_eager"] / res[k]
                rows.append(row)
                print(f"S={S:4d} ctx={ctx:5d} nano={n}: " + "  ".join(f"{k} {v:7.1f}" for k, v in res.items())
                      + f" us/layer; GEMMs {row['gemm_tflop_s']:.0f} TFLOP/s, attention {row['attention_tb_s']:.2f}"
                      f" TB/s; serial/overlap {row['serial_over_overlap']:.2f}; serial/pipeline "
                      + " ".join(f"c{c} {res['serial'] / res[f'pipeline_c{c}']:.2f}" for c in a.carveout)
                      + "".join(f"; {k} {v:.2f}" for k, v in row.items() if k.endswith("_tb_s") and "_g" in k)
                      + "".join(f"; {k} {v:.2f}" for k, v in row.items() if k.startswith("serial_eager_over")),
                      flush=True)
                m.layers.clear()
                torch.cuda.empty_cache()
    if a.output:
        with open(a.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
