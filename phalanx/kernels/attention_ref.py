"""Torch reference paged attention: K/V writes into slots, partial-reuse block copies, and
attention of packed variable-length queries over a paged cache (prefill over a cached prefix,
chunked prefill and decode are one case). GQA by grouped heads; optional sliding window.

Pool layout, per layer: ``k_cache``/``v_cache`` [num_blocks, tokens_per_block, Hkv, D];
slot s = block_id * tokens_per_block + offset. An FP8 pool keeps each block's values key-minor
(``values_key_minor``): the same bytes as [num_blocks, Hkv, D, tokens_per_block].

Packed queries of S sequences::

    seq s:   query rows [query_start[s], query_start[s+1])   at positions
             [seq_len[s] - q_len[s], seq_len[s])              attending keys [0, position]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

# A layer's (K scale, V scale) for an FP8 pool: the pool stores k / k_scale and v / v_scale, and
# attention reads them back times the scales (a checkpoint's calibrated ``k_scale``/``v_scale``,
# ``loader.kv_scale_names``; 1 without them). A pool of any other dtype stores K and V as they are.
KvScale = tuple[float, float]
UNIT_KV_SCALE: KvScale = (1.0, 1.0)


class HeadNorms(NamedTuple):
    """Per-head RMSNorms of q and k before the rotary (Qwen3's, Gemma's q/k norms): their weights
    [D], epsilon, and whether rows scale by 1 + weight (``reference.rms_norm_ref``)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    unit_offset: bool


def inverse_kv_scale(kv_scale: KvScale) -> tuple[float, float]:
    """What the writing kernels multiply K and V by (float32 products, as ``write_kv_ref``)."""
    return 1.0 / kv_scale[0], 1.0 / kv_scale[1]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """An FP8 pool as bytes (torch's CPU index kernels take no float8), any other as it is."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def pool_kv_scale(cache: torch.Tensor, kv_scale: KvScale) -> KvScale:
    """The scales a pool's K and V are read with: ``kv_scale`` for an FP8 pool, else 1."""
    return kv_scale if cache.element_size() == 1 else UNIT_KV_SCALE


def values_key_minor(cache: torch.Tensor) -> bool:
    """Whether a pool keeps each block's values key-minor, [Hkv, D, B] in place of [B, Hkv, D]:
    an FP8 (one-byte) pool does. The attention kernels then take a value tile's keys from
    consecutive bytes, as the second dot wants them; from rows, 8-bit values reach that dot only a
    byte at a time (docs/gpu_notes.md, twenty-first round). Their value loads are not masked by key
    (a masked load of single keys would be byte loads): a key past the sequence gets no weight, and
    the pool holds no NaN (zeroed when allocated, a NaN written as 0), so its stale value adds
    0 * finite."""
    return cache.element_size() == 1


def _value_planes(v_cache: torch.Tensor) -> torch.Tensor:
    """A key-minor pool layer's values as [num_blocks, Hkv, D, B] (bytes)."""
    NB, B, Hkv, D = v_cache.shape
    return _raw(v_cache).view(NB, Hkv, D, B)


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: KvScale = UNIT_KV_SCALE) -> None:
    """k, v: [T, Hkv, D] written at slots [T] of the flattened pool (rounded to its dtype; FP8
    divided by ``kv_scale`` — times its float32 inverse —, saturating at ±448; a NaN value into a
    key-minor pool as 0)."""
    Hkv, D = k.shape[-2:]
    if k_cache.element_size() == 1:     # (saturating whatever torch's own cast does; a NaN key stays NaN)
        k_inv, v_inv = (torch.tensor(x, dtype=torch.float32) for x in inverse_kv_scale(kv_scale))
        k = (k.float() * k_inv).clamp(-448.0, 448.0)
        v = (torch.where(v.isnan(), 0.0, v.float()) * v_inv).clamp(-448.0, 448.0)
    _raw(k_cache).view(-1, Hkv, D).index_copy_(0, slot_mapping, _raw(k.to(k_cache.dtype)))
    if values_key_minor(v_cache):
        B = v_cache.shape[1]
        _value_planes(v_cache)[slot_mapping // B, :, :, slot_mapping % B] = _raw(v.to(v_cache.dtype))
    else:
        _raw(v_cache).view(-1, Hkv, D).index_copy_(0, slot_mapping, _raw(v.to(v_cache.dtype)))


def copy_blocks_ref(kv_pool: torch.Tensor, src: list[int], dst: list[int], num_tokens: list[int]) -> None:
    """kv_pool: [L, 2, num_blocks, B, Hkv, D]; copies rows [0, n) of block src into dst."""
    for s, d, n in zip(src, dst, num_tokens, strict=True):
        kv_pool[:, :, d, :n] = kv_pool[:, :, s, :n]


@dataclass
class RefAttentionPlan:
    """Gather indices and masks shared by every layer of one step (built once per step)."""

    kv_slots: torch.Tensor          # [S, Lmax] slot of key j of seq s (0 where padded)
    q_index: torch.Tensor           # [S, Qmax] packed row of query i of seq s (T where padded)
    q_valid: torch.Tensor           # [S, Qmax] bool
    q_pos: torch.Tensor             # [S, Qmax] absolute position of each query
    k_len: torch.Tensor             # [S] keys per sequence
    masks: dict = field(default_factory=dict)  # sliding window (or None) -> [S, 1, Qmax, Lmax]

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            j = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)
            pos = self.q_pos.unsqueeze(-1)                              # [S, Qmax, 1]
            m = (j <= pos) & (j < self.k_len.view(-1, 1, 1))
            if window is not None:
                m &= j > pos - window
            m |= ~self.q_valid.unsqueeze(-1) & (j == 0)                 # padded rows: no NaN
            self.masks[window] = m.unsqueeze(1)
        return self.masks[window]


def build_ref_plan(query_start: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   tokens_per_block: int, max_query_len: int, max_seq_len: int) -> RefAttentionPlan:
    """Step metadata -> the padded gather plan of ``paged_attention_ref``.

    query_start [S+1], seq_lens [S], block_tables [S, max_blocks] (padded), all on one device.
    """
    dev, B = seq_lens.device, tokens_per_block
    q_lens = (query_start[1:] - query_start[:-1]).long()
    seq_lens = seq_lens.long()
    T = int(query_start[-1]) if query_start.numel() else 0
    j = torch.arange(max_seq_len, device=dev)
    blocks = block_tables.long().gather(1, (j // B).clamp(max=block_tables.shape[1] - 1)
                                        .expand(len(seq_lens), -1))
    kv_slots = torch.where(j < seq_lens[:, None], blocks * B + j % B, 0)
    qi = torch.arange(max_query_len, device=dev)
    q_valid = qi < q_lens[:, None]
    q_index = torch.where(q_valid, query_start[:-1, None].long() + qi, T)
    q_pos = seq_lens[:, None] - q_lens[:, None] + qi
    return RefAttentionPlan(kv_slots, q_index, q_valid, q_pos, seq_lens)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        plan: RefAttentionPlan, scale: float, window: int | None = None,
                        kv_of_q: torch.Tensor | None = None, kv_scale: KvScale = UNIT_KV_SCALE) -> torch.Tensor:
    """q: [T, H, D] packed queries -> [T, H, D].

    ``kv_of_q`` [H] maps each query head to its KV head when groups are not uniform
    (uneven tensor-parallel splits); otherwise heads are grouped GQA-style. An FP8 pool's keys
    and values are read times ``kv_scale``: the K scale joins the softmax scale, the V scale
    multiplies the output (as the kernels apply them).
    """
    T, H, D = q.shape
    Hkv = k_cache.shape[-2]
    qp = torch.cat([q, q.new_zeros(1, H, D)])[plan.q_index]          # [S, Qmax, H, D]
    k = _raw(k_cache).view(-1, Hkv, D)[plan.kv_slots].view(k_cache.dtype)    # [S, Lmax, Hkv, D]
    if values_key_minor(v_cache):
        B = v_cache.shape[1]
        v = _value_planes(v_cache)[plan.kv_slots // B, :, :, plan.kv_slots % B].view(v_cache.dtype)
    else:
        v = _raw(v_cache).view(-1, Hkv, D)[plan.kv_slots].view(v_cache.dtype)
    if kv_of_q is not None:
        k, v = k.index_select(2, kv_of_q), v.index_select(2, kv_of_q)
    k_s, v_s = pool_kv_scale(k_cache, kv_scale)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=plan.mask(window), scale=scale * k_s, enable_gqa=k.shape[2] != H)
    if v_s != 1.0:
        out = (out.float() * v_s).to(q.dtype)
    out = out.transpose(1, 2)                                        # [S, Qmax, H, D]
    result = q.new_empty(T, H, D)
    result[plan.q_index[plan.q_valid]] = out[plan.q_valid]
    return result
