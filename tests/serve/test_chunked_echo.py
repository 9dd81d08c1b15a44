"""A streamed completion with echo and logprobs whose prompt takes several prefill chunks: the
prompt's logprobs arrive chunk by chunk, and the echoed prompt goes out once, with all of them,
the same as the answer that is not streamed; with n = 2, each choice's tokens follow its echo."""

import json

import httpx

from serve_helpers import KEY, start_server, stop_server

H = {"Authorization": f"Bearer {KEY}"}


def test_streamed_echo_carries_every_chunk_of_the_prompt_logprobs():
    proc, url = start_server("--max_num_tokens", "16")
    try:
        prompt = "The history of the city goes back many centuries, to a small market town on the river. " * 4
        body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1,
                "temperature": 0}
        whole = httpx.post(url + "/v1/completions", json=body, headers=H, timeout=120).json()
        n_prompt = whole["usage"]["prompt_tokens"]
        assert n_prompt > 3 * 16                     # the prompt takes several steps' chunks
        lp = whole["choices"][0]["logprobs"]
        streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
        chunks = []
        with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), headers=H,
                          timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])["choices"][0]
                    chunks.append(chunk)
                    for key in streamed:
                        streamed[key] += chunk["logprobs"][key]
        assert chunks[0]["text"] == prompt and len(chunks[0]["logprobs"]["tokens"]) == n_prompt   # the echo, whole
        assert streamed["tokens"] == lp["tokens"] and len(streamed["tokens"]) == n_prompt + 3
        assert streamed["text_offset"] == lp["text_offset"]
        assert all(x is not None for x in streamed["token_logprobs"][1:])
        # n = 2 over the now cached prompt: only the first sequence computes the prompt's logprobs,
        # chunk by chunk, while the second may decode at once; each choice still starts with its echo
        by_choice: dict[int, list] = {0: [], 1: []}
        with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True, n=2, temperature=1.0,
                                                                     seed=3), headers=H, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])["choices"][0]
                    by_choice[chunk["index"]].append(chunk)
        for chunks in by_choice.values():
            assert chunks[0]["text"] == prompt and len(chunks[0]["logprobs"]["tokens"]) == n_prompt
            tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
            offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
            assert len(tokens) == n_prompt + 3
            assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    finally:
        stop_server(proc)
