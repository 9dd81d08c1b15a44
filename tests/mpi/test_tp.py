"""Tensor parallelism under mpirun (gloo on CPU): TP=2 greedy tokens equal transformers (and so
TP=1), for tiny random models and for the bundled SmolLM2 (9 heads, 3 KV heads: split unevenly)."""

import json

import pytest
import torch

from hf_reference import assert_same_greedy, assert_tp2_greedy, fp8_round_trip, hf_greedy
from phalanx import LLM, SamplingParams

pytestmark = pytest.mark.mpi


def prompts(vocab):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (2, 7, 19, 40)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_tp2_tiny_models_equal_transformers(kind, tiny_models, hf_models):
    hf = hf_models[kind]
    ps = prompts(hf.config.vocab_size)
    with LLM(tiny_models[kind], tensor_parallel_size=2, skip_tokenizer_init=True,
             kv_cache_config={"tokens_per_block": 8}, max_num_tokens=24) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
        for i, (p, out) in enumerate(zip(ps, outs, strict=True)):
            ref, gaps = hf_greedy(hf, p, 10)
            assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"{kind} TP=2 prompt {i}")
        assert llm._executor.check_integrity() == ["ok", "ok"]


def test_tp2_smollm2_chat_equals_transformers_and_tp1(smollm2_hf):
    questions = ["What is the capital of France?", "Name three fruits.", "What is 2 + 2?"]
    sp = SamplingParams(max_tokens=32, temperature=0.0)
    with LLM(tensor_parallel_size=2) as llm:
        prompts_ = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        tp2 = [o.outputs[0].token_ids for o in llm.generate(prompts_, sp, use_tqdm=False)]
        tok = llm.tokenizer
    hf = smollm2_hf
    for p, ours in zip(prompts_, tp2, strict=True):
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                              eos_token_id=list(tok.eos_token_ids))[0, ids.shape[1]:].tolist()
        assert ours == ref, (tok.decode(ours), tok.decode(ref))
    with LLM(tensor_parallel_size=1) as llm1:
        tp1 = [o.outputs[0].token_ids for o in llm1.generate(prompts_, sp, use_tqdm=False)]
    assert tp1 == tp2


def test_tp2_sync_loop_equals_overlap_loop(tiny_models):
    ps = prompts(256) + [[7] * 33]
    sp = [SamplingParams(max_tokens=3 + i * 4, ignore_eos=True) for i in range(len(ps))]
    outs = {}
    for overlap in (False, True):
        with LLM(tiny_models["qwen3"], tensor_parallel_size=2, skip_tokenizer_init=True,
                 disable_overlap_scheduler=not overlap, max_num_tokens=16) as llm:
            outs[overlap] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
            assert llm._executor.check_integrity() == ["ok", "ok"]
    assert outs[True] == outs[False]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_tp2_speculative_decoding_equals_transformers(proposer, tiny_models, hf_models):
    """Both ranks verify, accept (rank 0's tokens) and propose alike: greedy tokens equal
    transformers, with the overlap loop on, chunked prefill and a repeating prompt."""
    hf = hf_models["llama"]
    ps = prompts(hf.config.vocab_size) + [[100] * 10]
    spec = ({"decoding_type": "NGram", "max_draft_len": 3, "adaptive": False} if proposer == "ngram" else
            {"decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": tiny_models["llama"],
             "adaptive": False})
    with LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True, max_num_tokens=24,
             kv_cache_config={"tokens_per_block": 8}, speculative_config=spec) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
        for i, (p, out) in enumerate(zip(ps, outs, strict=True)):
            ref, gaps = hf_greedy(hf, p, 12)
            assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"{proposer} TP=2 prompt {i}")
        assert llm._executor.check_integrity() == ["ok", "ok"]
        stats = [json.loads(r) for r in llm.control("stats").per_rank]
    assert stats[0]["spec_accepted_drafts"] == stats[1]["spec_accepted_drafts"] > 0


def test_tp2_fp8_each_rank_quantizes_its_shard(tiny_models, hf_models):
    """quantization: fp8 under TP=2: every rank quantizes the shard it holds, a scale per output
    row of that shard — the same rows as unsharded for the column-split projections (q, k, v,
    gate, up), each half of the inputs apart for the row-split ones (o, down). Greedy tokens
    equal transformers' holding exactly those round trips, and the prompts' log-probs equal
    theirs within 1e-4 while those of the unsharded round trip are measurably elsewhere."""
    from phalanx.kernels import fp8
    from phalanx.models.parallel import split_range

    whole = fp8_round_trip(hf_models["llama"])
    sharded = fp8_round_trip(hf_models["llama"])
    with torch.no_grad():    # o and down: each rank's half of the inputs quantized apart
        for name, mod in sharded.named_modules():
            if name.rsplit(".", 1)[-1] in ("o_proj", "down_proj"):
                w = dict(hf_models["llama"].named_modules())[name].weight
                for r in range(2):
                    s, e = split_range(w.shape[1], r, 2)
                    mod.weight[:, s:e] = fp8.dequantize(*fp8.quantize_weight(w[:, s:e]), w.dtype)
    ps = prompts(sharded.config.vocab_size)
    with LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True, quantization="fp8",
             kv_cache_config={"tokens_per_block": 8}) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True, prompt_logprobs=0), use_tqdm=False)
    off_whole = 0.0
    for i, (p, out) in enumerate(zip(ps, outs, strict=True)):
        ref, gaps = hf_greedy(sharded, p, 10)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"FP8 TP=2 prompt {i}")
        if len(p) < 2:
            continue
        ours = torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], p[1:], strict=True)])
        with torch.no_grad():
            for model, tol in ((sharded, 1e-4), (whole, None)):
                theirs = model(torch.tensor([p])).logits[0, :-1].log_softmax(-1)
                theirs = theirs.gather(1, torch.tensor(p[1:])[:, None])[:, 0]
                if tol is not None:
                    torch.testing.assert_close(ours, theirs, atol=tol, rtol=0)
                else:
                    off_whole = max(off_whole, (ours - theirs).abs().max().item())
    assert off_whole > 1e-3      # the row-split projections really were quantized per shard


def test_tp2_lora_adapters_equal_peft(tiny_models, hf_models, tmp_path):
    """LoRA under TP=2: q/k/v and gate/up adapters take each rank's rows, o and down each rank's
    input columns (their partial products summed in the layer's all-reduce). Requests of two
    adapters and of none in one batch equal PEFT's models on both ranks' shared output."""
    from hf_reference import LORA_TARGETS, save_lora_adapter
    from phalanx import LoRARequest
    hf = hf_models["llama"]
    refs = {None: hf, "all": save_lora_adapter(hf, tmp_path / "all", 8, LORA_TARGETS, 21),
            "some": save_lora_adapter(hf, tmp_path / "some", 4, ["k_proj", "o_proj", "up_proj", "down_proj"], 22)}
    ids = {"all": 1, "some": 2}
    ps = prompts(hf.config.vocab_size)
    batch = [(p, name) for p in ps for name in refs]
    with LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True, max_num_tokens=24,
             kv_cache_config={"tokens_per_block": 8}, lora_config={"max_loras": 2, "max_lora_rank": 8}) as llm:
        outs = llm.generate([p for p, _ in batch], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False,
                            lora_request=[LoRARequest(n, ids[n], str(tmp_path / n)) if n else None
                                          for _, n in batch])
        assert llm._executor.check_integrity() == ["ok", "ok"]
    for (p, name), out in zip(batch, outs, strict=True):
        ref, gaps = hf_greedy(refs[name], p, 10)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"TP=2 adapter {name} prompt of {len(p)}")


def test_tp2_lora_with_heads_split_unevenly_equals_peft(smollm2_hf, tmp_path):
    """The bundled SmolLM2 (9 heads, 3 KV heads over two ranks: 5 + 4 query heads): o's adapter
    takes each rank's uneven input columns. Greedy chat tokens equal PEFT's model of it."""
    from hf_reference import save_lora_adapter
    from phalanx import LoRARequest
    peft_model = save_lora_adapter(smollm2_hf, tmp_path / "a", 4, ["q_proj", "o_proj", "down_proj"], 23, scale_b=2.0)
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    with LLM(tensor_parallel_size=2, enable_lora=True) as llm:
        text = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        ours = llm.generate(text, sp, lora_request=LoRARequest("a", 1, str(tmp_path / "a"))).outputs[0].token_ids
        base = llm.generate(text, sp).outputs[0].token_ids
        tok = llm.tokenizer
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        ref = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                  do_sample=False, eos_token_id=list(tok.eos_token_ids))[0, ids.shape[1]:].tolist()
    assert ours == ref and ours != base, (tok.decode(ours), tok.decode(ref), tok.decode(base))


def test_tp2_host_tier_each_rank_moves_its_shard(tiny_models, hf_models):
    """The KV host tier under TP=2: both ranks offload and onboard the same blocks (their
    decisions are compared every step), each its own heads; an evicted prefix comes back and the
    greedy tokens equal transformers'."""
    hf = hf_models["llama"]
    g = torch.Generator().manual_seed(5)
    first, *churn = [torch.randint(0, hf.config.vocab_size, (41,), generator=g).tolist() for _ in range(5)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    kv = {"tokens_per_block": 8, "max_tokens": 96, "host_cache_size": 1 << 20}
    with LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True, max_num_tokens=64,
             max_seq_len=64, kv_cache_config=kv) as llm:
        for p in [first, *churn]:
            llm.generate([p], sp, use_tqdm=False)
        again = llm.generate([first[:-1] + [7]], sp, use_tqdm=False)[0]
        stats = llm.stats()
        assert llm._executor.check_integrity() == ["ok", "ok"]
    assert again.cached_tokens == 40
    assert [s["kv_onboarded_blocks"] for s in stats] == [stats[0]["kv_onboarded_blocks"]] * 2
    assert stats[0]["kv_onboarded_blocks"] >= 5
    ref, gaps = hf_greedy(hf, first[:-1] + [7], 6)
    assert_same_greedy(again.outputs[0].token_ids, ref, gaps, "TP=2 onboarded prefix")


def test_tp2_eagle3_head_drafts_alike_on_both_ranks(tmp_path_factory):
    """An EAGLE-3 head under TP=2: the target's captured layers are whole on both ranks (their
    down projections are not deferred), the head runs unsharded on each with the target's sharded
    embedding, and a head trained to predict the target has its drafts accepted alike on both
    ranks; greedy tokens equal transformers."""
    from transformers import AutoModelForCausalLM

    from eagle3_reference import prompts as head_prompts
    from eagle3_reference import target_config, train_head, write_head
    from hf_reference import tiny_model_dirs
    path = tiny_model_dirs(lambda name: tmp_path_factory.mktemp(name), {"target4": target_config()}, seed=77)["target4"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    head = write_head(tmp_path_factory.mktemp("head"), train_head(hf), draft_vocab_size=None)
    ps = head_prompts(hf.config.vocab_size)
    with LLM(path, tensor_parallel_size=2, skip_tokenizer_init=True, max_num_tokens=24,
             kv_cache_config={"tokens_per_block": 8},
             speculative_config={"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model_dir": head,
                                 "adaptive": False}) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
        for i, (p, out) in enumerate(zip(ps, outs, strict=True)):
            ref, gaps = hf_greedy(hf, p, 20)
            assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"Eagle3 TP=2 prompt {i}")
        assert llm._executor.check_integrity() == ["ok", "ok"]
        stats = [json.loads(r) for r in llm.control("stats").per_rank]
    assert stats[0]["spec_accepted_drafts"] == stats[1]["spec_accepted_drafts"]
    assert stats[0]["spec_accepted_drafts"] > 0.25 * stats[0]["spec_draft_tokens"]


def test_tp2_gemma3_equals_transformers(tmp_path):
    """Gemma 3 under TP=2: nothing deferred (a norm follows each row-parallel projection, which
    reduces its own output), the GELU MLP's down projection split over its input columns, and
    the sliding-window layers' own rotary base, with 2 KV heads split one a rank."""
    from transformers import AutoModelForCausalLM

    from gemma3_reference import gemma3_dir
    path = gemma3_dir(tmp_path / "gemma3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_tp2_greedy(path, hf, prompts(hf.config.vocab_size), "gemma3")


@pytest.mark.parametrize("version", [3, 2])
def test_tp2_deepseek_equals_transformers(version, tmp_path):
    """DeepSeek under TP=2: each rank two of the four query heads (q_b_proj or q_proj and
    kv_b_proj by heads, o_proj by columns, deferred to the next norm), the latent projections and
    the pool's one latent head whole on both ranks; experts split between the ranks (EP=2) and the
    shared expert by its intermediate dimension."""
    from transformers import AutoModelForCausalLM

    from deepseek_reference import deepseek_dir
    path = deepseek_dir(tmp_path / "ds", version=version)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_tp2_greedy(path, hf, prompts(hf.config.vocab_size), f"deepseek v{version}")
