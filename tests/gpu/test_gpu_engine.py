"""GPU-only: CUDA graphs vs eager, end-to-end greedy equality with transformers on the GPU,
KV pool sized by profiling. Skipped without CUDA."""

import json

import pytest
import torch

from hf_reference import assert_same_greedy, fp8_round_trip, hf_greedy, write_fp8_checkpoint, write_plain_twin
from phalanx import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def prompts(vocab, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_gpu_greedy_equals_transformers_fp32(kind, tiny_models, hf_models):
    hf = hf_models[kind].to("cuda")
    ps = prompts(hf.config.vocab_size)
    with LLM(tiny_models[kind], skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess") as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
        again = llm.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert llm.engine_info.num_kv_blocks > 0
    for i, (p, o, o2) in enumerate(zip(ps, outs, again, strict=True)):
        ref, gaps = hf_greedy(hf, p, 12)
        assert_same_greedy(o.outputs[0].token_ids, ref, gaps, f"{kind} prompt {i}")
        assert_same_greedy(o2.outputs[0].token_ids, ref, gaps, f"{kind} prompt {i} (cached)")
    hf.to("cpu")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_graph_and_eager_give_identical_tokens(dtype, tiny_models):
    ps = prompts(256, n=20, seed=1)
    sp = [SamplingParams(max_tokens=4 + i % 9, ignore_eos=True) for i in range(len(ps))]
    out = {}
    for graphs in (True, False):
        cfg = {"batch_sizes": [1, 2, 4, 8, 16]} if graphs else None
        with LLM(tiny_models["qwen2"], skip_tokenizer_init=True, dtype=dtype, orchestrator_type="inprocess",
                 cuda_graph_config=cfg) as llm:
            runner = llm._executor.engine.runner
            assert (runner.graphs is not None) == graphs
            out[graphs] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    assert out[True] == out[False]


@pytest.mark.parametrize("kv,weights,max_num_tokens,draft", [("auto", None, 64, None), ("fp8", None, 64, None),
                                                              ("fp8", "fp8", 128, None), ("auto", None, 64, "qwen3"),
                                                              ("auto", "fp8-block", 128, None)])
def test_no_kernel_compiles_while_serving(kv, weights, max_num_tokens, draft, tiny_models, tmp_path):
    """Every kernel form a step can need exists once start-up is over: a compile (a second or so)
    in the middle of a step stalls every request in it. Chunked prompts beside decode rows (a
    mixed step's extend rows start at an odd row), prefix hits copying part of a block, and every
    count of sampled rows; the step timing lists the compiles made while it ran. The engine runs
    in an MPI rank of its own: in this process, forms an earlier test compiled would hide a gap.
    With FP8 weights, steps of more than 64 rows take the norms and the SiLU-and-mul that quantize.
    With a draft model of another head size (32 against 16), the draft's prompt and decode steps
    over its own pool take attention forms of their own. A block-scaled FP8 checkpoint's steps of
    more than 64 rows take the block GEMM, on rows of any count."""
    model = tiny_models["llama"]
    if weights == "fp8-block":
        write_fp8_checkpoint(model, tmp_path / "ckpt", (16, 32))
        model, weights = str(tmp_path / "ckpt"), None
    ps = prompts(256, n=24, seed=7)
    shared = [ps[i % 4][:20] + p for i, p in enumerate(prompts(256, n=16, seed=8))]   # hits inside a block
    sp = [SamplingParams(max_tokens=3 + i % 11, ignore_eos=True) for i in range(len(ps))]
    spec = None if draft is None else {"decoding_type": "DraftTarget", "max_draft_len": 3, "adaptive": False,
                                       "speculative_model_dir": tiny_models[draft]}    # every step drafts
    with LLM(model, skip_tokenizer_init=True, dtype="bfloat16", quantization=weights,
             max_num_tokens=max_num_tokens, kv_cache_config={"dtype": kv, "max_gpu_total_bytes": 16 << 20},
             cuda_graph_config={"batch_sizes": [1, 2, 4, 8]}, speculative_config=spec) as llm:
        llm.control("timing:on")
        llm.generate(ps, sp, use_tqdm=False)
        llm.generate(shared, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        report = json.loads(llm.control("timing").per_rank[0])
        assert llm.check_integrity() == ["ok"]
    assert report["steps"] > 20 and report["by_kind"]["prompt"]["decode_rows"] > 0   # mixed steps ran
    assert report["compiled"] == []


def test_kv_pool_sized_by_profiling(tiny_models):
    for fraction in (0.05, 0.10):
        with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
                 kv_cache_config={"free_gpu_memory_fraction": fraction}) as llm:
            info = llm.engine_info
            pool = llm._executor.engine.runner.kv_pool.tensor
            block_bytes = pool[:, :, 0].numel() * pool.element_size()
        s = info.startup
        assert s["profile_tokens"] > 0 and s["activation_peak_gib"] > 0
        expected = fraction * (s["free_after_weights_gib"] - s["activation_peak_gib"])
        assert abs(s["kv_budget_gib"] - expected) < 1e-6 * max(1.0, expected)
        assert info.num_kv_blocks == int(s["kv_budget_gib"] * 2**30) // block_bytes


def test_profiled_peak_covers_a_step_that_samples_its_most_rows(tmp_path):
    """The pool takes a fraction of what the profiling run leaves, so that run must allocate at
    least what any step does. With Llama-3's 128,256-token vocabulary and a tiny body, a step's
    sampling is its peak: 512 rows of logits, sampled 256 at a time with top-k, top-p, min-p,
    penalties, a bias, a seed and 20 logprobs, each chunk holding several [256, 128256] float32
    temporaries (~130 MB each). The peak of such steps stays within the profiled one but for
    1 %: a step holds a few MB beside them that the profiling run does not build, which the
    fraction's headroom holds."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=128256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path)
    sp = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.8, top_k=40, top_p=0.9, min_p=0.05,
                         repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3,
                         logit_bias={7: 2.0}, logprobs=20, seed=i) for i in range(512)]
    with LLM(str(tmp_path), skip_tokenizer_init=True, orchestrator_type="inprocess", max_batch_size=512,
             max_num_tokens=1024, cuda_graph_config=None) as llm:
        profiled = llm.engine_info.startup["activation_peak_gib"] * 2**30
        batch = [[i + 1, 2] for i in range(512)]
        # once first: what the first steps of a shape allocate for good (a library's workspace
        # on the engine's stream) stays out of the step's own peak
        llm.generate(batch, sp, use_tqdm=False)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        outs = llm.generate(batch, sp, use_tqdm=False)   # steps of 512 sampled rows
        torch.cuda.synchronize()
        step_peak = torch.cuda.max_memory_allocated() - base
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert step_peak > 2 * 512 * 128256 * 4, step_peak   # the sampling's temporaries were there to see
    assert step_peak <= 1.01 * profiled, (step_peak / 2**20, profiled / 2**20)


def test_mpi_rank_on_the_gpu_serves(tiny_models, hf_models):
    p = [5, 6, 7, 8, 9]
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32") as llm:
        out = llm.generate(p, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert llm._executor.check_integrity() == ["ok"]
    ref, gaps = hf_greedy(hf_models["llama"].to("cpu"), p, 8)
    assert_same_greedy(out.outputs[0].token_ids, ref, gaps)


def _graph_workload_matches_transformers(tiny_models, hf_models, graphs: dict, max_num_tokens: int, seed: int,
                                         max_tokens: int, label: str, spread: int = 7):
    """Six prompts after a cached 72-token prefix, ten short prompts and one of 200 tokens, run
    together through an engine with ``graphs`` (cuda_graph_config, decode graphs up to 8): its
    greedy tokens are transformers', the KV pool intact. Returns the engine's runner."""
    shared = list(range(3, 75))
    ps = [shared + [100 + i] * (i + 1) for i in range(6)] + prompts(256, n=10, seed=seed) + [list(range(7, 207))]
    sp = [SamplingParams(max_tokens=max_tokens + i % spread, ignore_eos=True) for i in range(len(ps))]
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
             max_num_tokens=max_num_tokens, kv_cache_config={"tokens_per_block": 16},
             cuda_graph_config={"batch_sizes": [1, 2, 4, 8], **graphs}) as llm:
        llm.generate(shared, SamplingParams(max_tokens=1), use_tqdm=False)      # the prefix is cached now
        outs = llm.generate(ps, sp, use_tqdm=False)
        runner = llm._executor.engine.runner
        assert llm.check_integrity() == ["ok"]
    assert sum(o.cached_tokens for o in outs) >= 6 * 64
    hf = hf_models["llama"].to("cuda")
    try:
        for i, (p, o, s) in enumerate(zip(ps, outs, sp, strict=True)):
            ref, gaps = hf_greedy(hf, p, s.max_tokens)
            assert_same_greedy(o.outputs[0].token_ids, ref, gaps, f"prompt {i}, {label}")
    finally:
        hf.to("cpu")
    return runner


def test_extend_graphs_match_transformers_with_prefix_hits_chunks_and_mixed_steps(tiny_models, hf_models):
    """Prompts, chunks of prompts and new tokens after cached prefixes, alone and mixed with
    decodes, replay extend graphs (up to 4 sequences, 96 tokens) and give transformers' tokens;
    with extend graphs off the same steps run eagerly."""
    for extend in ([16, 32, 64, 96], []):
        runner = _graph_workload_matches_transformers(
            tiny_models, hf_models, {"extend_num_tokens": extend, "extend_max_seqs": 4, "piecewise_num_tokens": []},
            max_num_tokens=96, seed=4, max_tokens=3, label=f"extend graphs {extend}")
        assert (runner.num_extend_graph_steps > 0) == bool(extend)


def test_piecewise_graphs_match_transformers_and_eager_on_mixed_and_large_decode_steps(tiny_models, hf_models):
    """Steps no decode or extend graph holds — prompt chunks among more decoding sequences than an
    extend graph takes, new tokens after cached prefixes, decode batches past the largest decode
    graph — replay piecewise graphs (attention eager between them) and give transformers' greedy
    tokens, as the same engine without them (eager) does."""
    for pieces in ([32, 64, 128], []):
        runner = _graph_workload_matches_transformers(
            tiny_models, hf_models,
            {"extend_num_tokens": [16, 32], "extend_max_seqs": 2, "piecewise_num_tokens": pieces},
            max_num_tokens=128, seed=5, max_tokens=4, spread=9, label=f"piecewise graphs {pieces}")
        assert (runner.num_piecewise_steps > 0) == bool(pieces)


def test_sampling_never_waits_for_the_stream():
    """Every sampling path (grammar mask with a padded output layer, logit bias, banned tokens,
    penalties, top-k/p) queues its work without a stream synchronization: under the overlap loop a
    wait there stalls the GPU for the host's whole step (a scalar fill once cost 3 ms a step)."""
    import xgrammar as xgr

    from helpers import make_request
    from phalanx.pyexecutor.sampler import Sampler, TokenMask

    V, real = 1000, 960
    sampler = Sampler(V, torch.device("cuda"))
    reqs = [make_request(8, temperature=0.0), make_request(8, temperature=0.8, top_k=20, top_p=0.9, seed=3),
            make_request(8, eos=(2,), logit_bias={5: 3.0}, min_tokens=4, repetition_penalty=1.2,
                         presence_penalty=0.5)]
    reqs[2].append_token(7)
    bits = xgr.allocate_token_bitmask(3, real).pin_memory()
    bits.fill_(-1)
    logits = torch.randn(3, V, device="cuda")
    sampler.sample(logits.clone(), reqs, bitmask=TokenMask(bits, [0, 2], real))    # warm the kernels up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler.sample(logits.clone(), reqs, bitmask=TokenMask(bits, [0, 2], real))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids[0].item() < real and out.token_ids[2].item() < real


def test_staging_gives_each_array_back_on_the_device_through_its_reused_buffers():
    """A step's host arrays (int64 and int32, 1-D and 2-D, empty ones) come back equal on the
    device through the staging ring: over more calls than it has slots, with a call larger than
    its slot's buffers, and with the host buffers rewritten while earlier copies' results are
    still alive (each call's tensors must keep their own values)."""
    import numpy as np

    from phalanx.pyexecutor.model_runner import Staging

    stage = Staging(torch.device("cuda"))
    rng = np.random.default_rng(0)
    kept = []
    for call in range(3 * Staging.SLOTS):
        n = 40_000 if call == 5 else int(rng.integers(1, 300))      # call 5: past the slot's first size
        arrays = [rng.integers(0, 1 << 40, n, dtype=np.int64), rng.integers(0, 1 << 30, (3, n), dtype=np.int32),
                  np.zeros(0, np.int64), rng.integers(-5, 5, n + 1, dtype=np.int32), np.arange(7, dtype=np.int64)]
        out = stage(arrays)
        assert [t.dtype for t in out] == [torch.int64, torch.int32, torch.int64, torch.int32, torch.int64]
        kept.append((arrays, out))
        kept = kept[-2:]                # two steps in flight at most, as in the overlap loop
        for host, dev in kept:
            for a, t in zip(host, dev, strict=True):
                assert tuple(t.shape) == a.shape and np.array_equal(t.cpu().numpy(), a)


def test_fp8_greedy_equals_transformers_with_the_round_tripped_weights_on_the_gpu(tiny_models, hf_models):
    """quantization: fp8 on the GPU (tuned skinny FP8 kernels in CUDA graphs, fp32 activations):
    the tokens of transformers on the same checkpoint with each projection's FP8 round trip."""
    ref = fp8_round_trip(hf_models["llama"]).to("cuda")
    ps = prompts(ref.config.vocab_size, n=8, seed=4)
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32", quantization="fp8",
             orchestrator_type="inprocess", cuda_graph_config={"batch_sizes": [1, 2, 4, 8]}) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
        one = llm.generate(ps[:1], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        want, gaps = hf_greedy(ref, p, 10)
        assert_same_greedy(o.outputs[0].token_ids, want, gaps, f"prompt {i}")
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_fp8_rows_quantized_by_the_norms_give_the_tokens_of_the_quantization_apart(tiny_models):
    """bf16 activations and FP8 weights: prompt steps of more than 64 rows multiply on cuBLASLt
    rows that the norms quantize in their own kernel. The same engine with the norms' hand-over
    turned off (the row quantization kernel apart, as before) gives the same tokens. (The
    SiLU-and-mul's quantized rows are compared byte for byte with the kernels apart in
    tests/kernels.) Each prompt goes alone, so that both runs multiply the same rows in the same
    GEMMs: a batch the executor happened to split differently would reach cuBLASLt with other
    row counts, whose algorithms may sum in another order."""
    from phalanx.models.layers import RMSNorm
    g = torch.Generator().manual_seed(10)
    ps = [torch.randint(0, 256, (70 + 17 * i,), generator=g).tolist() for i in range(6)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="bfloat16", quantization="fp8",
             orchestrator_type="inprocess", cuda_graph_config=None,
             kv_cache_config={"enable_block_reuse": False}) as llm:
        model = llm._executor.engine.runner.model
        norms = [m for m in model.modules() if isinstance(m, RMSNorm) and m.fp8_rows_above is not None]
        assert len(norms) == 2 * model.config.num_layers and {m.fp8_rows_above for m in norms} == {64}
        fused = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
        for m in norms:
            m.fp8_rows_above = None
        apart = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
    assert fused == apart


def test_fp8_kv_pool_on_the_gpu_holds_more_blocks_and_keeps_the_greedy_tokens_close(tiny_models):
    """kv_cache_config dtype fp8 with bf16 activations and CUDA graphs (the rope + K/V write, decode,
    extend kernels over an e4m3 pool): twice the blocks of a bf16 pool in the same bytes, and
    greedy tokens mostly those of the bf16 pool (K and V rounded to 3 mantissa bits)."""
    ps = prompts(256, n=8, seed=6)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    out, blocks = {}, {}
    for kv in ("auto", "fp8"):
        with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="bfloat16", orchestrator_type="inprocess",
                 kv_cache_config={"dtype": kv, "max_gpu_total_bytes": 8 << 20},
                 cuda_graph_config={"batch_sizes": [1, 2, 4, 8]}) as llm:
            out[kv] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
            blocks[kv] = llm.engine_info.num_kv_blocks
    assert blocks["fp8"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1)   # the budget's floor division
    first = sum(a[0] == b[0] for a, b in zip(out["auto"], out["fp8"], strict=True))
    same = sum(a == b for a, b in zip(out["auto"], out["fp8"], strict=True))
    assert first >= 7 and same >= 4, (first, same)


def test_fp8_experts_greedy_equals_transformers_on_the_gpu(tiny_moe_models, hf_moe_models):
    """quantization: fp8 on an MoE model on the GPU: the fused MoE kernels read e4m3 experts with a
    scale per (expert, output row); transformers holding the round-tripped experts agrees."""
    ref = fp8_round_trip(hf_moe_models["qwen3_moe"]).to("cuda")
    ps = prompts(ref.config.vocab_size, n=4, seed=2)
    with LLM(tiny_moe_models["qwen3_moe"], skip_tokenizer_init=True, dtype="float32", quantization="fp8",
             orchestrator_type="inprocess", cuda_graph_config={"batch_sizes": [1, 2, 4]}) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        want, gaps = hf_greedy(ref, p, 8)
        assert_same_greedy(o.outputs[0].token_ids, want, gaps, f"qwen3_moe prompt {i}")


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_block_scaled_fp8_checkpoints_serve_what_they_store_on_the_gpu(kind, tiny_models, tiny_moe_models, tmp_path):
    """A block-scaled FP8 checkpoint on the GPU (blocks of 16 x 32 kept as they are: the tuned
    skinny kernels, the one-token q/k/v and gate ‖ up paths and the fused MoE kernels scaling by
    block, in CUDA graphs, fp32 activations): the tokens of transformers holding the weights the
    checkpoint stands for. Steps of at most 32 tokens keep the experts' (token, expert) pairs
    under ``triton_moe.A8_MIN_PAIRS``, where they would multiply activations rounded to FP8,
    which transformers does not (a first run with whole prompts in a step differed at a gap of
    0.025)."""
    from transformers import AutoModelForCausalLM

    from phalanx.models.layers import Projection
    src = tiny_moe_models[kind] if kind == "qwen3_moe" else tiny_models[kind]
    meant = write_fp8_checkpoint(src, tmp_path / "ckpt", (16, 32))
    ref = AutoModelForCausalLM.from_pretrained(write_plain_twin(src, tmp_path / "plain", meant),
                                               dtype=torch.float32).eval().to("cuda")
    ps = prompts(ref.config.vocab_size, n=6, seed=7)
    with LLM(str(tmp_path / "ckpt"), skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
             max_num_tokens=32, cuda_graph_config={"batch_sizes": [1, 2, 4, 8]}) as llm:
        model = llm._executor.engine.runner.model
        projections = [m for m in model.modules() if isinstance(m, Projection) and m.plan.fp8]
        assert projections and all(m.plan.block == (16, 32) for m in projections)
        outs = llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
        one = llm.generate(ps[:1], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        want, gaps = hf_greedy(ref, p, 10)
        assert_same_greedy(o.outputs[0].token_ids, want, gaps, f"{kind} prompt {i}")
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
