"""Our logits equal transformers' within 1e-4 at prefill and at every decode step (fp32),
through the real scheduler, paged KV pool, chunked prefill and a sliding window."""

import pytest
import torch

from phalanx.kv_manager import KVCacheManager
from phalanx.llmapi.sampling_params import SamplingParams
from phalanx.models.loader import build_model
from phalanx.models.source import resolve_model
from phalanx.pyexecutor.kv_pool import KVPool
from phalanx.pyexecutor.model_runner import ModelRunner
from phalanx.pyexecutor.request import Request
from phalanx.pyexecutor.sampler import Sampler
from phalanx.pyexecutor.scheduler import Scheduler, SchedulerLimits

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("max_num_tokens", [16, 512])
def test_logits_match_transformers_every_step(kind, max_num_tokens, tiny_models, hf_models):
    source = resolve_model(tiny_models[kind])
    cfg = source.config
    model = build_model(source, torch.float32, CPU)
    pool = KVPool(cfg.num_layers, 32, 8, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU)
    kv = KVCacheManager(32, 8)
    sched = Scheduler(SchedulerLimits(4, max_num_tokens, 512), kv)
    runner = ModelRunner(model, pool, Sampler(cfg.vocab_size, CPU), CPU)
    torch.manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (37,)).tolist()
    req = Request(0, prompt, SamplingParams(max_tokens=12), max_total_tokens=len(prompt) + 12)
    sched.add_request(req)
    hf = hf_models[kind]
    steps = 0
    while sched.has_work:
        batch = sched.schedule()
        inputs = runner.prepare(batch)
        logits = runner.forward(batch, inputs)
        token = None
        if inputs.sample_rows:
            with torch.no_grad():
                ref = hf(torch.tensor([req.token_ids])).logits[0, -1]
            torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=0)
            token = int(ref.argmax())
            steps += 1
        sched.update(batch, [token])
    assert steps == 12
    kv.check_integrity()
