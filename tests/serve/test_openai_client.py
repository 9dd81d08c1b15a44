"""The official openai client against a real `phalanx serve` on loopback (bundled SmolLM2)."""

import functools

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_helpers import KEY

MODEL = "SmolLM2-135M-Instruct"
_post = functools.partial(httpx.post, timeout=120)     # (under make test's load a step can take seconds)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_a_request_id_names_the_response(client):
    """vLLM's ``request_id``: the response's id is built on it (streamed chunks too); without
    it each response gets an id of its own."""
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"request_id": "job-7"})
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       stream=True, extra_body={"request_id": "job-8"})
    assert r.id == "cmpl-job-7" and {ch.id for ch in c} == {"chatcmpl-job-8"}
    a, b = (client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).id for _ in range(2))
    assert a != b and a.startswith("cmpl-")


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_plain(client):
    r = client.chat.completions.create(model=MODEL,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_a_developer_message_is_a_system_message_to_a_template_without_the_role(client):
    """OpenAI's newer name for the system role: the bundled template does not know it, so the
    prompt is the system message's (its default system prompt replaced, not added to)."""
    def ask(role):
        return client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
            {"role": role, "content": "Answer in French."}, {"role": "user", "content": "Name a color."}])
    developer, system = ask("developer"), ask("system")
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    assert developer.choices[0].message.content == system.choices[0].message.content


def test_chat_streaming_one_finish_per_choice_and_usage_last(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=20, temperature=0, n=2, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    finishes = [(c.index, c.finish_reason) for ch in chunks for c in ch.choices if c.finish_reason]
    assert sorted(i for i, _ in finishes) == [0, 1]
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert all(ch.usage is None for ch in chunks[:-1])
    text = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
    assert text[0] == text[1] and text[0]      # greedy: both choices alike


def test_continuous_usage_stats_give_each_chunk_its_choice_s_tokens_so_far(client):
    """vLLM's ``continuous_usage_stats``: every chunk carries the prompt's tokens and its choice's
    tokens so far (chat and completions, n = 2); the last usage chunk the totals. Without it,
    only the last chunk has usage."""
    def running(chunks):
        """Each choice's last count and the prompt counts the chunks carried (checked as they go)."""
        last: dict[int, int] = {}
        with_choices = [ch for ch in chunks if ch.choices]
        assert with_choices and all(ch.usage is not None for ch in with_choices)
        for ch in with_choices:
            [c] = ch.choices
            assert ch.usage.completion_tokens >= last.get(c.index, 0)     # never goes back
            assert ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens
            last[c.index] = ch.usage.completion_tokens
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(last.values())
        return last, {ch.usage.prompt_tokens for ch in with_choices}

    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=7, temperature=0, n=2)
    chat = list(client.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    last, prompts = running(chat)
    plain = client.chat.completions.create(**ask)
    assert prompts == {plain.usage.prompt_tokens} and sum(last.values()) == plain.usage.completion_tokens
    assert chat[0].usage.completion_tokens == 0                  # the role chunk: nothing generated yet
    done = list(client.completions.create(model=MODEL, prompt="One, two,", max_tokens=5, temperature=0, n=2,
                                          stream=True, stream_options={"continuous_usage_stats": True}))
    last, prompts = running(done)
    assert last == {0: 5, 1: 5} and len(prompts) == 1
    quiet = list(client.completions.create(model=MODEL, prompt="One, two,", max_tokens=5, temperature=0, stream=True,
                                           stream_options={"include_usage": True, "continuous_usage_stats": False}))
    assert all(ch.usage is None for ch in quiet[:-1]) and quiet[-1].usage.completion_tokens == 5


def test_continue_final_message_goes_on_writing_the_assistant_s_message(server, client):
    """``continue_final_message`` (vLLM's, transformers' rendering): the prompt ends inside the
    final assistant message, and the model continues it: the same tokens as a completion of
    that prompt's ids. With add_generation_prompt left true it is a 400 naming the field, as a
    template argument put in chat_template_kwargs is."""
    auth = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "Write a short poem about the sea."},
                {"role": "assistant", "content": "The waves roll in, the"}]
    ask = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    t = _post(server + "/tokenize", json={**ask, "return_token_strs": True}, headers=auth).json()
    opened = _post(server + "/tokenize", json={"messages": messages}, headers=auth).json()
    assert t["count"] < opened["count"] and "".join(t["token_strs"]).endswith("Ġthe")   # no end of turn
    chat = _post(server + "/v1/chat/completions", json={**ask, "max_tokens": 8, "temperature": 0,
                                                             "return_token_ids": True}, headers=auth).json()
    assert chat["prompt_token_ids"] == t["tokens"]
    same = client.completions.create(model=MODEL, prompt=t["tokens"], max_tokens=8, temperature=0)
    assert chat["choices"][0]["message"]["content"] == same.choices[0].text and same.choices[0].text
    # vLLM's echo: the answer starts with the assistant's final message (streamed in a chunk of its own)
    echoed = _post(server + "/v1/chat/completions", json={**ask, "max_tokens": 8, "temperature": 0,
                                                               "echo": True}, headers=auth).json()
    assert echoed["choices"][0]["message"]["content"] == messages[-1]["content"] + same.choices[0].text
    streamed = "".join(c.delta.content or "" for ch in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True, "priority": 0})
        for c in ch.choices)
    assert streamed == echoed["choices"][0]["message"]["content"]
    asked = [{"role": "user", "content": "Hi"}]        # the final message is not the assistant's: nothing echoed
    plain, with_echo = (_post(server + "/v1/chat/completions", json={
        "messages": asked, "max_tokens": 4, "temperature": 0, **extra}, headers=auth).json()[
            "choices"][0]["message"]
        for extra in ({}, {"echo": True}))
    assert plain == with_echo
    for path, body, field in [("/v1/chat/completions", {"messages": messages, "priority": 1}, "priority"),
                              ("/v1/chat/completions", {"messages": messages, "continue_final_message": True},
                               "continue_final_message"),
                              ("/tokenize", {"messages": messages, "continue_final_message": True},
                               "continue_final_message"),
                              ("/v1/chat/completions", {"messages": messages, "chat_template_kwargs": {
                                  "add_generation_prompt": False}}, "chat_template_kwargs"),
                              ("/tokenize", {"messages": messages, "chat_template_kwargs": {"tools": []}},
                               "chat_template_kwargs")]:
        r = _post(server + path, json=body, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, body, r.text)


def test_a_streamed_choice_finishes_when_it_ends_not_with_the_last(client):
    """n = 2 sampled choices of one prompt, one cut short by a stop string it meets early: its
    finish comes as it ends, before the other's last text (OpenAI's and vLLM's streams), and
    nothing of it follows."""
    ask = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, n=2)
    for seed in range(1, 20):          # a seed whose first choice has early text the second lacks
        a, b = (c.text for c in client.completions.create(**ask, seed=seed).choices)
        early = next((a[k:k + 4] for k in range(1, 6) if len(a[k:k + 4]) == 4 and a[k:k + 4] not in b
                      and len(a) > k + 12), None)
        if early:
            break
    assert early, "no seed gave two choices apart"
    events = [(c.index, c.text, c.finish_reason) for ch in client.completions.create(
        **ask, seed=seed, stop=[early], stream=True) for c in ch.choices]
    end0 = next(k for k, (i, _, f) in enumerate(events) if i == 0 and f)
    assert sum(1 for i, t, _ in events[end0 + 1:] if i == 1 and t) >= 3, events   # the other goes on after it
    assert not any(i == 0 for i, _, _ in events[end0 + 1:])
    assert sum(1 for _, _, f in events if f) == 2


def test_completions_string_list_and_token_ids(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert len(r.choices) == 1 and r.choices[0].text
    r2 = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, temperature=0)
    assert [c.index for c in r2.choices] == [0, 1]
    r3 = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=4, temperature=0)
    assert r3.choices[0].text and r3.usage.prompt_tokens == 5


def test_completions_n2_logprobs_stop_echo(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0, seed=3,
                                  logprobs=3)
    assert len(r.choices) == 2
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    # the 3 likeliest and the sampled token (OpenAI's legacy completions: up to k + 1 entries)
    assert all(tok in t and 3 <= len(t) <= 4 and (len(t) == 3 or min(t.values()) == t[tok])
               for tok, t in zip(lp.tokens, lp.top_logprobs, strict=True))
    zero = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=1.0, seed=3,
                                     logprobs=0).choices[0].logprobs
    assert [list(t) for t in zero.top_logprobs] == [[tok] for tok in zero.tokens]
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    stop = full[3:6]
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    echo = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Hello")


def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs_alone(server, client):
    """The scoring idiom of OpenAI's completions (evaluation harnesses' loglikelihood): ``echo``
    with ``max_tokens: 0`` gives the prompt back with its logprobs and nothing generated (the
    echoed part of a one-token completion's), streamed or not; 0 without echo is a 400."""
    prompt = ["The capital of France is Paris", "One, two, three"]
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2)
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=2)
    assert [c.text for c in alone.choices] == prompt
    assert alone.usage.completion_tokens == 0 and alone.usage.prompt_tokens == one.usage.prompt_tokens
    for a, b in zip(alone.choices, one.choices, strict=True):
        n = len(a.logprobs.tokens)
        assert a.finish_reason == "length" and n == len(b.logprobs.tokens) - 1 > 3
        # (the same up to float rounding: the two prompts may share a step or not, whose shapes differ)
        assert a.logprobs.token_logprobs[0] is None and b.logprobs.token_logprobs[0] is None
        assert a.logprobs.token_logprobs[1:] == pytest.approx(b.logprobs.token_logprobs[1:n], abs=1e-4)
        assert a.logprobs.tokens == b.logprobs.tokens[:n] and a.logprobs.text_offset == b.logprobs.text_offset[:n]
        assert [list(t) for t in a.logprobs.top_logprobs[1:]] == [list(t) for t in b.logprobs.top_logprobs[1:n]]
    events = list(client.completions.create(model=MODEL, prompt=prompt[0], max_tokens=0, echo=True, logprobs=2,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.text for ch in events for c in ch.choices) == prompt[0]
    assert [c.finish_reason for ch in events for c in ch.choices if c.finish_reason] == ["length"]
    assert events[-1].usage.completion_tokens == 0
    assert sum(len(c.logprobs.tokens) for ch in events for c in ch.choices if c.logprobs) == \
        len(alone.choices[0].logprobs.tokens)
    r = _post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 0},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = _post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 0, "echo": True, "min_tokens": 2},
              headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_allowed_token_ids_bound_what_is_generated(server, client):
    """vLLM's ``allowed_token_ids`` through the server and the engine's ranks: every generated
    token is one of them (sampled, several choices), greedy takes the likeliest of them (the
    first of the free run's tokens that is allowed stays the first), and an id past the
    vocabulary is a 400 naming the field."""
    free = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                     extra_body={"return_token_ids": True})
    first = free.choices[0].model_extra["token_ids"][0]
    allowed = [first, 11, 29, 30, 216]
    greedy = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                       extra_body={"return_token_ids": True, "allowed_token_ids": allowed})
    assert greedy.choices[0].model_extra["token_ids"][0] == first
    hot = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.5, n=4,
                                    seed=1, extra_body={"return_token_ids": True, "allowed_token_ids": allowed[1:]})
    drawn = [t for c in hot.choices for t in c.model_extra["token_ids"]]
    assert len(drawn) == 48 and set(drawn) <= set(allowed[1:]) and len(set(drawn)) > 1
    r = _post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "allowed_token_ids": [1, 10 ** 6]},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_bad_words_through_the_server(client):
    """vLLM's ``bad_words``: the greedy answer that named Paris names it no more, in chat and in
    completions."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    free = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=16, temperature=0)
    assert "Paris" in free.choices[0].message.content
    barred = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=16, temperature=0,
                                            extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in barred.choices[0].message.content
    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                     extra_body={"bad_words": ["Paris", "paris"]})
    assert "aris" not in done.choices[0].text


def test_truncate_prompt_tokens_keeps_each_prompt_s_last_tokens(server, client):
    """vLLM's ``truncate_prompt_tokens`` through the server: a completion's prompt (text or ids)
    and a chat's rendered prompt keep their last k tokens, generate what those alone generate,
    and echo their text; 0 or more than the context is a 400 naming the field."""
    auth = {"Authorization": f"Bearer {KEY}"}
    text = "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve"
    full = _post(server + "/tokenize", json={"prompt": text}, headers=auth).json()["tokens"]
    tail = client.completions.create(model=MODEL, prompt=full[-8:], max_tokens=5, temperature=0, echo=True)
    for prompt in (text, full):
        cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                        extra_body={"truncate_prompt_tokens": 8, "return_token_ids": True})
        assert cut.choices[0].text == tail.choices[0].text and cut.usage.prompt_tokens == 8
        assert cut.choices[0].model_extra["prompt_token_ids"] == full[-8:]
    long = client.completions.create(model=MODEL, prompt="word " * 20000, max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": 12})
    assert long.usage.prompt_tokens == 12
    messages = [{"role": "user", "content": text}]
    whole = _post(server + "/tokenize", json={"messages": messages}, headers=auth).json()["tokens"]
    chat = _post(server + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                             "truncate_prompt_tokens": 10, "return_token_ids": True},
                      headers=auth).json()
    assert chat["prompt_token_ids"] == whole[-10:] and chat["usage"]["prompt_tokens"] == 10
    for bad in (0, 10 ** 6):
        r = _post(server + "/v1/completions", json={"prompt": text, "truncate_prompt_tokens": bad}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client):
    """vLLM's ``return_tokens_as_token_ids``: every token a logprob names (the chosen ones, the
    alternatives, an echoed prompt's, a streamed chat's) is ``token_id:<id>``, the ids the
    choice returns; the values are those of the same request without it."""
    ask = dict(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2, echo=True)
    named = client.completions.create(**ask)
    ids = client.completions.create(**ask, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    c = ids.choices[0]
    every = [*c.model_extra["prompt_token_ids"], *c.model_extra["token_ids"]]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in every]
    assert c.logprobs.token_logprobs[1:] == pytest.approx(named.choices[0].logprobs.token_logprobs[1:], abs=1e-4)
    assert all(k.startswith("token_id:") and int(k[9:]) >= 0 for top in c.logprobs.top_logprobs[1:] for k in top)
    assert [len(t) for t in c.logprobs.top_logprobs[1:]] == [len(t) for t in named.choices[0].logprobs.top_logprobs[1:]]
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True,
                top_logprobs=2, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    whole = client.chat.completions.create(**chat).choices[0]
    assert [e.token for e in whole.logprobs.content] == [f"token_id:{t}" for t in whole.model_extra["token_ids"]]
    assert all(a.token.startswith("token_id:") for e in whole.logprobs.content for a in e.top_logprobs)
    streamed = [e.token for ch in client.chat.completions.create(**chat, stream=True) for c in ch.choices
                if c.logprobs for e in c.logprobs.content]
    assert streamed == [e.token for e in whole.logprobs.content]


def test_prompt_logprobs_give_every_prompt_token_s_logprob(server, client):
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), its own logprob and the
    k likeliest, keyed by id with their ranks and texts; the values an echo's logprobs give
    (completions, per choice) and the chat's rendered prompt's (the response's); with a stream
    a 400 naming the field."""
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, n=2, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 3, "return_token_ids": True})
    c = r.choices[0]
    plp, ids = c.model_extra["prompt_logprobs"], c.model_extra["prompt_token_ids"]
    assert r.choices[1].model_extra["prompt_logprobs"] == plp and len(plp) == len(ids) == r.usage.prompt_tokens
    assert plp[0] is None
    for tid, entry, echoed in zip(ids[1:], plp[1:], c.logprobs.token_logprobs[1:len(ids)], strict=True):
        assert str(tid) in entry and entry[str(tid)]["logprob"] == pytest.approx(echoed, abs=1e-4)
        ranked = sorted(e["rank"] for e in entry.values())
        assert ranked[:3] == [1, 2, 3] and len(entry) in (3, 4)
        assert all(e["decoded_token"] for e in entry.values())
    chat = _post(server + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0,
        "return_tokens_as_token_ids": True}, headers={"Authorization": f"Bearer {KEY}"}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and not next(iter(e.values()))["decoded_token"].startswith("token_id:")
               for e in chat["prompt_logprobs"][1:])     # decoded_token stays the text (vLLM's)
    bad = _post(server + "/v1/completions", json={"prompt": prompt, "prompt_logprobs": 1, "stream": True},
                     headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs", bad.text


def test_completions_of_token_ids_echo_their_text_and_equal_the_text_prompt(client):
    """A prompt of token ids (checked on the event loop, its text decoded only for echo): the same
    completion as its text, streamed or not, and echo gives the text back."""
    from phalanx.llmapi.tokenizer import load_tokenizer
    from phalanx.models.source import bundled_model_path, resolve_model
    text = "The capital of France is"
    ids = load_tokenizer(resolve_model(bundled_model_path())).encode(text, add_special_tokens=False)
    want = client.completions.create(model=MODEL, prompt=text, max_tokens=5, temperature=0).choices[0].text
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=[ids], max_tokens=5, temperature=0, stream=True) if c.choices)
    echo = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, echo=True)
    assert got == want == streamed
    assert echo.choices[0].text == text + want


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


EMOJI = "Repeat exactly: 🍕🎉🍕🎉 中文字 naïve"


def test_logprob_bytes_and_offsets_of_tokens_that_split_a_character(client):
    """Tokens holding part of a character (the pizza's four bytes over several tokens) report
    their own bytes, which join into the text's; completions' text_offset points at the character
    each token's first byte belongs to (streamed or not)."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": EMOJI}], max_tokens=16,
                                       temperature=0, logprobs=True, top_logprobs=1)
    content, text = r.choices[0].logprobs.content, r.choices[0].message.content
    assert any(c.token == "\ufffd" for c in content)          # the model repeats an emoji, split over tokens
    assert bytes(b for c in content for b in c.bytes).decode(errors="replace") == text, text
    assert all(c.top_logprobs[0].bytes != list("\ufffd".encode()) for c in content if c.token == "\ufffd")

    for stream in (False, True):
        res = client.completions.create(model=MODEL, prompt=EMOJI, max_tokens=1, temperature=0, logprobs=0, echo=True,
                                        stream=stream)
        chunks = list(res) if stream else [res]
        echoed = "".join(c.choices[0].text for c in chunks)
        offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert echoed.startswith(EMOJI) and offsets == sorted(offsets) and offsets[0] == 0
        for tok, off in zip(tokens, offsets, strict=True):   # every whole token is the text at its offset
            assert "\ufffd" in tok or echoed.startswith(tok, off), (tok, off)
        assert offsets[tokens.index(" 中") if " 中" in tokens else tokens.index("中")] == EMOJI.index("中") - (
            " 中" in tokens)


def _error(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(server + path, json=body, headers=headers, timeout=60)
    return r.status_code, r.json()


@pytest.mark.parametrize("body,status,needle", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 600}]}, 400, "512"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}, 400, "512"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 1000}, 400, "n"),
    ({"model": "other-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "other-model"),
    # the bundled model's template reads neither (one that does: test_launch_and_instructions)
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "documents": [{"text": "x"}]}, 400,
     "documents"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}, 400,
     "reasoning_effort"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body, status, needle):
    code, payload = _error(server, "/v1/chat/completions", body)
    assert code == status
    err = payload["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == status
    assert needle in err["message"] or needle == err["param"]
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok?"}],
                                          max_tokens=2).choices


def test_context_overflow_names_both_numbers(server):
    code, payload = _error(server, "/v1/completions", {"model": MODEL, "prompt": "word " * 300, "max_tokens": 300})
    message = payload["error"]["message"]
    assert code == 400 and "512" in message and "300 in the completion" in message


def test_prompt_at_the_limit_with_one_token_works(server):
    ids = [504] * 511
    code, payload = _error(server, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1})
    assert code == 200 and payload["usage"]["completion_tokens"] == 1


def test_api_key_required_except_health_and_metrics(server):
    for key in (None, "wrong"):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        code, payload = _error(server, "/v1/chat/completions", body, key=key)
        assert code == 401 and payload["error"]["code"] == 401
    assert httpx.get(server + "/v1/models").status_code == 401
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/metrics").status_code == 200
    assert httpx.get(server + "/version", headers={"Authorization": f"Bearer {KEY}"}).json()["version"]


def test_special_token_text_in_a_message_is_plain_text(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Repeat: <|im_end|>"}],
                                       max_tokens=2, temperature=0)
    baseline = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Repeat: x"}],
                                              max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens > baseline.usage.prompt_tokens   # spelled out, not one control token


def metrics(server):
    text = httpx.get(server + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m, name):
    return sum(v for (n, _), v in m.items() if n == name)


def test_metrics_parse_and_move(server, client):
    before = metrics(server)
    prompt = [{"role": "user", "content": "Tell me about the history of tea in a few sentences. " * 8}]
    client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=4, temperature=0)
    client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=4, temperature=0)
    after = metrics(server)
    ttft = "phalanx:time_to_first_token_seconds_count"
    assert value(after, ttft) >= value(before, ttft) + 2
    assert value(after, "phalanx:prefix_cache_hits_total") > value(before, "phalanx:prefix_cache_hits_total")
    assert value(after, "phalanx:prompt_tokens_total") > value(before, "phalanx:prompt_tokens_total")
    assert value(after, "phalanx:generation_tokens_total") >= value(before, "phalanx:generation_tokens_total") + 8
    assert value(after, "phalanx:request_success_total") >= value(before, "phalanx:request_success_total") + 2
    for name in ("phalanx:num_requests_running", "phalanx:num_requests_waiting", "phalanx:kv_cache_usage_perc",
                 "phalanx:inter_token_latency_seconds_count", "phalanx:e2e_request_latency_seconds_count",
                 "phalanx:request_queue_time_seconds_count", "phalanx:prefix_cache_queries_total",
                 "phalanx:num_preemptions_total"):
        assert any(n == name for n, _ in after), name


def test_streams_lose_nothing_under_many_choices(client):
    """Every choice's streamed deltas add up to the non-streamed text (greedy, n=4, 3 times)."""
    msgs = [{"role": "user", "content": "Describe a rainy afternoon in a city in detail."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0)
    want = full.choices[0].message.content
    for _ in range(3):
        text = {i: "" for i in range(4)}
        for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0, n=4,
                                                 stream=True):
            for c in ch.choices:
                text[c.index] += c.delta.content or ""
        assert all(t == want for t in text.values()), text


def test_tokenize_and_detokenize_give_the_ids_the_endpoints_run_on(server):
    """vLLM's /tokenize and /detokenize: a prompt's ids as a completion runs on them, a
    conversation's as the chat endpoint renders it (the same ids it reports with
    return_token_ids), and the ids back to text; what they cannot do is a 400 naming the field."""
    auth = {"Authorization": f"Bearer {KEY}"}
    prompt = "The capital of France is"
    t = httpx.post(server + "/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True},
                   headers=auth).json()
    comp = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "return_token_ids": True},
                      headers=auth).json()
    assert t["tokens"] == comp["choices"][0]["prompt_token_ids"] and t["count"] == len(t["tokens"])
    assert t["max_model_len"] > t["count"] and len(t["token_strs"]) == t["count"]
    assert all(isinstance(s, str) for s in t["token_strs"])
    back = httpx.post(server + "/detokenize", json={"tokens": t["tokens"]}, headers=auth).json()
    assert back == {"prompt": prompt}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"}]
    chat = httpx.post(server + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                             "return_token_ids": True}, headers=auth).json()
    tc = httpx.post(server + "/tokenize", json={"messages": messages}, headers=auth).json()
    assert tc["tokens"] == chat["prompt_token_ids"] and tc["token_strs"] is None
    tool = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    shown = {c: httpx.post(server + "/tokenize", json={"messages": messages, "tools": tool, "tool_choice": c},
                           headers=auth).json()["tokens"] for c in ("auto", "none")}
    assert shown["auto"] == shown["none"] and len(shown["none"]) > tc["count"]   # "none" still shows the tools
    bare = httpx.post(server + "/tokenize", json={"messages": messages, "add_generation_prompt": False},
                      headers=auth).json()
    assert bare["count"] < tc["count"] and tc["tokens"][:bare["count"]] == bare["tokens"]
    for path, body, field in [("/tokenize", {"messages": messages, "add_special_tokens": True}, "add_special_tokens"),
                              ("/tokenize", {"prompt": prompt, "continue_final_message": True},
                               "continue_final_message"),   # a prompt's form has no final message
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"messages": messages, "tool_choice": "required"}, "tool_choice"),
                              ("/tokenize", {"messages": messages, "tools": [{"type": "function", "function": {
                                  "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
                               "tool_choice"),
                              ("/detokenize", {"tokens": [1, 10 ** 7]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens")]:
        r = httpx.post(server + path, json=body, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, body, r.text)
    assert httpx.post(server + "/tokenize", json={"prompt": prompt}).status_code == 401
    assert httpx.post(server + "/tokenize", json={"model": "other", "prompt": prompt}, headers=auth).status_code == 404


def test_a_request_s_chat_template_is_refused_by_a_server_that_does_not_trust_them(server):
    """vLLM's default: without --trust-request-chat-template a request's chat_template is a 400
    naming it (the chat endpoint and /tokenize), never rendered or ignored."""
    messages = [{"role": "user", "content": "Hi"}]
    for path, extra in (("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})):
        r = _post(server + path, json={"messages": messages, "chat_template": "{{ messages[0]['content'] }}", **extra},
                  headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
