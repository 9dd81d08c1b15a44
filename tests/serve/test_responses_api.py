"""OpenAI's Responses API through a real `phalanx serve` and the official openai client (bundled
SmolLM2): each response is checked against the chat completion of the conversation it amounts
to — same prompt tokens, same greedy text — whole, streamed, over stored turns, with tool calls,
structured output and logprobs; what is not served is refused by name."""

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from serve_helpers import KEY

MODEL = "SmolLM2-135M-Instruct"
TOOL = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"], "additionalProperties": False}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
GREEDY = {"model": MODEL, "temperature": 0}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(client, messages, max_tokens, **kw):
    return client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY, **kw)


def test_a_response_is_the_chat_answer_of_its_conversation(client):
    r = client.responses.create(instructions="Answer briefly.", input="What is the capital of France?",
                                max_output_tokens=16, extra_body={"request_id": "job-1"}, **GREEDY)
    c = _chat(client, [{"role": "system", "content": "Answer briefly."},
                       {"role": "user", "content": "What is the capital of France?"}], 16)
    assert r.id == "resp_job-1" and r.object == "response"
    assert [o.type for o in r.output] == ["message"] and r.output[0].id.startswith("msg_")
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.status == ("completed" if c.choices[0].finish_reason == "stop" else "incomplete")
    with pytest.raises(openai.BadRequestError) as e:      # a stored id is never taken over
        client.responses.create(input="Hi", max_output_tokens=1, extra_body={"request_id": "job-1"}, **GREEDY)
    assert e.value.body["param"] == "request_id"


def test_previous_response_id_goes_on_from_the_stored_conversation_without_its_instructions(client):
    first = client.responses.create(instructions="Answer in one word.", input="Name a color.",
                                    max_output_tokens=8, **GREEDY)
    second = client.responses.create(previous_response_id=first.id, input="And another one?",
                                     max_output_tokens=8, **GREEDY)
    turns = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And another one?"}]
    c = _chat(client, turns, 8)
    assert second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens == c.usage.prompt_tokens        # the first turn's instructions are gone
    third = client.responses.create(previous_response_id=second.id, instructions="Be kind.", input="Thanks!",
                                    max_output_tokens=8, **GREEDY)
    c3 = _chat(client, [{"role": "system", "content": "Be kind."}, *turns,
                        {"role": "assistant", "content": second.output_text},
                        {"role": "user", "content": "Thanks!"}], 8)
    assert (third.output_text, third.usage.input_tokens) == (c3.choices[0].message.content, c3.usage.prompt_tokens)
    # stored: retrieved as answered, until deleted
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id),
                 lambda: client.responses.create(previous_response_id=first.id, input="x", **GREEDY)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert first.id in e.value.message
    unstored = client.responses.create(input="Hi", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_streamed_response_is_the_whole_one(server, client):
    ask = {"input": "What is 2+2?", "max_output_tokens": 40, **GREEDY}
    whole = client.responses.create(**ask)
    with client.responses.stream(**ask) as stream:     # the client's reader checks every event's place
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert whole.status == "completed" and final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.output[0].id != whole.output[0].id
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.completed"
    assert client.responses.retrieve(final.id).output_text == whole.output_text
    # on the wire: an event line per SSE, numbered in order, no [DONE]
    with httpx.stream("POST", server + "/v1/responses", json={**ask, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        blocks = r.read().decode().strip().split("\n\n")
    events = [(b.split("\n")[0].removeprefix("event: "), json.loads(b.split("\n")[1].removeprefix("data: ")))
              for b in blocks]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert "".join(d["delta"] for _, d in events if d["type"] == "response.output_text.delta") == whole.output_text


def test_function_calls_and_their_outputs_round_trip(client):
    r = client.responses.create(input="What is the weather in Paris?", tools=[TOOL], tool_choice="required",
                                max_output_tokens=60, **GREEDY)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    after = client.responses.create(previous_response_id=r.id, tools=[TOOL], max_output_tokens=1, **GREEDY,
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": "Sunny, 21 C"}])
    called = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    turns = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [called]},
             {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]
    c = _chat(client, turns, 1, tools=[CHAT_TOOL])     # (the prompts are compared: one token each will do)
    assert after.usage.input_tokens == c.usage.prompt_tokens
    # the same conversation sent as items, without the store
    sent = client.responses.create(tools=[TOOL], max_output_tokens=1, store=False, **GREEDY, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert sent.usage.input_tokens == c.usage.prompt_tokens
    # a named function streams its arguments as they come
    with client.responses.stream(input="Weather in Rome?", tools=[TOOL], max_output_tokens=60,
                                 tool_choice={"type": "function", "name": "get_weather"}, **GREEDY) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [streamed] = final.output
    assert len(deltas) > 1 and "".join(deltas) == streamed.arguments and "city" in json.loads(streamed.arguments)


def test_the_output_limit_ends_an_incomplete_response(client):
    r = client.responses.create(input="Tell me a long story.", max_output_tokens=3, **GREEDY)
    assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    assert r.output[0].status == "incomplete"
    with client.responses.stream(input="Tell me a long story.", max_output_tokens=3, **GREEDY) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].content[0].text == r.output_text


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)


def test_text_format_gives_structured_output(client):
    r = client.responses.parse(input="Invent a person.", text_format=Person, max_output_tokens=80, **GREEDY)
    assert isinstance(r.output_parsed, Person)


def test_logprobs_come_with_the_output_text(client):
    r = client.responses.create(input="Count to five.", max_output_tokens=8, top_logprobs=2,
                                include=["message.output_text.logprobs"], **GREEDY)
    c = _chat(client, [{"role": "user", "content": "Count to five."}], 8, logprobs=True, top_logprobs=2)
    got, want = r.output[0].content[0].logprobs, c.choices[0].logprobs.content
    assert [x.token for x in got] == [x.token for x in want] and len(got) == r.usage.output_tokens
    assert all(abs(a.logprob - b.logprob) < 1e-4 and len(a.top_logprobs) == 2 for a, b in zip(got, want, strict=True))
    plain = client.responses.create(input="Count to five.", max_output_tokens=8, **GREEDY)
    assert plain.output[0].content[0].logprobs is None


@pytest.mark.parametrize("body, status, param, needle", [
    ({"input": "hi", "max_output_tokens": 600}, 400, "max_output_tokens", "512"),
    ({"input": "word " * 1000}, 400, "input", "512"),     # (over 4,096 characters: bound by tokens, not items)
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id", "resp_unknown"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools", "function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "input.0.content.0.type", "text only"),
    ({"input": "hi", "background": True}, 400, "background", "foreground"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning.effort", "does not read"),
    ({"input": "hi", "model": "other"}, 404, "model", "other"),
])
def test_what_does_not_fit_is_refused_by_name_and_the_server_keeps_serving(server, client, body, status, param,
                                                                           needle):
    r = httpx.post(server + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (status, param) and needle in err["message"], err
    assert client.responses.create(input="ok?", max_output_tokens=2, **GREEDY).output


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OUTPUTS = [   # (reasoning parser, tools' parser or a forced call, output texts, each also cut short)
    ("qwen3", None, ["<think>\nhmm, let me see\n</think>\n\n Hi there!", "<think>\n \n</think>\n\n  ", "Hi  "]),
    ("deepseek_r1", None, ["so 2 + 2 is 4 \n</think>\n\nIt is 4.", "  still thinking  "]),
    ("none", "hermes", [" \n" + HERMES_CALL, "Sure. " + HERMES_CALL + HERMES_CALL, "Hello", "   "]),
    ("qwen3", "hermes", ["<think>\nweather\n</think>\n\n" + HERMES_CALL]),
    ("none", "named", ['{"city": "Rome"}']),
    ("qwen3", "named", ['{"city": "Rome"}']),
    ("deepseek_r1", "named", ['{"city": "Rome"}', 'Rome, then.\n</think>\n\n{"city": "Rome"}']),
    # a continued message (a prefill): no <think> was opened for it, and its text goes on as written
    ("deepseek_r1", "continued", [" 42, as said.", "  <think>\nhmm\n</think> 42"]),
    ("qwen3", "continued", [" 42.", "   "]),
]


@pytest.mark.parametrize("reasoning, calls, texts", OUTPUTS)
def test_streamed_items_are_the_whole_answer_s_however_the_text_comes(reasoning, calls, texts):
    """The items a stream builds equal the items of the same output read whole — reasoning and
    answer stripped as the chat message is, blank text before a call dropped, the status on the
    item that was cut — for every cut of the text and any split of it into deltas (a token's
    text may hold a tag, a tag may span tokens); so do the content blocks of Anthropic's
    Messages API."""
    import random

    from phalanx.serve import messages as ms
    from phalanx.serve import responses as rs
    from phalanx.serve.openai_server import ChatPlan, _ChoiceStream, chat_message
    tools = [CHAT_TOOL] if calls in ("hermes", "named") else None
    forced = CHAT_TOOL if calls == "named" else None
    plan = ChatPlan([], tools, forced, "hermes" if calls == "hermes" else None, None, None,
                    continued=calls == "continued")
    strip = reasoning != "none" and not plan.continued
    rng = random.Random(0)
    for text in texts:
        for cut in sorted({len(text), *rng.sample(range(len(text)), min(6, len(text)))}):
            out, status = text[:cut], "completed" if cut == len(text) else "incomplete"
            ids = rs.OutputIds.new()
            message, _ = chat_message(out, plan, reasoning)
            if plan.continued and "<think>" not in out:     # what a prefill's continuation is: its text, as written
                assert message["content"] == out and not message.get("reasoning_content"), message
            whole = rs.output_items(message, ids, status, None, named=forced is not None)
            for split in range(4):
                k = max(0, min(len(out) - 1, rng.randint(0, 8))) if split else 0
                bounds = sorted(rng.sample(range(1, len(out)), k))
                pieces = [out[a:b] for a, b in zip([0, *bounds], [*bounds, len(out)], strict=True)] or [""]
                stream = _ChoiceStream(plan, reasoning)
                ev = rs.ResponseEvents(ids, logprobs=False, strip=strip, named=forced is not None)
                for i, piece in enumerate(pieces):
                    ev.feed(*stream.feed(piece, i == len(pieces) - 1), [])
                ev.finish(status)
                strip_call_id = lambda items: [{k: v for k, v in it.items() if k != "call_id"} for it in items]  # noqa: E731
                assert strip_call_id(ev.items) == strip_call_id(whole), (out, pieces)
                # Anthropic's Messages API reads the same items as content blocks; its own client
                # puts the events together into them
                stream = _ChoiceStream(plan, reasoning)
                blocks = ms.MessageEvents(strip=strip, named=forced is not None)
                events = [blocks.sse("message_start", message={
                    "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": ms.usage(1, 0, 0)})]
                for i, piece in enumerate(pieces):
                    events += blocks.feed(*stream.feed(piece, i == len(pieces) - 1), [])
                events += blocks.finish(status)
                events += [blocks.sse("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
                                      usage=ms.usage(1, 0, 1)), blocks.sse("message_stop")]
                strip_id = lambda bs: [{k: v for k, v in b.items() if k != "id"} for b in bs]  # noqa: E731
                assert strip_id(blocks.blocks) == strip_id(ms.content_blocks(message)), (out, pieces)
                read = [b.model_dump(exclude_none=True) for b in _anthropic_read(events).content]
                assert strip_id([{k: v for k, v in b.items() if k != "parsed_output"} for b in read]) == strip_id(
                    ms.content_blocks(message)), (out, pieces)


def _anthropic_read(events):
    """The message Anthropic's client builds from these stream events (an in-process transport)."""
    import anthropic
    try:
        import httpx2 as hx  # (newer Anthropic clients' fork of httpx)
    except ImportError:
        hx = httpx
    body = "".join(events).encode()
    client = anthropic.Anthropic(api_key="k", base_url="http://test", max_retries=0, http_client=hx.Client(
        transport=hx.MockTransport(lambda r: hx.Response(200, content=body,
                                                         headers={"content-type": "text/event-stream"}))))
    with client.messages.stream(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}]) as s:
        return s.get_final_message()
