"""The offline throughput bench on the tiny model: every point starts from an empty prefix cache."""

from phalanx import LLM, SamplingParams
from phalanx.bench.throughput import make_prompts, run_phalanx


def test_a_second_point_reuses_no_prompt_of_the_first(tiny_models):
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        first = run_phalanx(llm, isl=70, osl=4, concurrency=4, num_requests=4, warmup=1)
        second = run_phalanx(llm, isl=70, osl=4, concurrency=2, num_requests=4, warmup=1)
        # the same prompts again, outside a point: the cache does hold them (all but the last token)
        again = llm.generate([make_prompts(5, 70, llm.vocab_size)[1]], SamplingParams(max_tokens=1),
                             use_tqdm=False)[0]
    assert first["prefix_hit_tokens"] == 0 and second["prefix_hit_tokens"] == 0
    assert again.cached_tokens >= 64
    assert first["num_output_tokens"] == second["num_output_tokens"] == 16
