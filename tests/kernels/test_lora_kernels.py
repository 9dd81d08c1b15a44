"""LoRA's decode kernels (``kernels/triton_lora.py``) against the dense form they replace, y +
((x Aᵀ) ⊙ M) Bᵀ with M the token-to-slot mask (``models/lora.py``): tokens of several slots and
of none, one to three parts, ranks that are not powers of two, input widths with a remainder
past the shrink's chunks. In the interpreter on the CPU; over model sizes on a GPU."""

import pytest
import torch

triton = pytest.importorskip("triton")

from phalanx.kernels import triton_lora  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32


def dense(y, x, A, B, token_slots, parts, slots, rank):
    """The dense form in float32: every slot multiplied, the token's own kept."""
    slot_of_col = (torch.arange(slots * rank, device=x.device) // rank).repeat(parts)
    m = (token_slots[:, None].long() == slot_of_col[None, :]).float()
    return y.float() + ((x.float() @ A.float().t()) * m) @ B.float().t()


def layout(parts, slots, rank, K, N, g, adapter_ranks):
    """A [P·S·R, K] and B [N, P·S·R] as ``LoraWeights`` holds them: part p's rows of N hold values
    only in part p's columns; an adapter of a lower rank fills the first of its slot's columns."""
    A = torch.zeros(parts * slots * rank, K)
    B = torch.zeros(N, parts * slots * rank)
    bounds = torch.linspace(0, N, parts + 1).long().tolist()
    for p in range(parts):
        for s, r in enumerate(adapter_ranks):
            c = (p * slots + s) * rank
            A[c:c + r] = torch.randn(r, K, generator=g) / K ** 0.5
            B[bounds[p]:bounds[p + 1], c:c + r] = torch.randn(bounds[p + 1] - bounds[p], r, generator=g)
    return A.to(DEV, DTYPE), B.to(DEV, DTYPE), ((bounds + [N])[1], (bounds + [N, N])[2])


CASES = [(1, 1, 4, 64, 40), (5, 3, 6, 600, 130), (3, 2, 8, 96, 72)]
if CUDA:
    CASES += [(1, 3, 16, 4096, 6144), (32, 3, 16, 4096, 6144), (8, 1, 16, 14336, 4096), (17, 2, 64, 4096, 3000)]


@pytest.mark.parametrize("T,parts,rank,K,N", CASES)
def test_each_token_with_its_own_slot_equals_the_dense_form(T, parts, rank, K, N):
    g = torch.Generator().manual_seed(T * 100 + K)
    slots = 3
    A, B, bounds = layout(parts, slots, rank, K, N, g, adapter_ranks=[rank, max(1, rank // 2), rank])
    x = torch.randn(T, K, generator=g).to(DEV, DTYPE)
    y = torch.randn(T, N, generator=g).to(DEV, DTYPE)
    token_slots = torch.tensor([t % (slots + 1) if t % (slots + 1) < slots else -1 for t in range(T)],
                               dtype=torch.int32, device=DEV)   # slots 0, 1, 2, none, 0, ...
    sums = triton_lora.partials(K, rank, DEV)
    sums.fill_(float("nan"))          # nothing the kernels did not write is read
    out = triton_lora.lora_add(y.clone(), x, A, B, token_slots, sums, triton_lora.plan(K, parts, slots, rank, bounds))
    ref = dense(y, x, A, B, token_slots, parts, slots, rank)
    tol = 1e-4 if DTYPE is torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    none = token_slots < 0
    if none.any():                    # a token with no adapter keeps its projection's output, bit for bit
        assert torch.equal(out[none], y[none])
    assert (out[~none] != y[~none]).any()


def test_the_partial_sums_hold_the_widest_input_of_three_parts_at_the_most_rows():
    sums = triton_lora.partials(14336, 16, torch.device("cpu"))
    assert sums.shape == (triton_lora.splits(14336), triton_lora.MAX_ROWS, 48)
    assert triton_lora.splits(14336) == 28 and triton_lora.splits(4096) == 8 and triton_lora.splits(100) == 1
