"""The Responses API's plain-data side (``phalanx/serve/responses.py``): input items read as chat
messages, the chat request a response runs as, the store's bounds, reasoning tokens, and the
event stream, which the official openai client's own stream reader rebuilds into a response."""

import json

import httpx
import openai
import pytest

from phalanx.serve.protocol import BodyError, ChatCompletionRequest, _validate
from phalanx.serve.responses import (
    OutputIds,
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    output_items,
    reasoning_tokens,
)

CALL = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1}'}


def _request(**fields):
    return _validate({"input": "hi", **fields}, ResponsesRequest)


def test_input_items_become_the_chat_messages_a_template_renders():
    body = _request(input=[
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add"},
                                                        {"type": "input_text", "text": "1 and 2."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Use add."}]},
        {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
         "content": [{"type": "output_text", "text": "Calling.", "annotations": []}]},
        CALL, {**CALL, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "3"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "4"}]},
    ])
    calls = [{"id": c, "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
             for c in ("call_1", "call_2")]
    assert body.input_messages() == [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "Add\n1 and 2."},
        # the reasoning, the assistant's text and both calls are one assistant turn
        {"role": "assistant", "content": "Calling.", "reasoning_content": "Use add.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        {"role": "tool", "tool_call_id": "call_2", "content": "4"}]
    # a call with no assistant message before it opens one
    assert _request(input=[{"role": "user", "content": "x"}, CALL]).input_messages()[1] == {
        "role": "assistant", "content": None, "tool_calls": calls[:1]}


@pytest.mark.parametrize("items, param, needle", [
    ([{"type": "item_reference", "id": "msg_1"}], "input.0.type", "got 'item_reference'"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input.0.content.0.type",
     "text only"),
    ([{"role": "tool", "content": "x"}], "input.0.role", "must be one of"),
    ([{**CALL, "call_id": ""}], "input.0.call_id", "not empty"),
    ([{"type": "reasoning", "summary": [], "encrypted_content": "abc"}], "input.0.encrypted_content", "encrypt"),
    ([{"role": "user", "content": "x", "name": "bob"}], "input.0.name", "not supported"),
    ([{"type": "function_call_output", "call_id": "c", "output": 3}], "input.0.output", "string"),
    ([1], "input.0", "object"),
    ([{"type": "reasoning", "summary": [], "content": 0}], "input.0.content", "reasoning_text"),
    ([{"role": "user", "content": "x"}, *[CALL] * 129], "input.129", "at most 128"),
])
def test_an_item_that_does_not_fit_is_refused_naming_its_field(items, param, needle):
    with pytest.raises(BodyError) as e:
        _request(input=items).input_messages()
    assert e.value.param == param and needle in e.value.message


def test_the_chat_request_a_response_runs_as():
    tool = {"type": "function", "name": "add", "description": "Add", "parameters": {"type": "object"}}
    body = _request(instructions="Be terse.", tools=[tool], tool_choice={"type": "function", "name": "add"},
                    max_output_tokens=7, temperature=0.5, top_k=3, include=["message.output_text.logprobs"],
                    top_logprobs=2, truncation="auto", metadata={"k": "v"}, reasoning={"effort": "low"},
                    text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}})
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "then"}]
    chat = body.chat_body(history)
    assert chat["messages"] == [{"role": "system", "content": "Be terse."}, *history, {"role": "user", "content": "hi"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "add", "description": "Add",
                                                               "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "out",
                                                                              "schema": {"type": "object"}}}
    assert (chat["max_tokens"], chat["temperature"], chat["top_k"], chat["logprobs"], chat["top_logprobs"],
            chat["truncate_prompt_tokens"], chat["reasoning_effort"]) == (7, 0.5, 3, True, 2, -1, "low")
    req = _validate(chat, ChatCompletionRequest)     # the chat checks take it whole
    assert req.output_limit == 7 and len(req.messages) == 4
    # the chat's bounds apply to what passes through, named as the client sent it
    with pytest.raises(BodyError) as e:
        _validate(_request(temperature=3).chat_body([]), ChatCompletionRequest)
    assert e.value.param == "temperature"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "p"}}, "prompt"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"input": []}, "input"),
    ({"request_id": "a/b"}, "request_id"),
])
def test_what_phalanx_does_not_do_is_refused_by_name(fields, param):
    with pytest.raises(BodyError) as e:
        _request(**fields)
    assert e.value.param == param, e.value.message


def test_a_long_text_input_is_one_message_of_any_length():
    long = "word " * 2000      # (the item count's bound is not a bound on a string's characters)
    assert _request(input=long).input_messages() == [{"role": "user", "content": long}]


def test_the_store_keeps_the_newest_within_its_count_and_its_characters():
    store = ResponseStore(capacity=3, max_chars=100)
    for i in range(5):     # each 12 characters of JSON ({"id": "rN"}) and 10 of conversation
        store.put(f"r{i}", {"id": f"r{i}"}, [{"role": "user", "content": "x" * 10}])
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    store.put("big", {}, [{"role": "user", "content": "y" * 70}])     # 2 + 70 + 3 * 22 > 100: two go
    assert len(store) == 2 and store.get("r4") is not None and store.chars == 94
    assert store.delete("big") and not store.delete("big") and store.chars == 22
    # what a response holds besides its conversation counts too (instructions, logprobs, ...)
    store.put("wide", {"instructions": "z" * 200}, [])
    assert len(store) == 1 and store.get("wide") is not None
    none = ResponseStore(0)
    none.put("r", {}, [])
    assert none.get("r") is None


def test_reasoning_tokens_are_those_up_to_the_closing_tag():
    assert reasoning_tokens([b"<think>", b"a", b"</", b"think>", b"Hi"], False) == 4
    assert reasoning_tokens([b"a", b"b", b"</think>", b"Hi"], True) == 3
    assert reasoning_tokens([b"a", b"b"], True) == 2                 # never closed: all reasoning
    assert reasoning_tokens([b"<think>", b"a"], False) == 2
    assert reasoning_tokens([b"Hi", b"!"], False) == 0


def _sdk_stream(chunks: list[str]):
    """The openai client's stream reader over these SSE chunks (an in-process transport)."""
    body = "".join(chunks).encode()
    client = openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=0, http_client=httpx.Client(
        transport=httpx.MockTransport(lambda r: httpx.Response(200, content=body,
                                                               headers={"content-type": "text/event-stream"}))))
    return client.responses.stream(model="m", input="x")


def _lp(token):
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}


def test_the_event_stream_rebuilds_into_the_response_in_the_openai_client():
    ids = OutputIds.new()
    ev = ResponseEvents(ids, logprobs=True, strip=True)
    head = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m", "tools": [],
            "tool_choice": "auto", "parallel_tool_calls": True}
    chunks = [ev.sse("response.created", response={**head, "status": "in_progress", "output": []})]
    calls = [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
             {"index": 1, "id": "call_b", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]
    chunks += ev.feed({"reasoning_content": "Think"}, [], [_lp("<think>"), _lp("Think")])
    chunks += ev.feed({"reasoning_content": "ing.", "content": "Hel"}, [], [_lp("ing."), _lp("Hel")])
    chunks += ev.feed({}, [], [_lp("l")])                      # a token whose text is held back
    chunks += ev.feed({"content": "lo"}, calls, [_lp("lo")])
    chunks += ev.finish("completed")
    message = {"role": "assistant", "content": "Hello", "reasoning_content": "Thinking.",
               "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]}
    whole = output_items(message, ids, "completed", [_lp(t) for t in ("<think>", "Think", "ing.", "Hel", "l", "lo")])
    assert ev.items == whole      # the streamed items are the whole answer's, ids included
    chunks.append(ev.sse("response.completed", response={**head, "status": "completed", "output": ev.items}))
    data = [json.loads(c.split("data: ", 1)[1]) for c in chunks]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert all(c.startswith(f"event: {d['type']}\n") for c, d in zip(chunks, data, strict=True))
    with _sdk_stream(chunks) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output_text == "Hello" and final.output[0].content[0].text == "Thinking."
    assert [(o.call_id, json.loads(o.arguments)) for o in final.output[2:]] == [("call_a", {"a": 1}),
                                                                               ("call_b", {"a": 2})]
    assert len(final.output[1].content[0].logprobs) == 6


def test_an_output_with_nothing_in_it_streams_an_empty_message():
    ev = ResponseEvents(OutputIds.new(), logprobs=False, strip=False)
    chunks = ev.finish("incomplete")
    assert [json.loads(c.split("data: ", 1)[1])["type"] for c in chunks] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done"]
    assert ev.items == output_items({"role": "assistant", "content": None}, ev.ids, "incomplete", None)
