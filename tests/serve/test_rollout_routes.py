"""The RL hand-off routes of `phalanx serve` (bundled SmolLM2): the API key guards each one, bad
input is a 400 naming the field and changes nothing, an update from disk sets the version that
every completion then carries, pause/continue and sleep/wake_up work over HTTP."""

import threading
import time

import httpx
import pytest

from phalanx.models.source import bundled_model_path
from serve_helpers import KEY

AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTES = [("post", "/pause_generation"), ("post", "/continue_generation"), ("post", "/sleep"), ("post", "/wake_up"),
          ("get", "/is_sleeping"), ("get", "/weight_version"), ("post", "/update_weights_from_disk"),
          ("post", "/update_weights_from_tensor"), ("post", "/init_weights_update_group"),
          ("post", "/update_weights_from_distributed"), ("post", "/destroy_weights_update_group"),
          ("post", "/reset_prefix_cache"), ("get", "/flush_cache"), ("post", "/generate"), ("post", "/abort_request"),
          ("post", "/release_memory_occupation"), ("post", "/resume_memory_occupation"), ("get", "/v1/loads"),
          ("get", "/get_load")]


def complete(url, **extra):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_route_needs_the_key(server, method, path):
    r = getattr(httpx, method)(server + path, timeout=30)
    assert r.status_code == 401


@pytest.mark.parametrize("path, body, param", [
    ("/pause_generation", {"mode": "later"}, "mode"),
    ("/sleep", {"level": 3}, "level"),
    ("/sleep", {"level": True}, "level"),
    ("/wake_up", {"tags": ["gpu"]}, "tags.0"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/ckpt"}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/x", "path": "/x"}, "path"),
    ("/update_weights_from_tensor", {"tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [3],
                                                  "shm": "nothing", "offset": 0}]}, "tensors"),
    ("/update_weights_from_tensor", {"tensors": [{"name": "model.nope.weight", "dtype": "float32", "shape": [576],
                                                  "shm": "nothing", "offset": 0}]}, "tensors"),
    ("/update_weights_from_tensor", {"tensors": [{"name": "model.norm.weight", "dtype": "int64", "shape": [576],
                                                  "shm": "nothing", "offset": 0}]}, "tensors"),
    ("/update_weights_from_tensor", {"tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [576],
                                                  "shm": "nothing", "offset": 0}]}, "tensors"),
    ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                          "shapes": [[576]]}, None),
    ("/continue_generation", {"now": True}, "now"),
])
def test_bad_input_is_a_400_and_changes_nothing(server, path, body, param):
    before = complete(server)
    r = httpx.post(server + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["message"]
    if param is not None:
        assert err["param"] == param, err
    after = complete(server)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert after["weight_version"] == before["weight_version"]


def test_a_tensor_update_refused_on_a_later_tensor_changes_no_weight(server):
    """Every tensor's location is checked before the first one loads: an update whose last
    tensor lies outside its segment is a 400 naming tensors, and the weights before it are
    not half-replaced (zeroed norms would change every output)."""
    import torch

    from phalanx.llmapi.weight_transfer import share_tensors
    before = complete(server)
    with share_tensors([("model.norm.weight", torch.zeros(576)),
                        ("model.layers.0.input_layernorm.weight", torch.zeros(576))]) as shared:
        specs = [dict(s) for s in shared.specs]
        specs[1]["offset"] = 10 ** 8
        r = httpx.post(server + "/update_weights_from_tensor", json={"tensors": specs}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tensors", r.text
    assert "outside segment" in r.json()["error"]["message"]
    after = complete(server)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert after["weight_version"] == before["weight_version"]
    r = httpx.post(server + "/sleep", json={"level": 1}, headers=AUTH, timeout=120)
    again = httpx.post(server + "/sleep", json={"level": 1}, headers=AUTH, timeout=120)
    assert again.status_code == 400 and again.json()["error"]["param"] is None    # the call, no field of it
    assert httpx.post(server + "/wake_up", json={}, headers=AUTH, timeout=120).status_code == 200


def test_update_from_disk_sets_the_version_every_response_carries(server):
    first = complete(server, return_token_ids=True)
    choice = first["choices"][0]
    assert len(choice["token_ids"]) == first["usage"]["completion_tokens"] and choice["prompt_token_ids"]
    r = httpx.post(server + "/update_weights_from_disk", json={"model_path": bundled_model_path(),
                                                               "weight_version": "policy-2"}, headers=AUTH, timeout=300)
    assert r.status_code == 200 and r.json() == {"success": True, "weight_version": "policy-2"}
    assert httpx.get(server + "/weight_version", headers=AUTH, timeout=60).json() == {"weight_version": "policy-2"}
    again = complete(server)
    assert again["weight_version"] == "policy-2"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0     # not the old weights' KV
    assert again["choices"][0]["text"] == choice["text"]                     # the same weights, reloaded
    r = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=120, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "return_token_ids": True})
    assert r.json()["weight_version"] == "policy-2" and r.json()["prompt_token_ids"]
    assert httpx.post(server + "/reset_prefix_cache", headers=AUTH, timeout=60).json() == {"success": True}


def test_flush_cache_empties_the_prefix_cache(server):
    """SGLang's /flush_cache (slime calls it after a weight update) is reset_prefix_cache."""
    prompt = "A long enough prompt to fill whole blocks of the cache: " * 8
    complete(server, prompt=prompt)
    assert complete(server, prompt=prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for method in ("get", "post"):
        r = getattr(httpx, method)(server + "/flush_cache", headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json() == {"success": True}
        assert complete(server, prompt=prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        complete(server, prompt=prompt)


def test_pause_keep_holds_a_request_until_continue(server):
    assert httpx.post(server + "/pause_generation", json={"mode": "keep"}, headers=AUTH, timeout=60).status_code == 200
    done = []
    t = threading.Thread(target=lambda: done.append(complete(server)))
    t.start()
    time.sleep(0.5)
    assert not done
    assert httpx.post(server + "/continue_generation", headers=AUTH, timeout=60).status_code == 200
    t.join(60)
    assert done and done[0]["choices"][0]["finish_reason"] == "length"


def test_sleep_and_wake_up(server):
    before = complete(server)
    assert httpx.post(server + "/sleep", json={"level": 1}, headers=AUTH, timeout=120).json() == {"success": True}
    assert httpx.get(server + "/is_sleeping", headers=AUTH, timeout=60).json() == {"is_sleeping": True}
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    assert httpx.post(server + "/wake_up", json={}, headers=AUTH, timeout=120).json() == {"success": True}
    assert httpx.get(server + "/is_sleeping", headers=AUTH, timeout=60).json() == {"is_sleeping": False}
    assert complete(server)["choices"][0]["text"] == before["choices"][0]["text"]


def test_sglang_release_and_resume_memory_occupation(server):
    """SGLang's names for sleep and wake-up, as verl's SGLang adapter calls them: release
    everything, then resume the weights and then the KV cache (with its CUDA graphs); a partial
    release, or CUDA graphs alone, is a 400 naming tags."""
    before = complete(server)
    for tags in (["kv_cache"], ["weights", "cuda_graph"]):
        r = httpx.post(server + "/release_memory_occupation", json={"tags": tags}, headers=AUTH, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tags", r.text
    assert httpx.get(server + "/is_sleeping", headers=AUTH, timeout=60).json() == {"is_sleeping": False}
    r = httpx.post(server + "/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}, headers=AUTH,
                   timeout=120)
    assert r.json() == {"success": True}
    assert httpx.get(server + "/is_sleeping", headers=AUTH, timeout=60).json() == {"is_sleeping": True}
    r = httpx.post(server + "/resume_memory_occupation", json={"tags": ["cuda_graph"]}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags", r.text
    for tags in (["weights"], ["kv_cache", "cuda_graph"]):
        r = httpx.post(server + "/resume_memory_occupation", json={"tags": tags}, headers=AUTH, timeout=120)
        assert r.json() == {"success": True}, r.text
    assert httpx.get(server + "/is_sleeping", headers=AUTH, timeout=60).json() == {"is_sleeping": False}
    assert complete(server)["choices"][0]["text"] == before["choices"][0]["text"]
    assert httpx.post(server + "/release_memory_occupation", json={}, headers=AUTH, timeout=120).status_code == 200
    assert httpx.post(server + "/resume_memory_occupation", json={}, headers=AUTH, timeout=120).status_code == 200
    assert complete(server)["choices"][0]["text"] == before["choices"][0]["text"]


def test_cuda_ipc_specs_are_strict():
    """A CUDA IPC location names every field the engine reads, handles in base64; anything
    else is refused naming the field (not a 500 on the rank)."""
    import base64
    import json

    from phalanx.serve.protocol import BodyError, parse_body
    from phalanx.serve.rollout_routes import TensorsBody
    ipc = {"device_uuid": "GPU-1", "handle": base64.b64encode(b"\x01" * 64).decode(), "storage_bytes": 64,
           "storage_offset_bytes": 0, "ref_counter_handle": base64.b64encode(b"/ref").decode(),
           "ref_counter_offset": 0, "event_handle": "", "event_sync_required": False, "element_offset": 0}

    def parse(cuda_ipc):
        body = {"tensors": [{"name": "w", "dtype": "float32", "shape": [4, 4], "cuda_ipc": cuda_ipc}]}
        return parse_body(json.dumps(body).encode(), TensorsBody)
    spec = parse(ipc).tensors[0].cuda_ipc.spec()
    assert spec["handle"] == b"\x01" * 64 and spec["ref_counter_handle"] == b"/ref" and spec["event_handle"] == b""
    for bad, field in (({**ipc, "extra": 1}, "extra"), ({**ipc, "handle": "%%%"}, "handle"),
                       ({k: v for k, v in ipc.items() if k != "storage_bytes"}, "storage_bytes")):
        with pytest.raises(BodyError) as e:
            parse(bad)
        assert field in (e.value.param or "") + e.value.message


# -- SGLang's /generate and /abort_request (RL trainers' rollouts: slime, AReaL, verl's HTTP adapter) --

def generate(url, **body):
    r = httpx.post(url + "/generate", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_answers_as_sglang_does(server):
    """One prompt: the text and token ids a greedy completion gives, SGLang's meta_info (finish
    reason dict, counts, weight version), logprobs as [logprob, id, text or null] with the same
    values as the completion's, the prompt's from logprob_start_len (the first one null), a stop
    string matched (trimmed unless no_stop_trim) and EOS matched as its id."""
    done = complete(server, logprobs=2, return_token_ids=True)["choices"][0]
    out = generate(server, text="The capital of France is", return_logprob=True, top_logprobs_num=2,
                   logprob_start_len=0, sampling_params={"temperature": 0, "max_new_tokens": 6})
    meta = out["meta_info"]
    assert out["text"] == done["text"] and out["output_ids"] == done["token_ids"]
    assert meta["finish_reason"] == {"type": "length", "length": 6} and meta["completion_tokens"] == 6
    assert meta["prompt_tokens"] == len(done["prompt_token_ids"]) and meta["weight_version"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == done["token_ids"]
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(done["logprobs"]["token_logprobs"],
                                                                               abs=1e-4)
    assert all(text is None for _, _, text in meta["output_token_logprobs"])
    assert all(len(top) == 2 and top[0][0] >= top[1][0] for top in meta["output_top_logprobs"])
    first, *rest = meta["input_token_logprobs"]
    assert first[0] is None and [t for _, t, _ in [first, *rest]] == done["prompt_token_ids"]
    assert all(lp < 0 for lp, _, _ in rest) and meta["input_top_logprobs"][0] is None
    named = generate(server, input_ids=done["prompt_token_ids"], return_logprob=True, return_text_in_logprobs=True,
                     logprob_start_len=3, sampling_params={"temperature": 0, "max_new_tokens": 2})["meta_info"]
    assert named["output_token_logprobs"][0][2] == " Paris" and len(named["input_token_logprobs"]) == 2
    stop = done["text"][3:6]
    for trim, text in ((False, done["text"][:done["text"].find(stop)]), (True, done["text"][:done["text"].find(stop)]
                                                                         + stop)):
        cut = generate(server, text="The capital of France is", sampling_params={
            "temperature": 0, "max_new_tokens": 6, "stop": [stop], "no_stop_trim": trim})
        assert cut["text"] == text and cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    ends = generate(server, text="Say hi.", sampling_params={"temperature": 0, "max_new_tokens": 200})
    from phalanx.llmapi.tokenizer import load_tokenizer
    from phalanx.models.source import resolve_model
    eos = load_tokenizer(resolve_model(bundled_model_path())).eos_token_ids
    assert ends["meta_info"]["finish_reason"]["type"] == "stop" and ends["meta_info"]["finish_reason"]["matched"] in eos
    assert ends["output_ids"][-1] in eos
    # SGLang's prompt-only request (a cache fill): nothing generated, the prompt's logprobs given
    fill = generate(server, text="The capital of France is", return_logprob=True, logprob_start_len=0,
                    sampling_params={"max_new_tokens": 0})
    assert (fill["text"], fill["output_ids"], fill["meta_info"]["output_token_logprobs"]) == ("", [], [])
    assert fill["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(fill["meta_info"]["input_token_logprobs"]) == fill["meta_info"]["prompt_tokens"]
    # no prompt logprobs asked (the start past the prompt): the cached prefix is reused
    long = "The capital of France is a city with a long history, " * 6
    for _ in range(2):
        past = generate(server, text=long, return_logprob=True, logprob_start_len=10 ** 6,
                        sampling_params={"max_new_tokens": 1})["meta_info"]
    assert past["input_token_logprobs"] == [] and past["cached_tokens"] > 0


def test_generate_logprobs_are_of_the_tempered_distribution(server):
    """SGLang's logprobs are those of the logits divided by the temperature: the gap between the
    first position's two likeliest tokens is the model's own gap (a completion's, raw) over T."""
    raw = complete(server, max_tokens=1, logprobs=2)["choices"][0]["logprobs"]["top_logprobs"][0]
    (a, b) = sorted(raw.values(), reverse=True)[:2]
    hot = generate(server, text="The capital of France is", return_logprob=True, top_logprobs_num=2,
                   sampling_params={"temperature": 0.5, "max_new_tokens": 1, "sampling_seed": 1})["meta_info"]
    (ta, _, _), (tb, _, _) = hot["output_top_logprobs"][0]
    assert ta - tb == pytest.approx((a - b) / 0.5, rel=1e-3) and abs((a - b) / 0.5 - (a - b)) > 0.1
    greedy = generate(server, text="The capital of France is", return_logprob=True, top_logprobs_num=2,
                      sampling_params={"temperature": 0, "max_new_tokens": 1})["meta_info"]
    assert [x[0] for x in greedy["output_top_logprobs"][0]] == pytest.approx([a, b], abs=1e-4)   # greedy: T = 1


def test_generate_batches_samples_and_streams(server):
    """A batch (token ids, per-prompt sampling params, n samples) answers a list prompt by
    prompt, each prompt's samples in order; a stream sends each item's whole output so far,
    with its index, and ends as the plain answer does."""
    prompts = [[504, 3575, 282, 4649, 314], [504, 3575]]
    out = generate(server, input_ids=prompts, rid="job", sampling_params=[
        {"temperature": 0, "max_new_tokens": 3, "n": 2}, {"temperature": 0, "max_new_tokens": 5, "n": 2}])
    assert [o["meta_info"]["completion_tokens"] for o in out] == [3, 3, 5, 5]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [5, 5, 2, 2]
    assert out[0]["output_ids"] == out[1]["output_ids"] and len({o["meta_info"]["id"] for o in out}) == 4
    one = generate(server, input_ids=prompts[1], sampling_params={"temperature": 0, "max_new_tokens": 5})
    assert one["output_ids"] == out[2]["output_ids"]                      # a single prompt: one answer, not a list
    events = []
    with httpx.stream("POST", server + "/generate", headers=AUTH, timeout=120, json={
            "input_ids": prompts, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    import json
    with httpx.stream("POST", server + "/generate", headers=AUTH, timeout=120, json={
            "input_ids": prompts[:1], "stream": True, "sampling_params": {"max_new_tokens": 2}}) as r:
        one_batch = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert one_batch and all(e["index"] == 0 for e in one_batch)       # a batch of one still says which
    by_index: dict[int, list] = {}
    for e in map(json.loads, events[:-1]):
        by_index.setdefault(e["index"], []).append(e)
    for i, seq in by_index.items():
        ids = [e["output_ids"] for e in seq]
        assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:], strict=False))     # each event: all so far
        assert seq[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert all(e["meta_info"]["finish_reason"] is None for e in seq[:-1])
        assert ids[-1] == generate(server, input_ids=prompts[i], sampling_params={
            "temperature": 0, "max_new_tokens": 4})["output_ids"]


def test_abort_request_ends_a_generation_with_its_tokens_so_far(server):
    """slime's partial rollouts: /abort_request (by rid, or all) ends a running /generate, which
    ends with the tokens so far and finish reason type abort (a stream here, so that the abort
    comes once tokens have; a plain request answers 200 the same way)."""
    import json
    for body in ({"rid": "long-1"}, {"rid": "", "abort_all": True}):     # (the second: verl's form)
        events: list = []
        started = threading.Event()

        def run(events=events, started=started):
            with httpx.stream("POST", server + "/generate", headers=AUTH, timeout=120, json={
                    "text": "Tell me a long story.", "rid": "long-1", "stream": True,
                    "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        started.set()
        t = threading.Thread(target=run)
        t.start()
        assert started.wait(120)
        r = httpx.post(server + "/abort_request", json=body, headers=AUTH, timeout=30)
        t.join(120)
        assert r.status_code == 200 and r.json()["aborted"] == 1, r.text
        last = events[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(last["output_ids"]) < 400 and last["meta_info"]["completion_tokens"] == len(last["output_ids"])
    for nothing in ({"rid": "nobody"}, {}, {"rid": "", "abort_all": False}):
        r = httpx.post(server + "/abort_request", json=nothing, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["aborted"] == 0


def test_loads_count_a_running_request_until_abort_all_ends_it(server):
    """slime's drain: /abort_request with abort_all, then /v1/loads?include=core polled until no
    request is left; /get_load is the older form routers read."""
    def load(**params):
        r = httpx.get(server + "/v1/loads", params=params, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_for(pred, what):
        deadline = time.monotonic() + 60
        while not pred(report := load(include="core")):
            assert time.monotonic() < deadline, (what, report)
            time.sleep(0.1)
        return report

    idle = wait_for(lambda r: r["aggregate"]["total_reqs"] == 0, "idle")
    [rank] = idle["loads"]
    assert rank["dp_rank"] == 0 and rank["max_total_num_tokens"] == idle["aggregate"]["total_tokens"] > 0
    t = threading.Thread(target=lambda: httpx.post(server + "/generate", headers=AUTH, timeout=120, json={
        "text": "Tell me a long story.", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}))
    t.start()
    busy = wait_for(lambda r: r["loads"][0]["num_running_reqs"] == 1, "the request running")
    assert busy["loads"][0]["num_used_tokens"] > 0 and 0 < busy["loads"][0]["token_usage"] <= 1
    [old] = httpx.get(server + "/get_load", headers=AUTH, timeout=30).json()
    assert old["num_reqs"] >= 1 and old["dp_rank"] == 0 and old["num_tokens"] > 0
    assert httpx.post(server + "/abort_request", json={"abort_all": True}, headers=AUTH, timeout=30).json()["aborted"]
    wait_for(lambda r: r["aggregate"]["total_reqs"] == 0, "drained after abort_all")
    t.join(120)
    every = load()
    assert set(every["loads"][0]) >= {"num_running_reqs", "queues", "memory", "lora"}
    assert load(dp_rank=0)["dp_rank_count"] == 1 and "num_running_reqs" in load(include="queues")["loads"][0]
    for params, param in (({"include": "core,gpu"}, "include"), ({"dp_rank": 3}, "dp_rank"),
                          ({"format": "prometheus"}, "format")):
        r = httpx.get(server + "/v1/loads", params=params, headers=AUTH, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("body, param", [
    ({"text": "Hi", "input_ids": [1, 2]}, None),
    ({"input_ids": [1, -2]}, "input_ids"),
    ({"text": "Hi", "sampling_params": {"custom_params": {"x": 1}}}, "sampling_params.custom_params"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "Hi", "sampling_params": {"json_schema": "{}", "regex": "a"}}, "sampling_params"),
    ({"text": "Hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "Hi", "sampling_params": {"regex": "[a-"}}, "sampling_params"),
    ({"input_ids": [10 ** 7]}, "input_ids"),
    ({"text": "Hi", "image_data": "x.png"}, "image_data"),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, "rid"),
    ({"text": "Hi", "sampling_params": {"top_k": 0}}, "sampling_params"),
    ({"text": ["a"] * 40, "sampling_params": {"n": 128}}, "sampling_params"),
])
def test_generate_refuses_what_it_cannot_do_by_name(server, body, param):
    r = httpx.post(server + "/generate", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    got = r.json()["error"]["param"]
    assert got == param or param is None and got in ("text", "input_ids", None), r.text


def test_sglang_s_model_and_server_info_describe_the_worker(server):
    """SGLang's /get_model_info and /get_server_info (a router checks a worker by them): the
    model, the context, the pool's tokens as /v1/loads counts them, the key guarding both."""
    for path in ("/get_model_info", "/get_server_info", "/server_info"):
        assert httpx.get(server + path, timeout=30).status_code == 401
    info = httpx.get(server + "/get_model_info", headers=AUTH, timeout=30).json()
    assert info["is_generation"] is True and info["model_type"] == "llama"
    assert info["weight_version"] == httpx.get(server + "/weight_version", headers=AUTH, timeout=30).json()[
        "weight_version"]
    models = httpx.get(server + "/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert info["served_model_name"] == models[0]["id"]
    srv = httpx.get(server + "/get_server_info", headers=AUTH, timeout=30).json()
    assert srv == httpx.get(server + "/server_info", headers=AUTH, timeout=30).json() | {
        "internal_states": srv["internal_states"]}
    assert srv["context_length"] == models[0]["max_model_len"] and srv["tp_size"] == 1 and srv["dp_size"] == 1
    loads = httpx.get(server + "/v1/loads", headers=AUTH, timeout=30).json()
    assert srv["max_total_num_tokens"] == loads["aggregate"]["total_tokens"] > 0
    assert srv["page_size"] > 0 and srv["version"] and len(srv["internal_states"]) == 1
    complete(server)   # a request finished since: SGLang's clients read the generation rate per rank
    [state] = httpx.get(server + "/get_server_info", headers=AUTH, timeout=30).json()["internal_states"]
    assert state["last_gen_throughput"] > 0 and state["memory_usage"]["token_capacity"] == srv["max_total_num_tokens"]
