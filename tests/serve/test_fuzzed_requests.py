"""Property: whatever a client sends, it gets a normal completion or a 400 naming a field
(404 naming the model), never a 500 — and an innocent request running at the same time gets
exactly the tokens it gets alone."""

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from serve_helpers import KEY

MODEL = "SmolLM2-135M-Instruct"
H = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
INNOCENT = {"model": MODEL, "prompt": "My favourite fruit is", "max_tokens": 5, "temperature": 0}
SEEDED = {"model": MODEL, "prompt": "Pick a number:", "max_tokens": 5, "temperature": 1.0, "seed": 1234}

wide_ints = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70), st.booleans())
# a length limit's hostile values: none that is valid (a valid 404-token answer is served, and under
# a whole make test's load took more than the client's 120 s), the context's bound crossed included
bad_lengths = st.one_of(st.integers(-3, 0), st.integers(-(2**70), -1), st.integers(600, 2**70), st.booleans())
hostile_reals = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-30, 30), st.booleans(),
                          st.text(max_size=3))
texts = st.one_of(st.text(max_size=40), st.just("a\ud800b"), st.just("<|im_end|>"), st.just(""))
token_ids = st.lists(st.one_of(st.integers(0, 49151), st.integers(-5, 2**64), st.booleans()), max_size=12)
#          field: (valid values, hostile values)
FIELDS = {
    "max_tokens": (st.integers(1, 6), bad_lengths),
    "temperature": (st.floats(0, 2), hostile_reals),
    "top_p": (st.floats(0.01, 1), hostile_reals),
    "min_p": (st.floats(0, 1), hostile_reals),
    "top_k": (st.integers(-1, 100_000), wide_ints),
    "seed": (st.integers(-(2**63), 2**63 - 1), wide_ints),
    "presence_penalty": (st.floats(-2, 2), hostile_reals),
    "frequency_penalty": (st.floats(-2, 2), hostile_reals),
    "repetition_penalty": (st.floats(0.1, 10), hostile_reals),
    "n": (st.integers(1, 2), wide_ints),
    "min_tokens": (st.integers(0, 3), wide_ints),
    "stop": (st.lists(st.text(min_size=1, max_size=5), max_size=2), st.one_of(texts, st.integers())),
    "stop_token_ids": (st.lists(st.integers(0, 49151), max_size=3), st.one_of(token_ids, st.text(max_size=3))),
    "logit_bias": (st.dictionaries(st.from_regex(r"[0-9]{1,4}", fullmatch=True), st.floats(-100, 100), max_size=3),
                   st.dictionaries(st.text(max_size=4), hostile_reals, min_size=1, max_size=3)),
    "stream": (st.booleans(), st.sampled_from(["yes", 1, None])),
    "ignore_eos": (st.booleans(), st.integers(0, 1)),
    "skip_special_tokens": (st.booleans(), st.text(max_size=2)),
    "user": (st.text(max_size=20), st.just("\udfff")),
}
COMPLETION_FIELDS = dict(
    FIELDS, echo=(st.booleans(), st.integers(0, 1)), logprobs=(st.integers(0, 5), wide_ints),
    prompt=(st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 49151), min_size=1, max_size=12)),
            st.one_of(texts, token_ids, st.lists(texts, max_size=3), st.lists(token_ids, max_size=2), st.integers())))
_message = (st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                   "content": st.text(min_size=1, max_size=40)}),
            st.fixed_dictionaries({"role": st.sampled_from(["user", "x", 3]),
                                   "content": st.one_of(texts, st.none(), st.lists(st.fixed_dictionaries(
                                       {"type": st.sampled_from(["text", "image_url"]),
                                        "text": st.one_of(texts, st.integers())}), max_size=2))}))
CHAT_FIELDS = dict(
    FIELDS, logprobs=(st.booleans(), st.integers(0, 1)), top_logprobs=(st.integers(0, 5), wide_ints),
    messages=(st.lists(_message[0], min_size=1, max_size=3),
              st.lists(st.one_of(_message[0], _message[1]), max_size=3)))
_valid_item = st.fixed_dictionaries({"role": st.sampled_from(["user", "developer"]),
                                     "content": st.text(min_size=1, max_size=30)})
_item = st.one_of(
    _valid_item,
    st.fixed_dictionaries({"type": st.just("message"), "role": st.sampled_from(["user", "assistant", "tool", 1]),
                           "content": st.one_of(texts, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                "text": st.one_of(texts, st.integers())}), max_size=2))}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning",
                                                    "item_reference", "x"]),
                           "call_id": st.one_of(st.text(max_size=8), st.integers()), "name": st.just("get_weather"),
                           "arguments": st.one_of(st.just('{"city": "Paris"}'), st.integers()),
                           "output": st.one_of(texts, st.integers())}),
    texts, st.integers())
_tool = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}
RESPONSES_FIELDS = {
    "input": (st.one_of(st.text(min_size=1, max_size=40), st.lists(_valid_item, min_size=1, max_size=3)),
              st.one_of(texts, st.lists(_item, max_size=3), st.integers())),
    "max_output_tokens": (st.integers(1, 6), bad_lengths),
    "instructions": (st.text(max_size=30), st.one_of(st.just("a\ud800"), st.integers())),
    "temperature": FIELDS["temperature"], "top_p": FIELDS["top_p"], "top_k": FIELDS["top_k"], "seed": FIELDS["seed"],
    "stop": FIELDS["stop"], "stream": FIELDS["stream"], "user": FIELDS["user"],
    "tools": (st.just([_tool]), st.one_of(st.just([{"type": "web_search"}]), st.lists(st.integers(), max_size=2),
                                          st.just([_tool, _tool]))),
    "tool_choice": (st.sampled_from(["auto", "none"]), st.one_of(st.sampled_from(["required", "any"]),
                                                                 st.just({"type": "function", "name": "nope"}))),
    "text": (st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
             st.one_of(st.just({"format": {"type": "json_schema"}}), st.just({"verbosity": "low"}), st.integers())),
    "include": (st.just(["message.output_text.logprobs"]), st.lists(st.text(max_size=10), min_size=1, max_size=2)),
    "truncation": (st.sampled_from(["disabled", "auto"]), st.one_of(st.text(max_size=4), st.booleans())),
    "store": (st.booleans(), st.integers(0, 1)),
    "previous_response_id": (st.none(), st.text(min_size=1, max_size=10)),
}
UNKNOWN = {"frobnicate": st.integers(), "response_format": st.just({"type": "json_object"}), "tools": st.just([])}


def bodies(fields, required, hostile=True):
    """Bodies with the required fields, ``max_tokens`` and up to five optional ones. With
    ``hostile``, each value is valid four times out of five and one body in six carries a field
    phalanx does not implement; without, every value is one a client may send."""
    @st.composite
    def build(draw):
        def value(name):
            valid, bad = fields[name]
            return draw(bad if hostile and draw(st.integers(0, 4)) == 4 else valid)

        names = draw(st.lists(st.sampled_from(sorted(k for k in fields if k not in (*required, "max_output_tokens"))),
                              max_size=5))
        limit = "max_output_tokens" if "max_output_tokens" in fields else "max_tokens"
        body = {"model": MODEL, **{k: value(k) for k in required}, "max_tokens": value(limit)}
        body.update({k: value(k) for k in sorted(set(names))})
        if hostile and draw(st.integers(0, 5)) == 5:
            name = draw(st.sampled_from(sorted(UNKNOWN)))
            body[name] = draw(UNKNOWN[name])
        if "max_output_tokens" in fields:   # a Responses body: its own limit's name, not chat's
            body["max_output_tokens"] = body.pop("max_tokens")
        if not hostile:                  # rules across fields, as OpenAI's
            if "top_logprobs" in body:
                body["logprobs"] = True
            body["min_tokens"] = min(body.get("min_tokens", 0), body["max_tokens"])
        return body
    return build()


async def _post(client, url, path, body):
    raw = json.dumps(body, allow_nan=True).encode()
    if body.get("stream") is True:
        async with client.stream("POST", url + path, content=raw, headers=H) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread())
            return r.status_code, [line async for line in r.aiter_lines() if line.startswith("data: ")]
    r = await client.post(url + path, content=raw, headers=H)
    return r.status_code, r.json()


def _text(status, answer):
    assert status == 200, answer
    return answer["choices"][0]["text"]


def check(server, path, body, reference, expect=None):
    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(_post(c, server, "/v1/completions", INNOCENT),
                                        _post(c, server, "/v1/completions", SEEDED),
                                        _post(c, server, path, body))
    (s1, a1), (s2, a2), (status, answer) = asyncio.run(main())
    assert (_text(s1, a1), _text(s2, a2)) == reference
    assert status in (200, 400, 404), (status, answer)
    assert expect is None or status == expect, (status, answer)
    event(f"HTTP {status} {answer['error']['param'] if status != 200 else ''}")
    if status == 200 and body.get("stream") is True and path == "/v1/responses":   # typed events, no [DONE]
        assert json.loads(answer[-1][6:])["type"] in ("response.completed", "response.incomplete"), answer
    elif status == 200 and body.get("stream") is True:
        assert answer[-1] == "data: [DONE]" and not any('"error"' in line for line in answer), answer
    elif status == 200:
        assert answer.get("choices") or answer.get("output"), answer
    else:
        err = answer["error"]
        assert err["code"] == status and err["param"], err
        assert status == 400 or err["param"] in ("model", "previous_response_id")


@pytest.fixture(scope="module")
def reference(server):
    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(_post(c, server, "/v1/completions", INNOCENT),
                                        _post(c, server, "/v1/completions", SEEDED))
    (s1, a1), (s2, a2) = asyncio.run(main())
    return _text(s1, a1), _text(s2, a2)


FUZZ = settings(max_examples=24, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=bodies(COMPLETION_FIELDS, ["prompt"]))
def test_fuzzed_completions(server, reference, body):
    check(server, "/v1/completions", body, reference)


@FUZZ
@given(body=bodies(CHAT_FIELDS, ["messages"]))
def test_fuzzed_chat(server, reference, body):
    check(server, "/v1/chat/completions", body, reference)


@settings(FUZZ, max_examples=16)
@given(body=bodies(RESPONSES_FIELDS, ["input"]))
def test_fuzzed_responses(server, reference, body):
    check(server, "/v1/responses", body, reference)


@settings(FUZZ, max_examples=10)
@given(body=bodies(COMPLETION_FIELDS, ["prompt"], hostile=False), chat=bodies(CHAT_FIELDS, ["messages"], False))
def test_valid_bodies_always_complete(server, reference, body, chat):
    """Any combination of valid values is served (200), next to the innocent requests."""
    check(server, "/v1/completions", body, reference, expect=200)
    check(server, "/v1/chat/completions", chat, reference, expect=200)


def test_the_engine_is_idle_and_whole_afterwards(server):
    stats = httpx.get(server + "/debug/stats", headers=H, timeout=30).json()
    assert all(s["num_running"] == 0 and s["num_available_blocks"] == s["num_blocks"] for s in stats), stats
    r = httpx.get(server + "/debug/check_integrity", headers=H, timeout=30)
    assert r.status_code == 200 and r.json()["ok"]
