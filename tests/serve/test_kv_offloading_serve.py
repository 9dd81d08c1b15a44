"""`phalanx serve --kv-offloading-size` (vLLM's flag) with the bundled SmolLM2: a prompt whose
blocks the small GPU-side pool evicted comes back from the host tier (its usage counts the
cached tokens), and /metrics counts the blocks moved each way."""

import re
import time

import httpx

from serve_helpers import KEY, start_server, stop_server


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_an_evicted_prompt_comes_back_from_the_host_tier(tmp_path):
    (tmp_path / "kv.yaml").write_text("kv_cache_config:\n  max_tokens: 1024\n")   # 32 blocks of 32 tokens
    proc, url = start_server("--kv-offloading-size", "0.25", "--kv-offloading-backend", "native",
                             "--config", str(tmp_path / "kv.yaml"))
    try:
        h = {"Authorization": f"Bearer {KEY}"}

        def complete(prompt: str) -> dict:
            r = httpx.post(url + "/v1/completions", headers=h, timeout=120,
                           json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        texts = [" ".join(f"{topic} fact number {i} is worth noting." for i in range(40))
                 for topic in ("Rivers", "Mountains", "Comets", "Forests", "Glaciers")]
        first = complete(texts[0])
        for t in texts[1:]:          # ~300 tokens each: more than the 1,024-token pool holds
            complete(t)
        again = complete(texts[0])
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 256, f"only {cached} of {again['usage']['prompt_tokens']} prompt tokens came back"
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        deadline = time.monotonic() + 30   # (the engine's counters reach /metrics with its heartbeats)
        while True:
            metrics = httpx.get(url + "/metrics", timeout=30).text
            moved = [_metric(metrics, f"phalanx:kv_{way}_blocks_total") for way in ("offloaded", "onboarded")]
            if min(moved) >= 8 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert moved[0] >= 8 and moved[1] >= 8, moved
    finally:
        stop_server(proc)
