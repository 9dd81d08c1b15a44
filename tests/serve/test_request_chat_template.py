"""A chat request's own ``chat_template`` (vLLM's field and its ``--trust-request-chat-template``):
a server started with the flag renders the conversation with the request's template, in the chat
endpoint (streamed or not) and in ``/tokenize``, as the same text tokenized; a template that
does not parse is a 400 naming the field. (Without the flag the field is refused:
``test_openai_client.py``.)"""

import httpx
import pytest

from serve_helpers import KEY, start_server, stop_server

AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def trusting_server():
    proc, url = start_server("--trust-request-chat-template")
    yield url
    stop_server(proc)


def post(url, path, body):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=120)


def test_a_request_s_template_renders_its_conversation(trusting_server):
    url = trusting_server
    text = "[SYSTEM] Be brief.\n[USER] Name a colour.\n[ASSISTANT] "
    want = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    got = post(url, "/tokenize", {"messages": MESSAGES, "chat_template": TEMPLATE}).json()["tokens"]
    default = post(url, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert got == want and default != want
    chat = post(url, "/v1/chat/completions", {"messages": MESSAGES, "chat_template": TEMPLATE, "max_tokens": 2,
                                              "return_token_ids": True})
    assert chat.status_code == 200 and chat.json()["prompt_token_ids"] == want, chat.text
    plain = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "return_token_ids": True})
    assert plain.json()["prompt_token_ids"] == default          # the next request has the model's template again
    with httpx.stream("POST", url + "/v1/chat/completions", headers=AUTH, timeout=120,
                      json={"messages": MESSAGES, "chat_template": TEMPLATE, "max_tokens": 2, "stream": True,
                            "stream_options": {"include_usage": True}}) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert s.status_code == 200 and lines[-1] == "data: [DONE]"
    assert f'"prompt_tokens":{len(want)}' in lines[-2].replace(" ", ""), lines[-2]
    unrendered = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                    "chat_template": TEMPLATE + "{{ nothing_here.attr }}"})
    assert unrendered.status_code == 400 and unrendered.json()["error"]["param"] == "chat_template", unrendered.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("body,field", [
    ({"chat_template": "{% if %}"}, "chat_template"), ({"chat_template": ""}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": TEMPLATE}}, "chat_template_kwargs")])
def test_a_template_that_cannot_be_taken_is_a_400_naming_it(trusting_server, path, body, field):
    r = post(trusting_server, path, {"messages": MESSAGES, "max_tokens": 1, **body} if path != "/tokenize"
             else {"messages": MESSAGES, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    after = post(trusting_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert after.status_code == 200   # the server goes on
