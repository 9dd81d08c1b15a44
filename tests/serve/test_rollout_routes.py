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
          ("post", "/reset_prefix_cache")]


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
