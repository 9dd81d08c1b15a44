"""Which CUDA graphs an engine captures: the piecewise token counts kept for a max_num_tokens."""

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
