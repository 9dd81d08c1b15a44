"""Structured output and tool calls through `phalanx serve` and the official openai client
(bundled SmolLM2): response_format with a pydantic model, extension fields, forced and parsed
tool calls, a tool round trip, streamed tool-call deltas, and 400s for what does not fit."""

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from serve_helpers import KEY

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two small numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                       "required": ["a", "b"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                      response_format=Person, max_tokens=80, temperature=0)
    assert isinstance(r.choices[0].message.parsed, Person) and r.choices[0].finish_reason == "stop"


def test_extension_fields_and_json_object(client):
    r = client.completions.create(model=MODEL, prompt="Phone: ", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"\+33 [0-9]{9}"})
    assert re.fullmatch(r"\+33 [0-9]{9}", r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       max_tokens=5, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Return {"ok": true} as JSON.'}],
        max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_round_trip(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=60, temperature=0)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert finish == "tool_calls" and msg.content is None and msg.tool_calls
    call = msg.tool_calls[0]
    assert call.function.name in ("get_weather", "add") and isinstance(json.loads(call.function.arguments), dict)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in msg.tool_calls]},
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "cloudy"})}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    # the message sent back whole, as the SDK returned it (refusal, audio, function_call, annotations:
    # null; its calls with the index a stream gives them): the same history, the same answer
    sent_back = msg.model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= sent_back.keys()
    for i, c in enumerate(sent_back["tool_calls"]):
        c["index"] = i
    again = client.chat.completions.create(model=MODEL, messages=[*ASK, sent_back, history[-1]], tools=TOOLS,
                                           max_tokens=40, temperature=0)
    assert again.choices[0].message.content == answer.choices[0].message.content


class Weather(BaseModel):
    city: str = Field(max_length=30)


def test_strict_tools_under_auto_through_the_openai_parse_helper(client):
    """The openai client's ``parse`` with ``pydantic_function_tool`` (``strict: true``) under
    tool_choice "auto": accepted (a structural tag holds any call to the tool's schema), and
    whatever the model writes comes back as the helper reads it."""
    r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(Weather)],
                                      max_tokens=300, temperature=0)   # (the helper refuses a "length" finish)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "tool_calls")
    for call in choice.message.tool_calls or []:
        assert isinstance(call.function.parsed_arguments, Weather)
    assert choice.message.content or choice.message.tool_calls


def test_named_tool_choice_streams_its_arguments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=60, temperature=0).choices[0]
    assert whole.message.tool_calls[0].function.name == "get_weather"
    deltas = [c for ch in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                         max_tokens=60, temperature=0, stream=True)
              for c in ch.choices]
    calls = [tc for c in deltas for tc in (c.delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert "".join(tc.function.arguments or "" for tc in calls) == whole.message.tool_calls[0].function.arguments
    for c in deltas:   # a call's pieces in a chunk: one entry an index
        indices = [tc.index for tc in c.delta.tool_calls or []]
        assert len(indices) == len(set(indices)), c
    # a named function was forced, not chosen: the choice stops as "stop" (OpenAI, vLLM), with its stop_reason
    assert whole.finish_reason == "stop" and deltas[-1].finish_reason == "stop"
    assert "stop_reason" in deltas[-1].model_extra and deltas[-1].model_extra["stop_reason"] == whole.model_extra[
        "stop_reason"]


def test_required_tool_choice_streams_complete_calls(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=60, temperature=0, stream=True)
    chunks = [c for ch in stream for c in ch.choices]
    calls = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
    assert calls and all(json.loads(tc.function.arguments) is not None for tc in calls)
    assert chunks[-1].finish_reason == "tool_calls"
    assert not chunks[-1].delta.tool_calls      # the finish comes alone, after the last call's delta
    # so the openai client's stream helper closes every call's arguments (its .done event)
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=60, temperature=0) as events:
        kinds = [e.type for e in events]
    assert "tool_calls.function.arguments.done" in kinds, kinds


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}


def test_structural_tag_response_formats(client):
    """vLLM's ``response_format`` of type structural_tag, both forms: xgrammar's ``format`` (here
    the whole answer one tag: <answer>, a JSON object of the schema, </answer>), and
    ``structures`` with ``triggers`` (text runs free until a trigger, then a structure must
    follow: the bundled model starts its answer with "The", which the grammar makes "The
    answer: " and an object of the schema)."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    tag = {"type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": CITY},
           "end": "</answer>"}
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0,
                                       response_format={"type": "structural_tag", "format": tag})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and text.startswith("<answer>") and text.endswith("</answer>"), text
    assert set(json.loads(text[len("<answer>"):-len("</answer>")])) == {"city"}
    free = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0)
    assert free.choices[0].message.content.startswith("The")
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0, response_format={
        "type": "structural_tag", "triggers": ["The"],
        "structures": [{"begin": "The answer: ", "schema": CITY, "end": "."}]})
    text = r.choices[0].message.content
    assert text.startswith("The answer: "), text
    obj, end = json.JSONDecoder().raw_decode(text, len("The answer: "))
    assert set(obj) == {"city"} and text[end] == "."
    assert all(text.startswith("The answer: ", i) for i in range(len(text)) if text.startswith("The", i)), text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f"], "structures": [
        {"begin": "<g>", "schema": CITY, "end": "</g>"}]}}, "response_format"),
    ({"response_format": {"type": "json_object", "format": {}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "guided_json"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
])
def test_what_does_not_fit_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or err["param"].startswith(param + "."), err
