"""The rank loop's profiling controls, on the tiny model in process: its stamped marks name every
phase of a step (tools/profile_ttft.py --timeline reads them), and hostprofile:start/stop put the
loop under cProfile."""

import json

from phalanx import LLM, SamplingParams
from phalanx.pyexecutor.host_clock import PHASES


def test_the_trace_names_each_phase_and_the_host_profile_names_the_loops_functions(tiny_models):
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        refused = llm.control("hostprofile:stop").per_rank[0]
        llm.control("trace:on")
        llm.generate([[5] * 40], sp, use_tqdm=False)
        marks = json.loads(llm.control("trace:off").per_rank[0])
        assert llm.control("hostprofile:start").per_rank == ["ok"]
        llm.generate([[6] * 40], sp, use_tqdm=False)
        stats = llm.control("hostprofile:stop", args={"top": 200}).per_rank[0]
    assert refused.startswith("error") and "without hostprofile:start" in refused
    seen = [phase for _, phase, _ in marks]
    assert all(p in seen for p in PHASES), sorted(set(seen))
    times = [t for _, _, t in marks]
    assert times == sorted(times)
    # a step packs, then stages, then finishes preparing, in that order
    first = seen.index("pack")
    assert seen[first:first + 3] == ["pack", "stage", "prepare"]
    assert "function calls" in stats and "model_runner.py" in stats and "(prepare)" in stats
