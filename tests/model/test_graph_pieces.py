"""Piecewise graphs on the CPU: the token counts kept for a max_num_tokens, and the forward
cut at its attention calls."""

import pytest
from pydantic import ValidationError

from phalanx.config import CudaGraphConfig
from phalanx.pyexecutor.creator import _piecewise_sizes


def test_default_piecewise_sizes_reach_2048_in_growing_steps():
    sizes = CudaGraphConfig().piecewise_num_tokens
    assert sizes == sorted(set(sizes)) and sizes[0] == 64 and sizes[-1] == 2048
    assert all(b - a <= 128 for a, b in zip(sizes, sizes[1:], strict=False))


def test_piecewise_sizes_stop_at_max_num_tokens_and_keep_it():
    assert _piecewise_sizes([64, 128, 256], 8192) == [64, 128, 256]
    assert _piecewise_sizes([64, 128, 256], 100) == [64, 100]      # steps of 65-100 tokens still replay
    assert _piecewise_sizes([64, 128, 256], 128) == [64, 128]
    assert _piecewise_sizes([64, 128], 32) == [32]
    assert _piecewise_sizes([], 100) == []


def test_piecewise_sizes_are_token_counts_of_two_or_more():
    with pytest.raises(ValidationError, match=">= 2"):
        CudaGraphConfig(piecewise_num_tokens=[64, 1])
    assert CudaGraphConfig(piecewise_num_tokens=[128, 64, 64]).piecewise_num_tokens == [64, 128]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_the_forwards_stretches_between_attention_calls_are_the_forward(kind, tiny_models):
    """DecoderModel.piece, stretch by stretch with attention between (what piecewise graphs
    replay), gives the forward's hidden states and writes the same K/V, on a mixed step of
    decode rows and a prompt."""
    import torch

    from phalanx.kv_manager.manager import KVCacheManager
    from phalanx.llmapi.sampling_params import SamplingParams
    from phalanx.models.loader import build_model, resolve_model
    from phalanx.pyexecutor.kv_pool import KVPool
    from phalanx.pyexecutor.model_runner import ModelRunner
    from phalanx.pyexecutor.request import Request
    from phalanx.pyexecutor.sampler import Sampler
    from phalanx.pyexecutor.scheduler import Scheduler, SchedulerLimits

    cpu = torch.device("cpu")
    source = resolve_model(tiny_models[kind])
    cfg = source.config
    model = build_model(source, torch.float32, cpu)
    pool = KVPool(cfg.num_layers, 64, 8, cfg.num_kv_heads, cfg.head_dim, torch.float32, cpu)
    sched = Scheduler(SchedulerLimits(8, 64, 512), KVCacheManager(64, 8))
    runner = ModelRunner(model, pool, Sampler(cfg.vocab_size, cpu), cpu)
    g = torch.Generator().manual_seed(3)
    for rid, n in enumerate([5, 9, 40]):   # the first two decode while the third's prompt comes
        prompt = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=8), max_total_tokens=n + 8))
        if rid == 1:
            batch = sched.schedule()
            sched.update(batch, [int(x) for x in runner.forward(batch, runner.prepare(batch)).argmax(-1)])
    inputs = runner.prepare(sched.schedule())
    assert inputs.meta.num_decode_rows == 2        # a mixed step
    decoder, kv_eager, kv_pieces = model.model, pool.tensor.clone(), pool.tensor.clone()
    with torch.inference_mode():
        want = decoder(inputs.input_ids, inputs.positions, inputs.meta, kv_eager)
        residual, q, attn = None, None, None
        for i in range(cfg.num_layers + 1):
            residual, q = decoder.piece(i, inputs.input_ids, inputs.positions, inputs.meta, kv_pieces, residual, attn)
            if q is not None:
                attn = decoder.decoder_layers[i].self_attn.attend(q, inputs.meta, kv_pieces[i, 0], kv_pieces[i, 1])
    assert q is None
    torch.testing.assert_close(residual, want, atol=0, rtol=0)
    assert torch.equal(kv_pieces, kv_eager)
