"""vLLM's ``use_beam_search`` through ``phalanx serve`` (bundled SmolLM2): completions and chat give
the ``n`` best beams, best first, as ``LLM.beam_search`` gives them for the same prompt (the chat
one rendered by the model's template); fields beam search does not take are refused by name, and
the server goes on."""

import httpx
import pytest

from phalanx import LLM
from phalanx.llmapi.beam_search import BeamSearchParams
from serve_helpers import KEY

AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def post(url, path, body):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=300)


@pytest.fixture(scope="module")
def reference():
    """The LLM class over the same model: each prompt's beams."""
    with LLM(orchestrator_type="inprocess", max_seq_len=512) as llm:
        chat_ids = llm.tokenizer.encode_chat(MESSAGES)
        outs = llm.beam_search(["The best way to learn is", {"prompt_token_ids": chat_ids}],
                               BeamSearchParams(beam_width=3, max_tokens=8))
        texts = [[llm.tokenizer.decode(s.tokens[len(ids):], skip_special_tokens=True) for s in o.sequences]
                 for o, ids in zip(outs, [llm.tokenizer.encode("The best way to learn is"), chat_ids], strict=True)]
        yield outs, texts, chat_ids


def test_completions_and_chat_give_the_llm_class_s_beams(server, reference):
    outs, texts, chat_ids = reference
    r = post(server, "/v1/completions", {"prompt": "The best way to learn is", "use_beam_search": True, "n": 3,
                                         "max_tokens": 8, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice, seq in zip(body["choices"], outs[0].sequences, strict=True):
        assert choice["prompt_token_ids"] + choice["token_ids"] == seq.tokens
        assert choice["finish_reason"] == seq.finish_reason
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) == 3    # three beams, not one thrice
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])
    c = post(server, "/v1/chat/completions", {"messages": MESSAGES, "use_beam_search": True, "n": 3, "max_tokens": 8,
                                              "return_token_ids": True, "length_penalty": 1.0})
    assert c.status_code == 200, c.text
    chat = c.json()
    assert chat["prompt_token_ids"] == chat_ids
    for choice, seq, text in zip(chat["choices"], outs[1].sequences, texts[1], strict=True):
        assert chat_ids + choice["token_ids"] == seq.tokens
        assert choice["message"]["content"] == text and choice["message"]["role"] == "assistant"


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "temperature": 0.8}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "n": 11}, "n"),
    ("/v1/completions", {"prompt": "Hi", "length_penalty": 0.5}, "length_penalty"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "max_tokens": 600}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "use_beam_search": True, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "use_beam_search": True, "stop": ["x"]}, "stop"),
])
def test_what_beam_search_does_not_take_is_refused_by_name(server, path, body, field):
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    ok = post(server, path, {**{k: v for k, v in body.items() if k in ("prompt", "messages")}, "max_tokens": 2,
                             "use_beam_search": True, "n": 2, "stream": False})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text


def test_explicit_values_that_ask_nothing_more_are_taken(server):
    """A client that spells out sampling's neutral values (top_p 1, top_k -1, no stop strings,
    best_of equal to n, a null temperature) still gets its beams."""
    r = post(server, "/v1/completions", {"prompt": "Hi", "use_beam_search": True, "n": 2, "max_tokens": 2,
                                         "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1, "stop": [],
                                         "best_of": 2, "temperature": None, "stream": False})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
