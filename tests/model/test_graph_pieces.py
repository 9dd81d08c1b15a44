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
    from phalanx.models.loader import build_model
    from phalanx.models.source import resolve_model
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


def test_an_extend_steps_inputs_reach_the_graph_buffers_padded_in_one_copy():
    """CudaGraphRunner.stage_extend writes a step's host arrays into the extend graphs' buffer
    through pinned host memory of the same layout: the step's tokens first, the padding up to
    the graph's token count as one more sequence over the scratch block, the rows after it
    empty, the logits rows past the step's zeroed; the sampling rows' slots ride along. A second,
    smaller step through the other host copy leaves nothing of the first where a graph reads."""
    import numpy as np
    import torch

    from phalanx.pyexecutor.cuda_graph import CudaGraphRunner

    B, scratch = 16, 9
    g = CudaGraphRunner(None, None, [1], 8, B, 128, scratch, True, torch.device("cpu"),  # type: ignore[arg-type]
                        extend_sizes=[16, 32], extend_max_seqs=3)
    i64 = np.int64
    # two sequences: 3 new tokens at 17.. (blocks 4, 5) and 2 at 0.. (block 7); both sample
    g.stage_extend(16, np.array([11, 12, 13, 21, 22], i64), np.array([17, 18, 19, 0, 1], i64),
                   np.array([81, 82, 83, 112, 113], i64), np.array([0, 3, 5], np.int32), np.array([20, 2], np.int32),
                   np.array([[4, 5], [7, 9]], np.int32), np.array([2, 4], i64), np.array([6, 3], i64))
    assert g.e_ids[:16].tolist() == [11, 12, 13, 21, 22] + [0] * 11
    assert g.e_positions[:16].tolist() == [17, 18, 19, 0, 1] + list(range(11))
    assert g.e_slots[:16].tolist() == [81, 82, 83, 112, 113] + [scratch * B + p for p in range(11)]
    assert g.e_query_start.tolist() == [0, 3, 5, 16, 16]
    assert g.e_seq_lens.tolist() == [20, 2, 11, 0]
    assert g.e_block_tables[:3, :2].tolist() == [[4, 5], [7, 9], [scratch, scratch]]
    assert g.e_block_tables[2].tolist() == [scratch] * 8
    assert g.e_logits_indices.tolist() == [2, 4, 0]
    assert g.e_sample_slots[:2].tolist() == [6, 3]     # the sampler's rows ride along
    # one sequence of 20 tokens in a 32-token graph, through the other host copy
    g.stage_extend(32, np.arange(100, 120, dtype=i64), np.arange(20, dtype=i64), np.arange(20, dtype=i64) + 32,
                   np.array([0, 20], np.int32), np.array([20], np.int32), np.array([[2, 3]], np.int32),
                   np.array([19], i64))
    assert g.e_ids[:32].tolist() == list(range(100, 120)) + [0] * 12
    assert g.e_positions[:32].tolist() == list(range(20)) + list(range(12))
    assert g.e_slots[20:32].tolist() == [scratch * B + p for p in range(12)]
    assert g.e_query_start.tolist() == [0, 20, 32, 32, 32]
    assert g.e_seq_lens.tolist() == [20, 12, 0, 0]
    assert g.e_block_tables[0, :2].tolist() == [2, 3] and g.e_block_tables[1].tolist() == [scratch] * 8
    assert g.e_logits_indices.tolist() == [19, 0, 0]
