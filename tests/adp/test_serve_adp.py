"""`phalanx serve --tp_size 2` with `enable_attention_dp: true` in the YAML: two replicas
behind one endpoint, requests placed by the router, metrics summed over ranks."""

import httpx
import pytest

from serve_helpers import KEY, start_server, stop_server

pytestmark = pytest.mark.mpi


def test_serve_with_attention_dp_from_yaml(tmp_path):
    cfg = tmp_path / "adp.yaml"
    cfg.write_text("enable_attention_dp: true\nattention_dp_config:\n  routing: cache_aware\n")
    proc, url = start_server("--tp_size", "2", "--config", str(cfg))
    try:
        h = {"Authorization": f"Bearer {KEY}"}

        def chat(q):
            return httpx.post(url + "/v1/chat/completions", headers=h, timeout=120, json={
                "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": q}],
                "max_tokens": 12, "temperature": 0})

        # one at a time: the chat template's shared system prompt keeps them on the rank that has it
        cached = []
        for q in ("What is the capital of France?", "Name a primary color.", "What is 2 + 2?"):
            r = chat(q)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[0] == 0 and all(c > 0 for c in cached[1:])
        placed = httpx.get(url + "/debug/stats", headers=h, timeout=60).json()[0]["num_placed"]
        assert sorted(placed) == [0, 3]
        # a burst arrives together: load spreads it over both replicas
        import asyncio

        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                body = lambda i: {"model": "SmolLM2-135M-Instruct", "max_tokens": 32, "ignore_eos": True,  # noqa: E731
                                  "messages": [{"role": "user", "content": f"Count to {i}."}]}
                return await asyncio.gather(*(c.post(url + "/v1/chat/completions", headers=h, json=body(i))
                                              for i in range(8)))
        assert all(r.status_code == 200 for r in asyncio.run(burst()))
        stats = httpx.get(url + "/debug/stats", headers=h, timeout=60).json()
        assert len(stats) == 2 and sum(stats[0]["num_placed"]) == 11
        assert min(stats[0]["num_placed"]) >= 2
        assert httpx.get(url + "/debug/check_integrity", headers=h, timeout=60).json()["ok"]
    finally:
        assert stop_server(proc) == 0
