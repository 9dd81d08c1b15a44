"""Speculative decoding (CPU, fp32): greedy tokens with speculation equal transformers' (so the
engine's without), for both proposers, batched, with prefix hits, chunked prefill, preemption,
the overlap loop on and off, stop tokens, stop strings and aborts; a draft equal to the target
accepts every draft; with temperature > 0 the tokens follow the target's own distribution
(chi-square against the exact one); the NGram proposer's drafts; settings refused by name."""

import asyncio
import itertools

import pytest
import torch

from hf_reference import assert_same_greedy, hf_greedy, tiny_model_dirs
from phalanx import LLM, SamplingParams

NEW = 14


def ngram(k=3, adaptive=False):
    return {"decoding_type": "NGram", "max_draft_len": k, "max_matching_ngram_size": 3, "adaptive": adaptive}


def draft(path, k=3, adaptive=False):
    return {"decoding_type": "DraftTarget", "max_draft_len": k, "speculative_model_dir": path, "adaptive": adaptive}


def prompts(vocab):
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, vocab, (24,), generator=g).tolist()
    out = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 5, 17, 40)]
    out += [[5, 6, 7, 8] * 6, shared + [1, 2], shared + [3]]     # a repeating prompt; a shared prefix
    return out


def stats(llm):
    return llm._executor.engine.stats()


COMBOS = [("ngram", False, False, True, False), ("ngram", True, True, True, False),
          ("ngram", True, True, False, False), ("draft", False, False, True, False),
          ("draft", True, True, True, False), ("draft", False, True, False, False),
          ("ngram", True, True, True, True), ("draft", False, False, True, True)]


@pytest.mark.parametrize("proposer,chunked,preempt,overlap,adaptive", COMBOS,
                         ids=[f"{p}-chunk{int(c)}-preempt{int(e)}-overlap{int(o)}-adaptive{int(a)}"
                              for p, c, e, o, a in COMBOS])
def test_speculative_greedy_equals_transformers(proposer, chunked, preempt, overlap, adaptive, tiny_models,
                                                hf_models):
    """adaptive: steps with and without drafts alternate (the policy turns drafts off after
    rejections; a no-draft step decodes one token from the device state)."""
    hf = hf_models["llama"]
    ps = prompts(hf.config.vocab_size)
    refs = [hf_greedy(hf, p, NEW) for p in ps]
    # the draft: another model of the same vocabulary (qwen2 tiny: different weights, so drafts get rejected)
    spec = ngram(adaptive=adaptive) if proposer == "ngram" else draft(tiny_models["qwen2"], adaptive=adaptive)
    kv = {"tokens_per_block": 8}
    extra = {}
    if preempt:
        kv["max_tokens"] = 104
        extra["scheduler_config"] = {"capacity_scheduler_policy": "MAX_UTILIZATION"}
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, kv_cache_config=kv, orchestrator_type="inprocess",
             max_num_tokens=16 if chunked else 512, disable_overlap_scheduler=not overlap,
             speculative_config=spec, **extra) as llm:
        for round_ in range(2):     # the second round hits the prefix cache
            outs = llm.generate(ps, SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
            for i, (out, (ref, gaps)) in enumerate(zip(outs, refs, strict=True)):
                assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"{proposer} prompt {i} round {round_}")
            if round_ == 1 and not preempt:
                assert all(o.cached_tokens > 0 for o in outs[1:])
        s = stats(llm)
        assert s["spec_verify_rows"] > 0 and s["spec_draft_tokens"] == 3 * s["spec_verify_rows"]
        if adaptive:   # fewer verify rows than tokens decoded after the first: some steps went without drafts
            assert s["spec_verify_rows"] + s["spec_accepted_drafts"] < 2 * len(ps) * (NEW - 1)
        assert s["spec_accepted_drafts"] < s["spec_draft_tokens"]          # rejections happened
        if proposer == "ngram":
            assert s["spec_accepted_drafts"] > 0                          # the repeating prompt
        if preempt:
            assert s["num_preemptions"] > 0
        llm._executor.engine.scheduler.kv.check_integrity()


def test_a_draft_equal_to_the_target_accepts_every_draft(tiny_models, hf_models):
    hf = hf_models["qwen3"]
    ps = prompts(hf.config.vocab_size)[:4]
    with LLM(tiny_models["qwen3"], skip_tokenizer_init=True, kv_cache_config={"tokens_per_block": 8},
             orchestrator_type="inprocess", speculative_config=draft(tiny_models["qwen3"], k=4)) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=21, ignore_eos=True), use_tqdm=False)
        s = stats(llm)
    for p, out in zip(ps, outs, strict=True):
        ref, gaps = hf_greedy(hf, p, 21)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps)
    assert s["spec_accepted_drafts"] == s["spec_draft_tokens"] > 0
    # 21 tokens: the first from the prompt's step, then 5 per verify step
    assert s["spec_verify_rows"] == 4 * 4


def test_ngram_accepts_on_a_repeating_output_and_sends_several_tokens_a_step(tiny_models):
    """A prompt the tiny model answers with one token repeated: the n-gram drafts are right,
    a step brings k + 1 tokens (never split across streamed chunks) and the tokens equal plain
    decoding's."""
    prompt, sp = [100] * 10, SamplingParams(max_tokens=20, ignore_eos=True)
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        plain = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(plain)) == 1        # what makes the drafts right
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             speculative_config=ngram(k=4)) as llm:

        async def chunks():
            sizes, last = [], None
            async for o in llm.generate_async(prompt, sp, streaming=True):
                sizes.append(len(o.outputs[0].token_ids))
                last = o.outputs[0].token_ids
            return sizes, last
        sizes, tokens = asyncio.run(chunks())
        s = stats(llm)
    assert tokens == plain
    # every draft accepted: 20 tokens = the prompt step's 1, then 5 + 5 + 5 + 4 from four verify steps
    assert s["spec_verify_rows"] == 4 and s["spec_accepted_drafts"] == s["spec_draft_tokens"] == 16, s
    # a chunk ends only where a step ends (a slow consumer may get several steps in one chunk)
    assert set(sizes) <= {1, 6, 11, 16, 20} and sizes[-1] == 20, sizes


def test_stop_tokens_inside_an_accepted_run_end_the_request_there(tiny_models):
    ps = prompts(256)[:4]
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(ps, SamplingParams(max_tokens=NEW, ignore_eos=True),
                                                                use_tqdm=False)]
    stops = [p[5] for p in plain]       # each request's 6th token becomes its stop token
    sps = [SamplingParams(max_tokens=NEW, stop_token_ids=[t], ignore_eos=True) for t in stops]
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             speculative_config=draft(tiny_models["llama"], k=4)) as llm:
        outs = llm.generate(ps, sps, use_tqdm=False)
    for p, stop, o in zip(plain, stops, outs, strict=True):
        expected = p[:p.index(stop) + 1]
        assert o.outputs[0].token_ids == expected
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == stop


def test_stop_strings_and_chat_on_the_real_model_equal_plain_decoding():
    questions = ["Repeat exactly: one two three one two three one two three", "List the days of the week.",
                 "What is 2 + 2?"]
    results = {}
    for spec in (None, ngram(k=4)):
        with LLM(speculative_config=spec, orchestrator_type="inprocess") as llm:
            ps = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
            sp = [SamplingParams(max_tokens=40, temperature=0.0),
                  SamplingParams(max_tokens=40, temperature=0.0, stop=["Wednesday"]),
                  SamplingParams(max_tokens=24, temperature=0.0, stop=["4"], include_stop_str_in_output=True)]
            outs = llm.generate(ps, sp, use_tqdm=False)
            results[spec is None] = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                                     for o in outs]
            if spec is not None:
                s = stats(llm)
                results["acceptance"] = s["spec_accepted_drafts"] / s["spec_draft_tokens"]
    assert results[False] == results[True]
    assert "Wednesday" not in results[False][1][0] and results[False][1][2] == "stop"
    print(f"n-gram acceptance on the bundled model's chat answers: {results['acceptance']:.2f}")


def test_abort_mid_draft_leaves_the_others_unchanged(tiny_models, hf_models):
    hf = hf_models["llama"]
    ps = prompts(256)[:4]

    async def run(llm):
        # request 1 (aborted) is long enough that it cannot end before its abort however slow this thread
        sps = [SamplingParams(max_tokens=400 if i == 1 else 40, ignore_eos=True) for i in range(len(ps))]
        tasks = [llm.generate_async(p, sp, streaming=True) for p, sp in zip(ps, sps, strict=True)]

        async def consume(i, gen):
            last = None
            async for o in gen:
                last = o
                if i == 1 and len(o.outputs[0].token_ids) >= 6:
                    gen.abort()
            return last
        return await asyncio.gather(*(consume(i, g) for i, g in enumerate(tasks)))

    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 8}, speculative_config=draft(tiny_models["llama"])) as llm:
        outs = asyncio.run(run(llm))
        llm._executor.engine.scheduler.kv.check_integrity()
        assert not llm._executor.engine.scheduler.requests
    assert outs[1].outputs[0].finish_reason == "abort"
    for i in (0, 2, 3):
        ref, gaps = hf_greedy(hf, ps[i], 40)
        assert_same_greedy(outs[i].outputs[0].token_ids, ref, gaps)


# -- temperature > 0: the target's distribution ----------------------------------------------------
VOCAB = 12


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    return tiny_model_dirs(lambda name: tmp_path_factory.mktemp(f"v12-{name}"), {"llama": cfg}, seed=5)["llama"]


def exact_marginals(path, prompt, temperature, steps):
    """P(token at output position i) for i < steps, by enumerating every continuation."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    prefixes = {(): 1.0}
    marginals = []
    with torch.no_grad():
        for _ in range(steps):
            keys = list(prefixes)
            ids = torch.tensor([prompt + list(k) for k in keys])
            probs = (hf(ids).logits[:, -1] / temperature).softmax(-1)
            m = torch.zeros(VOCAB, dtype=torch.float64)
            nxt = {}
            for key, p_prefix, row in zip(keys, (prefixes[k] for k in keys), probs, strict=True):
                m += p_prefix * row
                for t in range(VOCAB):
                    nxt[key + (t,)] = p_prefix * float(row[t])
            marginals.append(m)
            prefixes = nxt
    return marginals


def chi_square_p(counts, expected_probs, n):
    """Pearson's chi-square p-value; bins expected below 5 are pooled."""
    exp = expected_probs * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = e > 0
    chi2 = float(((obs[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_sampled_tokens_follow_the_targets_distribution(proposer, small_vocab_model):
    """2,000 requests at temperature 0.8, 3 tokens each; the second and third come out of
    verify steps. Their marginals against the exact ones: the test fails below p = 0.001;
    against the distribution at temperature 0.4 (what a sampler that leaned towards the
    greedy drafts would give) it must fail, so the test can tell."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    temperature, n, steps = 0.8, 2000, 3
    spec = draft(small_vocab_model, k=3) if proposer == "draft" else ngram(k=3)
    with LLM(small_vocab_model, skip_tokenizer_init=True, orchestrator_type="inprocess", seed=123,
             max_batch_size=2048, max_num_tokens=32768, speculative_config=spec) as llm:
        sp = SamplingParams(max_tokens=steps, temperature=temperature, ignore_eos=True)
        outs = llm.generate([prompt] * n, sp, use_tqdm=False)
        s = stats(llm)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outs])
    assert s["spec_verify_rows"] >= n and 0 < s["spec_accepted_drafts"] < s["spec_draft_tokens"]
    exact = exact_marginals(small_vocab_model, prompt, temperature, steps)
    colder = exact_marginals(small_vocab_model, prompt, 0.4, steps)
    for pos in range(steps):
        counts = torch.bincount(tokens[:, pos], minlength=VOCAB)
        p = chi_square_p(counts, exact[pos], n)
        assert p > 1e-3, (pos, p, counts.tolist(), (exact[pos] * n).round().tolist())
        if pos:
            assert chi_square_p(counts, colder[pos], n) < 1e-3


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(tiny_models, monkeypatch):
    """A seeded row's noise is keyed by position: verify steps (several positions at once,
    drafts accepted or not) give exactly plain sampling's tokens, whatever the batch, and so do
    steps that sample their rows a chunk at a time (here 2 rows, and 1 verify row of k + 1)."""
    from phalanx.pyexecutor import sampler
    ps = prompts(256)
    sp = [SamplingParams(max_tokens=12, temperature=t, top_p=p, seed=s, ignore_eos=True)
          for t, p, s in ((1.0, 1.0, 1), (0.7, 0.9, 2), (1.0, 1.0, 1), (1.3, 0.8, 3))]
    outs = {}
    for name, spec, chunk in ((None, None, None), ("DraftTarget", draft(tiny_models["llama"]), None),
                              ("NGram", ngram(), None), ("chunked", None, 2),
                              ("DraftTarget chunked", draft(tiny_models["llama"]), 2)):
        monkeypatch.setattr(sampler, "SAMPLE_CHUNK_ROWS", chunk or 256)
        with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
                 speculative_config=spec) as llm:
            assert llm._executor.engine.runner.sampler.chunk_rows == (chunk or 256)
            batch = [o.outputs[0].token_ids for o in llm.generate(ps[:4], sp, use_tqdm=False)]
            alone = llm.generate(ps[:1], sp[:1], use_tqdm=False)[0].outputs[0].token_ids
            outs[name] = (batch, alone)
            if spec is not None and spec["decoding_type"] == "DraftTarget":
                assert stats(llm)["spec_verify_rows"] > 0
    assert outs[None] == outs["DraftTarget"] == outs["NGram"] == outs["chunked"] == outs["DraftTarget chunked"]
    batch, alone = outs[None]
    assert batch[0] == alone and batch[0] != batch[2]     # same seed, other prompt: other tokens


def test_the_policy_turns_drafts_off_when_they_do_not_pay():
    from phalanx.pyexecutor.scheduler import SpecPolicy
    p = SpecPolicy(k=4)
    assert p.draft_len(64, 8192) == 4 and p.propose                  # optimistic start
    assert p.draft_len(64, 8192) == 4                                # (the next step is decided before it is read)
    p.observe([1] * 64)
    p.observe([1] * 64)                                        # nothing accepted: mean accepted length 2
    assert p.draft_len(64, 8192) == 0 and p.propose                  # right after a verify step: fresh drafts kept
    steps, proposes = [], []
    for _ in range(300):
        steps.append(p.draft_len(64, 8192))
        proposes.append(p.propose)
        if steps[-1]:
            p.observe([1] * 64)
    probes = [i for i, k in enumerate(steps) if k]
    every = p.probe_every(64)
    assert 30 < every < 200 and len(probes) == 300 // (every + 1)             # only probes verify
    assert all(b - a == every + 1 for a, b in itertools.pairwise(probes))
    assert sum(proposes) <= 4 * len(probes)                    # drafts proposed only around them
    assert all(proposes[i - 1] for i in probes)                # a probe verifies fresh drafts
    p = SpecPolicy(k=4)
    for _ in range(20):
        assert p.draft_len(1, 8192) == 4
        p.observe([2])                                         # 1 draft in 4 accepted pays at batch 1
    assert p.draft_len(64, 8192) == 0                                # but not at batch 64
    q = SpecPolicy(k=4)
    steps = []
    for _ in range(200):                                       # nothing accepted at batch 1: off, probes
        steps.append(q.draft_len(1, 8192))
        if steps[-1]:
            q.observe([1])
    assert 0 < steps[100:].count(4) <= 100 // q.probe_every(1) + 1 and q.probe_every(1) >= 8
    for _ in range(3):
        p.observe([5] * 64)
    assert p.draft_len(64, 8192) == 4 and p.draft_len(300, 8192) == 0      # all accepted: worth it at 64, not at 300
    assert p.draft_len(0, 8192) == 0 and p.propose                   # prompts completing: their first drafts
    assert SpecPolicy(k=4, max_concurrency=8).draft_len(9, 8192) == 0
    assert SpecPolicy(k=4, adaptive=False).draft_len(1000, 16384) == 4
    assert SpecPolicy(k=3, adaptive=False).draft_len(3, 16) == 0     # drafts take at most half the token budget


# -- pieces -----------------------------------------------------------------------------------------
def test_ngram_proposer_drafts_the_continuation_periodically():
    from phalanx.pyexecutor.speculative import NGramProposer, SpecDecoder
    prop = NGramProposer(k=5, max_ngram=3)
    dec = SpecDecoder(5, prop, 100, 64, 64, 8, 0, torch.device("cpu"), keep_history=True)
    dec.ensure_rows(3)
    rows = [[1, 2, 3, 4, 1, 2], [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7], [5, 6, 7]]
    for i, r in enumerate(rows):
        dec.history[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    drafts = prop.propose(dec, torch.tensor([0, 1, 2]), torch.tensor([len(r) for r in rows]), None, 16)
    # [1 2] seen at 0: continue 3 4 1 2 3; period-5 text: 8 9 10 11 7; no match: the last token
    assert drafts.tolist() == [[3, 4, 1, 2, 3], [8, 9, 10, 11, 7], [7, 7, 7, 7, 7]]
    # the shortest suffix matched: [.. 9 2] ends in a 2 seen before, but [9 2] was not
    dec.history[0, :4] = torch.tensor([1, 2, 9, 2], dtype=torch.int32)
    one = [NGramProposer(k=3, max_ngram=3, min_ngram=m).propose(dec, torch.tensor([0]), torch.tensor([4]), None, 16)
           for m in (1, 2)]
    assert one[0].tolist() == [[9, 2, 9]] and one[1].tolist() == [[2, 2, 2]]


def test_settings_are_checked_by_name(tiny_models, small_vocab_model):
    from phalanx.config import make_llm_args
    with pytest.raises(ValueError, match="speculative_config.*speculative_model_dir"):
        make_llm_args(model=tiny_models["llama"], speculative_config={"decoding_type": "DraftTarget"})
    with pytest.raises(ValueError, match="speculative_config.max_draft_len"):
        make_llm_args(model=tiny_models["llama"], speculative_config={"decoding_type": "NGram", "max_draft_len": 0})
    with pytest.raises(ValueError, match="speculative_config.draft_len"):
        make_llm_args(model=tiny_models["llama"], speculative_config={"decoding_type": "NGram", "draft_len": 2})
    with pytest.raises(ValueError, match="speculative_config.decoding_type"):
        make_llm_args(model=tiny_models["llama"], speculative_config={"decoding_type": "MTP"})
    spelled = make_llm_args(model=tiny_models["llama"], speculative_config={      # API.md's name for the draft
        "decoding_type": "DraftTarget", "speculative_model": tiny_models["qwen2"]})
    assert spelled.speculative_config.speculative_model_dir == tiny_models["qwen2"]
    with pytest.raises(ValueError, match="speculative_config.speculative_model"):   # one name, not both
        make_llm_args(model=tiny_models["llama"], speculative_config={
            "decoding_type": "DraftTarget", "speculative_model": "a", "speculative_model_dir": "b"})
    # vLLM's spelling
    vllm = lambda **sc: make_llm_args(model=tiny_models["llama"], speculative_config=sc).speculative_config  # noqa: E731
    sc = vllm(method="ngram", num_speculative_tokens=3)
    assert (sc.decoding_type, sc.max_draft_len, sc.min_matching_ngram_size, sc.max_matching_ngram_size) == (
        "NGram", 3, 5, 5)                                                  # vLLM's prompt lookup defaults
    sc = vllm(method="ngram", num_speculative_tokens=2, prompt_lookup_max=4)
    assert (sc.min_matching_ngram_size, sc.max_matching_ngram_size) == (4, 4)
    sc = vllm(method="ngram", num_speculative_tokens=2, prompt_lookup_max=4, prompt_lookup_min=2)
    assert (sc.min_matching_ngram_size, sc.max_matching_ngram_size) == (2, 4)
    sc = vllm(method="ngram", num_speculative_tokens=2, max_matching_ngram_size=2)   # ours, as a YAML adds it
    assert (sc.min_matching_ngram_size, sc.max_matching_ngram_size) == (2, 2)
    assert vllm(method=None, model=tiny_models["qwen2"], num_speculative_tokens=2).decoding_type == "DraftTarget"
    assert vllm(speculative_model=tiny_models["qwen2"], num_speculative_tokens=2).decoding_type == "DraftTarget"
    for name in ("ngram", "[ngram]"):    # vLLM's older spelling of prompt lookup
        assert vllm(model=name, num_speculative_tokens=2).decoding_type == "NGram"
    for sc in (vllm(model=tiny_models["qwen2"], num_speculative_tokens=5),
               vllm(method="draft_model", model=tiny_models["qwen2"], num_speculative_tokens=5)):
        assert (sc.decoding_type, sc.speculative_model_dir, sc.max_draft_len) == (
            "DraftTarget", tiny_models["qwen2"], 5)
    for bad, match in (({"method": "eagle", "num_speculative_tokens": 3}, "speculative_config.method 'eagle'"),
                       ({"method": "ngram"}, "speculative_config.num_speculative_tokens is needed"),
                       ({"method": "ngram", "num_speculative_tokens": 3, "max_draft_len": 3},
                        "num_speculative_tokens .* and max_draft_len name one setting"),
                       ({"decoding_type": "NGram", "num_speculative_tokens": 3},
                        "num_speculative_tokens is vLLM's spelling; with decoding_type it is max_draft_len"),
                       ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) is above prompt_lookup_max \(2\)"),
                       ({"method": "ngram", "num_speculative_tokens": 17},       # named as the user wrote it
                        "speculative_config.num_speculative_tokens must be an integer from 1 to 16, got 17"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 40},
                        "speculative_config.prompt_lookup_max must be an integer from 1 to 16"),
                       ({"decoding_type": "NGram", "max_draft_len": 1, "min_matching_ngram_size": 4,
                         "max_matching_ngram_size": 2}, r"min_matching_ngram_size \(4\) is above")):
        with pytest.raises(ValueError, match=match):
            make_llm_args(model=tiny_models["llama"], speculative_config=bad)
    with pytest.raises(ValueError, match="speculative_model_dir: the draft model did not load"):
        LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
            speculative_config=draft(str(tiny_models["llama"]) + "-missing"))
    with pytest.raises(ValueError, match="speculative_model_dir: the draft's vocabulary"):
        LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
            speculative_config=draft(small_vocab_model))


def test_requests_with_settings_the_verify_step_does_not_apply_decode_plainly(tiny_models):
    """Penalties, logprobs and logit bias are honoured (the same tokens as without speculation),
    by one-token steps for those requests, batched with speculative ones."""
    ps = prompts(256)[:3]
    sps = [SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.5),
           SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2),
           SamplingParams(max_tokens=10, ignore_eos=True)]
    got = {}
    for spec in (None, ngram()):
        with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
                 speculative_config=spec) as llm:
            outs = llm.generate(ps, sps, use_tqdm=False)
            got[spec is None] = [(o.outputs[0].token_ids, o.outputs[0].logprobs is not None) for o in outs]
            if spec is not None:
                engine = llm._executor.engine
                assert engine.stats()["spec_verify_rows"] > 0
    assert got[True] == got[False]


def test_sleep_is_refused_with_a_draft_model_and_works_with_ngram(tiny_models):
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             speculative_config=draft(tiny_models["llama"])) as llm:
        with pytest.raises(Exception, match="draft model"):
            llm.sleep()
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             speculative_config=ngram()) as llm:
        before = llm.generate([[100] * 10], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
        llm.sleep()
        llm.wake_up()
        after = llm.generate([[100] * 10], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert before[0].outputs[0].token_ids == after[0].outputs[0].token_ids


def test_ngram_history_holds_prompt_tokens_found_in_the_prefix_cache(tiny_models):
    """The history the proposer matches in covers the cached part of a prompt too (the slot
    held another request's tokens before)."""
    g = torch.Generator().manual_seed(2)
    p, q = (torch.randint(0, 256, (40,), generator=g).tolist() for _ in range(2))
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 8}, speculative_config=ngram()) as llm:
        sp = SamplingParams(max_tokens=3, ignore_eos=True)
        llm.generate([p], sp, use_tqdm=False)           # p cached
        llm.generate([q], sp, use_tqdm=False)           # slot 0 now holds q's tokens
        out = llm.generate([p], sp, use_tqdm=False)     # slot 0 again: p's prefix from the cache
        assert out[0].cached_tokens >= 32
        history = llm._executor.engine.runner.spec.history[0, :len(p)].tolist()
    assert history == p


def test_a_draft_shorter_than_max_seq_len_is_refused(tiny_models, tmp_path):
    from transformers import LlamaConfig

    from hf_reference import TINY
    short = tiny_model_dirs(lambda n: tmp_path / n, {"llama": LlamaConfig(**{**TINY, "max_position_embeddings": 64})})
    with pytest.raises(ValueError, match="max_position_embeddings .64. is below max_seq_len .512."):
        LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
            speculative_config=draft(short["llama"]))
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess", max_seq_len=64,
             speculative_config=draft(short["llama"])) as llm:
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=50, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids) == 50


def test_the_throughput_bench_reports_acceptance(tiny_models):
    from phalanx.bench.throughput import run_phalanx
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             speculative_config=ngram(k=4)) as llm:
        res = run_phalanx(llm, isl=16, osl=12, concurrency=4, num_requests=4, warmup=0)
    assert res["spec_verify_rows"] > 0 and 0.0 <= res["spec_acceptance_rate"] <= 1.0
    assert 1.0 <= res["spec_mean_accepted_length"] <= 5.0
