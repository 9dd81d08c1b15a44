"""LoRA's grouped kernels (``kernels/triton_lora.py``: the step's tokens sorted by slot, cut into
tiles of one slot, each tile multiplied by its slot's A and B on the tensor cores) against the
dense form, and the tiles the host cuts (``groups``). In the interpreter on the CPU; over model
sizes on a GPU."""

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from test_lora_kernels import CUDA, DEV, DTYPE, dense, layout  # noqa: E402

from phalanx.kernels import triton_lora  # noqa: E402


def tiles_of(g: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    n = triton_lora.max_tiles(triton_lora.GROUPED_ROWS, slots)
    return g[:3 * n].reshape(n, 3), g[3 * n:]


@pytest.mark.parametrize("token_slots", [
    [], [-1, -1, -1], [0] * 40, [2, -1, 0, 2, 1, 1, -1, 0] * 9, [1] * 17 + [-1] * 5 + [0] * 16 + [2] * 33,
    list(np.random.default_rng(3).integers(-1, 3, triton_lora.GROUPED_ROWS))])
def test_the_tiles_take_each_adapted_token_once_in_tiles_of_one_slot(token_slots):
    slots = 3
    ts = np.asarray(token_slots, np.int64)
    g = triton_lora.groups(ts, slots)
    assert g.dtype == np.int32
    tiles, order = tiles_of(g, slots)
    assert sorted(order.tolist()) == list(range(len(ts)))
    taken = []
    live = tiles[tiles[:, 0] >= 0]
    assert (tiles[len(live):] == [-1, 0, 0]).all()          # the step's tiles first, then empty ones
    assert len(live) <= triton_lora.max_tiles(len(ts), slots)  # within the grid T tokens launch
    for slot, lo, hi in live:
        assert 0 < hi - lo <= triton_lora.TILE_ROWS
        toks = order[lo:hi]
        assert (ts[toks] == slot).all()
        taken += toks.tolist()
    assert sorted(taken) == [t for t in range(len(ts)) if ts[t] >= 0]


CASES = [(33, 1, 4, 64, 40, 3), (37, 2, 8, 96, 72, 2), (70, 3, 6, 600, 130, 4), (5, 3, 16, 200, 96, 3)]
if CUDA:
    CASES += [(64, 3, 16, 4096, 6144, 4), (512, 2, 16, 4096, 28672, 4), (100, 1, 16, 14336, 4096, 4),
              (64, 1, 64, 4096, 4096, 2), (48, 3, 8, 4096, 6144, 16)]


@pytest.mark.parametrize("T,parts,rank,K,N,slots", CASES)
def test_the_grouped_kernels_equal_the_dense_form(T, parts, rank, K, N, slots):
    g = torch.Generator().manual_seed(T * 10 + K)
    ranks = [rank, max(1, rank // 2)] * slots
    A, B, bounds = layout(parts, slots, rank, K, N, g, adapter_ranks=ranks[:slots])
    x = torch.randn(T, K, generator=g).to(DEV, DTYPE)
    y = torch.randn(T, N, generator=g).to(DEV, DTYPE)
    ts = np.array([(t * 7) % (slots + 1) - 1 for t in range(T)], np.int64)   # every slot and none, interleaved
    step = torch.from_numpy(triton_lora.groups(ts, slots)).to(DEV)
    sums = triton_lora.grouped_partials(K, rank, DEV)
    sums.fill_(float("nan"))          # nothing the kernels did not write is read
    lp = triton_lora.plan(K, parts, slots, rank, bounds, DTYPE)
    out = triton_lora.lora_add_grouped(y.clone(), x, A, B, triton_lora.split_groups(step, slots), sums, lp)
    token_slots = torch.from_numpy(ts).to(DEV, torch.int32)
    ref = dense(y, x, A, B, token_slots, parts, slots, rank)
    tol = 1e-4 if DTYPE is torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    none = token_slots < 0
    assert torch.equal(out[none], y[none])   # a token with no adapter keeps its projection's output, bit for bit
    assert (out[~none] != y[~none]).any()


def test_a_grid_larger_than_the_step_runs_only_the_steps_tiles():
    """A CUDA graph captured at 48 tokens replays a step of 20: the tokens past the step's own
    (the graph's padding) keep their outputs, and the step's equal the dense form."""
    slots, parts, rank, K, N = 2, 2, 4, 64, 48
    g = torch.Generator().manual_seed(1)
    A, B, bounds = layout(parts, slots, rank, K, N, g, adapter_ranks=[rank, rank])
    x = torch.randn(48, K, generator=g).to(DEV, DTYPE)
    y = torch.randn(48, N, generator=g).to(DEV, DTYPE)
    ts = np.array([t % 2 for t in range(20)], np.int64)
    step = torch.from_numpy(triton_lora.groups(ts, slots)).to(DEV)
    sums = triton_lora.grouped_partials(K, rank, DEV)
    out = triton_lora.lora_add_grouped(y.clone(), x, A, B, triton_lora.split_groups(step, slots), sums,
                                       triton_lora.plan(K, parts, slots, rank, bounds, DTYPE))
    assert torch.equal(out[20:], y[20:])
    ref = dense(y[:20], x[:20], A, B, torch.from_numpy(ts).to(DEV, torch.int32), parts, slots, rank)
    torch.testing.assert_close(out[:20].float(), ref, atol=1e-4 if DTYPE is torch.float32 else 3e-2, rtol=1e-4)
