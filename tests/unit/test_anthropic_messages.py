"""Anthropic's Messages API's plain-data side (``phalanx/serve/messages.py``): content blocks read
as chat messages, the chat request a message runs as, the stop reason, the usage."""

import pytest

from phalanx.serve.messages import Conversation, MessagesRequest, content_blocks, stop_of, usage
from phalanx.serve.protocol import BodyError, ChatCompletionRequest, _validate

USE = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}


def _request(**fields):
    return _validate({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}, MessagesRequest)


def test_blocks_become_the_chat_messages_a_template_renders():
    body = _request(system=[{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}],
                    messages=[
                        {"role": "user", "content": [{"type": "text", "text": "Add"}, {"type": "text", "text": "1."}]},
                        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use add.", "signature": ""},
                                                          {"type": "text", "text": "Calling."}, USE]},
                        {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"},
                            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                             "content": [{"type": "text", "text": "no such tool"}]},
                            {"type": "text", "text": "And now?"}]}])
    call = {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    assert body.chat_messages() == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Add\n1."},
        {"role": "assistant", "content": "Calling.", "reasoning_content": "Use add.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "2"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such tool"},
        {"role": "user", "content": "And now?"}]


def test_the_chat_request_a_message_runs_as():
    tool = {"name": "add", "description": "Add", "input_schema": {"type": "object"}}
    body = _request(tools=[tool], tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True},
                    stop_sequences=["END"], temperature=0.5, top_k=4, metadata={"user_id": "u1"},
                    output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}, "effort": "low"})
    chat = body.generation_body()
    assert chat["tools"] == [{"type": "function", "function": {"name": "add", "description": "Add",
                                                               "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert (chat["stop"], chat["temperature"], chat["top_k"], chat["user"], chat["reasoning_effort"],
            chat["max_tokens"]) == (["END"], 0.5, 4, "u1", "low", 8)
    assert "parallel_tool_calls" not in chat      # (a named tool makes one call)
    one = _request(tools=[tool], tool_choice={"type": "any", "disable_parallel_tool_use": True}).generation_body()
    assert (one["tool_choice"], one["parallel_tool_calls"]) == ("required", False)
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert _validate(chat, ChatCompletionRequest).output_limit == 8
    assert _request(tools=[tool]).generation_body()["tool_choice"] == "auto"
    assert _request(tools=[tool], tool_choice={"type": "any"}).generation_body()["tool_choice"] == "required"
    # a count has no output limit
    assert "max_tokens" not in _validate({"messages": [{"role": "user", "content": "x"}]}, Conversation).chat_body()


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages.0.content.0.type"),
    ([{"role": "assistant", "content": [{**USE, "input": "1"}]}], "messages.0.content.0.input"),
    ([{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}], "messages.0.content.0.type"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{"a": 1}]}]}],
     "messages.0.content.0.citations"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "", "content": "x"}]}],
     "messages.0.content.0.tool_use_id"),
    ([{"role": "system", "content": "x"}], "messages.0.role"),
    ([{"role": "user", "content": "x", "name": "bob"}], "messages.0.name"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}],
     "messages.0.content.0.cache_control"),
])
def test_a_block_that_does_not_fit_is_refused_naming_its_field(messages, param):
    with pytest.raises(BodyError) as e:
        _request(messages=messages).chat_messages()
    assert e.value.param == param, e.value.message


def test_the_answer_s_blocks_stop_reason_and_usage():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    assert content_blocks({"content": "Hi", "reasoning_content": "hmm", "tool_calls": [call]}) == [
        {"type": "thinking", "thinking": "hmm", "signature": ""}, {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1}}]
    assert content_blocks({"content": None}) == [{"type": "text", "text": ""}]
    cut = {**call, "function": {"name": "add", "arguments": '{"a": '}}
    assert content_blocks({"content": None, "tool_calls": [cut]})[0]["input"] == {}
    assert stop_of("stop", "END", False, ["END"]) == ("stop_sequence", "END")
    assert stop_of("stop", 2, False, ["END"]) == ("end_turn", None)       # EOS, a stop token
    assert stop_of("stop", None, True, None) == ("tool_use", None)
    assert stop_of("length", None, True, None) == ("max_tokens", None)
    assert stop_of("abort", None, False, None) == (None, None)
    assert usage(30, 20, 5) == {"input_tokens": 10, "cache_read_input_tokens": 20, "cache_creation_input_tokens": 0,
                                "output_tokens": 5}


def test_a_final_assistant_message_is_a_prefill_the_answer_goes_on_from():
    body = _request(messages=[{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2,"}])
    chat = body.generation_body()
    assert (chat["add_generation_prompt"], chat["continue_final_message"]) == (False, True)
    assert _validate(chat, ChatCompletionRequest).continue_final_message
    assert "continue_final_message" not in _request().generation_body()
    called = _request(messages=[{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [USE]}])
    with pytest.raises(BodyError) as e:         # a prefill is text the answer goes on writing, not a call
        called.generation_body()
    assert e.value.param == "messages.1.content"


def test_thinking_blocks_join_and_text_blocks_join_in_linear_time():
    import time
    body = _request(messages=[{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "A", "signature": "s"}, {"type": "text", "text": "x"},
        {"type": "thinking", "thinking": "B", "signature": ""}]}])
    assert body.chat_messages()[0]["reasoning_content"] == "A\nB"
    many = _request(messages=[{"role": "user", "content": [{"type": "text", "text": "0123456789"}] * 200_000}])
    started = time.perf_counter()
    [message] = many.chat_messages()
    assert len(message["content"]) == 200_000 * 11 - 1 and time.perf_counter() - started < 5   # (quadratic: ~11 s)


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"name": "add", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "sub"}}, "tool_choice"),
    ({"tools": [{"name": "add", "input_schema": {}}], "tool_choice": {"type": "auto",
                                                                      "disable_parallel_tool_use": True}},
     "tool_choice"),
    ({"system": []}, "system"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
])
def test_what_does_not_fit_the_request_is_refused_by_name(fields, param):
    with pytest.raises(BodyError) as e:
        _request(**fields)
    assert e.value.param == param, e.value.message


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
    ({"tools": [{"name": "add"}]}, "tools.0.input_schema"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": 5}]}]},
     "messages.0.content.0.signature"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                 "cache_control": {"type": "ephemeral", "ttl": 5}}]}]},
     "messages.0.content.0.cache_control"),
])
def test_what_does_not_fit_a_block_or_tool_is_refused_by_name(fields, param):
    with pytest.raises(BodyError) as e:
        _request(**fields).generation_body()
    assert e.value.param == param, e.value.message


def test_a_call_cut_short_keeps_its_whole_values_as_the_client_reads_its_pieces():
    from phalanx.serve.messages import tool_input
    assert tool_input('{"city": "Rome", "days": 3}') == {"city": "Rome", "days": 3}
    assert tool_input('{"city": "Rome", "days": ') == {"city": "Rome"}
    assert tool_input('{"city": "Ro') == {} and tool_input("") == {} and tool_input("[1, 2]") == {}
