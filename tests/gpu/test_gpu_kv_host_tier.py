"""GPU-only: the KV cache's host tier with pinned host memory and the copies on the stream,
CUDA graphs on and the overlap loop on. A prefix the device pool evicted comes back from the
host: in float32 its greedy tokens equal transformers'; in bf16 and with an FP8 pool they equal
those of the same prompt hitting a prefix that never left the device (the same bytes read)."""

import pytest
import torch

from hf_reference import assert_same_greedy, hf_greedy
from phalanx import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK, NEW = 16, 8


def _run(model_dir: str, first: list[int], churn: list[list[int]], **kw):
    kvc = {"tokens_per_block": BLOCK, "max_tokens": 16 * BLOCK, "host_cache_size": 8 << 20, **kw.pop("kv", {})}
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    with LLM(model_dir, skip_tokenizer_init=True, orchestrator_type="inprocess", kv_cache_config=kvc,
             max_num_tokens=256, max_seq_len=128, **kw) as llm:
        for p in [first, *churn]:
            llm.generate([p], params, use_tqdm=False)
        # the churn ran as a batch too: several prompts' offloads in one step
        llm.generate(churn[::-1], params, use_tqdm=False)
        out = llm.generate([first[:-1] + [9]], params, use_tqdm=False)[0]
        engine = llm._executor.engine
        engine.scheduler.kv.check_integrity()
        assert engine.runner.kv_pool.host is not None and engine.runner.kv_pool.host.is_pinned()
        return out, engine.stats()


def _prompts():
    g = torch.Generator().manual_seed(3)
    first = torch.randint(0, 256, (7 * BLOCK + 1,), generator=g).tolist()
    return first, [torch.randint(0, 256, (7 * BLOCK + 1,), generator=g).tolist() for _ in range(4)]


def test_an_onboarded_prefix_in_float32_equals_transformers(tiny_models, hf_models):
    first, churn = _prompts()
    out, s = _run(tiny_models["llama"], first, churn, dtype="float32")
    assert out.cached_tokens == 7 * BLOCK and s["kv_onboarded_blocks"] >= 7 and s["num_graph_steps"] > 0
    hf = hf_models["llama"].to("cuda")
    try:
        ref, gaps = hf_greedy(hf, first[:-1] + [9], NEW)
    finally:
        hf.to("cpu")
    assert_same_greedy(out.outputs[0].token_ids, ref, gaps, "onboarded prefix on the GPU")


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_an_onboarded_prefix_reads_the_bytes_it_left_with(tiny_models, kv_dtype):
    first, churn = _prompts()
    host, s = _run(tiny_models["llama"], first, churn, dtype="bfloat16", kv={"dtype": kv_dtype})
    device, s0 = _run(tiny_models["llama"], first, [], dtype="bfloat16", kv={"dtype": kv_dtype})
    assert host.cached_tokens == device.cached_tokens == 7 * BLOCK
    assert s["kv_onboarded_blocks"] >= 7 and s0["kv_onboarded_blocks"] == 0
    assert host.outputs[0].token_ids == device.outputs[0].token_ids
