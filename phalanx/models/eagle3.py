"""An EAGLE-3 head: the draft of ``speculative_config.decoding_type: Eagle3``.

EAGLE-3 (Li et al., 2025) drafts from the target's own hidden states. The target writes the
residual stream after three of its layers (low, middle, high) for every token it runs
(``DecoderModel.capture_hidden``); ``fc`` maps their concatenation [T, 3 · H_target] to one
hidden state h_p a position. The head is one decoder layer whose entry at position p takes h_p
and the embedding of the token *after* p, and predicts the token after that one::

    e   = embed(x_{p+1})                         (the target's embedding, unless the head has one)
    a   = attention(positions, [input_layernorm(e) ‖ hidden_norm(h_p)])   (q/k/v take 2H columns)
    r   = a + h_p                                (hidden_norm(h_p) with norm_before_residual)
    m   = mlp(post_attention_layernorm(r))
    out = norm(m + r)   -> lm_head (draft_vocab_size rows) -> argmax + d2t[argmax]: a target token id
    g   = m + r         (before the norm) stands in for h at the next position while drafting

Its KV cache is a pool of one layer sharing the target's block ids (its entry at p sits where
the target's token p does). ``Eagle3Proposer`` (pyexecutor/speculative.py) runs it.

Checkpoints: a ``LlamaForCausalLMEagle3`` directory (safetensors) with ``midlayer.*`` (or
``layers.0.*``), ``fc``, ``norm``, ``lm_head``, ``d2t`` (draft id -> target id offset) and
optionally ``embed_tokens``; ``t2d`` is not needed. The layers read are
``eagle_aux_hidden_state_layer_ids`` when the config names them (vLLM's numbering: id j is the
output of layer j − 1; id 0, the embeddings, is refused), else the outputs of layers 1, L/2 − 1
and L − 4 of an L-layer target (vLLM's and TensorRT-LLM's default). The head runs unsharded on
every rank (it is small); only its embedding, when it is the target's, is the target's sharded one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from phalanx.kernels.metadata import AttentionMetadata
from phalanx.models.config import ModelConfig
from phalanx.models.layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
)
from phalanx.models.llama import MLP, Attention, CausalLM
from phalanx.models.parallel import TPGroup


def aux_layers(cfg: ModelConfig, target_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs the head reads, in the order ``fc`` takes them: ascending,
    as the target's forward meets them (vLLM's and TensorRT-LLM's order, whatever the config's);
    a ValueError naming the field for ids the target does not have."""
    if not cfg.eagle_aux_layer_ids:
        if target_layers < 5:
            raise ValueError(f"speculative_config: an EAGLE-3 head reads three layers of the target by default "
                             f"(1, L/2 - 1, L - 4); the target has {target_layers} layers: name them in the head's "
                             "eagle_aux_hidden_state_layer_ids")
        return (1, target_layers // 2 - 1, target_layers - 4)
    bad = [i for i in cfg.eagle_aux_layer_ids if not 1 <= i < target_layers]
    if bad:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids: {bad} are not taken (ids 1 .. {target_layers - 1}: id "
                         "j is the output of the target's layer j - 1; 0, the embeddings, is not captured)")
    return tuple(sorted(i - 1 for i in cfg.eagle_aux_layer_ids))


class Eagle3Head(nn.Module):
    """The head's layers (see the module docstring). ``forward`` -> (normed out, g)."""

    lora = None    # (the kernel tuner asks: a head takes no LoRA adapters)

    def __init__(self, cfg: ModelConfig, target_hidden: int, num_aux: int, target_embed: VocabParallelEmbedding,
                 own_embedding: bool, max_positions: int) -> None:
        super().__init__()
        one = TPGroup()
        H, D = cfg.hidden_size, cfg.head_dim
        if target_hidden != H:
            raise ValueError(f"speculative_config.speculative_model_dir: the EAGLE-3 head's hidden_size ({H}) "
                             f"differs from the target's ({target_hidden})")
        self.config = cfg
        self.vocab_size = cfg.draft_vocab_size or cfg.vocab_size
        self.fc = ColumnParallelLinear(num_aux * target_hidden, H, False, one)
        # the target's positions, whatever the head's config says (published heads say 2,048): a
        # rotation clamped there would leave the head's attention blind to distance past it
        self.max_positions = max(max_positions, cfg.max_position_embeddings)
        self.rotary = RotaryEmbedding(D, self.max_positions, cfg.rope_theta, cfg.rope)
        self.self_attn = Attention(cfg, 0, one, self.rotary)
        self.self_attn.qkv_proj = QKVParallelLinear(2 * H, D, self.self_attn.heads, cfg.qkv_bias)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size, cfg.mlp_bias, one)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(H, self.vocab_size, False, one)
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(self.vocab_size, dtype=torch.long), persistent=False)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H, one) if own_embedding else None
        self._target_embed = [target_embed]   # the target's (a list keeps it out of this module's parameters)

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._target_embed[0])(ids)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                kv_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] (the token after each position), positions [T], hidden [T, H] -> (the normed
        output [T, H], g [T, H]). kv_pool: [1, 2, blocks, B, Hkv, D]."""
        x, normed_h = self._input(ids, hidden)
        residual = normed_h if self.config.eagle_norm_before_residual else hidden
        a = self.self_attn(positions, x, meta, kv_pool[0, 0], kv_pool[0, 1])
        h, residual = self.post_attention_layernorm(a, residual)
        return self.norm(self.mlp(h), residual)

    def write_kv(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor,
                 kv_pool: torch.Tensor) -> None:
        """The entries' K and V alone, into pool ``slots`` (``forward`` up to the attention's K/V
        write): all that entries whose output no draft reads need."""
        x, _ = self._input(ids, hidden)
        self.self_attn.qkv_rope(positions, x, AttentionMetadata.kv_writes(slots), kv_pool[0, 0], kv_pool[0, 1])

    def _input(self, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input [T, 2H]: the next token's normed embedding ‖ the normed h, the normed h)."""
        normed_h = self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(self.embed(ids)), normed_h], dim=-1), normed_h

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """The greedy draft of each row of ``out`` as a target token id."""
        best = self.lm_head(out).argmax(dim=-1)
        return best + self.d2t[best]

    # -- weights ---------------------------------------------------------------------------------
    def random_weights(self, seed: int) -> None:
        """Random weights (``load_format: dummy``): projections ~ N(0, 0.02), norms 1, d2t 0."""
        g = torch.Generator(device=self.norm.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * 0.02)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """An EAGLE-3 checkpoint's tensors (see the module docstring); a ValueError names a
        tensor with no place here, or a parameter left unloaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        mapped = False
        for name, w in weights:
            name = re.sub(r"^(midlayer|layers\.0)\.", "", re.sub(r"^model\.", "", name))
            if name in ("t2d",) or "rotary_emb" in name:
                continue
            if name == "d2t":
                mapped = True
                if w.shape != self.d2t.shape:
                    raise ValueError(f"EAGLE-3 checkpoint tensor 'd2t': shape {tuple(w.shape)}, the head's "
                                     f"draft_vocab_size is {self.vocab_size}")
                self.d2t.copy_(w.long())
                continue
            target, shard = name, None
            for ckpt, ours, s in CausalLM.stacked:
                if f".{ckpt}." in name:
                    target, shard = name.replace(f".{ckpt}.", f".{ours}."), s
            param = params.get(target)
            if param is None:
                raise ValueError(f"EAGLE-3 checkpoint tensor {name!r} has no place in the head"
                                 + (" (it brings an embedding: the head was built without one)"
                                    if name == "embed_tokens.weight" else ""))
            param.weight_loader(param, w.to(param.dtype), shard)  # type: ignore[attr-defined]  # layers._param
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"EAGLE-3 checkpoint: weights missing: {', '.join(missing[:8])}")
        if not mapped and self.vocab_size != self.config.vocab_size:
            raise ValueError(f"EAGLE-3 checkpoint: no d2t (draft id -> target id), and draft_vocab_size "
                             f"({self.vocab_size}) is not the target's vocabulary ({self.config.vocab_size})")
        return len(loaded)
