"""EAGLE-3 speculative decoding (CPU, fp32), against a dense reference written here from the
published architecture and transformers' own hidden states of the target:

- every draft the engine proposes equals the reference head's drafts from the same accepted
  tokens (the target's hidden states of three layers through ``fc``, each entry fed the next
  token, the chain fed the head's own pre-norm output);
- greedy tokens equal transformers' (so plain decoding's), batched, chunked, with prefix hits,
  with the policy turning drafts off and on;
- a head trained here for a few seconds to predict the target's tokens has its drafts
  accepted, and batched steps accept exactly what one request at a time accepts;
- checkpoints and settings are refused by name where they do not fit.
"""

import pytest
import torch

from eagle3_reference import (
    AUX_IDS,
    K,
    assert_cached_entries,
    head_tensors,
    prompts,
    ref_drafts,
    target_config,
    train_head,
    write_head,
)
from hf_reference import assert_same_greedy, hf_greedy, tiny_model_dirs
from phalanx import LLM, SamplingParams


def eagle(path, k=K, adaptive=False):
    return {"decoding_type": "Eagle3", "max_draft_len": k, "speculative_model_dir": path, "adaptive": adaptive}


def engine(target_path, head_path, **kw):
    kw.setdefault("kv_cache_config", {"tokens_per_block": 8})
    return LLM(target_path, skip_tokenizer_init=True, orchestrator_type="inprocess",
               speculative_config=eagle(head_path, adaptive=kw.pop("adaptive", False)), **kw)


def stats(llm):
    return llm._executor.engine.stats()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer Llama (the tests' tiny shape) and transformers' model of it."""
    from transformers import AutoModelForCausalLM
    path = tiny_model_dirs(lambda name: tmp_path_factory.mktemp(name), {"target4": target_config()}, seed=77)["target4"]
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trained(target):
    return train_head(target[1])


# -- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random", "trained"])
def test_every_draft_equals_the_reference_heads(kind, target, trained, tmp_path):
    """random: a draft vocabulary of 96 (d2t), drafts rejected; trained: drafts accepted, so the
    head's next entry comes from a later verify position."""
    path, hf = target
    tensors = head_tensors(1) if kind == "random" else trained
    head = write_head(tmp_path / "head", tensors, **({} if kind == "random" else {"draft_vocab_size": None}))
    with engine(path, head, max_num_tokens=16) as llm:      # the 40-token prompt comes in chunks of 16
        proposer = llm._executor.engine.runner.spec.proposer
        seen = []
        propose = proposer.propose

        def recording(spec, slots, length, tables, max_length, hidden):
            drafts = propose(spec, slots, length, tables, max_length, hidden)
            seen.append((length.tolist(), drafts.tolist()))
            return drafts
        proposer.propose = recording
        for p in prompts(hf.config.vocab_size):
            seen.clear()
            out = llm.generate([p], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
            ref, gaps = hf_greedy(hf, p, 12)
            assert_same_greedy(out.outputs[0].token_ids, ref, gaps)
            seq = p + out.outputs[0].token_ids
            assert len(seen) >= 3
            for (L,), (drafts,) in seen:
                if len(seq) > L:     # (the last proposal, past the end, drafts for nothing)
                    assert drafts == ref_drafts(hf, tensors, seq[:L]), f"prompt of {len(p)}, L = {L}"
        s = stats(llm)
        if kind == "trained":
            assert s["spec_accepted_drafts"] > 0.25 * s["spec_draft_tokens"]
        else:
            assert s["spec_accepted_drafts"] < 0.1 * s["spec_draft_tokens"]


def test_batched_steps_accept_what_one_request_at_a_time_accepts(target, trained, tmp_path):
    path, hf = target
    head = write_head(tmp_path / "head", trained, draft_vocab_size=None)
    ps = prompts(hf.config.vocab_size)
    accepted = []
    for batched in (False, True):
        with engine(path, head) as llm:
            params = SamplingParams(max_tokens=20, ignore_eos=True)
            outs = (llm.generate(ps, params, use_tqdm=False) if batched
                    else [llm.generate([p], params, use_tqdm=False)[0] for p in ps])
            for p, out in zip(ps, outs, strict=True):
                ref, gaps = hf_greedy(hf, p, 20)
                assert_same_greedy(out.outputs[0].token_ids, ref, gaps)
            accepted.append((stats(llm)["spec_accepted_drafts"], stats(llm)["spec_verify_rows"]))
    assert accepted[0] == accepted[1] and accepted[0][0] > accepted[0][1] / 2


def test_greedy_equals_transformers_batched_chunked_with_prefix_hits_and_the_policy(target, tmp_path):
    path, hf = target
    head = write_head(tmp_path / "head", head_tensors(2))
    ps = prompts(hf.config.vocab_size) + [prompts(hf.config.vocab_size)[3][:24] + [7, 8]]   # a shared prefix
    refs = [hf_greedy(hf, p, 14) for p in ps]
    for kw in ({"max_num_tokens": 16}, {"adaptive": True, "disable_overlap_scheduler": True}):
        with engine(path, head, **kw) as llm:
            for round_ in range(2):
                outs = llm.generate(ps, SamplingParams(max_tokens=14, ignore_eos=True), use_tqdm=False)
                for out, (ref, gaps) in zip(outs, refs, strict=True):
                    assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"{kw} round {round_}")
            assert outs[-1].cached_tokens > 0
            s = stats(llm)
            assert s["spec_verify_rows"] > 0
            llm._executor.engine.scheduler.kv.check_integrity()


def test_settings_and_checkpoints_are_refused_by_name(target, tmp_path, tiny_models):
    from phalanx.config import make_llm_args
    path, _ = target
    args = make_llm_args(model=path, speculative_config={"method": "eagle3", "model": "x", "num_speculative_tokens": 2})
    assert args.speculative_config.decoding_type == "Eagle3" and args.speculative_config.max_draft_len == 2
    with pytest.raises(ValueError, match="Eagle3 needs speculative_model_dir"):
        make_llm_args(model=path, speculative_config={"decoding_type": "Eagle3"})
    with pytest.raises(ValueError, match="needs an EAGLE-3 head"):          # a causal LM is not a head
        LLM(path, skip_tokenizer_init=True, orchestrator_type="inprocess",
            speculative_config=eagle(tiny_models["llama"]))
    head = write_head(tmp_path / "head", head_tensors(3))
    with pytest.raises(ValueError, match="takes a causal LM, not an EAGLE-3 head"):
        LLM(path, skip_tokenizer_init=True, orchestrator_type="inprocess",
            speculative_config={"decoding_type": "DraftTarget", "speculative_model_dir": head})
    bad_ids = write_head(tmp_path / "ids", head_tensors(3),
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids: \[0\] are not taken"):
        engine(path, bad_ids)
    tensors = head_tensors(3)
    del tensors["fc.weight"]
    with pytest.raises(ValueError, match="speculative_model_dir: EAGLE-3 checkpoint: weights missing: fc.weight"):
        engine(path, write_head(tmp_path / "missing", tensors))
    tensors = head_tensors(3)
    tensors["midlayer.extra.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="'extra.weight' has no place in the head"):
        engine(path, write_head(tmp_path / "extra", tensors))


def test_random_weights_need_only_the_heads_config(target, tmp_path):
    """load_format dummy (benchmarks): the head takes random weights too, from its config.json
    alone, and decoding with it equals plain decoding of the same random target."""
    import json

    from phalanx.bench.shapes import resolve_spec_shape
    path, _ = target
    head = tmp_path / "head-config"
    head.mkdir()
    write_head(tmp_path / "full", head_tensors(4))
    (head / "config.json").write_text((tmp_path / "full" / "config.json").read_text())   # no weights
    ps = prompts(256)
    outs = []
    for spec in (None, eagle(str(head))):
        with LLM(path, skip_tokenizer_init=True, orchestrator_type="inprocess", load_format="dummy",
                 speculative_config=spec) as llm:
            outs.append([o.outputs[0].token_ids for o in
                         llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)])
            if spec is not None:
                assert stats(llm)["spec_verify_rows"] > 0
    assert outs[0] == outs[1]
    kw = resolve_spec_shape({"speculative_config": {"decoding_type": "Eagle3",
                                                    "speculative_model_dir": "shape:llama-3.1-8b-eagle3"}})
    with open(f"{kw['speculative_config']['speculative_model_dir']}/config.json") as f:
        shape = json.load(f)
    assert shape["architectures"] == ["LlamaForCausalLMEagle3"] and shape["draft_vocab_size"] == 32000


def recording(llm) -> list[tuple[int, list[int]]]:
    """Every row the head proposes for from now on: (its L, its drafts)."""
    proposer = llm._executor.engine.runner.spec.proposer
    seen: list[tuple[int, list[int]]] = []
    propose = proposer.propose

    def wrapped(spec, slots, length, tables, max_length, head_rows):
        drafts = propose(spec, slots, length, tables, max_length, head_rows)
        seen.extend(zip(length.tolist(), drafts.tolist(), strict=True))
        return drafts
    proposer.propose = wrapped
    return seen


def assert_reference_drafts(hf, tensors, seen, seqs, aux_ids=AUX_IDS):
    """Each recorded row's drafts are the reference head's for one of ``seqs`` at its L."""
    checked = 0
    for L, drafts in seen:
        refs = [ref_drafts(hf, tensors, s[:L], aux_ids=aux_ids) for s in seqs if len(s) > L]
        if refs:
            assert drafts in refs, f"L = {L}: {drafts} not in {refs}"
            checked += 1
    assert checked >= 3


def test_entries_written_while_drafts_are_off_are_right(target, trained, tmp_path):
    """max_concurrency 1 with two requests: steps verify no drafts while both decode (each writes
    the head's entry at L − 2 without drafting); once the short one ends, the long one's drafts
    read those entries and equal the reference."""
    path, hf = target
    head = write_head(tmp_path / "head", trained, draft_vocab_size=None)
    ps = prompts(hf.config.vocab_size)[1:3]
    with LLM(path, skip_tokenizer_init=True, orchestrator_type="inprocess", kv_cache_config={"tokens_per_block": 8},
             speculative_config={"decoding_type": "Eagle3", "max_draft_len": K, "speculative_model_dir": head,
                                 "max_concurrency": 1, "adaptive": False}) as llm:
        seen = recording(llm)
        outs = llm.generate(ps, [SamplingParams(max_tokens=6, ignore_eos=True),
                                 SamplingParams(max_tokens=24, ignore_eos=True)], use_tqdm=False)
        s = stats(llm)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(ps, outs, strict=True)]
    assert s["spec_accepted_drafts"] > 0
    assert_reference_drafts(hf, trained, [(L, d) for L, d in seen if len(seqs[0]) < L], seqs[1:])


@pytest.mark.parametrize("first", ["speculative to its length limit", "plain (logprobs)"])
def test_a_prefix_hit_reads_the_entries_its_first_request_left(first, target, trained, tmp_path):
    """A second request extends the first's whole sequence and hits its cached blocks: the head's
    entries there — written by verify steps up to the length limit, or, for a request that did
    not speculate, after each token it sampled — equal the reference's, so its drafts do."""
    path, hf = target
    head = write_head(tmp_path / "head", trained, draft_vocab_size=None)
    p = prompts(hf.config.vocab_size)[1]
    with engine(path, head) as llm:
        a = llm.generate([p], SamplingParams(max_tokens=24, ignore_eos=True,
                                             logprobs=1 if first.startswith("plain") else None), use_tqdm=False)[0]
        b_prompt = p + a.outputs[0].token_ids + [11, 12]
        seen = recording(llm)
        b = llm.generate([b_prompt], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert b.cached_tokens >= 24
    assert_reference_drafts(hf, trained, seen, [b_prompt + b.outputs[0].token_ids])


def test_the_head_rotates_past_its_own_max_position_embeddings(target, tmp_path):
    """Published heads say max_position_embeddings 2048; the head takes the target's positions
    (here a head that says 16, prompts of 40 tokens and more)."""
    path, hf = target
    tensors = head_tensors(6)
    head = write_head(tmp_path / "head", tensors, max_position_embeddings=16)
    p = prompts(hf.config.vocab_size)[3]
    with engine(path, head) as llm:
        seen = recording(llm)
        out = llm.generate([p], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert_reference_drafts(hf, tensors, seen, [p + out.outputs[0].token_ids])


@pytest.mark.parametrize("case", ["to the length limit", "drafts off (max_concurrency)", "plain (logprobs)",
                                  "chunked prompts"])
def test_every_cached_entry_of_the_head_equals_the_reference(case, target, trained, tmp_path):
    """Whatever wrote them — a verify step's pass, the first draft step at L − 2 (within the
    length limit), the entry written when no drafts follow, a plain row's sampled token, a
    prompt chunk's next prompt token — the entries the prefix cache keeps are exact."""
    path, hf = target
    head = write_head(tmp_path / "head", trained, draft_vocab_size=None)
    ps = prompts(hf.config.vocab_size)
    spec = {"decoding_type": "Eagle3", "max_draft_len": K, "speculative_model_dir": head, "adaptive": False}
    kw: dict = {"max_num_tokens": 12} if case == "chunked prompts" else {}
    if case.startswith("drafts off"):
        spec["max_concurrency"] = 1
    # requests end apart (with max_concurrency 1 the last one drafts once alone), at lengths of 1 past
    # a block (17, 33, 33, 57 tokens): the entry at the limit's L − 2 is in a block the cache keeps
    params = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=1 if case.startswith("plain") else None)
              for n in (14, 24, 16, 17)]
    with LLM(path, skip_tokenizer_init=True, orchestrator_type="inprocess", kv_cache_config={"tokens_per_block": 8},
             speculative_config=spec, **kw) as llm:
        outs = llm.generate(ps, params, use_tqdm=False)
        checked = sum(assert_cached_entries(llm, hf, trained, p + o.outputs[0].token_ids)
                      for p, o in zip(ps, outs, strict=True))
        s = stats(llm)
    assert checked >= 100
    if case == "to the length limit":
        assert s["spec_accepted_drafts"] > 0


def test_checkpoint_layouts_and_their_refusals(target, tmp_path):
    """Names under a model. prefix or layers.0 load as midlayer's; a head that names a layer twice
    fills both of its slices (the reference reads the same layer twice); a draft vocabulary
    without d2t, and weights as pickles only, are refused naming the field."""
    path, hf = target
    tensors = head_tensors(8)
    renamed = {("model." + k.replace("midlayer.", "layers.0.")) if k not in ("d2t", "t2d") else k: v
               for k, v in tensors.items()}
    p = prompts(hf.config.vocab_size)[2]
    with engine(path, write_head(tmp_path / "renamed", renamed)) as llm:
        seen = recording(llm)
        out = llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert_reference_drafts(hf, tensors, seen, [p + out.outputs[0].token_ids])
    twice = [AUX_IDS[0], AUX_IDS[2], AUX_IDS[2]]
    with engine(path, write_head(tmp_path / "twice", tensors, eagle_config={"eagle_aux_hidden_state_layer_ids": twice})
                ) as llm:
        seen = recording(llm)
        out = llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert_reference_drafts(hf, tensors, seen, [p + out.outputs[0].token_ids], aux_ids=twice)
    no_map = {k: v for k, v in tensors.items() if k != "d2t"}
    with pytest.raises(ValueError, match=r"speculative_model_dir: EAGLE-3 checkpoint: no d2t .* \(96\)"):
        engine(path, write_head(tmp_path / "no-d2t", no_map))
    pickled = tmp_path / "pickled"
    write_head(pickled, tensors)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="speculative_model_dir: no .safetensors weights"):
        engine(path, str(pickled))
