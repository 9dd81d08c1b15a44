"""The kernels compile for a Hopper GPU (sm_90) on this machine, no GPU needed: the interpreter
runs kernels as Python and so lets through what the compiler refuses (a name bound to pointers
of two dtypes in two branches, say). The FP8 variants with bf16 activations over FP8 (e4m3)
pools and weights, as ``quantization: fp8`` and ``kv_cache_config.dtype: fp8`` run them, and
the bf16 variants of the kernels they share with every model (PDL on)."""

import inspect
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from phalanx.kernels import gemv, triton_attention, triton_lora, triton_mla, triton_moe, triton_ops  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import bench_handover  # noqa: E402  (tools/: the persistent chain a GPU run measures)
import bench_layer_stream  # noqa: E402  (tools/: the persistent layer a GPU run measures)

FP8_POOL = {"q_ptr": "*bf16", "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "out_ptr": "*bf16", "lse_ptr": "*fp32",
            "part_ptr": "*fp32", "bt_ptr": "*i32", "len_ptr": "*i32", "qstart_ptr": "*i32"}
FP8_WEIGHT = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "b_ptr": "*bf16", "s_ptr": "*fp32", "y_ptr": "*bf16",
              "part_ptr": "*fp32", "count_ptr": "*i32"}
ATTN = {"G": 4, "BLOCK_G": 16, "D": 128, "BLOCK_D": 128, "B": 32, "BLOCK_N": 64, "PREC": "tf32", "KV_F16": False,
        "V_KEYS": False}
# an FP8 pool's dots in float16, as shipped (FP8_POOL_F16); its values key-minor (values_key_minor)
ATTN_FP8 = {**ATTN, "KV_F16": True, "V_KEYS": True}
DECODE_FP8 = {**ATTN_FP8, "BLOCK_N": triton_attention.DECODE_CONFIG_FP8[0]}

CASES = {
    "rope + K/V write into an FP8 pool": (triton_ops._rope_qkv_kernel, {
        "pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
        "qo_ptr": "*bf16", "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "qn_ptr": "*bf16", "kn_ptr": "*bf16"},
        {"HALF": 64, "BLOCK": 64, "QH": 8, "KVH": 8, "VB": 32, "PDL": False}),
    "one token's q/k/v (FP8 weights) + rotary into an FP8 pool": (gemv._qkv_rope_kernel, {
        "x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "b_ptr": "*bf16", "sc_ptr": "*fp32", "pos_ptr": "*i64",
        "cs_ptr": "*fp32", "slot_ptr": "*i64", "q_ptr": "*bf16", "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"},
        {"HAS_BIAS": False, "HAS_SCALE": True, "D": 128, "BLOCK_N": 16, "BLOCK_K": 1024, "FOLD": 16, "PRE": True,
         "VB": 32, "PDL": False}),
    "one token's gate ‖ up + SiLU, FP8 weights": (gemv._gate_up_silu_kernel, {
        "x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "b_ptr": "*bf16", "sc_ptr": "*fp32", "a_ptr": "*bf16"},
        {"HAS_BIAS": False, "HAS_SCALE": True, "BLOCK_N": 16, "BLOCK_K": 1024, "FOLD": 16, "PRE": True,
         "PDL": False}),
    "decode over an FP8 pool": (triton_attention._decode_split_kernel, FP8_POOL, {**DECODE_FP8, "SPLITS": 4,
                                                                                 "PDL": False}),
    "decode over an FP8 pool, bf16 dots": (triton_attention._decode_split_kernel, FP8_POOL,
                                           {**DECODE_FP8, "KV_F16": False, "SPLITS": 4, "PDL": False}),
    "decode over an FP8 pool, key slices": (triton_attention._decode_split_kernel, FP8_POOL,
                                            {**ATTN_FP8, "BLOCK_N": triton_attention.DECODE_CONFIG_FP8_SPLIT[0],
                                             "SPLITS": 8, "PDL": True}),
    "decode over an FP8 pool, a wide grid": (triton_attention._decode_split_kernel, FP8_POOL, {
        **ATTN_FP8, "BLOCK_N": triton_attention.DECODE_CONFIG_FP8_WIDE[0], "SPLITS": 1, "PDL": True},
        dict(zip(("num_warps", "num_stages"), triton_attention.DECODE_CONFIG_FP8_WIDE[1:], strict=True))),
    "decode over an FP8 pool, the widest grid": (triton_attention._decode_split_kernel, FP8_POOL, {
        **ATTN_FP8, "BLOCK_N": triton_attention.DECODE_CONFIG_FP8_WIDEST[0], "SPLITS": 1, "PDL": True},
        dict(zip(("num_warps", "num_stages"), triton_attention.DECODE_CONFIG_FP8_WIDEST[1:], strict=True))),
    "prefill over an FP8 pool": (triton_attention._prefill_kernel, FP8_POOL,
                                 {**ATTN_FP8, "BLOCK_G": 4, "BLOCK_M": 32,
                                  "BLOCK_N": triton_attention.PREFILL_CONFIG_FP8[1]},
                                 {"num_warps": 8, "num_stages": 2}),
    "prefill over a bf16 pool, long prompts": (triton_attention._prefill_kernel, {**FP8_POOL, "kc_ptr": "*bf16",
                                                                                  "vc_ptr": "*bf16"},
                                               {**ATTN, "BLOCK_G": 4, "BLOCK_M": 64,
                                                "BLOCK_N": triton_attention.PREFILL_CONFIG_LONG[1]},
                                               {"num_warps": 8, "num_stages": 3}),
    "prefill over an FP8 pool, long prompts": (triton_attention._prefill_kernel, FP8_POOL,
                                               {**ATTN_FP8, "BLOCK_G": 4, "BLOCK_M": 64,
                                                "BLOCK_N": triton_attention.PREFILL_CONFIG_FP8_LONG[1]},
                                               {"num_warps": 8, "num_stages": 2}),
    "prefill, float32 model": (triton_attention._prefill_kernel,
                               {**FP8_POOL, "q_ptr": "*fp32", "kc_ptr": "*fp32", "vc_ptr": "*fp32", "out_ptr": "*fp32"},
                               {**ATTN, "PREC": "ieee", "BLOCK_G": 4, "BLOCK_M": 16,
                                "BLOCK_N": triton_attention.PREFILL_CONFIG_F32[1]},
                               {"num_warps": 4, "num_stages": 2}),
    "split extend over an FP8 pool": (triton_attention._extend_split_kernel, FP8_POOL,
                                      {**ATTN_FP8, "BLOCK_M": 16,
                                       "BLOCK_N": triton_attention.EXTEND_SPLIT_CONFIG[0]}),
    "one row, FP8 weights": (gemv._gemv_kernel, FP8_WEIGHT, {"HAS_BIAS": True, "HAS_SCALE": True, "BLOCK_N": 8,
                                                            "BLOCK_K": 1024, "FOLD": 16, "SILU": True, "PRE": True,
                                                            "PDL": False}),
    "padded rows, FP8 weights, split K": (gemv._rows_kernel, FP8_WEIGHT, {
        "HAS_BIAS": False, "HAS_SCALE": True, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "PREC": "tf32",
        "SILU": False, "SPLIT": True, "PDL": False}),
    "FP8 experts, gate ‖ up": (triton_moe._moe_gate_up_kernel, {
        "x_ptr": "*bf16", "xs_ptr": "*bf16", "w_ptr": "*fp8e4nv", "sc_ptr": "*fp32", "pair_ptr": "*i64",
        "bexp_ptr": "*i64", "act_ptr": "*bf16"}, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "PREC": "tf32",
                                                  "HAS_SCALE": True, "A8": False}),
    "FP8 experts, down": (triton_moe._moe_down_kernel, {
        "act_ptr": "*bf16", "as_ptr": "*bf16", "w_ptr": "*fp8e4nv", "sc_ptr": "*fp32", "pair_ptr": "*i64",
        "bexp_ptr": "*i64", "rw_ptr": "*fp32", "y_ptr": "*bf16"}, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
                                                                   "PREC": "tf32", "HAS_SCALE": True, "A8": False}),
    "per-row activation quantization, a row held": (
        triton_ops._quantize_rows_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
        {"FMAX": 448.0, "TINY": 1e-12, "BLOCK": 4096, "HELD": True, "PDL": True}, {"num_warps": 8}),
    "per-row activation quantization, a row read twice": (
        triton_ops._quantize_rows_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
        {"FMAX": 448.0, "TINY": 1e-12, "BLOCK": 16384, "HELD": False, "PDL": True}, {"num_warps": 16}),
    "RMSNorm (+ residual) writing FP8 rows": (triton_ops._rms_norm_kernel, {
        "x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp8e4nv", "res_out_ptr": "*bf16",
        "s_ptr": "*fp32"}, {"HAS_RES": True, "BLOCK": 4096, "PDL": True, "FP8_OUT": True, "FMAX": 448.0,
                            "TINY": 1e-12}),
    "RMSNorm writing FP8 rows": (triton_ops._rms_norm_kernel, {
        "x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp8e4nv", "res_out_ptr": "*fp8e4nv",
        "s_ptr": "*fp32"}, {"HAS_RES": False, "BLOCK": 4096, "PDL": True, "FP8_OUT": True, "FMAX": 448.0,
                            "TINY": 1e-12}),
    "SiLU-and-mul writing FP8 rows": (triton_ops._silu_mul_fp8_kernel, {
        "x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, {"FMAX": 448.0, "TINY": 1e-12, "BLOCK": 16384,
                                                                   "PDL": True}, {"num_warps": 16}),
}


def compile_case(case: str):
    """Compile one case for sm_90 as the JIT would see a launch (pointers and strides divisible
    by 16, but for the arguments the kernel does not specialize on); the compiled kernel."""
    fn, pointers, constexprs, *options = CASES[case]     # options: the launch's warps and stages, where given
    params = inspect.signature(fn.fn).parameters
    names = list(params)
    constexprs = {**{n: p.default for n, p in params.items()   # a launch leaves these at their defaults
                     if p.default is not p.empty and "constexpr" in str(p.annotation)}, **constexprs}
    floats = ("scale", "scaling", "eps", "k_inv", "v_inv", "v_scale")
    sig = {n: pointers.get(n, "fp32" if n in floats else "i32") for n in names}
    assert not [n for n in names if n.endswith("_ptr") and n not in pointers], "a pointer without a dtype"
    for k in constexprs:
        sig[k] = "constexpr"
    loose = set(getattr(fn, "do_not_specialize", ()) or ()) | set(getattr(fn, "do_not_specialize_on_alignment", ())
                                                                   or ())
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constexprs and n not in loose and (n.endswith("_ptr") or n.startswith("s_"))}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options[0] if options else None)


def compile_all() -> None:
    """Print {case: {"error": None or the compiler's last line, "byte_loads" / "global_byte_loads":
    single-byte shared / global memory loads in its PTX, "shared": bytes of shared memory a
    program takes}} as JSON."""
    import json
    out = {}
    for case in CASES:
        try:
            kernel = compile_case(case)
            ptx = kernel.asm["ptx"]
            out[case] = {"error": None, "byte_loads": ptx.count("ld.shared.b8 ") + ptx.count("ld.shared.u8 "),
                         "global_byte_loads": ptx.count("ld.global.b8 ") + ptx.count("ld.global.u8 "),
                         "shared": kernel.metadata.shared}
        except Exception as e:  # noqa: BLE001 - the case's failure is the result
            out[case] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"}
    print(json.dumps(out))


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every case compiled in one process of its own: the kernels here are the interpreter's
    (conftest sets TRITON_INTERPRET), and the compiler needs them jitted."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", "import test_gpu_compile as t; t.compile_all()"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


# the same kernels as every bf16 model runs them (the FP8 branches compiled out)
BF16_POOL = {k: ("*bf16" if v == "*fp8e4nv" else v) for k, v in FP8_POOL.items()}
CASES |= {
    "rope + K/V write into a bf16 pool, one KV head a program": (triton_ops._rope_qkv_kernel, {
        k: ("*bf16" if v == "*fp8e4nv" else v) for k, v in CASES["rope + K/V write into an FP8 pool"][1].items()},
        {"HALF": 64, "BLOCK": 64, "QH": 4, "KVH": 1, "VB": 0, "PDL": True}),
    "rope + K/V write into a bf16 pool, q/k heads normed first (Qwen3)": (triton_ops._rope_qkv_kernel, {
        k: ("*bf16" if v == "*fp8e4nv" else v) for k, v in CASES["rope + K/V write into an FP8 pool"][1].items()},
        {"HALF": 64, "BLOCK": 64, "QH": 8, "KVH": 4, "VB": 0, "PDL": True, "NORM": 1}),
    "rope + K/V write into a bf16 pool": (triton_ops._rope_qkv_kernel, {
        k: ("*bf16" if v == "*fp8e4nv" else v) for k, v in CASES["rope + K/V write into an FP8 pool"][1].items()},
        {"HALF": 64, "BLOCK": 64, "QH": 8, "KVH": 2, "VB": 0, "PDL": True}),
    "decode over a bf16 pool": (triton_attention._decode_split_kernel, BF16_POOL, {**ATTN, "SPLITS": 4, "PDL": True}),
    "decode over a bf16 pool, a wide grid": (triton_attention._decode_split_kernel, BF16_POOL, {
        **ATTN, "BLOCK_N": triton_attention.DECODE_CONFIG_WIDE[0], "SPLITS": 1, "PDL": True},
        dict(zip(("num_warps", "num_stages"), triton_attention.DECODE_CONFIG_WIDE[1:], strict=True))),
    "one row, bf16 weights": (gemv._gemv_kernel, {**FP8_WEIGHT, "w_ptr": "*bf16"}, {
        "HAS_BIAS": False, "HAS_SCALE": False, "BLOCK_N": 8, "BLOCK_K": 512, "FOLD": 1, "SILU": False, "PRE": True,
        "PDL": True}),
    "bf16 experts, gate ‖ up": (triton_moe._moe_gate_up_kernel, {
        **CASES["FP8 experts, gate ‖ up"][1], "w_ptr": "*bf16"}, {**CASES["FP8 experts, gate ‖ up"][2],
                                                                   "HAS_SCALE": False}),
}
# LoRA's kernels for decode steps (bf16 model, rank 16; the expand over q ‖ k ‖ v's three parts with 32 partial
# sums a token, as many as down's 14,336 input columns make)
CASES |= {
    "LoRA shrink, rank 16": (triton_lora._lora_shrink_kernel, {
        "x_ptr": "*bf16", "a_ptr": "*bf16", "slot_ptr": "*i32", "s_ptr": "*fp32"},
        {"R": 16, "RP": 16, "BLOCK_K": 256, "PDL": True}),
    "LoRA expand, rank 16, three parts": (triton_lora._lora_expand_kernel, {
        "y_ptr": "*bf16", "s_ptr": "*fp32", "b_ptr": "*bf16", "slot_ptr": "*i32"},
        {"R": 16, "RP": 16, "P": 3, "SPLIT_P": 32, "BLOCK_N": 128, "PDL": True}),
}
# LoRA's grouped kernels (tiles of one slot's tokens on the tensor cores), rank 8 (dots at 16) and 64
for rank in (8, 64):
    lp = triton_lora.plan(4096, 3, 4, rank, (4096, 5120))
    CASES |= {
        f"LoRA grouped shrink, rank {rank}": (triton_lora._lora_shrink_grouped_kernel, {
            "x_ptr": "*bf16", "a_ptr": "*bf16", "tile_ptr": "*i32", "order_ptr": "*i32", "s_ptr": "*fp32"},
            {"R": rank, "RD": lp.rank_dot, "BM": triton_lora.TILE_ROWS, "BLOCK_K": lp.grouped_block_k,
             "PREC": lp.precision, "PDL": True}),
        f"LoRA grouped expand, rank {rank}, three parts": (triton_lora._lora_expand_grouped_kernel, {
            "y_ptr": "*bf16", "s_ptr": "*fp32", "b_ptr": "*bf16", "tile_ptr": "*i32", "order_ptr": "*i32"},
            {"R": rank, "RD": lp.rank_dot, "P": 3, "BM": triton_lora.TILE_ROWS, "BLOCK_N": lp.grouped_block_n,
             "PREC": lp.precision, "PDL": True}),
    }
# FP8 experts multiplied in FP8 (W8A8): the activations come in as e4m3 with a float32 scale a row
A8_TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "A8": True}
CASES |= {
    "FP8 experts multiplied in FP8, gate ‖ up": (triton_moe._moe_gate_up_kernel, {
        **CASES["FP8 experts, gate ‖ up"][1], "x_ptr": "*fp8e4nv", "xs_ptr": "*fp32"},
        {**CASES["FP8 experts, gate ‖ up"][2], **A8_TILE}),
    "FP8 experts multiplied in FP8, down": (triton_moe._moe_down_kernel, {
        **CASES["FP8 experts, down"][1], "act_ptr": "*fp8e4nv", "as_ptr": "*fp32"},
        {**CASES["FP8 experts, down"][2], **A8_TILE}),
}
# tools/bench_handover.py's persistent chain of one-row FP8 products (a counter in memory between them),
# with and without the next weight tile loaded before the wait, registers capped as the tool caps them
for prefetch in (False, True):
    CASES[f"persistent chain of FP8 products{', prefetched' if prefetch else ''}"] = (
        bench_handover._chain_kernel, {"buf_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "ctr_ptr": "*i32",
                                       "err_ptr": "*i32"},
        {"N": 4096, "PHASES": 4, "BLOCK_N": 8, "STAGES": 3, "PREFETCH": prefetch},
        {"num_warps": 8, "num_stages": 1, "maxnreg": 128})
# tools/bench_layer_stream.py's persistent layer of FP8 products at Llama-3.1-8B's shape, the tiles it runs
LAYER_POINTERS = {"x_ptr": "*bf16", "qkv_ptr": "*bf16", "o_ptr": "*bf16", "act_ptr": "*bf16", "ctr_ptr": "*i32",
                  "err_ptr": "*i32", **{f"w{w}_ptr": "*fp8e4nv" for w in "qogd"},
                  **{f"s{w}_ptr": "*fp32" for w in "qogd"}}
# (registers capped where two programs of 8 warps share an SM, as the tool caps them)
for warps, bn_h, bn_i, prefetch, mlp_only in ((4, 4, 1, False, False), (8, 8, 2, True, False), (8, 4, 1, True, True)):
    layer_case = (f"persistent layer of FP8 products{' (MLP)' if mlp_only else ''}, {bn_h}/{bn_i}-row tiles, "
                  f"{warps} warps")
    CASES[layer_case + (", prefetched" if prefetch else "")] = (
        bench_layer_stream._layers_kernel, LAYER_POINTERS,
        {"H": 4096, "NQ": 6144, "I": 14336, "KP_I": 16384, "BN_H": bn_h, "BN_I": bn_i, "STAGES": 3,
         "PREFETCH": prefetch, "MLP_ONLY": mlp_only},
        {"num_warps": warps, "num_stages": 1, **({"maxnreg": 128} if warps == 8 else {})})

# the fused MoE's few-token form (each pair one row), PDL on: bf16 experts, FP8 with a scale a row and a block
ROWS_GATE_UP = {"x_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*bf16", "sc_ptr": "*bf16", "act_ptr": "*bf16"}
ROWS_DOWN = {"act_ptr": "*bf16", "ids_ptr": "*i64", "rw_ptr": "*fp32", "w_ptr": "*bf16", "sc_ptr": "*bf16",
             "y_ptr": "*bf16"}
FP8_EXPERTS = {"w_ptr": "*fp8e4nv", "sc_ptr": "*fp32"}
for label, pointers, tile, scales in (
        ("bf16", {}, gemv.ONE_ROW_TILES[1], {"HAS_SCALE": False, "SBN": 1, "SBK": 0}),
        ("FP8, a scale a row", FP8_EXPERTS, gemv.ONE_ROW_TILES_FP8[0], {"HAS_SCALE": True, "SBN": 1, "SBK": 0}),
        ("FP8, a scale a block", FP8_EXPERTS, gemv.ONE_ROW_TILES_FP8[0], {"HAS_SCALE": False, "SBN": 128,
                                                                          "SBK": 128})):
    launch = {"BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k, "FOLD": tile.fold, "PDL": True, **scales}
    CASES |= {
        f"few-token experts, {label}, gate ‖ up": (triton_moe._moe_gate_up_rows_kernel,
                                                    {**ROWS_GATE_UP, **pointers}, launch,
                                                    {"num_warps": tile.warps, "num_stages": tile.stages}),
        f"few-token experts, {label}, down": (triton_moe._moe_down_rows_kernel, {**ROWS_DOWN, **pointers}, launch,
                                               {"num_warps": tile.warps, "num_stages": tile.stages}),
    }

# DeepSeek's latent attention at the releases' widths (512 + 64), bf16 (triton_mla)
LATENT_BN, LATENT_WARPS, LATENT_STAGES = triton_mla.LATENT_DECODE_CONFIG
CASES |= {
    "latent rows, norm and rotary, 128 heads": (triton_mla._latent_rope_kernel, {
        "pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64", "q_ptr": "*bf16", "lat_ptr": "*bf16",
        "w_ptr": "*bf16", "qo_ptr": "*bf16", "kc_ptr": "*bf16"},
        {"NOPE": 128, "R": 512, "BLOCK_R": 512, "HALF": 32, "BLOCK_HALF": 32, "BLOCK_H": 128, "INTERLEAVE": True,
         "PDL": True}),
    "DeepSeek-V3's router product and routing in one launch": (triton_moe._router_kernel, {
        "x_ptr": "*bf16", "g_ptr": "*fp32", "bias_ptr": "*fp32", "logit_ptr": "*fp32", "cnt_ptr": "*i32",
        "w_ptr": "*fp32", "id_ptr": "*i64"},
        {"BLOCK_E": 256, "TILE_E": 2, "BLOCK_H": 512, "K": 8, "SIGMOID": True, "METHOD": 2, "HAS_BIAS": True, "NG": 8,
         "BLOCK_K": 8, "BLOCK_G": 8, "TOPK_GROUP": 4, "RENORM": True, "PDL": True}),
    "Qwen3-MoE's router product and routing in one launch": (triton_moe._router_kernel, {
        "x_ptr": "*bf16", "g_ptr": "*bf16", "bias_ptr": "*bf16", "logit_ptr": "*fp32", "cnt_ptr": "*i32",
        "w_ptr": "*fp32", "id_ptr": "*i64"},
        {"BLOCK_E": 128, "TILE_E": 4, "BLOCK_H": 512, "K": 8, "SIGMOID": False, "METHOD": 0, "HAS_BIAS": False,
         "NG": 1, "BLOCK_K": 8, "BLOCK_G": 2, "TOPK_GROUP": 1, "RENORM": True, "PDL": True}),
    "DeepSeek-V3's routing (256 experts, 8 groups, noaux_tc)": (triton_moe._grouped_topk_kernel, {
        "logit_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "id_ptr": "*i64"},
        {"BLOCK_E": 256, "K": 8, "SIGMOID": True, "METHOD": 2, "HAS_BIAS": True, "NG": 8, "BLOCK_K": 8, "BLOCK_G": 8,
         "TOPK_GROUP": 4, "RENORM": True, "PDL": True}),
} | {
    f"latent decode, {splits} key slice{'s' if splits > 1 else ''}": (triton_mla._latent_decode_kernel, {
        "q_ptr": "*bf16", "kc_ptr": "*bf16", "bt_ptr": "*i32", "len_ptr": "*i32", "out_ptr": "*bf16" if splits == 1
        else "*fp32", "lse_ptr": "*fp32"},
        {"R": 512, "BLOCK_R": 512, "P": 64, "BLOCK_P": 64, "BLOCK_H": triton_mla.LATENT_HEADS, "B": 32,
         "BLOCK_N": LATENT_BN, "SPLITS": splits, "PREC": "tf32", "PDL": True},
        {"num_warps": LATENT_WARPS, "num_stages": LATENT_STAGES})
    for splits in (1, 8)
} | {
    f"latent extend, {'key slices' if parts else 'one key slice'}": (triton_mla._latent_extend_kernel, {
        "q_ptr": "*bf16", "kc_ptr": "*bf16", "bt_ptr": "*i32", "qstart_ptr": "*i32", "len_ptr": "*i32",
        "out_ptr": "*fp32" if parts else "*bf16", "lse_ptr": "*fp32"},
        {"R": 512, "BLOCK_R": 512, "P": 64, "BLOCK_P": 64, "HB": triton_mla.LATENT_HEADS,
         "BLOCK_T": triton_mla.LATENT_EXTEND_CONFIG[0], "B": 32, "BLOCK_N": triton_mla.LATENT_EXTEND_CONFIG[1],
         "PARTS": parts, "PREC": "tf32", "PDL": True},
        dict(zip(("num_warps", "num_stages"), triton_mla.LATENT_EXTEND_CONFIG[2:], strict=True)))
    for parts in (False, True)
}


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("persistent layer")])
def test_the_persistent_layers_weight_loads_are_pipelined(case, compiled):
    """Its row tiles' loads go through shared memory ahead of use (the tile loop's stages), and
    two programs fit an SM's shared memory (the grid of two an SM must be resident at once)."""
    assert compiled[case]["error"] is None
    assert 0 < 2 * compiled[case]["shared"] <= SM90_SHARED


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_compile_for_sm90(case, compiled):
    assert compiled[case]["error"] is None, compiled[case]["error"]


SM90_SHARED = 232448    # bytes of shared memory an sm_90 (H100, H200) program may take


@pytest.mark.parametrize("case", [c for c in CASES if "prefill" in c or c.startswith(("latent decode", "latent ext"))])
def test_prefill_tiles_fit_an_sm90_sms_shared_memory(case, compiled):
    """The prefill kernel's tiles, the tall long-prompt ones and a float32 model's with 128-wide
    heads among them, take no more shared memory than an sm_90 SM has (a launch would fail)."""
    assert compiled[case]["error"] is None
    assert compiled[case]["shared"] <= SM90_SHARED, compiled[case]["shared"]


@pytest.mark.parametrize("case", [c for c in CASES if "over an FP8 pool" in c])
def test_attention_over_an_fp8_pool_reads_no_value_a_byte_at_a_time(case, compiled):
    """An FP8 value tile stored by rows reached the decode kernel's second dot through one
    single-byte shared-memory load per element; stored key-minor (values_key_minor) it comes in
    16-byte runs of keys, which a load masked key by key (or without the run hints) would turn
    into single-byte global loads."""
    assert compiled[case]["error"] is None
    assert compiled[case]["byte_loads"] == 0 and compiled[case]["global_byte_loads"] == 0
