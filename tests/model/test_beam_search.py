"""``LLM.beam_search`` (vLLM's): with ``ignore_eos`` the beams equal transformers' own beam search
(``generate(num_beams=W)``, end-of-sequence switched off): the same W sequences in the same order,
the same scores. With end-of-sequence tokens, the beams equal the algorithm the module documents
run over transformers' full next-token distributions (finished candidates kept beside the live
beams, vLLM's score). Bad parameters are refused by name."""

import json
import math
import shutil

import pytest
import torch

from phalanx import LLM
from phalanx.llmapi.beam_search import BeamSearchParams, score

PROMPTS = [[5, 17, 99, 3], [200, 1, 42, 42, 8, 77, 250], list(range(30, 70))]


@pytest.fixture(scope="module")
def llm(tiny_models):
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 8}) as llm:
        yield llm


def test_beams_without_end_of_sequence_equal_transformers_beam_search(llm, hf_models):
    hf = hf_models["llama"]
    width, steps = 3, 6
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=steps, min_new_tokens=steps, eos_token_id=None, pad_token_id=0,
                              early_stopping=False, length_penalty=1.0, output_scores=True,
                              return_dict_in_generate=True)
        assert len(out.sequences) == width
        for seq, ids, hf_score in zip(out.sequences, ref.sequences.tolist(), ref.sequences_scores.tolist(),
                                      strict=True):
            assert seq.tokens == ids and seq.tokens[:len(prompt)] == prompt
            assert seq.finish_reason == "length" and len(seq.logprobs) == steps
            # transformers divides the sum by the output's length
            assert math.isclose(seq.cum_logprob / steps, hf_score, rel_tol=1e-4, abs_tol=1e-5)


def reference_beams(hf, prompt, width, steps, eos, length_penalty):
    """The module's algorithm over transformers' full distributions (each beam's 2·W likeliest
    next tokens, its own greedy token among them)."""
    live, done = [([*prompt], 0.0)], []

    def key(b):
        n = len(b[0]) - (1 if b[0][-1] in eos else 0)
        return b[1] / n ** length_penalty
    for _ in range(steps):
        if not live:
            break
        grown = []
        for toks, cum in live:
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([toks])).logits[0, -1].float(), -1)
            for t in lp.topk(2 * width).indices.tolist():
                nb = (toks + [t], cum + float(lp[t]))
                (done if t in eos else grown).append(nb)
        live = sorted(grown, key=key, reverse=True)[:width]
    return sorted(done + live, key=key, reverse=True)[:width]


def test_beams_that_end_are_kept_beside_the_live_ones_as_the_algorithm_says(tiny_models, hf_models, tmp_path):
    hf = hf_models["llama"]
    prompt, width, steps = PROMPTS[1], 2, 5
    with torch.no_grad():   # end-of-sequence: the second likeliest first token, so that beams end early
        eos = int(hf(torch.tensor([prompt])).logits[0, -1].topk(2).indices[1])
    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    with LLM(str(model), skip_tokenizer_init=True, orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 8}) as llm:
        for lp in (1.0, 0.0, 2.0):
            [out] = llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=steps, length_penalty=lp))
            ref = reference_beams(hf, prompt, width, steps, {eos}, lp)
            assert [s.tokens for s in out.sequences] == [toks for toks, _ in ref], lp
            for s, (_, cum) in zip(out.sequences, ref, strict=True):
                assert math.isclose(s.cum_logprob, cum, rel_tol=1e-4, abs_tol=1e-5)
                assert s.finish_reason == ("stop" if s.tokens[-1] == eos else "length")
                assert s.stop_reason == (eos if s.finish_reason == "stop" else None)
            scores = [score(s, frozenset({eos}), lp) for s in out.sequences]
            assert scores == sorted(scores, reverse=True)
        assert any(s.finish_reason == "stop" for s in out.sequences)   # (the test's premise)


@pytest.mark.parametrize("field,params", [
    ("beam_width", BeamSearchParams(beam_width=0, max_tokens=4)),
    ("beam_width", BeamSearchParams(beam_width=11, max_tokens=4)),
    ("max_tokens", BeamSearchParams(beam_width=2, max_tokens=0)),
    ("temperature", BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)),
    ("length_penalty", BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))),
    ("ignore_eos", BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=1)),
    ("max_tokens", BeamSearchParams(beam_width=2, max_tokens=10_000)),
])
def test_bad_parameters_are_refused_by_name_and_the_engine_goes_on(llm, field, params):
    with pytest.raises(ValueError, match=field):
        llm.beam_search(PROMPTS[:1], params)
    [out] = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(out.sequences) == 2
    with pytest.raises(ValueError, match="list of prompts"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=2))


def test_a_length_penalty_past_a_float_s_range_still_ranks_the_beams():
    """n ** length_penalty overflows (or reaches 0) for long beams at large penalties: the score
    stays a number and the beams are still ranked, as the score's logarithm ranks them."""
    from phalanx.llmapi.beam_search import BeamSearchSequence, _key
    eos = frozenset({2})
    for lp in (100.0, -100.0):
        beams = [BeamSearchSequence(list(range(n)), cum_logprob=c) for n, c in
                 ((2000, -5.0), (2000, -3.0), (1999, -4.0), (10, -1.0), (3, 0.0))]
        for b in beams:
            assert not math.isnan(score(b, eos, lp))
        by_log = sorted(beams, key=_key(eos, lp), reverse=True)
        want = sorted(beams, key=lambda b: (math.log(-b.cum_logprob) - lp * math.log(len(b.tokens))
                                            if b.cum_logprob < 0 else -math.inf))
        assert by_log == want and by_log[0].cum_logprob == 0.0


def test_each_prompt_stops_at_its_own_limit(llm):
    """``BeamSearch`` with a limit a prompt (the server's, each prompt's room in the context):
    the shorter prompt's beams are as long as its own limit, not the other's."""
    from phalanx.llmapi.beam_search import BeamSearch
    from phalanx.llmapi.llm import PreparedPrompt
    search = BeamSearch(llm, PROMPTS[:2], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True), None,
                        limits=[6, 2])
    while step := search.step():
        search.advance([f.result() for f in llm._submit_all([PreparedPrompt(None, ids, search.request)
                                                             for ids in step], None)])
    a, b = search.results()
    assert {len(s.tokens) - len(PROMPTS[0]) for s in a.sequences} == {6}
    assert {len(s.tokens) - len(PROMPTS[1]) for s in b.sequences} == {2}


def test_beams_of_a_lora_adapter_equal_transformers_beam_search_on_peft(tiny_models, hf_models, tmp_path):
    """Each prompt's adapter runs every step of its beams: the beams equal transformers' beam
    search over PEFT's model, and a prompt without one the base model's."""
    from hf_reference import LORA_TARGETS, save_lora_adapter
    from phalanx import LoRARequest
    hf = hf_models["llama"]
    peft_model = save_lora_adapter(hf, tmp_path / "a", 8, LORA_TARGETS, 71)
    width, steps = 2, 4
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 8}, lora_config={"max_loras": 1, "max_lora_rank": 8}) as llm:
        outs = llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True),
                               lora_request=[LoRARequest("a", 1, str(tmp_path / "a")), None])
    for prompt, out, model in zip(PROMPTS[:2], outs, (peft_model, hf), strict=True):
        with torch.no_grad():
            ref = model.generate(input_ids=torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                 do_sample=False, max_new_tokens=steps, min_new_tokens=steps, eos_token_id=None,
                                 pad_token_id=0, early_stopping=False)
        assert [s.tokens for s in out.sequences] == ref.tolist()
