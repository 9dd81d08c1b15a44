"""tools/bench_fp8_gemv.py's one-row product with its weight tiles loaded by the TMA (host tensor
descriptors): the product equals the float32 product of the dequantized weight, FP8 and bf16, with
row counts and K that the tiles do not divide (the TMA's zero fill) and the first box asked for
before the PDL wait or not. On a CPU the interpreter runs it; with a GPU, the hardware's TMA."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import bench_fp8_gemv as bfg  # noqa: E402
from phalanx.kernels import fp8  # noqa: E402

if bfg.TensorDescriptor is None:
    pytest.skip("this Triton has no host tensor descriptors", allow_module_level=True)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("pre", [False, True])
@pytest.mark.parametrize("N,K,tile", [(20, 1024, (8, 512, 4, 2, 16)), (20, 768, (4, 256, 4, 3, 8)),
                                      (16, 1280, (16, 512, 4, 2, 1))])
def test_the_tma_one_row_product_equals_the_float32_product(dtype, pre, N, K, tile):
    g = torch.Generator().manual_seed(N * K)
    wb = torch.randn(N, K, generator=g) / 8
    w, s = fp8.quantize_weight(wb.to(DEV)) if dtype == "fp8" else (wb.to(torch.bfloat16).to(DEV), None)
    # the interpreter multiplies bf16 wrongly (float32 activations there); a GPU runs the engine's bf16
    x = torch.randn(1, K, generator=g).to(DEV, torch.bfloat16 if DEV.type == "cuda" else torch.float32)
    want = x.float() @ (w.float() * s[:, None] if s is not None else w.float()).t()
    y = bfg.tma_row(tile, pre=pre)(x, w, s)
    assert y.shape == (1, N) and y.dtype == x.dtype
    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=1e-2)
    desc = bfg.tma_descriptor(w, tile[0], tile[1])   # a descriptor made beforehand gives the same bits
    assert torch.equal(bfg.tma_row(tile, pre=pre)(x, w, s, desc), y)


def test_a_descriptor_boxes_256_bytes_of_a_row_at_a_time():
    w8 = torch.zeros(16, 4096, dtype=torch.float8_e4m3fn)
    assert bfg.tma_descriptor(w8, 8, 2048).block_shape == [8, 8, 256]
    wb = torch.zeros(16, 4096, dtype=torch.bfloat16)
    assert bfg.tma_descriptor(wb, 8, 1024).block_shape == [8, 8, 128]
