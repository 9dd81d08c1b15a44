"""EAGLE-3 heads for the tests: random checkpoints in the published layout, a dense reference of
the head written from the published architecture (over transformers' hidden states of the
target), and a head trained in about a second to predict a target's greedy tokens."""

import json
import math

import torch

from hf_reference import TINY, hf_greedy

K = 3
AUX_IDS = [1, 2, 3]          # vLLM's numbering: the outputs of the target's layers 0, 1 and 2
HEAD = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-6, rope_theta=10000.0, draft_vocab_size=96)


def head_tensors(seed: int, vocab: int = TINY["vocab_size"]) -> dict[str, torch.Tensor]:
    """A random head in the checkpoint's layout (``midlayer.*``, ``fc``, ``d2t``, ...)."""
    g = torch.Generator().manual_seed(seed)
    H, F, D = HEAD["hidden_size"], HEAD["intermediate_size"], HEAD["head_dim"]
    nq, nkv, dv = HEAD["num_attention_heads"], HEAD["num_key_value_heads"], HEAD["draft_vocab_size"]

    def w(*shape, scale=0.15):
        return torch.randn(*shape, generator=g) * scale

    def norm():
        return 1 + 0.1 * torch.randn(H, generator=g)
    draft_to_target = torch.sort(torch.randperm(vocab, generator=g)[:dv]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_to_target] = True
    return {
        "fc.weight": w(H, len(AUX_IDS) * H), "midlayer.self_attn.q_proj.weight": w(nq * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(nkv * D, 2 * H), "midlayer.self_attn.v_proj.weight": w(nkv * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, nq * D), "midlayer.mlp.gate_proj.weight": w(F, H),
        "midlayer.mlp.up_proj.weight": w(F, H), "midlayer.mlp.down_proj.weight": w(H, F),
        "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(), "norm.weight": norm(),
        "lm_head.weight": w(dv, H, scale=0.5), "d2t": draft_to_target - torch.arange(dv), "t2d": t2d,
    }


def write_head(path, tensors: dict[str, torch.Tensor], **config) -> str:
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
           "vocab_size": TINY["vocab_size"], "max_position_embeddings": 512, "torch_dtype": "float32",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS}, **HEAD, **config}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


# -- the reference ---------------------------------------------------------------------------------
def _rms(x, w, eps=HEAD["rms_norm_eps"]):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos):
    """Rotate-half rotary of x [T, heads, D] at positions pos [T]."""
    D = x.shape[-1]
    inv = 1.0 / HEAD["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + half * sin


class RefHead:
    """The head, densely: ``entries`` appends entries (positions, next tokens, hidden) to its KV
    lists and returns (normed out, pre-norm g) of each."""

    def __init__(self, t: dict[str, torch.Tensor], embed: torch.Tensor):
        self.t, self.embed = t, embed
        self.k, self.v = [], []

    def entries(self, pos, ids, h):
        t, m = self.t, "midlayer."
        D, nq, nkv = HEAD["head_dim"], HEAD["num_attention_heads"], HEAD["num_key_value_heads"]
        x = torch.cat([_rms(self.embed[ids], t[m + "input_layernorm.weight"]),
                       _rms(h, t[m + "hidden_norm.weight"])], -1)
        q = _rope((x @ t[m + "self_attn.q_proj.weight"].T).view(-1, nq, D), pos)
        self.k.append(_rope((x @ t[m + "self_attn.k_proj.weight"].T).view(-1, nkv, D), pos))
        self.v.append((x @ t[m + "self_attn.v_proj.weight"].T).view(-1, nkv, D))
        k, v = torch.cat(self.k), torch.cat(self.v)
        k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
        n, T = k.shape[0], q.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        mask = torch.arange(n)[None, :] > (n - T + torch.arange(T))[:, None]    # causal over all entries
        a = torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, -1e30).softmax(-1), v).reshape(T, nq * D)
        r = a @ t[m + "self_attn.o_proj.weight"].T + h
        u = _rms(r, t[m + "post_attention_layernorm.weight"])
        act = torch.nn.functional.silu(u @ t[m + "mlp.gate_proj.weight"].T) * (u @ t[m + "mlp.up_proj.weight"].T)
        g = act @ t[m + "mlp.down_proj.weight"].T + r
        return _rms(g, t["norm.weight"]), g

    def token(self, out):
        best = (out @ self.t["lm_head.weight"].T).argmax(-1)
        return best + self.t["d2t"][best] if "d2t" in self.t else best


def target_hidden(hf, tensors, seq: list[int], aux_ids=AUX_IDS) -> torch.Tensor:
    """fc of the target's hidden states after the captured layers, at every position of seq."""
    with torch.no_grad():
        hs = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in aux_ids], -1) @ tensors["fc.weight"].T


def ref_drafts(hf, tensors, seq: list[int], k: int = K, aux_ids=AUX_IDS) -> list[int]:
    """The head's k drafts once seq (its last token not yet run by the target) is accepted."""
    L = len(seq)
    h = target_hidden(hf, tensors, seq, aux_ids)
    head = RefHead(tensors, hf.model.embed_tokens.weight.detach())
    out, g = head.entries(torch.arange(L - 1), torch.tensor(seq[1:]), h[:L - 1])
    out, g = out[-1:], g[-1:]
    drafts = []
    for i in range(k):
        tok = head.token(out)
        drafts.append(int(tok))
        if i + 1 < k:
            out, g = head.entries(torch.tensor([L - 1 + i]), tok, g)
    return drafts


def prompts(vocab, n=(3, 9, 17, 40)):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in n]


def train_head(hf, steps: int = 120) -> dict[str, torch.Tensor]:
    """A head (the target's vocabulary: no d2t) trained for ~1 s to predict, at each entry, the
    token after next of the target's greedy continuations of ``prompts``: its first draft is
    then right on those, and drafts get accepted."""
    seqs = [torch.tensor(p + hf_greedy(hf, p, 24)[0]) for p in prompts(hf.config.vocab_size)]
    with torch.no_grad():
        aux = [torch.cat([hf(s[None], output_hidden_states=True).hidden_states[i][0] for i in AUX_IDS], -1)
               for s in seqs]
    tensors = head_tensors(9)
    del tensors["d2t"], tensors["t2d"]
    tensors["lm_head.weight"] = torch.randn(hf.config.vocab_size, HEAD["hidden_size"],
                                            generator=torch.Generator().manual_seed(9)) * 0.1
    params = {k: v.requires_grad_(True) for k, v in tensors.items()}
    opt = torch.optim.Adam(params.values(), lr=3e-3)
    embed = hf.model.embed_tokens.weight.detach()
    for _ in range(steps):
        loss = torch.zeros(())
        for seq, a in zip(seqs, aux, strict=True):
            n = len(seq) - 2
            out, _ = RefHead(params, embed).entries(torch.arange(n), seq[1:-1], (a @ params["fc.weight"].T)[:n])
            loss = loss + torch.nn.functional.cross_entropy(out @ params["lm_head.weight"].T, seq[2:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


def target_config():
    """The targets' shape: the tests' tiny Llama with 4 layers (three captured, one after)."""
    from transformers import LlamaConfig
    return LlamaConfig(**dict(TINY, num_hidden_layers=4), tie_word_embeddings=False)


def assert_cached_entries(llm, hf, tensors, seq: list[int], tol: float = 1e-4) -> int:
    """The head's K and V at every position of ``seq`` whose block the prefix cache holds equal
    the reference head's entry there: (the target's h at p, the token at p + 1), within ``tol``.
    Returns the positions checked."""
    engine_ = llm._executor.engine
    nodes = engine_.scheduler.kv.match(seq).tree_match.nodes
    pool = engine_.runner.spec.proposer.pool.tensor            # [1, 2, blocks, B, Hkv, D]
    B = pool.shape[3]
    n = len(nodes) * B
    ref = RefHead(tensors, hf.model.embed_tokens.weight.detach())
    with torch.no_grad():
        ref.entries(torch.arange(n), torch.tensor(seq[1:n + 1]), target_hidden(hf, tensors, seq)[:n])
    ours = torch.stack([pool[0, :, node.block_id] for node in nodes], 1).flatten(1, 2)   # [2, n, Hkv, D]
    ours = ours.float().cpu()
    for what, mine, theirs in (("K", ours[0], ref.k[0]), ("V", ours[1], ref.v[0])):
        bad = ((mine - theirs).abs().amax(dim=(1, 2)) > tol).nonzero().flatten().tolist()
        assert not bad, f"the head's {what} differs from the reference at positions {bad}"
    return n
