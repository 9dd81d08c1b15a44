"""Our GGUF dequantization (a type's block function over many blocks at once) gives the very
values of gguf's own ``dequantize`` (16 rows at a time), for every tensor of the bundled model
and for each block type on random bytes."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from phalanx.models.gguf_file import _BLOCKWISE, GGUFFile, TensorInfo  # noqa: E402


def test_bundled_model_tensors_equal_gguf_dequantize():
    from gguf.quants import dequantize

    from phalanx.models.source import resolve_model
    f = GGUFFile(resolve_model(None).path)
    kinds = set()
    for info in f.tensors:
        ours = f.dequantize(info)
        theirs = dequantize(f.raw(info), gguf.GGMLQuantizationType(info.ggml_type))
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, info.name
        assert np.array_equal(ours, theirs), info.name
        kinds.add(info.ggml_type)
    assert len(kinds) >= 2     # the file mixes a block type with float tensors


@pytest.mark.parametrize("name", sorted(_BLOCKWISE))
def test_each_block_type_on_random_bytes(name, tmp_path, monkeypatch):
    from gguf.quants import dequantize
    qtype = gguf.GGMLQuantizationType[name]
    assert hasattr(gguf.quants, name)      # the block function is this type's own, not the fallback
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 5, 3 * block
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=rows * cols // block * type_size, dtype=np.uint8)
    f = GGUFFile.__new__(GGUFFile)
    f._mm = data.tobytes()
    info = TensorInfo("t", (cols, rows), int(qtype), 0)
    monkeypatch.setattr("phalanx.models.gguf_file._VALUES_AT_ONCE", 2 * block)    # several calls a tensor
    ours = f.dequantize(info)
    theirs = dequantize(f.raw(info), qtype)
    assert ours.shape == theirs.shape == (rows, cols)
    assert np.array_equal(ours, theirs, equal_nan=True)     # random scales spell NaN too
