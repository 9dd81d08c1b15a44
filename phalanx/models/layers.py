"""Building blocks of the decoders: tensor-parallel linears and embeddings, RMSNorm, rotary.

Every parameter that comes from a checkpoint has a ``weight_loader(param, full_tensor,
shard_id)`` that copies this rank's slice of the full (unsharded) tensor. At tp size 1 the
slices are the whole tensors.

Every projection is a ``Projection``: it says at construction what runs in front of it
(``behind``) and holds the ``LinearPlan`` it runs with — the reference until the engine's tuner
replaces it, once, at build time (pyexecutor/creator.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.kernels import fp8, ops
from phalanx.kernels.linear_plan import LinearPlan, Neighbour
from phalanx.models.parallel import HeadShard, TPGroup, split_range


def _param(shape: tuple[int, ...], loader: Callable) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _copy(param: torch.Tensor, src: torch.Tensor) -> None:
    if param.shape != src.shape:
        raise ValueError(f"weight shape {tuple(src.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(src)


def default_loader(param: torch.Tensor, w: torch.Tensor, shard_id: object = None) -> None:
    _copy(param, w)


_FP8_WEIGHTS: contextvars.ContextVar[tuple[bool, fp8.Block | None]] = contextvars.ContextVar(
    "phalanx_fp8_weights", default=(False, None))


@contextlib.contextmanager
def fp8_weights(enabled: bool = True, block: fp8.Block | None = None) -> Iterator[None]:
    """While a model is built inside: its projections (the output layer excepted) and MoE
    experts get FP8 weights from the start, and each load quantizes the rows it writes, so the
    model is never held in full precision on a GPU (``quantization: fp8``: a model whose bf16
    weights do not fit the GPU can still be served in FP8; a CPU, which runs the reference,
    keeps each projection's dequantized copy from its first use: ``fp8.reference``).

    ``block`` = (rows, cols): a block-scaled FP8 checkpoint's blocks (``fp8.Fp8BlockWeight``).
    Each projection and MoE layer whose rank's rows and columns fall on whole blocks of the
    checkpoint keeps a scale per block (the checkpoint's bytes and scales as they are); one that
    does not (a section or a split inside a block) keeps a scale per row, its weights
    dequantized and quantized again as they load."""
    token = _FP8_WEIGHTS.set((enabled, block if enabled else None))
    try:
        yield
    finally:
        _FP8_WEIGHTS.reset(token)


def building_fp8() -> bool:
    return _FP8_WEIGHTS.get()[0]


def building_fp8_block() -> fp8.Block | None:
    """The blocks of the FP8 checkpoint being built for (``fp8_weights``), or None."""
    return _FP8_WEIGHTS.get()[1]


Section = tuple[int, int, "int | None"]   # (first row or column in the checkpoint, how many, the checkpoint's)


def sections_fit(sections: list[Section], b: int) -> bool:
    """Whether sections of a checkpoint tensor, placed one after another, keep its blocks of
    ``b`` whole: each starts on a block and holds whole blocks, but the last may end where the
    checkpoint's tensor ends (its last block partial there too)."""
    for i, (start, size, full) in enumerate(sections):
        ends = full is not None and start + size == full and i == len(sections) - 1
        if start % b or not (size % b == 0 or ends):
            return False
    return True


def block_slice(rows: slice, b: int) -> slice:
    """The block rows (of ``b`` rows each) that hold the rows ``rows`` (a slice starting on a block)."""
    if rows.start is None and rows.stop is None:
        return rows
    return slice((rows.start or 0) // b, None if rows.stop is None else -(-rows.stop // b))


def fp8_param(shape: tuple[int, ...], loader: Callable) -> nn.Parameter:
    """An FP8 weight built under ``fp8_weights``: zero until its ``loader`` quantizes rows into
    it; checkpoints load into it in the model's dtype."""
    p = nn.Parameter(torch.zeros(shape, dtype=fp8.FP8), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    p.load_dtype = torch.get_default_dtype()  # type: ignore[attr-defined]
    return p


def scale_param(shape: tuple[int, ...]) -> nn.Parameter:
    """The float32 scales of an FP8 weight (one per output row, or per block), written by the
    weight's loader."""
    p = nn.Parameter(torch.ones(shape, dtype=torch.float32), requires_grad=False)
    p.written_by_loader = True  # type: ignore[attr-defined]
    return p


class Projection(nn.Module):
    """A layer computing x Wᵀ (+ b) through its plan. ``behind``: the kernel in front of it.
    Built under ``fp8_weights`` the weight is FP8 with a scale per output channel
    (``weight_scale``), or per block of a block-scaled checkpoint where this rank's rows and
    columns fall on whole blocks (``fp8_block``, decided once here: ``sections_fit``). A subclass
    says where a checkpoint tensor's rows go (``_place``) and which sections of the checkpoint's
    rows and columns it holds (``_out_sections``, ``_in_sections``); one loader copies them, the
    FP8 one quantizes them first (each row, or block, with its own scale, so a row's value does
    not depend on the order or grouping of the loads)."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, behind: Neighbour = Neighbour.PLAIN) -> None:
        super().__init__()
        self.plan = LinearPlan(behind)
        self.weight_scale: nn.Parameter | None = None
        self.fp8_block: fp8.Block | None = None
        self.lora: nn.Module | None = None    # its LoRA adapter slots (models/lora.py), set at build

    @property
    def behind(self) -> Neighbour:
        return self.plan.neighbour

    def project(self, x: torch.Tensor) -> torch.Tensor:
        y = self.plan(x, self.weight, self.bias, self.weight_scale)
        return y if self.lora is None else self.lora(y, x)

    def _place(self, w: torch.Tensor, shard_id: object) -> tuple[slice, torch.Tensor]:
        """(the rows of this rank's parameter, the checkpoint rows that go there)."""
        raise NotImplementedError

    def _load(self, param: torch.Tensor, w: torch.Tensor, shard_id: object = None) -> None:
        rows, src = self._place(w, shard_id)
        _copy(param.data[rows], src)

    def _out_sections(self) -> list[Section]:
        """The sections of the checkpoint's rows this rank's weight holds, in order."""
        raise NotImplementedError

    def _in_sections(self, K: int) -> list[Section]:
        """The sections of the checkpoint's columns this rank's weight (K wide) holds: all of
        them, unless split."""
        return [(0, K, K)]

    def _weight_param(self, shape: tuple[int, int]) -> nn.Parameter:
        """The weight: full precision, or under ``fp8_weights`` FP8 (zero, scale 1 until loaded)
        with an FP8 plan (the reference until the tuner replaces it)."""
        if not building_fp8():
            return _param(shape, self._load)
        block = building_fp8_block()
        N, K = shape
        if block is not None and sections_fit(self._out_sections(), block[0]) and sections_fit(
                self._in_sections(K), block[1]):
            self.fp8_block = block
            self.weight_scale = scale_param((-(-N // block[0]), -(-K // block[1])))
        else:
            self.weight_scale = scale_param(shape[:1])
        self.plan = LinearPlan(self.behind, fp8=True, block=self.fp8_block)
        return fp8_param(shape, self._load_fp8)

    def _place_scale(self, scale: torch.Tensor, shard_id: object) -> torch.Tensor:
        """The scales of the checkpoint rows ``_place`` sends here (one per row, [N])."""
        return self._place(scale[:, None], shard_id)[1][:, 0]

    def _place_blocks(self, scale: torch.Tensor, shard_id: object) -> tuple[slice, torch.Tensor]:
        """(the block rows of this rank's scales, the checkpoint's block scales that go there): the
        scale's rows spread to one per weight row, placed as the weight's rows are, one kept a
        block."""
        assert self.fp8_block is not None
        r = self.fp8_block[0]
        rows, placed = self._place(scale.repeat_interleave(r, 0), shard_id)
        return block_slice(rows, r), placed[::r]

    def _load_fp8(self, param: torch.Tensor, w: torch.Tensor | fp8.Fp8Weight | fp8.Fp8BlockWeight,
                  shard_id: object = None) -> None:
        """A checkpoint tensor into the FP8 weight, the rows it writes only (the rows of other
        loads keep theirs): full precision is quantized with a scale a row; an FP8 checkpoint's
        rows with a scale each (``fp8.Fp8Weight``) are stored as they are (a block-scaled one
        is dequantized first). A weight scaled per block takes ``_load_fp8_blocks``."""
        assert self.weight_scale is not None
        if self.fp8_block is not None:
            return self._load_fp8_blocks(param, w, shard_id)
        if isinstance(w, fp8.Fp8BlockWeight):
            w = w.dequantize(torch.float32)
        if isinstance(w, fp8.Fp8Weight):
            rows, q_rows = self._place(w.q, shard_id)
            src: torch.Tensor | fp8.Fp8Weight = fp8.Fp8Weight(q_rows, self._place_scale(w.scale, shard_id))
            shape = q_rows.shape
        else:
            rows, src = self._place(w, shard_id)
            shape = src.shape
        if shape != param.data[rows].shape:
            raise ValueError(f"weight shape {tuple(shape)} does not fit parameter {tuple(param.data[rows].shape)}")
        q, scale = fp8.weight_rows(src, param.device)   # checkpoint tensors arrive on the host
        with torch.no_grad():   # through the parameters, not .data: their version counters see the write
            param[rows] = q                                    # (fp8.reference keeps a CPU copy by them)
            self.weight_scale[rows] = scale

    def _load_fp8_blocks(self, param: torch.Tensor, w: torch.Tensor | fp8.Fp8Weight | fp8.Fp8BlockWeight,
                         shard_id: object) -> None:
        """``_load_fp8`` for a weight scaled per block: a block-scaled checkpoint tensor of the
        same blocks keeps its bytes and scales; anything else is quantized a block at a time (its
        rows and columns here fall on whole blocks: ``sections_fit``)."""
        assert self.weight_scale is not None and self.fp8_block is not None
        if isinstance(w, fp8.Fp8BlockWeight) and tuple(w.block) == self.fp8_block:
            rows, q = self._place(w.q, shard_id)
            block_rows, scale = self._place_blocks(w.scale, shard_id)
        else:
            if isinstance(w, (fp8.Fp8Weight, fp8.Fp8BlockWeight)):
                w = w.dequantize(torch.float32)
            rows, src = self._place(w, shard_id)
            q, scale = fp8.quantize_blocks(src.to(param.device), self.fp8_block)
            block_rows = block_slice(rows, self.fp8_block[0])
        have = self.weight_scale.data[block_rows].shape
        if q.shape != param.data[rows].shape or scale.shape != have:
            raise ValueError(f"weight shape {tuple(q.shape)} (scales {tuple(scale.shape)}) does not fit parameter "
                             f"{tuple(param.data[rows].shape)} (scales {tuple(have)})")
        with torch.no_grad():
            param[rows] = q.to(param.device)
            self.weight_scale[block_rows] = scale.to(param.device, torch.float32)


class ColumnParallelLinear(Projection):
    """y = x Wᵀ with W's output rows split across ranks (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 behind: Neighbour = Neighbour.PLAIN) -> None:
        super().__init__(behind)
        self.tp = tp
        self.out_features = out_features
        self.start, self.end = split_range(out_features, tp.rank, tp.size)
        self.weight = self._weight_param((self.end - self.start, in_features))
        self.bias = _param((self.end - self.start,), self._load) if bias else None

    def _place(self, w: torch.Tensor, shard_id: object) -> tuple[slice, torch.Tensor]:
        return slice(None), w[self.start:self.end]

    def _out_sections(self) -> list[Section]:
        return [(self.start, self.end - self.start, self.out_features)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)


class MergedColumnParallelLinear(Projection):
    """Several column-parallel projections of the same input in one matmul (gate ‖ up)."""

    def __init__(self, in_features: int, out_features: list[int], bias: bool, tp: TPGroup,
                 behind: Neighbour = Neighbour.PLAIN) -> None:
        super().__init__(behind)
        self.out_features = out_features
        self.ranges = [split_range(n, tp.rank, tp.size) for n in out_features]
        self.offsets = [0]
        for s, e in self.ranges:
            self.offsets.append(self.offsets[-1] + e - s)
        self.weight = self._weight_param((self.offsets[-1], in_features))
        self.bias = _param((self.offsets[-1],), self._load) if bias else None

    def _place(self, w: torch.Tensor, shard_id: object) -> tuple[slice, torch.Tensor]:
        i = int(shard_id)  # type: ignore[call-overload]
        s, e = self.ranges[i]
        return slice(self.offsets[i], self.offsets[i + 1]), w[s:e]

    def _out_sections(self) -> list[Section]:
        return [(s, e - s, n) for (s, e), n in zip(self.ranges, self.out_features, strict=True)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)


class QKVParallelLinear(Projection):
    """q ‖ k ‖ v projections of this rank's heads in one matmul."""

    def __init__(self, hidden: int, head_dim: int, heads: HeadShard, bias: bool,
                 behind: Neighbour = Neighbour.NORM) -> None:
        super().__init__(behind)
        self.heads, self.head_dim = heads, head_dim
        self.q_size = heads.num_heads * head_dim
        self.kv_size = heads.num_kv_heads * head_dim
        out = self.q_size + 2 * self.kv_size
        self.weight = self._weight_param((out, hidden))
        self.bias = _param((out,), self._load) if bias else None

    def _place(self, w: torch.Tensor, shard_id: object) -> tuple[slice, torch.Tensor]:
        h, D = self.heads, self.head_dim
        if shard_id == "q":
            return slice(0, self.q_size), w[h.q_start * D:(h.q_start + h.num_heads) * D]
        if shard_id in ("k", "v"):
            off = self.q_size + (0 if shard_id == "k" else self.kv_size)
            return slice(off, off + self.kv_size), w[h.kv_start * D:(h.kv_start + h.num_kv_heads) * D]
        raise ValueError(f"unknown qkv shard {shard_id!r}")

    def _out_sections(self) -> list[Section]:
        h, D = self.heads, self.head_dim
        kv = (h.kv_start * D, self.kv_size, None)
        return [(h.q_start * D, self.q_size, None), kv, kv]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) of x [T, hidden]: [T, H·D], [T, Hkv·D], [T, Hkv·D]."""
        return self.project(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(Projection):
    """y = x Wᵀ with W's input columns split across ranks; partial sums are all-reduced — here,
    or, when ``deferred`` (set by the owner at build time: a norm follows and there is no bias),
    by that norm (``RMSNorm.forward(..., reduce=tp)``), fused with it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 in_ranges: list[tuple[int, int]] | None = None, behind: Neighbour = Neighbour.PLAIN) -> None:
        super().__init__(behind)
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        # in_ranges: the input columns of this rank as ranges of the full matrix (heads may
        # be split unevenly); default is an even split.
        self.in_ranges = in_ranges or [split_range(in_features, tp.rank, tp.size)]
        width = sum(e - s for s, e in self.in_ranges)
        self.weight = self._weight_param((out_features, width))
        self.bias = _param((out_features,), default_loader) if bias else None
        self.deferred = False

    @property
    def can_defer(self) -> bool:
        """Whether a norm after it may do the reduction (several ranks, no bias to add first)."""
        return self.tp.size > 1 and self.bias is None

    def _place(self, w: torch.Tensor, shard_id: object) -> tuple[slice, torch.Tensor]:
        return slice(None), torch.cat([w[:, s:e] for s, e in self.in_ranges], dim=1)

    def _place_scale(self, scale: torch.Tensor, shard_id: object) -> torch.Tensor:
        return scale   # every output row is here, its input columns split

    def _place_blocks(self, scale: torch.Tensor, shard_id: object) -> tuple[slice, torch.Tensor]:
        assert self.fp8_block is not None
        c = self.fp8_block[1]
        return slice(None), torch.cat([scale[:, s // c:-(-e // c)] for s, e in self.in_ranges], dim=1)

    def _out_sections(self) -> list[Section]:
        return [(0, self.out_features, self.out_features)]

    def _in_sections(self, K: int) -> list[Section]:
        return [(s, e - s, self.in_features) for s, e in self.in_ranges]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: this rank's input columns (gate ‖ up behind SILU) -> the full output on every rank
        (this rank's partial sum when ``deferred``)."""
        if self.lora is None:
            return self.output(self.plan(x, self.weight, None, self.weight_scale))
        if self.lora.silu_in_front:   # its plan is then a plain one (models/lora.install)
            x = ops.silu_and_mul(x)
        return self.output(self.lora(self.plan(x, self.weight, None, self.weight_scale), x))

    def output(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's partial product as the layer's output: kept partial when deferred, else
        the sum over the ranks plus the bias."""
        if self.deferred:
            return partial
        y = self.tp.all_reduce(partial)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; each rank looks up its rows, the sum is all-reduced."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = _param((self.per_rank, hidden), self._load)

    def _load(self, param: torch.Tensor, w: torch.Tensor, shard_id: object = None) -> None:
        param.data.zero_()
        param.data[:self.end - self.start].copy_(w[self.start:self.end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(Projection):
    """logits = h Wᵀ over this rank's vocab rows, gathered to the full vocabulary."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__(Neighbour.PLAIN)
        self.tp, self.vocab_size = tp, vocab_size
        self.bias = None
        if tied is not None:
            self.weight = tied.weight
            self.per_rank, self.start, self.end = tied.per_rank, tied.start, tied.end
        else:
            emb = VocabParallelEmbedding(vocab_size, hidden, tp)
            self.per_rank, self.start, self.end = emb.per_rank, emb.start, emb.end
            self.weight = emb.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last_dim(self.project(h))[..., :self.vocab_size]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with ``residual`` it first adds it (fused add + norm) and
    returns (normed, new residual). ``unit_offset`` (Gemma's norms): rows are scaled by
    1 + weight, in float32, rather than by weight.

    ``fp8_rows_above``: set at build time where the projection after this norm multiplies FP8
    rows (``fp8.takes_fp8_rows``; the engine's ``DecoderLayer.prepare_fp8_rows``). A batch of more rows
    than that (the cuBLASLt bucket of ``linear_plan``) then leaves the norm already quantized per
    row, as ``fp8.Fp8Rows``, by the same kernel."""

    def __init__(self, hidden: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = _param((hidden,), default_loader)
        self.fp8_rows_above: int | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: TPGroup | None = None):
        """``reduce``: x is this rank's partial sum over that group (a deferred row-parallel
        output): all-reduce, add and norm in one (``TPGroup.all_reduce_add_rms_norm``; not with
        ``unit_offset``, whose layers defer nothing)."""
        if self.fp8_rows_above is not None and x.shape[0] > self.fp8_rows_above:
            return self._fp8_rows(x, residual, reduce)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)
        if reduce is not None:
            assert not self.unit_offset, "a unit-offset norm takes whole sums"
            return reduce.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)

    def _fp8_rows(self, x: torch.Tensor, residual: torch.Tensor | None, reduce: TPGroup | None):
        if reduce is not None and residual is not None:
            assert not self.unit_offset, "a unit-offset norm takes whole sums"
            if reduce.fuses_norm(x, residual, self.weight):   # the all-reduce kernel's norm, then the rows apart
                h, residual = reduce.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
                return fp8.quantize_rows(h), residual
            x = reduce.all_reduce(x)
        rows, res = ops.rms_norm_fp8(x, residual, self.weight, self.eps, self.unit_offset)
        return rows if residual is None else (rows, res)


class RotaryEmbedding(nn.Module):
    """The float32 cos ‖ sin table over positions for rotate-half rotary embedding; attention
    applies it together with the K/V write (``ops.rope_and_write_kv``). YaRN's attention factor
    multiplies the table (as transformers multiplies its cos and sin)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                      # [P, D/2]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        factor = rope_attention_factor(scaling)
        self.cos_sin: torch.Tensor
        self.register_buffer("cos_sin", table if factor == 1.0 else table * factor, persistent=False)



def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale for a context ``factor`` times the trained one: 0.1 · mscale · ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict) -> float:
    """What YaRN multiplies cos and sin by (its ``attention_factor``, else from ``factor``,
    ``mscale`` and ``mscale_all_dim``); 1 for the other rope types."""
    if scaling.get("rope_type", "default") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: the low frequencies (long wavelengths) divided by ``factor``, the high ones kept, a
    linear ramp between the dimensions that turn ``beta_slow`` and ``beta_fast`` times over the
    original context (floored and ceiled unless ``truncate`` is false)."""
    factor, old_len = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Inverse frequencies [D/2] for rope types default, linear, llama3 and yarn."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if kind != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
