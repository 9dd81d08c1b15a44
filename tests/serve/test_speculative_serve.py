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
