"""`phalanx serve` with speculative decoding from its YAML config: the openai client's greedy
answers equal plain decoding's (the LLM class without speculation), streamed answers too, and
/metrics counts the drafts."""

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from phalanx import LLM, SamplingParams
from serve_helpers import KEY, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
TEXT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
        "Pack my box with five dozen liquor jugs.")


def test_serve_with_ngram_speculation_equals_plain_decoding(tmp_path):
    messages = [[{"role": "user", "content": f"Copy this text exactly: {TEXT}"}],
                [{"role": "user", "content": "Count from one to ten."}]]
    with LLM(orchestrator_type="inprocess", max_seq_len=512) as llm:
        prompts = [llm.apply_chat_template(m) for m in messages]
        plain = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0),
                                                         use_tqdm=False)]
    cfg = tmp_path / "spec.yaml"
    cfg.write_text("speculative_config:\n  decoding_type: NGram\n  max_draft_len: 4\n")
    proc, url = start_server("--config", str(cfg))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        for m, expected in zip(messages, plain, strict=True):
            r = client.chat.completions.create(model=MODEL, messages=m, max_tokens=48, temperature=0)
            assert r.choices[0].message.content == expected
            stream = client.chat.completions.create(model=MODEL, messages=m, max_tokens=48, temperature=0,
                                                    stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
        text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        drafts = values["phalanx:spec_decode_num_draft_tokens_total"]
        accepted = values["phalanx:spec_decode_num_accepted_tokens_total"]
        assert drafts == 4 * values["phalanx:spec_decode_num_drafts_total"] > 0
        assert 0 < accepted <= drafts
    finally:
        stop_server(proc)


def test_serve_with_an_eagle3_head_equals_plain_decoding(tmp_path):
    """vLLM's spelling on the command line (method eagle3) with an EAGLE-3 head of the bundled
    model's shape (random weights, a 4,096-token draft vocabulary mapped through d2t): answers
    equal plain decoding's, and /metrics counts the drafts."""
    import json

    import torch
    from safetensors.torch import save_file
    H, D, nq, nkv, F, V, dv = 576, 64, 9, 3, 1536, 49152, 4096
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
    tensors = {"fc.weight": w(H, 3 * H), "midlayer.self_attn.q_proj.weight": w(nq * D, 2 * H),
               "midlayer.self_attn.k_proj.weight": w(nkv * D, 2 * H),
               "midlayer.self_attn.v_proj.weight": w(nkv * D, 2 * H), "midlayer.self_attn.o_proj.weight": w(H, nq * D),
               "midlayer.mlp.gate_proj.weight": w(F, H), "midlayer.mlp.up_proj.weight": w(F, H),
               "midlayer.mlp.down_proj.weight": w(H, F), "lm_head.weight": w(dv, H),
               "d2t": torch.randperm(V, generator=g)[:dv].sort().values - torch.arange(dv)}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[name + ".weight"] = torch.ones(H, dtype=torch.bfloat16)
    head = tmp_path / "head"
    head.mkdir()
    save_file(tensors, str(head / "model.safetensors"))
    (head / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "head_dim": D,
        "num_attention_heads": nq, "num_key_value_heads": nkv, "intermediate_size": F, "num_hidden_layers": 1,
        "vocab_size": V, "draft_vocab_size": dv, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}))
    messages = [[{"role": "user", "content": f"Copy this text exactly: {TEXT}"}]]
    with LLM(orchestrator_type="inprocess", max_seq_len=512) as llm:
        prompts = [llm.apply_chat_template(m) for m in messages]
        plain = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0),
                                                         use_tqdm=False)]
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    proc, url = start_server("--speculative-config", spec)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        for m, expected in zip(messages, plain, strict=True):
            r = client.chat.completions.create(model=MODEL, messages=m, max_tokens=32, temperature=0)
            assert r.choices[0].message.content == expected
        text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        drafts = values["phalanx:spec_decode_num_draft_tokens_total"]
        assert drafts == 3 * values["phalanx:spec_decode_num_drafts_total"] > 0
    finally:
        stop_server(proc)
