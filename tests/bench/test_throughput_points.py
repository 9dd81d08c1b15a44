"""The offline throughput bench on the tiny model: every point starts from an empty prefix cache;
its step times split decode steps from steps with prompt tokens; workloads pair up."""

import pytest

from phalanx import LLM, SamplingParams
from phalanx.bench import throughput
from phalanx.bench.throughput import make_prompts, run_phalanx
from phalanx.pyexecutor.model_runner import ModelRunner, step_shape
from phalanx.pyexecutor.request import Request
from phalanx.pyexecutor.scheduler import ScheduledBatch


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


def test_a_point_counts_its_own_preemptions(tiny_models):
    """Four requests of 110 tokens over a pool of 256 under MAX_UTILIZATION preempt; one at a
    time they do not, and the counts are each point's own (not the engine's running total)."""
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 8, "max_tokens": 256},
             scheduler_config={"capacity_scheduler_policy": "MAX_UTILIZATION"}) as llm:
        crowded = run_phalanx(llm, isl=70, osl=40, concurrency=4, num_requests=4, warmup=0)
        alone = run_phalanx(llm, isl=70, osl=40, concurrency=1, num_requests=2, warmup=0)
    assert crowded["num_preemptions"] > 0
    assert alone["num_preemptions"] == 0
    assert crowded["num_output_tokens"] == 160 and alone["num_output_tokens"] == 80


class _Event:
    """A CUDA event's stand-in: a time in ms (the split reads elapsed_time only)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, end: "_Event") -> float:
        return end.ms - self.ms


def test_step_times_split_decode_steps_from_steps_with_prompt_tokens():
    """A row past its prompt is a decode row, with its drafts when it speculates; a row still in
    its prompt brings prompt tokens, even a single one (a chunk's or a prefix hit's last)."""
    sp = SamplingParams(max_tokens=4)
    reqs = [Request(i, list(range(10, 10 + n)), sp, max_total_tokens=n + 4) for i, n in enumerate([6, 9, 40, 33])]
    for r in reqs[:2]:
        r.num_computed_tokens = len(r.prompt_token_ids)     # past their prompts: decode rows
    reqs[3].num_computed_tokens = 32                         # one prompt token left (a prefix hit's rest)
    mixed = ScheduledBatch(step=1)
    mixed.add(reqs[0], 1, [0])
    mixed.add(reqs[1], 1, [1])
    mixed.add(reqs[2], 32, [2])                              # a prompt's first chunk
    mixed.add(reqs[3], 1, [3])
    decode = ScheduledBatch(step=2)
    decode.add(reqs[0], 1, [0])
    decode.add(reqs[1], 3, [1], num_drafts=2)                # a speculative row: 2 drafts verified
    assert step_shape(mixed) == (2, 33, 6 + 1 + 9 + 1) and step_shape(decode) == (2, 0, 6 + 1 + 9 + 3)
    runner = object.__new__(ModelRunner)                     # only the timings are read
    runner.timings = [(_Event(0), _Event(30)), (_Event(31), _Event(35)), (_Event(36), _Event(41))]
    runner.timing_shapes = [step_shape(mixed), step_shape(decode), step_shape(decode)]
    kinds = runner._steps_by_kind()
    assert kinds == {"prompt": {"steps": 1, "gpu_ms": 30, "decode_rows": 2, "prompt_tokens": 33, "context_tokens": 17},
                     "decode": {"steps": 2, "gpu_ms": 9, "decode_rows": 4, "prompt_tokens": 0, "context_tokens": 38}}
    single = ScheduledBatch(step=3)
    single.add(reqs[0], 1, [0])
    runner.timings.append((_Event(42), _Event(44)))
    runner.timing_shapes.append(step_shape(single))
    by_rows = runner._steps_by_kind(rows_bin=2)      # decode steps only, by their rows
    assert by_rows == {"2": {"steps": 2, "gpu_ms": 9, "decode_rows": 4, "prompt_tokens": 0, "context_tokens": 38},
                       "0": {"steps": 1, "gpu_ms": 2, "decode_rows": 1, "prompt_tokens": 0, "context_tokens": 7}}
    line = throughput._steps_line({"by_kind": kinds, "decode_by_rows": by_rows, "gap_ms": 2.0})
    assert "prompt: 1 steps 0.0 s GPU (30.0 ms a step, 2 decode rows + 33 prompt tokens)" in line
    assert "decode steps by rows: 0+: 1 x 2.0 ms (2000 us a row, context 7); 2+: 2 x 4.5 ms (2250 us a row" in line


def test_workloads_pair_input_and_output_lengths(capsys):
    with pytest.raises(SystemExit):
        throughput.main(["--isl", "16", "32", "--osl", "4"])
    assert "--isl has 2 values and --osl 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput.main(["--isl", "16", "32", "--osl", "4", "4", "--num-requests", "2", "2", "2"])
    assert "--num-requests has 3 values" in capsys.readouterr().err
