"""tools/bench_layer_stream.py's persistent kernel over a layer's four FP8 products (q/k/v, o, gate ‖
up with SiLU, down), against the float32 chain of the dequantized weights. On a CPU the
interpreter runs one program (the counter between products then never waits); with a GPU
several, all resident at once."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import bench_layer_stream as bls  # noqa: E402
from phalanx.kernels.reference import silu_and_mul_ref as silu_and_mul  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
SHAPE = bls.Shape(hidden=32, qkv=48, inter=48)     # an intermediate size that is no power of two: masked K


def stages(layers, layer):
    """Each product of ``layer`` in float32 from the kernel's own stored input (so a bf16 rounding
    step earlier does not carry), beside what the kernel stored."""
    H, _, I = layers.shape  # noqa: E741 (the intermediate size)

    def mm(v, name):
        return v.float() @ (layers.w[name][layer].float() * layers.s[name][layer][:, None]).t()
    mlp_in = layers.x[layer] if layers.mlp_only else layers.o[layer]
    gu = mm(mlp_in, "gu").to(torch.bfloat16)
    mlp = [(silu_and_mul(gu), layers.act[layer]),
           (mm(layers.act[layer], "d"), layers.x[layer + 1])]
    if layers.mlp_only:
        return mlp
    return [(mm(layers.x[layer], "q"), layers.qkv[layer]), (mm(layers.qkv[layer, :H], "o"), layers.o[layer]), *mlp]


@pytest.mark.parametrize("mlp_only", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("programs", [1, 4] if CUDA else [1])
def test_the_persistent_layers_equal_the_float32_products(prefetch, programs, mlp_only):
    layers = bls.Layers(SHAPE, 2, DEV, torch.Generator(device=DEV).manual_seed(5), mlp_only=mlp_only)
    x = torch.randn(SHAPE.hidden, generator=torch.Generator().manual_seed(6)).to(DEV)
    layers.x[0] = x
    run = bls.Persistent(layers, bls.Tile(programs, 8, 2, 4, 2, prefetch))
    first = run().float().cpu()
    for layer in range(2):     # every product, its q part read by o, gate and up paired by the SiLU
        for ref, got in stages(layers, layer):
            torch.testing.assert_close(got.float(), ref.to(torch.bfloat16).float(), atol=2e-2, rtol=1e-2)
    again = run().float().cpu()    # the counter only grows: a second launch needs no reset
    assert run.err.item() == 0
    products = 2 if mlp_only else 4      # every program counts itself in before each product of each layer
    assert int(run.ctr.item()) == 2 * products * 2 * programs
    assert torch.equal(first, again)


def test_tiles_that_do_not_divide_the_products_or_leave_a_program_idle_are_refused():
    layers = bls.Layers(SHAPE, 1, DEV)
    with pytest.raises(ValueError, match="divide"):
        bls.Persistent(layers, bls.Tile(1, 32, 2, 4, 2, False))      # 48 q/k/v rows in tiles of 32
    with pytest.raises(ValueError, match="fewer row tiles"):
        bls.Persistent(layers, bls.Tile(8, 8, 2, 4, 2, False))       # o has 4 tiles of 8 rows


def test_row_tiles_hold_the_bytes_asked_for():
    assert bls.rows_for(16 << 10, 4096, 2) == 4 and bls.rows_for(32 << 10, 4096, 2) == 8
    assert bls.rows_for(16 << 10, 14336, 1) == 1 and bls.rows_for(32 << 10, 14336, 1) == 2
