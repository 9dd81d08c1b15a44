"""Anthropic's Messages API through a real `phalanx serve` and Anthropic's own client (bundled
SmolLM2): each message is checked against the chat completion of the conversation it amounts
to — same prompt tokens, same greedy text — whole and streamed, with tool use and tool results,
stop sequences, a JSON schema and token counts; what is not served is refused by name, in
Anthropic's error shape."""

import json

import anthropic
import httpx
import openai
import pytest

from serve_helpers import KEY

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"model": MODEL, "extra_body": {"temperature": 0}}    # (Anthropic's client no longer has the argument)
TOOL = {"name": "get_weather", "description": "The current weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                         "required": ["city"], "additionalProperties": False}}
CHAT_TOOL = {"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                              "parameters": TOOL["input_schema"]}}
ASK = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(chat, messages, max_tokens, **kw):
    return chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def test_a_message_is_the_chat_answer_of_its_conversation(client, chat):
    m = client.messages.create(system="Be brief.", messages=ASK, max_tokens=24, **GREEDY)
    c = _chat(chat, [{"role": "system", "content": "Be brief."}, *ASK], 24)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == c.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert m.usage.output_tokens == c.usage.completion_tokens
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[c.choices[0].finish_reason]
    cut = client.messages.create(messages=ASK, max_tokens=2, **GREEDY)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 2)


def test_a_streamed_message_is_the_whole_one(server, client):
    whole = client.messages.create(messages=ASK, max_tokens=40, **GREEDY)
    with client.messages.stream(messages=ASK, max_tokens=40, **GREEDY) as stream:   # the client's own reader
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens and kinds[0] == "message_start"
    # on the wire: an event line per event, no [DONE]; the key as x-api-key
    with httpx.stream("POST", server + "/v1/messages", timeout=120, headers={"x-api-key": KEY}, json={
            "model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0, "stream": True}) as r:
        blocks = r.read().decode().strip().split("\n\n")
    events = [(b.split("\n")[0].removeprefix("event: "), json.loads(b.split("\n")[1].removeprefix("data: ")))
              for b in blocks]
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events] == ["message_start", "content_block_start", *["content_block_delta"] * (
        len(events) - 5), "content_block_stop", "message_delta", "message_stop"]
    assert "".join(d["delta"]["text"] for _, d in events[2:-3]) == whole.content[0].text


def test_tool_use_and_tool_results_round_trip(client, chat):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(messages=ask, tools=[TOOL], tool_choice={"type": "any"}, max_tokens=60, **GREEDY)
    [use] = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and set(use.input) == {"city"}
    assert m.stop_reason == "tool_use"
    turns = [*ask, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                      "input": use.input}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"},
                                          {"type": "text", "text": "Thanks. Anything else?"}]}]
    after = client.messages.create(messages=turns, tools=[TOOL], max_tokens=1, **GREEDY)   # (prompts compared)
    c = _chat(chat, [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"},
        {"role": "user", "content": "Thanks. Anything else?"}], 1, tools=[CHAT_TOOL])
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert client.messages.count_tokens(model=MODEL, messages=turns, tools=[TOOL]).input_tokens == c.usage.prompt_tokens
    # a named tool streams its input as JSON pieces, which the client puts together
    with client.messages.stream(messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=60, **GREEDY) as s:
        pieces = [e.delta.partial_json for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    [streamed] = final.content
    assert len(pieces) > 1 and json.loads("".join(pieces)) == streamed.input and "city" in streamed.input


def test_a_final_assistant_message_is_a_prefill_the_answer_goes_on_from(server, client):
    """Anthropic's prefill: the answer continues the final assistant message, as chat's
    continue_final_message does (not a new turn after it)."""
    turns = [{"role": "user", "content": "Count from 1 to 10."}, {"role": "assistant", "content": "1, 2, 3, 4,"}]
    m = client.messages.create(messages=turns, max_tokens=8, **GREEDY)
    r = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120, json={
        "model": MODEL, "messages": turns, "max_tokens": 8, "temperature": 0, "add_generation_prompt": False,
        "continue_final_message": True}).json()
    assert m.content[0].text == r["choices"][0]["message"]["content"]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == r["usage"]["prompt_tokens"]


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    words = client.messages.create(messages=ASK, max_tokens=40, **GREEDY).content[0].text.split()
    stop = words[2]
    m = client.messages.create(messages=ASK, max_tokens=40, stop_sequences=[stop], **GREEDY)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop) and stop not in m.content[0].text


def test_an_output_schema_holds_the_text(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer"], "additionalProperties": False}
    m = client.messages.create(messages=ASK, max_tokens=40, extra_body={"temperature": 0, "output_config": {
        "format": {"type": "json_schema", "schema": schema}}}, model=MODEL)
    assert set(json.loads(m.content[0].text)) == {"answer"}


@pytest.mark.parametrize("body, status, needle", [
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "messages.0.content.0.type"),
    ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "server tools"),
    ({"max_tokens": 600, "messages": ASK}, 400, "512"),
    ({"max_tokens": 5, "messages": ASK, "stop_sequences": [""]}, 400, "stop_sequences"),
    ({"max_tokens": 5, "messages": ASK, "mcp_servers": []}, 400, "mcp_servers"),
    ({"max_tokens": 5, "messages": ASK, "tools": [TOOL], "tool_choice": {"type": "auto",
                                                                          "disable_parallel_tool_use": True}}, 400,
     "disable_parallel_tool_use"),
    ({"max_tokens": 5, "messages": ASK, "model": "claude-x"}, 404, "claude-x"),
])
def test_what_does_not_fit_is_refused_by_name_in_anthropic_s_shape(server, client, body, status, needle):
    r = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120)
    assert r.status_code == status and r.json()["type"] == "error", r.text
    assert needle in r.json()["error"]["message"] and r.json()["error"]["type"] == {
        400: "invalid_request_error", 404: "not_found_error"}[status]
    wrong = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=120)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert client.messages.create(messages=ASK, max_tokens=2, **GREEDY).content
