"""An eager step's output layer runs over a row count the start-up already ran (the CUDA-graph
batch sizes): padded with row 0, whose logits are dropped, so the tokens and log-probs are those
of the unpadded rows (the log-probs to rounding: a product of another row count may sum in
another order, as any change of batch does)."""

import pytest

from phalanx import LLM, SamplingParams
from phalanx.pyexecutor.model_runner import padded_rows


def test_rows_are_padded_to_the_next_size_and_left_alone_past_the_last():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_rows(n, sizes) for n in (1, 3, 4, 5, 16)] == [1, 4, 4, 8, 16]
    assert padded_rows(17, sizes) == 17 and padded_rows(3, []) == 3


def _run(tiny_models, pad: list[int] | None) -> tuple[list, list[int]]:
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13] * 9]      # three sampling rows a step
    sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    # no graphs (a CPU has none anyway): every step eager, padded only as set here
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             cuda_graph_config=None) as llm:
        runner = llm._executor.engine.runner
        rows: list[int] = []
        compute = runner.model.compute_logits
        runner.model.compute_logits = lambda h: (rows.append(h.shape[0]), compute(h))[1]   # records, then runs
        if pad is not None:
            runner.pad_logits_to(pad)
        outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], rows


def test_padded_output_layer_rows_give_the_tokens_and_logprobs_of_the_unpadded(tiny_models):
    plain, plain_rows = _run(tiny_models, None)
    padded, padded_rows_seen = _run(tiny_models, [4, 16])
    assert 3 in plain_rows and 3 not in padded_rows_seen and 4 in padded_rows_seen
    assert all(n in (4, 16) for n in padded_rows_seen)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(padded, plain, strict=True):
        assert tokens == ref_tokens
        for got, ref in zip(lps, ref_lps, strict=True):
            assert got.keys() == ref.keys()
            assert [got[t].logprob for t in got] == pytest.approx([ref[t].logprob for t in ref], abs=1e-5)
