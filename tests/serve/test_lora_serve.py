"""``phalanx serve --lora_modules``: an adapter is a model of its own (vLLM's way). A request
naming it runs with it and gets the LLM class's tokens for that adapter; its answer names it;
/v1/models lists it under the base model; a name the server does not serve is a 404. With
``--allow_runtime_lora_updating`` adapters are loaded and unloaded while serving; SGLang's
``/generate`` names one as ``lora_path``."""

import json

import httpx
import pytest
import torch
from safetensors.torch import save_file

from serve_helpers import KEY, start_server, stop_server

H = {"Authorization": f"Bearer {KEY}"}
BASE = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A random rank-4 adapter of the bundled model's q, v, o and down projections, large enough
    to change its greedy text."""
    from phalanx.models.lora import module_shapes
    from phalanx.models.source import bundled_model_path, resolve_model
    cfg = resolve_model(bundled_model_path()).config
    shapes = module_shapes(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size)
    g = torch.Generator().manual_seed(11)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, block in (("q_proj", "self_attn"), ("v_proj", "self_attn"), ("o_proj", "self_attn"),
                              ("down_proj", "mlp")):
            fan_in, fan_out = shapes[module]
            key = f"base_model.model.model.layers.{layer}.{block}.{module}.lora_"
            tensors[key + "A.weight"] = torch.randn(4, fan_in, generator=g) / fan_in ** 0.5
            tensors[key + "B.weight"] = torch.randn(fan_out, 4, generator=g) * 0.05
    path = tmp_path_factory.mktemp("tuned")
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"],
        "bias": "none"}))
    return str(path)


@pytest.fixture(scope="module")
def reference(adapter):
    """The LLM class's greedy texts of PROMPT: (base, with the adapter)."""
    from phalanx import LLM, LoRARequest, SamplingParams
    llm = LLM(None, orchestrator_type="inprocess", enable_lora=True, max_seq_len=512)
    try:
        sp = SamplingParams(max_tokens=12, temperature=0)
        return (llm.generate(PROMPT, sp).outputs[0].text,
                llm.generate(PROMPT, sp, lora_request=LoRARequest("tuned", 1, adapter)).outputs[0].text)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def server(adapter):
    proc, url = start_server("--lora_modules", f"tuned={adapter}", "--max_lora_rank", "8",
                             "--allow_runtime_lora_updating")
    yield url
    stop_server(proc)


def test_an_adapter_served_as_a_model_gives_the_llm_class_tokens(server, reference):
    base, tuned = reference
    assert base != tuned, "an adapter that changes nothing proves nothing"
    answers = {}
    for model in (BASE, "tuned"):
        r = httpx.post(server + "/v1/completions", headers=H, timeout=120,
                       json={"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        answers[model] = r.json()["choices"][0]["text"]
    assert (answers[BASE], answers["tuned"]) == (base, tuned)
    # a stream of the adapter's chat names it in every chunk and says what the whole answer says
    chat = {"model": "tuned", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 10,
            "temperature": 0}
    whole = httpx.post(server + "/v1/chat/completions", headers=H, json=chat, timeout=120).json()
    with httpx.stream("POST", server + "/v1/chat/completions", headers=H, json={**chat, "stream": True},
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert {c["model"] for c in chunks} == {"tuned"} and whole["model"] == "tuned"
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == whole["choices"][0]["message"]["content"]


def test_models_lists_the_adapter_and_an_unknown_model_is_a_404(server):
    data = httpx.get(server + "/v1/models", headers=H, timeout=30).json()["data"]
    assert [m["id"] for m in data] == [BASE, "tuned"]
    assert data[1]["parent"] == BASE and "parent" not in data[0]
    card = httpx.get(server + "/v1/models/tuned", headers=H, timeout=30).json()
    assert card["id"] == "tuned" and card["parent"] == BASE
    r = httpx.post(server + "/v1/completions", headers=H, timeout=30,
                   json={"model": "tuned2", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "'tuned'" in r.json()["error"]["message"]


def test_adapters_loaded_and_unloaded_while_serving(server, reference, adapter, tmp_path):
    _, tuned = reference

    def post(path, body):
        return httpx.post(server + path, headers=H, json=body, timeout=120)

    assert post("/v1/load_lora_adapter", {"lora_name": "again", "lora_path": adapter}).status_code == 200
    assert [m["id"] for m in httpx.get(server + "/v1/models", headers=H).json()["data"]] == [BASE, "tuned", "again"]
    r = post("/v1/completions", {"model": "again", "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.json()["choices"][0]["text"] == tuned and r.json()["model"] == "again"
    taken = post("/load_lora_adapter", {"lora_name": "again", "lora_path": adapter})
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 64, "lora_alpha": 8}))
    big = post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(tmp_path)})
    assert big.status_code == 400 and big.json()["error"]["param"] == "lora_path"
    assert "max_lora_rank (8)" in big.json()["error"]["message"]
    # SGLang's /generate names an adapter as lora_path
    g = post("/generate", {"text": PROMPT, "lora_path": "again",
                           "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert g.status_code == 200 and g.json()["text"] == tuned, g.text
    unknown = post("/generate", {"text": PROMPT, "lora_path": "nope", "sampling_params": {"max_new_tokens": 2}})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora_path"
    assert post("/v1/unload_lora_adapter", {"lora_name": "again"}).status_code == 200
    gone = post("/v1/completions", {"model": "again", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404
    assert post("/unload_lora_adapter", {"lora_name": "again"}).status_code == 404


def test_an_adapter_loaded_from_a_trainer_s_tensors_while_serving(server, reference, adapter):
    """SGLang's /load_lora_adapter_from_tensors: the adapter's tensors shared in place (here CPU
    tensors through shared memory) with its PEFT config; served as a model of its own with the
    LLM class's tokens; refused by field where it cannot be; unloaded, its name is free again."""
    from safetensors.torch import load_file

    from phalanx.llmapi.weight_transfer import share_tensors
    _, tuned = reference
    with open(f"{adapter}/adapter_config.json") as f:
        config = json.load(f)
    tensors = load_file(f"{adapter}/adapter_model.safetensors")

    def post(path, body):
        return httpx.post(server + path, headers=H, json=body, timeout=120)

    with share_tensors(tensors.items()) as shared:
        body = {"lora_name": "mem", "config_dict": config, "tensors": shared.specs}
        big = post("/load_lora_adapter_from_tensors", {**body, "config_dict": {**config, "r": 64}})
        assert big.status_code == 400 and big.json()["error"]["param"] == "config_dict", big.text
        assert "max_lora_rank (8)" in big.json()["error"]["message"]
        dora = post("/load_lora_adapter_from_tensors", {**body, "lora_name": "tensor layer 2",
                                                         "config_dict": {**config, "use_dora": True}})
        assert dora.status_code == 400 and dora.json()["error"]["param"] == "config_dict", dora.text   # (not its name)
        assert "use_dora=True in config_dict" in dora.json()["error"]["message"]
        pickled = post("/load_lora_adapter_from_tensors", {"lora_name": "mem", "config_dict": config,
                                                            "serialized_tensors": "gASV"})
        assert pickled.status_code == 400 and pickled.json()["error"]["param"] == "serialized_tensors"
        wrong = post("/load_lora_adapter_from_tensors",
                     {**body, "tensors": [dict(s, shape=[4, 3]) if i == 0 else s for i, s in enumerate(shared.specs)]})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "tensors", wrong.text
        assert "do not fit the model" in wrong.json()["error"]["message"]
        r = post("/load_lora_adapter_from_tensors", body)
        assert r.status_code == 200, r.text
    # (the segment is gone now: the ranks hold their own copy)
    c = post("/v1/completions", {"model": "mem", "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert c.status_code == 200 and c.json()["choices"][0]["text"] == tuned and c.json()["model"] == "mem"
    assert post("/v1/unload_lora_adapter", {"lora_name": "mem"}).status_code == 200
    assert post("/v1/completions", {"model": "mem", "prompt": PROMPT, "max_tokens": 2}).status_code == 404
    assert post("/load_lora_adapter", {"lora_name": "mem", "lora_path": adapter}).status_code == 200
    assert post("/unload_lora_adapter", {"lora_name": "mem"}).status_code == 200
