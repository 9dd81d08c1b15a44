"""tools/bench_handover.py's persistent chain of one-row FP8 products, against the float32 chain
of the dequantized weights. On a CPU the interpreter runs its programs one after another, so a
grid of one program (the counter between products then never waits); with a GPU, grids of 1 and
8 programs, all resident at once."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import bench_handover  # noqa: E402
from phalanx.kernels import fp8  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def chain_reference(x, q, s):
    """The float32 products of the dequantized weights, rounded to bf16 after each, as the kernel stores them."""
    y = x.float()
    for i in range(q.shape[0]):
        y = (y @ (q[i].float() * s[i][:, None]).t()).to(torch.bfloat16).float()
    return y


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("programs", [1, 8] if CUDA else [1])
def test_the_persistent_chain_equals_the_float32_chain(prefetch, programs):
    g = torch.Generator().manual_seed(3)
    P, N = 3, 256
    q, s = zip(*(fp8.quantize_weight(torch.randn(N, N, generator=g) * N ** -0.5) for _ in range(P)), strict=True)
    ws, ss = [torch.stack(q).to(DEV)], [torch.stack(s).to(DEV)]
    x = torch.randn(N, generator=g).to(DEV, torch.bfloat16)
    chain = bench_handover.Persistent(x, ws, ss, programs, prefetch, block_n=8, warps=4, stages=2)
    first = chain(0).float().cpu()
    again = chain(0).float().cpu()     # the counter only grows: a second launch needs no reset
    ref = chain_reference(x.cpu(), ws[0].cpu(), ss[0].cpu())
    assert chain.err.item() == 0
    assert int(chain.ctr.item()) == 2 * P * programs     # each program counted in before each product
    torch.testing.assert_close(first, ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(first, again)


def test_a_size_without_a_row_tile_for_every_program_is_refused():
    w = [torch.zeros(2, 64, 64).to(torch.float8_e4m3fn)]
    with pytest.raises(ValueError, match="row tiles"):
        bench_handover.Persistent(torch.zeros(64, dtype=torch.bfloat16), w, [torch.ones(2, 64)], 16, False,
                                  block_n=8)
