"""EAGLE-3 speculative decoding (CPU, fp32), against a dense reference written here from the
published architecture and transformers' own hidden states of the target:

- every draft the engine proposes equals the reference head's drafts from the same accepted
  tokens (the target's hidden states of three layers through ``fc``, each entry fed the next
  token, the chain fed the head's own pre-norm output);
- greedy tokens equal transformers' (so plain decoding's), batched, chunked, with prefix hits,
  with the policy turning drafts off and on;
- a head trained here for a few seconds to predict the target's tokens has its drafts
  accepted, and batched steps accept exactly what one request at a time accepts;
- checkpoints and settings are refused by name where they do not fit.
"""

import json
import math

import pytest
import torch

from hf_reference import TINY, assert_same_greedy, hf_greedy, tiny_model_dirs
from phalanx import LLM, SamplingParams

K = 3
AUX_IDS = [1, 2, 3]          # vLLM's numbering: the outputs of the target's layers 0, 1 and 2
HEAD = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-6, rope_theta=10000.0, draft_vocab_size=96)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer Llama (the tests' tiny shape) and transformers' model of it."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(**dict(TINY, num_hidden_layers=4), tie_word_embeddings=False)
    path = tiny_model_dirs(lambda name: tmp_path_factory.mktemp(name), {"target4": cfg}, seed=77)["target4"]
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


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


def target_hidden(hf, tensors, seq: list[int]) -> torch.Tensor:
    """fc of the target's hidden states after the captured layers, at every position of seq."""
    with torch.no_grad():
        hs = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in AUX_IDS], -1) @ tensors["fc.weight"].T


def ref_drafts(hf, tensors, seq: list[int], k: int = K) -> list[int]:
    """The head's k drafts once seq (its last token not yet run by the target) is accepted."""
    L = len(seq)
    h = target_hidden(hf, tensors, seq)
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


def eagle(path, k=K, adaptive=False):
    return {"decoding_type": "Eagle3", "max_draft_len": k, "speculative_model_dir": path, "adaptive": adaptive}


def engine(target_path, head_path, **kw):
    kw.setdefault("kv_cache_config", {"tokens_per_block": 8})
    return LLM(target_path, skip_tokenizer_init=True, orchestrator_type="inprocess",
               speculative_config=eagle(head_path, adaptive=kw.pop("adaptive", False)), **kw)


def stats(llm):
    return llm._executor.engine.stats()


@pytest.fixture(scope="module")
def trained(target):
    """A head (the target's vocabulary: no d2t) trained for ~1 s to predict, at each entry, the
    token after next of the target's greedy continuations of ``prompts``: its first draft is
    then right on those, and drafts get accepted."""
    _, hf = target
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
    for _ in range(120):
        loss = torch.zeros(())
        for seq, a in zip(seqs, aux, strict=True):
            n = len(seq) - 2
            out, _ = RefHead(params, embed).entries(torch.arange(n), seq[1:-1], (a @ params["fc.weight"].T)[:n])
            loss = loss + torch.nn.functional.cross_entropy(out @ params["lm_head.weight"].T, seq[2:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


# -- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random", "trained"])
def test_every_draft_equals_the_reference_heads(kind, target, trained, tmp_path):
    """random: a draft vocabulary of 96 (d2t), drafts rejected; trained: drafts accepted, so the
    head's next entry comes from a later verify position."""
    path, hf = target
    tensors = head_tensors(1) if kind == "random" else trained
    head = write_head(tmp_path / "head", tensors, **({} if kind == "random" else {"draft_vocab_size": None}))
    with engine(path, head, max_num_tokens=16) as llm:      # the 40-token prompt comes in chunks of 16
        proposer = llm._executor.engine.runner.spec.proposer
        seen = []
        propose = proposer.propose

        def recording(spec, slots, length, tables, max_length, hidden):
            drafts = propose(spec, slots, length, tables, max_length, hidden)
            seen.append((length.tolist(), drafts.tolist()))
            return drafts
        proposer.propose = recording
        for p in prompts(hf.config.vocab_size):
            seen.clear()
            out = llm.generate([p], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
            ref, gaps = hf_greedy(hf, p, 12)
            assert_same_greedy(out.outputs[0].token_ids, ref, gaps)
            seq = p + out.outputs[0].token_ids
            assert len(seen) >= 3
            for (L,), (drafts,) in seen:
                if len(seq) > L:     # (the last proposal, past the end, drafts for nothing)
                    assert drafts == ref_drafts(hf, tensors, seq[:L]), f"prompt of {len(p)}, L = {L}"
        s = stats(llm)
        if kind == "trained":
            assert s["spec_accepted_drafts"] > 0.25 * s["spec_draft_tokens"]
        else:
            assert s["spec_accepted_drafts"] < 0.1 * s["spec_draft_tokens"]


def test_batched_steps_accept_what_one_request_at_a_time_accepts(target, trained, tmp_path):
    path, hf = target
    head = write_head(tmp_path / "head", trained, draft_vocab_size=None)
    ps = prompts(hf.config.vocab_size)
    accepted = []
    for batched in (False, True):
        with engine(path, head) as llm:
            params = SamplingParams(max_tokens=20, ignore_eos=True)
            outs = (llm.generate(ps, params, use_tqdm=False) if batched
                    else [llm.generate([p], params, use_tqdm=False)[0] for p in ps])
            for p, out in zip(ps, outs, strict=True):
                ref, gaps = hf_greedy(hf, p, 20)
                assert_same_greedy(out.outputs[0].token_ids, ref, gaps)
            accepted.append((stats(llm)["spec_accepted_drafts"], stats(llm)["spec_verify_rows"]))
    assert accepted[0] == accepted[1] and accepted[0][0] > accepted[0][1] / 2


def test_greedy_equals_transformers_batched_chunked_with_prefix_hits_and_the_policy(target, tmp_path):
    path, hf = target
    head = write_head(tmp_path / "head", head_tensors(2))
    ps = prompts(hf.config.vocab_size) + [prompts(hf.config.vocab_size)[3][:24] + [7, 8]]   # a shared prefix
    refs = [hf_greedy(hf, p, 14) for p in ps]
    for kw in ({"max_num_tokens": 16}, {"adaptive": True, "disable_overlap_scheduler": True}):
        with engine(path, head, **kw) as llm:
            for round_ in range(2):
                outs = llm.generate(ps, SamplingParams(max_tokens=14, ignore_eos=True), use_tqdm=False)
                for out, (ref, gaps) in zip(outs, refs, strict=True):
                    assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"{kw} round {round_}")
            assert outs[-1].cached_tokens > 0
            s = stats(llm)
            assert s["spec_verify_rows"] > 0
            llm._executor.engine.scheduler.kv.check_integrity()


def test_settings_and_checkpoints_are_refused_by_name(target, tmp_path, tiny_models):
    from phalanx.config import make_llm_args
    path, _ = target
    args = make_llm_args(model=path, speculative_config={"method": "eagle3", "model": "x", "num_speculative_tokens": 2})
    assert args.speculative_config.decoding_type == "Eagle3" and args.speculative_config.max_draft_len == 2
    with pytest.raises(ValueError, match="Eagle3 needs speculative_model_dir"):
        make_llm_args(model=path, speculative_config={"decoding_type": "Eagle3"})
    with pytest.raises(ValueError, match="needs an EAGLE-3 head"):          # a causal LM is not a head
        LLM(path, skip_tokenizer_init=True, orchestrator_type="inprocess",
            speculative_config=eagle(tiny_models["llama"]))
    head = write_head(tmp_path / "head", head_tensors(3))
    with pytest.raises(ValueError, match="takes a causal LM, not an EAGLE-3 head"):
        LLM(path, skip_tokenizer_init=True, orchestrator_type="inprocess",
            speculative_config={"decoding_type": "DraftTarget", "speculative_model_dir": head})
    bad_ids = write_head(tmp_path / "ids", head_tensors(3),
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids: \[0\] are not taken"):
        engine(path, bad_ids)
    tensors = head_tensors(3)
    del tensors["fc.weight"]
    with pytest.raises(ValueError, match="speculative_model_dir: EAGLE-3 checkpoint: weights missing: fc.weight"):
        engine(path, write_head(tmp_path / "missing", tensors))
    tensors = head_tensors(3)
    tensors["midlayer.extra.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="'extra.weight' has no place in the head"):
        engine(path, write_head(tmp_path / "extra", tensors))
