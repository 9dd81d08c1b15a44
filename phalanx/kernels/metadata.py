"""AttentionMetadata: what every attention layer of one step needs, built once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Packed variable-length batch of S sequences and T query tokens over a paged KV pool.

    slot_mapping [T]      pool slot each new token's K/V is written to
    query_start [S+1]     row offsets of each sequence's queries in the packed batch
    seq_lens [S]          keys per sequence after this step (cached prefix + new tokens)
    block_tables [S, M]   block ids per sequence, padded
    """

    slot_mapping: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    tokens_per_block: int
    is_decode_only: bool = False
    plan_num_seqs: int | None = None   # sequences to plan kernels for (None: all; a graph's padding rows are empty)
    num_decode_rows: int = 0   # a mixed step's leading sequences of one query each (0: none, or not split)
    cache: dict = field(default_factory=dict)  # backend-specific per-step plans

    @classmethod
    def one_prompt(cls, n: int, tokens_per_block: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """One prompt of ``n`` tokens, its K/V written to slots 0..n-1 of blocks 0, 1, ...
        (a pool of at least cdiv(n, tokens_per_block) blocks)."""
        i32 = torch.int32
        blocks = -(-n // tokens_per_block)
        return cls(slot_mapping=torch.arange(n, device=device),
                   query_start=torch.tensor([0, n], dtype=i32, device=device),
                   seq_lens=torch.tensor([n], dtype=i32, device=device),
                   block_tables=torch.arange(blocks, dtype=i32, device=device)[None],
                   max_query_len=n, max_seq_len=n, tokens_per_block=tokens_per_block)

    @classmethod
    def kv_writes(cls, slot_mapping: torch.Tensor) -> AttentionMetadata:
        """Metadata of K/V writes alone (``ops.rope_and_write_kv`` reads ``slot_mapping`` only): it
        holds no sequence, so no attention can run on it."""
        none = slot_mapping.new_zeros(0, dtype=torch.int32)
        return cls(slot_mapping=slot_mapping, query_start=none, seq_lens=none, block_tables=none.view(0, 0),
                   max_query_len=0, max_seq_len=0, tokens_per_block=1)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
