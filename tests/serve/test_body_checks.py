"""The body checks before validation (protocol.parse_body): a token-id prompt's thousands of
numbers skip the per-value walk, which still finds what it is for — nesting past MAX_DEPTH and
strings that are not valid Unicode — wherever they are."""

import json

import pytest

from phalanx.serve.protocol import MAX_DEPTH, BodyError, CompletionRequest, parse_body


def _body(prompt) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 2}).encode()


def test_a_token_id_prompt_passes_whole():
    ids = list(range(5, 2085))
    assert parse_body(_body(ids), CompletionRequest).prompt == ids


def test_numbers_nested_too_deep_are_refused():
    deep: list = [1, 2, 3]
    for _ in range(MAX_DEPTH):
        deep = [deep]
    with pytest.raises(BodyError, match="nested deeper"):
        parse_body(_body(deep), CompletionRequest)


def test_a_lone_surrogate_among_numbers_is_named_by_its_path():
    raw = b'{"model": "m", "max_tokens": 2, "prompt": [[1, 2], [3, "\\ud800"]]}'
    with pytest.raises(BodyError, match="lone surrogate") as e:
        parse_body(raw, CompletionRequest)
    assert e.value.param == "prompt.1.1"


@pytest.mark.parametrize("wrappers", range(MAX_DEPTH - 3, MAX_DEPTH + 2))
def test_numbers_at_every_depth_near_the_limit_get_the_walks_answer(wrappers, monkeypatch):
    """The fast path for lists of numbers refuses exactly what the walk over each number does,
    at the depth limit and on either side of it."""
    from phalanx.serve import protocol
    deep: list = [1, 2, 3]
    for _ in range(wrappers):
        deep = [deep]

    def outcome() -> str:
        try:
            parse_body(_body(deep), CompletionRequest)
        except BodyError as e:
            return "depth" if "nested deeper" in e.message else "other"
        return "ok"

    fast = outcome()
    monkeypatch.setattr(protocol, "_numbers_only", lambda items: False)
    assert fast == outcome()
    assert fast == ("depth" if wrappers >= MAX_DEPTH - 1 else "other")


def test_null_is_the_default_of_a_field_that_has_one_and_a_meaning_where_it_has_one():
    """OpenAI's and vLLM's optional fields sent as null (as clients that serialise every field
    do): the default where the field does not take null; a null that means something
    (completions' max_tokens: fill the context) kept; a null for a field phalanx does not have
    still refused by name."""
    from phalanx.serve.protocol import ChatCompletionRequest
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "n": None, "stream": None, "presence_penalty": None,
         "frequency_penalty": None, "logprobs": None, "parallel_tool_calls": None, "skip_special_tokens": None,
         "add_generation_prompt": None, "min_tokens": None, "stream_options": None, "max_tokens": None})
    assert (chat.n, chat.stream, chat.presence_penalty, chat.logprobs, chat.parallel_tool_calls,
            chat.skip_special_tokens, chat.add_generation_prompt, chat.min_tokens) == (1, False, 0.0, False, True,
                                                                                     True, True, 0)
    done = CompletionRequest.model_validate({"prompt": "x", "max_tokens": None, "echo": None, "n": None,
                                             "stream": True, "stream_options": {"include_usage": None}})
    assert done.max_tokens is None and done.echo is False and done.n == 1
    assert done.stream_options is not None and not done.stream_options.include_usage   # null: none (vLLM)
    given = CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": {}})
    assert given.stream_options is not None and given.stream_options.include_usage   # vLLM's default
    assert not given.stream_options.continuous     # usage in every chunk: only when asked
    running = CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": {
        "continuous_usage_stats": True}})
    assert running.stream_options is not None and running.stream_options.continuous
    for options in ({"continuous_usage_stats": None}, {"include_usage": None, "continuous_usage_stats": True}):
        off = CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": options})
        assert off.stream_options is not None and not off.stream_options.continuous   # no usage, none running
    with pytest.raises(ValueError, match="functions"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "functions": None})
    labels = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 0,
                                                   "safety_identifier": "u1", "prompt_cache_key": "k"})
    assert labels.top_logprobs == 0 and not labels.logprobs      # 0 without logprobs asks for nothing (vLLM)
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them():
    from phalanx.serve.protocol import ChatMessage
    m = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "Name three"},
                                                                {"type": "text", "text": "colors."}]})
    assert m.text() == "Name three\ncolors." and m.num_chars() == len(m.text())


def test_a_completion_s_add_special_tokens_reaches_its_text_prompts():
    """vLLM's ``add_special_tokens`` (true by default): a text prompt gets the tokenizer's BOS
    or not; token-id prompts are taken as they are either way. (The bundled tokenizer made to
    add its BOS, as Llama's do.)"""
    import copy
    from types import SimpleNamespace

    from phalanx.llmapi.tokenizer import Tokenizer, _gguf_tokenizer
    from phalanx.models.source import bundled_model_path
    from phalanx.serve.openai_server import OpenAIServer
    hf = copy.deepcopy(_gguf_tokenizer(bundled_model_path()))
    hf.add_bos_token = True
    tok = Tokenizer(hf)
    server = SimpleNamespace(llm=SimpleNamespace(tokenizer=tok, max_seq_len=512, vocab_size=tok.vocab_size))
    server._whole_prompts = OpenAIServer._whole_prompts.__get__(server)
    bare = tok.encode("Hi there", add_special_tokens=False)
    for add, want in ((True, [hf.bos_token_id, *bare]), (False, bare)):
        body = parse_body(json.dumps({"prompt": ["Hi there", "Hi there"], "add_special_tokens": add}).encode(),
                          CompletionRequest)
        assert OpenAIServer._prompts(server, body.prompt, False, None, body.add_special_tokens) == [
            ("Hi there", want)] * 2
    assert OpenAIServer._prompts(server, bare, False, None, True) == [(None, bare)]
    assert parse_body(b'{"prompt": "x"}', CompletionRequest).add_special_tokens      # vLLM's default
