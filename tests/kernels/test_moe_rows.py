"""The fused MoE's few-token form (``triton_moe.fused_moe_rows``: each (token, expert) pair one
row, a token's experts summed inside the down kernel) against ``reference.experts_ref``, in full
precision and with FP8 experts scaled per row and per block; experts of other ranks; the
dispatch from ``fused_moe`` by the plan; and the tuner's choice on a GPU. The interpreter at tiny
sizes on the CPU; a released shape on a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from test_triton_kernels import close, experts_case, mostly_close  # noqa: E402  (the general kernels' tolerances, beside this file)

from phalanx.kernels import fp8, triton_moe  # noqa: E402
from phalanx.kernels.linear_plan import MoeOneRows, MoePlan, OneRowTile  # noqa: E402
from phalanx.kernels.reference import experts_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
# (T, k, experts in all, first local, local): one rank's experts, and a rank holding half
CASES = [(1, 2, 4, 0, 4), (3, 3, 8, 4, 4), (2, 4, 6, 0, 3)]
# tiles: gate ‖ up rows interleaved (block_n // 2 of each), K steps wider and narrower than K
TILES = [MoeOneRows(OneRowTile(8, 16, 4, 2), OneRowTile(4, 32, 4, 3), 8),
         MoeOneRows(OneRowTile(16, 64, 4, 2, 4), OneRowTile(16, 16, 4, 2, 2), 8)]


def _experts(T: int, k: int, E: int, local: int, H: int, I: int, seed: int):  # noqa: E741 (I: intermediate size)
    return experts_case(T, k, E, local, H, I, seed, DTYPE)


@pytest.mark.parametrize("rows", TILES)
@pytest.mark.parametrize("T,k,E,first,local", CASES)
def test_few_token_experts_equal_the_reference(T, k, E, first, local, rows):
    # I and H end inside a program's rows and a K step (the tiles' masks); the released shape on a GPU
    H, I = (50, 42) if not CUDA else (2048, 1408)  # noqa: E741 (I: intermediate size)
    x, ids, w, w13, w2 = _experts(T, k, E, local, H, I, T * 10 + k)
    ref = experts_ref(x, ids, w, w13, w2, first)
    got = triton_moe.fused_moe_rows(x, ids, w, w13, w2, first, rows)
    close(got, ref, DTYPE)
    # a token with no expert on this rank gets zeros, not what the output's memory held
    if first > 0:
        far = torch.zeros_like(ids)   # every pair on expert 0, another rank's
        empty = torch.empty

        def nan_empty(*a, **kw):
            return empty(*a, **kw).fill_(float("nan"))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "empty", nan_empty)
            assert (triton_moe.fused_moe_rows(x, far, w, w13, w2, first, rows) == 0).all()
    # FP8 experts, a scale per output row, widened for the products (as the blocked form at this size)
    q13, s13 = fp8.quantize_weight(w13.float().reshape(-1, H))
    q2, s2 = fp8.quantize_weight(w2.float().reshape(-1, I))
    q13, q2, s13, s2 = q13.view(w13.shape), q2.view(w2.shape), s13.view(local, 2 * I), s2.view(local, H)
    ref8 = experts_ref(x, ids, w, q13, q2, first, s13, s2)
    mostly_close(triton_moe.fused_moe_rows(x, ids, w, q13, q2, first, rows, s13, s2), ref8, DTYPE, 1e-5)


@pytest.mark.parametrize("T,k,E,first,local", CASES[:2])
def test_few_token_experts_scaled_per_block(T, k, E, first, local):
    """Blocks of 16 × 16 (128 × 128 on a GPU): a program's gate rows and its up rows each in one
    block row, a K step spanning several block columns; H ends inside a block."""
    H, I = (40, 32) if not CUDA else (2048, 1408)  # noqa: E741 (I: intermediate size)
    block = (16, 16) if not CUDA else (128, 128)
    x, ids, w, w13, w2 = _experts(T, k, E, local, H, I, 7 + T)
    b13 = [fp8.quantize_blocks(w13[e].float(), block) for e in range(local)]
    b2 = [fp8.quantize_blocks(w2[e].float(), block) for e in range(local)]
    q13, s13 = (torch.stack(t) for t in zip(*b13, strict=True))
    q2, s2 = (torch.stack(t) for t in zip(*b2, strict=True))
    ref8 = experts_ref(x, ids, w, q13, q2, first, s13, s2, block=block)
    rows = MoeOneRows(OneRowTile(16, 32, 4, 2, 4), OneRowTile(8, 64, 4, 2, 8), 8)
    mostly_close(triton_moe.fused_moe_rows(x, ids, w, q13, q2, first, rows, s13, s2, block), ref8, DTYPE, 1e-5)
    # the blocked form gives the same result, through fused_moe with no few-token form in the plan
    blocked = triton_moe.fused_moe(x, ids, w, q13, q2, first, MoePlan(), s13, s2, a8=False, block=block)
    mostly_close(blocked, ref8, DTYPE, 1e-5)
    # a tile whose up rows would straddle two block rows is refused, by the fit rule and by the launcher
    wide = MoeOneRows(OneRowTile(2 * block[0] * 2, 32, 4, 2), rows.down, 8)
    assert not triton_moe.rows_take(wide, I, block)
    with pytest.raises(ValueError, match="do not fit"):
        triton_moe.fused_moe_rows(x, ids, w, q13, q2, first, wide, s13, s2, block)


def test_fused_moe_takes_the_few_token_form_up_to_the_plans_bound(monkeypatch):
    """``fused_moe`` runs the few-token form for steps of at most ``max_tokens`` tokens, the
    blocked form above, and the blocked form whenever FP8 products are asked for (W8A8)."""
    H, I, E, k = 32, 24, 6, 2  # noqa: E741 (I: intermediate size)
    rows = MoeOneRows(OneRowTile(8, 16, 4, 2), OneRowTile(8, 16, 4, 2), 2)
    plan = MoePlan(MoePlan().tiles, rows)
    taken = []
    real = triton_moe.fused_moe_rows
    monkeypatch.setattr(triton_moe, "fused_moe_rows", lambda *a, **kw: taken.append(a[0].shape[0]) or real(*a, **kw))
    for T in (1, 2, 3):
        x, ids, w, w13, w2 = _experts(T, k, E, E, H, I, T)
        close(triton_moe.fused_moe(x, ids, w, w13, w2, 0, plan), experts_ref(x, ids, w, w13, w2, 0), DTYPE)
    assert taken == [1, 2]
    q13, s13 = fp8.quantize_weight(w13.float().reshape(-1, H))
    q2, s2 = fp8.quantize_weight(w2.float().reshape(-1, I))
    x = x[:1]
    triton_moe.fused_moe(x, ids[:1], w[:1], q13.view(w13.shape), q2.view(w2.shape), 0, plan, s13.view(E, -1),
                         s2.view(E, -1), a8=True)
    assert taken == [1, 2]


@pytest.mark.skipif(not CUDA, reason="tuning times CUDA graphs")
def test_tuning_times_the_few_token_form_against_the_blocked_one():
    """A DeepSeek-V2-Lite-sized layer (64 experts, top 6): the tuner's few-token tiles are
    candidates that fit, its bound one of the timed sizes, and the tuned plan's result equals the
    reference at one token."""
    from phalanx.kernels.gemv import ONE_ROW_TILES
    E, H, I, k = 64, 2048, 1408, 6  # noqa: E741 (I: intermediate size)
    w13 = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) / I ** 0.5
    plan = triton_moe.tune(w13, w2, k, E, 0)
    if plan.rows is not None:
        assert plan.rows.gate_up in ONE_ROW_TILES and plan.rows.down in ONE_ROW_TILES
        assert plan.rows.max_tokens in triton_moe.ROWS_TOKENS
    x, ids, w, _, _ = _experts(1, k, E, E, H, I, 1)
    close(triton_moe.fused_moe(x, ids, w, w13, w2, 0, plan), experts_ref(x, ids, w, w13, w2, 0), DTYPE)


@pytest.mark.parametrize("E,k,renorm", [(128, 8, True), (8, 2, True), (60, 4, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_routing_in_one_kernel_equals_the_torch_ops(E, k, renorm, dtype):
    """Qwen3-MoE's, Mixtral's and Qwen2-MoE's routing (``SparseMoE.route``) through the routing
    kernel: the logits in the model's dtype read as float32, softmax, the k best, renormalised
    where the config says — the experts torch.topk picks, in its order, and the same weights."""
    from phalanx.kernels import ops
    g = torch.Generator().manual_seed(E * k)
    logits = (torch.randn(5, E, generator=g) * 2).to(DEV, dtype)
    w, ids = triton_moe.grouped_topk(logits, None, k, False, "greedy", 1, 1, renorm, 1.0)
    ref_w, ref_ids = logits.float().softmax(dim=-1).topk(k, dim=-1)
    if renorm:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    assert ids.equal(ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    w2, ids2 = ops.grouped_topk(logits.cpu(), None, k, False, "greedy", 1, 1, renorm, 1.0)  # the CPU engine's path
    assert ids2.equal(ref_ids.cpu())
    torch.testing.assert_close(w2, ref_w.cpu(), atol=1e-6, rtol=1e-5)


def test_qwen3_moe_on_the_triton_path_equals_transformers(tiny_moe_models, hf_moe_models, monkeypatch):
    """The engine on the Triton kernels (the interpreter on the CPU) with every MoE layer's plan
    giving the few-token form up to two tokens: decode steps of one and two sequences take it,
    prompt steps the blocked form; decode steps route in one launch with the router's product,
    and the q/k norms run inside the rotary's launch. Greedy tokens equal transformers'."""
    from hf_reference import assert_same_greedy, hf_greedy
    from phalanx import LLM, SamplingParams
    from phalanx.kernels import ops, triton_attention, triton_ops
    from phalanx.models.moe import SparseMoE
    monkeypatch.setattr(ops, "FORCE_TRITON", True)
    if not CUDA:   # (as the dense model's Triton test: prompt steps take the prefill kernel)
        monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 2)
    calls: dict[str, list[int]] = {}

    def counting(mod, name, rows_of):
        real = getattr(mod, name)

        def wrapper(*a, **kw):
            calls.setdefault(name, []).append(rows_of(a, kw))
            return real(*a, **kw)
        monkeypatch.setattr(mod, name, wrapper)

    counting(triton_moe, "fused_moe_rows", lambda a, kw: a[0].shape[0])
    counting(triton_moe, "align", lambda a, kw: a[0].shape[0])
    counting(triton_moe, "grouped_topk", lambda a, kw: a[0].shape[0])
    counting(triton_moe, "route", lambda a, kw: a[0].shape[0])
    counting(triton_ops, "rope_and_write_kv", lambda a, kw: int(kw.get("qk_norm", a[9] if len(a) > 9 else None)
                                                               is not None))
    prompts = [[3, 1, 4, 1, 5], list(range(10, 40))]
    rows = MoeOneRows(OneRowTile(8, 16, 4, 2), OneRowTile(8, 16, 4, 2), 2)
    with LLM(tiny_moe_models["qwen3_moe"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             dtype="float32", cuda_graph_config=None) as llm:
        for m in llm._executor.engine.runner.model.modules():
            if isinstance(m, SparseMoE):
                m.moe_plan = MoePlan(m.moe_plan.tiles, rows)
        calls.clear()   # (on a GPU the start-up's tuner timed both forms)
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    hf = hf_moe_models["qwen3_moe"]
    for p, o in zip(prompts, outs, strict=True):
        ref, gaps = hf_greedy(hf, p, 5)
        assert_same_greedy(o.outputs[0].token_ids, ref, gaps)
    assert calls["fused_moe_rows"] and set(calls["fused_moe_rows"]) <= {1, 2}, calls["fused_moe_rows"]
    assert calls["align"] and min(calls["align"]) > 2                 # the prompt steps: blocked
    # a few tokens routed in one launch with the router's product, more after it
    assert calls["route"] and max(calls["route"]) <= 16 and min(calls.get("grouped_topk", [17])) > 16
    routed = len(calls["route"]) + len(calls.get("grouped_topk", []))
    assert routed == len(calls["fused_moe_rows"]) + len(calls["align"])
    assert calls["rope_and_write_kv"] and all(calls["rope_and_write_kv"])   # every layer's q/k norms fused


# (experts, top_k, sigmoid, method, n_group, topk_group, renormalize, scaling, bias, the router's dtype)
ROUTER_CASES = [(64, 6, False, "greedy", 1, 1, False, 1.0, False, torch.float32),              # V2-Lite
                (256, 8, True, "noaux_tc", 8, 4, True, 2.5, True, torch.float32),                # V3
                (128, 8, False, "greedy", 1, 1, True, 1.0, False, torch.bfloat16),               # Qwen3-MoE
                (12, 2, False, "group_limited_greedy", 3, 1, True, 1.0, False, torch.float32)]


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_product_and_routing_in_one_launch(case, monkeypatch):
    """``triton_moe.route``: every token's logits over several programs (the last to finish routes
    it), equal to ``F.linear`` of x in the router's dtype then the routing kernel; the counters
    are left zero for the next layer's launch, and a step of more tokens than counters is refused."""
    import torch.nn.functional as F
    E, k, sigmoid, method, n_group, topk_group, renorm, scaling, has_bias, gate_dtype = case
    H = 96 if not CUDA else 2048
    g = torch.Generator().manual_seed(E)
    x = torch.randn(5, H, generator=g).to(DEV, torch.bfloat16 if gate_dtype == torch.bfloat16 else DTYPE)
    gate = (torch.randn(E, H, generator=g) / H ** 0.5).to(DEV, gate_dtype)
    bias = (torch.randn(E, generator=g) * 0.3).to(DEV) if has_bias else None
    counts = torch.zeros(8, dtype=torch.int32, device=DEV)
    args = (k, sigmoid, method, n_group, topk_group, renorm, scaling)
    if not CUDA:   # two rows a program: several programs a token at these sizes too
        monkeypatch.setattr(triton_moe, "ROUTER_TILE_BYTES", 2 * H * gate.element_size())
    assert triton_moe.ROUTER_TILE_BYTES // (H * gate.element_size()) < E
    w, ids = triton_moe.route(x, gate, bias, counts, *args)
    logits = F.linear(x.to(gate_dtype), gate)
    ref_w, ref_ids = triton_moe.grouped_topk(logits, bias, *args)
    if gate_dtype == torch.bfloat16:   # logits rounded to bf16 tie often, and sums in another order
        # may round a logit the other way: the picked experts' logits are the best ones to a bf16 step
        torch.testing.assert_close(logits.float().gather(1, ids), logits.float().topk(k).values, atol=0,
                                   rtol=2 ** -7)
        torch.testing.assert_close(w.sort().values, ref_w.sort().values, atol=0, rtol=5e-2)
    else:
        assert ids.equal(ref_ids)
        torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-4)
    assert (counts == 0).all()
    w2, ids2 = triton_moe.route(x, gate, bias, counts, *args)      # the counters serve again
    assert ids2.equal(ids) and w2.equal(w)
    with pytest.raises(ValueError, match="router counters"):
        triton_moe.route(torch.cat([x, x]), gate, bias, counts, *args)


def test_router_logits_are_rounded_to_the_routers_dtype():
    """As ``F.linear`` of bf16 x by a bf16 router gives them: expert 1's logit 1 + 2^-9 rounds to
    expert 0's 1.0, and of the tie the lower index is picked — float32 logits would pick expert 1."""
    x = torch.zeros(1, 16, dtype=torch.bfloat16, device=DEV)
    x[0, :2] = 1.0
    gate = torch.zeros(4, 16, dtype=torch.bfloat16, device=DEV)
    gate[0, 0], gate[1, 0], gate[1, 1], gate[2, 0] = 1.0, 1.0, 2 ** -9, 0.5
    counts = torch.zeros(1, dtype=torch.int32, device=DEV)
    w, ids = triton_moe.route(x, gate, None, counts, 1, False, "greedy", 1, 1, False, 1.0)
    assert ids.tolist() == [[0]]
