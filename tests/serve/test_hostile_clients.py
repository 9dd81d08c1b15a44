"""A hostile client against a real `phalanx serve` (bundled SmolLM2): every bad input is a 400
naming its field, never a 500; nothing it does fails, slows or changes anyone else's request;
nothing it starts keeps running after it got its answer or went away."""

import asyncio
import json
import time
from itertools import pairwise

import httpx
import pytest

from serve_helpers import KEY, job_exposure

MODEL = "SmolLM2-135M-Instruct"
H = {"Authorization": f"Bearer {KEY}"}
INNOCENT = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0}


def post(server, path, body=None, raw=None, headers=None, timeout=120):
    h = dict(H, **(headers or {}))
    if raw is not None:
        return httpx.post(server + path, content=raw, headers=dict(h, **{"Content-Type": "application/json"}),
                          timeout=timeout)
    return httpx.post(server + path, json=body, headers=h, timeout=timeout)


def assert_openai_error(r, status, param=None, needle=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    if param is not None:   # the field, or a path inside it ("messages.0.content")
        assert err["param"] == param or err["param"].startswith(param + "."), err
    if needle is not None:
        assert needle in err["message"], err
    return err


def engine_idle(server, timeout=10.0):
    """True once no request is running or waiting and every KV block is free again."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        stats = httpx.get(server + "/debug/stats", headers=H, timeout=30).json()
        if all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_available_blocks"] == s["num_blocks"]
               for s in stats):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def innocent_text(server):
    return post(server, "/v1/completions", INNOCENT).json()["choices"][0]["text"]


# -- each defect found, as a regression test ------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("top_k", 2**63), ("top_k", 2**64), ("top_k", -2), ("seed", 2**64), ("max_tokens", 2**40),
    ("logit_bias", {"--5": 1}), ("logit_bias", {"²": 1}), ("logit_bias", {"5": 1e9}),
    ("stream", "yes"), ("logprobs", True), ("echo", 1), ("n", True), ("temperature", "0.5"),
    ("stop", [""]), ("stop_token_ids", [True]), ("tools", []), ("functions", []), ("guided_decoding_backend", "x"),
    ("response_format", {"type": "xml"}), ("guided_regex", "[a-"), ("guided_choice", []),
    # past the vocabulary (named by their own field, not the prompt's) and past the protocol's limits
    ("stop_token_ids", [99999]), ("logit_bias", {"99999": 5}), ("n", 17), ("stop", ["x"] * 65),
    ("stop", ["x" * 1025]), ("logit_bias", {str(i): 1 for i in range(1025)}), ("logprobs", 21),
])
def test_bad_field_is_a_400_naming_it(server, field, value):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, field: value})
    assert_openai_error(r, 400, param=field)


def test_a_chat_output_limit_past_the_context_names_the_field_sent(server):
    for field in ("max_tokens", "max_completion_tokens"):
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                 field: 600})
        assert_openai_error(r, 400, param=field, needle="maximum context length")


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "prompt": [True, False]}, "prompt"),
    ({"model": MODEL, "prompt": "a\ud800b"}, "prompt"),
    ({"model": "x\ud800", "prompt": "hi"}, "model"),
    ({"model": MODEL, "prompt": "a\ud800b", "echo": True, "stream": True}, "prompt"),
    ({"model": MODEL, "prompt": ["fine", 7]}, "prompt"),
])
def test_bad_prompts_are_400s(server, body, param):
    assert_openai_error(post(server, "/v1/completions", raw=json.dumps(body).encode()), 400, param=param)


@pytest.mark.parametrize("message,param", [
    ({"role": "user", "content": [{"type": "text", "text": {"nested": 1}}]}, "messages.0.content"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages.0.content"),
    ({"role": "user", "content": "hi", "tool_calls": []}, "messages.0.tool_calls"),
    ({"role": "wizard", "content": "hi"}, "messages.0.role"),
    ({"role": "user", "content": "\udfff"}, "messages.0.content"),
    ({"role": "user"}, "messages.0.content"),
    ({"role": "tool", "content": "18 C"}, "messages.0.tool_call_id"),
    ({"role": "assistant", "content": "no", "refusal": "I cannot"}, "messages.0.refusal"),
    ({"role": "assistant", "content": "hi", "audio": {"id": "a1"}}, "messages.0.audio"),
    ({"role": "assistant", "content": "hi", "annotations": [{"type": "url_citation"}]}, "messages.0.annotations"),
    ({"role": "user", "content": "hi", "reasoning_content": "hm"}, "messages.0.reasoning_content"),
])
def test_bad_chat_messages_are_400s(server, message, param):
    r = post(server, "/v1/chat/completions", raw=json.dumps({"model": MODEL, "messages": [message]}).encode())
    assert_openai_error(r, 400, param=param)


def test_every_error_is_openai_shaped(server):
    assert_openai_error(post(server, "/v1/completions", raw=b"\xff\xfe{}"), 400, needle="UTF-8")
    assert_openai_error(post(server, "/v1/completions", raw=b"[" * 100_000 + b"]" * 100_000), 400)
    assert_openai_error(post(server, "/v1/completions", raw=b'{"a":' * 40 + b"1" + b"}" * 40), 400, needle="nested")
    assert_openai_error(post(server, "/v1/completions", raw=b"{not json"), 400, needle="JSON")
    assert_openai_error(httpx.get(server + "/v1/nowhere", headers=H), 404)
    assert_openai_error(httpx.post(server + "/v1/models", headers=H), 405)
    assert_openai_error(httpx.get(server + "/v1/models/other", headers=H), 404, param="model")
    card = httpx.get(server + f"/v1/models/{MODEL}", headers=H).json()
    assert card["id"] == MODEL and card["max_model_len"] == 512
    assert_openai_error(httpx.get(server + "/v1/models"), 401)
    assert httpx.get(server + "/health_generate").status_code == 200   # probes (/health*) and /metrics need no key


def test_openapi_lists_the_status_codes_the_server_returns(server):
    doc = httpx.get(server + "/openapi.json", headers=H).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"200", "400", "401", "413"} <= set(responses)
        assert "requestBody" in doc["paths"][path]["post"]
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "previous_response_id" in doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert "404" in doc["paths"]["/v1/responses/{response_id}"]["get"]["responses"]


def test_body_limits_hold_for_chunked_uploads_and_content_parts(server):
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + 1 << 20]
    r = httpx.post(server + "/v1/completions", content=chunks(), timeout=60,
                   headers=dict(H, **{"Content-Type": "application/json"}))
    assert_openai_error(r, 413)
    parts = [{"type": "text", "text": "b" * (1 << 20)} for _ in range(5)]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    assert_openai_error(r, 400, param="messages", needle="characters")


def test_a_later_bad_prompt_leaves_nothing_running(server):
    body = {"model": MODEL, "prompt": ["fine", "word " * 600], "max_tokens": None, "ignore_eos": True}
    assert_openai_error(post(server, "/v1/completions", body), 400, needle="512")
    body = {"model": MODEL, "prompt": [[5, 6, 7], [999_999]], "max_tokens": None, "ignore_eos": True}
    assert_openai_error(post(server, "/v1/completions", body), 400, param="prompt", needle="vocabulary")
    assert engine_idle(server, timeout=30)


def test_a_non_streaming_client_that_leaves_has_its_request_aborted(server):
    before = _counter(server, "phalanx:client_aborts_total")
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": None, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/completions", body, timeout=1.0)
    assert engine_idle(server, timeout=30)     # returns once idle: the bound only stops a hang
    assert _counter(server, "phalanx:client_aborts_total") >= before + 1


@pytest.mark.alone   # the other stream's gaps are timed: another test on the other core would stretch them
def test_huge_prompts_do_not_stall_other_streams(server):
    """4M characters as a prompt and as chat content parts: each is refused quickly (it cannot
    fit in 512 tokens, which is known before tokenizing), and a concurrent stream keeps flowing."""
    async def stream_gaps():
        body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 60, "ignore_eos": True, "stream": True,
                "temperature": 0}
        stamps = []
        async with httpx.AsyncClient(timeout=120) as c, c.stream("POST", server + "/v1/completions", json=body,
                                                                  headers=H) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    stamps.append(time.monotonic())
        return [b - a for a, b in pairwise(stamps)]

    async def huge(path, body):
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(timeout=120) as c:
            t0 = time.monotonic()
            r = await c.post(server + path, headers=H, json=body)
            return r, time.monotonic() - t0

    parts = [{"type": "text", "text": "hello world " * 87_000} for _ in range(4)]
    async def main():
        return await asyncio.gather(
            stream_gaps(),
            huge("/v1/completions", {"model": MODEL, "prompt": "hello world " * 349_000, "max_tokens": 1}),
            huge("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": parts}]}))
    gaps, (r1, took1), (r2, took2) = asyncio.run(main())
    assert_openai_error(r1, 400, param="prompt", needle="characters")
    assert_openai_error(r2, 400, param="messages", needle="characters")
    assert took1 < 2.0 and took2 < 2.0, (took1, took2)
    assert max(gaps) < 0.5, max(gaps)


def test_echo_with_logprobs_covers_the_prompt(server):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "echo": True, "logprobs": 2,
            "temperature": 0}
    r = post(server, "/v1/completions", body).json()
    lp = r["choices"][0]["logprobs"]
    n_prompt = r["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + 3 and "".join(lp["tokens"]) == r["choices"][0]["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(t) == 2 for t in lp["top_logprobs"][n_prompt:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    with httpx.stream("POST", server + "/v1/completions", json=dict(body, stream=True), headers=H, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for key in streamed:
                    streamed[key] += chunk["choices"][0]["logprobs"][key]
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)


def test_bad_requests_batched_with_good_ones_change_nothing(server, innocent_text):
    """Hostile requests at the same time as innocent ones: each hostile one gets its 400, every
    innocent one its usual tokens."""
    hostile = [{"top_k": 2**63}, {"top_k": 2**64}, {"logit_bias": {"--5": 1}}, {"prompt": "\ud800"},
               {"prompt": [True]}, {"seed": 2**64}, {"min_tokens": 50, "max_tokens": 2}]

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            good = [c.post(server + "/v1/completions", json=INNOCENT, headers=H) for _ in range(4)]
            bad = [c.post(server + "/v1/completions", headers=dict(H, **{"Content-Type": "application/json"}),
                          content=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 4, **h}).encode())
                   for h in hostile]
            return await asyncio.gather(*good, *bad)
    results = asyncio.run(main())
    for r in results[:4]:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == innocent_text
    for r in results[4:]:
        assert_openai_error(r, 400)
        assert r.json()["error"]["param"]


def test_nothing_the_server_started_is_reachable_from_other_machines(server):
    """The MPI job below the server runs in a network namespace of its own (Open MPI's launcher
    listens on every interface), and nothing of it listens beyond loopback here."""
    import psutil
    port = server.rsplit(":", 1)[1]
    proc = next(p for p in psutil.process_iter(["cmdline"])
                if "serve" in (p.info["cmdline"] or []) and port in (p.info["cmdline"] or []))
    launcher = next(c for c in proc.children() if c.name() in ("prterun", "mpirun", "orterun"))
    isolated, exposed = job_exposure(launcher.pid)
    if not isolated:
        pytest.skip("no network namespace can be created here: the launcher runs in the host's")
    assert not exposed, exposed


def _counter(server, name):
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(server + "/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)
