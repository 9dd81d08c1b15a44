"""The tool-call and reasoning parsers on hand-written model outputs (pure Python)."""

import json

from phalanx.serve.tools import (
    ReasoningStream,
    ToolCallStream,
    forced_tool_calls,
    forced_tool_grammar,
    guided_params,
    parse_tool_calls,
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "add"}}]


def test_hermes_blocks_are_calls_and_the_rest_is_content():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    content, calls = parse_tool_calls(text, "hermes", TOOLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("add", {"a": 1, "b": 2})]
    assert parse_tool_calls('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', "hermes", TOOLS)[1] == []
    assert parse_tool_calls("<tool_call>{not json</tool_call>", "hermes", TOOLS)[1] == []


def test_llama3_json_calls():
    content, calls = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                                      '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "llama3_json", TOOLS)
    assert content is None and [c.name for c in calls] == ["add", "get_weather"]
    assert parse_tool_calls("The answer is 3.", "llama3_json", TOOLS) == ("The answer is 3.", [])
    content, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "a;b"}};{"name": "add", '
                                      '"parameters": {"a": 1, "b": 2}}', "llama3_json", TOOLS)   # ";" in an argument
    assert content is None and [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == {"city": "a;b"}
    # cut inside its second call (max_tokens, a stop string): the first call stands, as a whole
    # Hermes block and "required"'s whole calls do; the rest is content
    content, calls = parse_tool_calls('{"name": "add", "parameters": {"a": 1}}; {"name": "add"', "llama3_json", TOOLS)
    assert content == '{"name": "add"' and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1})]
    half = '{"name": "add", "parameters": {"a"'
    assert parse_tool_calls(half, "llama3_json", TOOLS) == (half, [])     # no whole call: all of it is content
    assert parse_tool_calls('{"answer": 3}', "llama3_json", TOOLS) == ('{"answer": 3}', [])   # not a call
    shown = '{"name": "add", "parameters": {"a": 1}}\n\nThis is how you would call it.'   # an answer
    assert parse_tool_calls(shown, "llama3_json", TOOLS) == (shown, [])


def test_forced_choices_become_grammars_and_read_back():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_tool_grammar(TOOLS, named).json == {"type": "object"}
    required = forced_tool_grammar(TOOLS, "required", parallel=False)
    assert required.json["maxItems"] == 1 and len(required.json["items"]["anyOf"]) == 2
    assert forced_tool_grammar(TOOLS, "auto") is None
    calls = forced_tool_calls('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', "required")
    assert calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert forced_tool_calls('{"city": "Rome"}', named)[0].arguments == '{"city": "Rome"}'


def test_strict_tools_under_auto_are_held_by_a_structural_tag():
    """Under tool_choice "auto" the output runs free; with a ``strict`` tool, a structural tag
    holds every call (once the parser's trigger begins one) to a tool and its parameters, written
    as the parser reads it. ``parallel_tool_calls: false`` stays refused there (only a grammar
    that ends the output could hold it)."""
    import pytest

    from phalanx.serve.tools import strict_tools_tag
    with pytest.raises(ValueError, match="^parallel_tool_calls"):
        forced_tool_grammar(TOOLS, "auto", parallel=False)
    strict = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object"}}},
              *TOOLS]
    assert forced_tool_grammar(TOOLS, "auto", parser="hermes") is None      # no strict tool: free
    strict[1] = {"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}
    tag = forced_tool_grammar(strict, "auto", parser="hermes").structural_tag
    fmt = tag["format"]
    assert tag["type"] == "structural_tag" and fmt["triggers"] == ["<tool_call>"]
    assert [t["begin"] for t in fmt["tags"]] == [f'<tool_call>\n{{"name": "{t["function"]["name"]}", "arguments": '
                                                 for t in strict]
    assert fmt["tags"][1]["content"]["json_schema"] == TOOLS[0]["function"]["parameters"]   # strict: its schema
    assert fmt["tags"][2]["content"]["json_schema"] == {"type": "object"}     # not strict: any object, as OpenAI
    assert {t["end"] for t in fmt["tags"]} == {"}\n</tool_call>"}
    # Llama 3's JSON calls are not marked off from an answer's JSON: the whole output is calls, or
    # text that cannot begin one
    # (the grammar itself is matched on a vocabulary in tests/model/test_guided_decoding.py)
    fmt = strict_tools_tag(strict, "llama3_json")["format"]
    calls, tagged, text = fmt["elements"]
    assert fmt["type"] == "or" and calls["type"] == "tags_with_separator" and calls["separator"] == "; "
    assert [t["begin"] for t in calls["tags"]] == [f'{{"name": "{t["function"]["name"]}", "parameters": '
                                                   for t in strict]
    assert calls["tags"][1]["content"]["json_schema"] == TOOLS[0]["function"]["parameters"]
    assert tagged["elements"] == [{"type": "const_string", "value": "<|python_tag|>"}, calls]
    assert text["type"] == "regex"
    with pytest.raises(ValueError, match="^tools: strict"):
        strict_tools_tag(strict, "mistral")
    unenforced = [{"type": "function", "function": {"name": "tag", "strict": True, "parameters": {
        "type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}}}]
    with pytest.raises(ValueError, match=r"^tools: tools\[0\] \('tag'\) parameters: the keyword 'uniqueItems'"):
        strict_tools_tag(unenforced, "hermes")
    strict_tools_tag([{**unenforced[0], "function": {**unenforced[0]["function"], "strict": False}}, strict[0]],
                     "hermes")   # a tool that is not strict is not held to its schema, so not checked
    assert forced_tool_grammar(strict, "required", parallel=False).json["maxItems"] == 1   # held by the grammar


def test_one_constraint_per_request():
    class Body:
        response_format = None
        guided_regex = "a+"
        guided_choice = ["x"]
    try:
        guided_params(Body(), None)
    except ValueError as e:
        assert "only one output constraint" in str(e)
    else:
        raise AssertionError("two constraints were accepted")


def test_reasoning_split_whole_and_streamed():
    assert whole_message("<think>\nweigh it\n</think>\n\nYes.") == ("weigh it", "Yes.")
    assert whole_message("No thinking here.") == (None, "No thinking here.")
    pieces = ["<th", "ink>\nfirst", " second</thi", "nk>\n\nThe", " answer"]
    stream, reasoning, answer = ReasoningStream(), "", ""
    for i, p in enumerate(pieces):
        r, a = stream.feed(p, final=i == len(pieces) - 1)
        reasoning, answer = reasoning + r, answer + a
    assert (reasoning, answer) == ("first second", "The answer")
    r1 = ReasoningStream(starts_in_reasoning=True)
    assert r1.feed("plan</think>done", final=True) == ("plan", "done")


def whole_message(text: str, reasoning_parser: str = "qwen3") -> tuple[str | None, str]:
    """(reasoning, answer) of a whole, non-streamed chat output."""
    from types import SimpleNamespace

    from phalanx.serve.openai_server import ChatPlan, OpenAIServer
    plan = ChatPlan([], None, None, None, None, None)
    message, _ = OpenAIServer._chat_message(SimpleNamespace(reasoning_parser=reasoning_parser), text, plan)
    return message["reasoning_content"], message["content"]


def test_include_reasoning_false_leaves_the_reasoning_out():
    """vLLM's ``include_reasoning: false``: the reasoning is still read off the output (the
    content is the answer alone), and left out of the message and of every streamed delta."""
    from types import SimpleNamespace

    from phalanx.serve.openai_server import ChatPlan, OpenAIServer, _ChoiceStream
    plan = ChatPlan([], None, None, None, None, None)
    text = "<think>\nsome thought</think>\n\nThe answer"
    server = SimpleNamespace(reasoning_parser="qwen3")
    shown, _ = OpenAIServer._chat_message(server, text, plan)
    hidden, _ = OpenAIServer._chat_message(server, text, plan, False)
    assert shown["reasoning_content"] == "some thought" and hidden["reasoning_content"] is None
    assert hidden["content"] == shown["content"] == "The answer"
    stream = _ChoiceStream(plan, "qwen3", include_reasoning=False)
    deltas = [stream.feed(p, final=i == 3)[0] for i, p in enumerate(["<think>\nsome", " thought</th", "ink>\n\nThe",
                                                                     " answer"])]
    assert all("reasoning_content" not in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas).strip() == "The answer"


def test_tool_call_stream_holds_back_a_call_and_streams_the_rest():
    stream = ToolCallStream("hermes", TOOLS)
    out = [stream.feed(p) for p in ["Sure", ", one <tool", '_call>{"name": "add", "arguments": {"a": 1, "b": 1}}',
                                    "</tool_call>"]]
    assert "".join(out) == "Sure, one "
    rest, calls = stream.finish()
    assert rest == "" and calls[0].name == "add"
    plain = ToolCallStream("hermes", TOOLS)
    text = "".join(plain.feed(p) for p in ["No calls ", "<b>here</b>"])
    assert text + plain.finish()[0] == "No calls <b>here</b>"
    # Llama 3: a "<" at the start is held while it could begin <|python_tag|>, then released
    llama = ToolCallStream("llama3_json", TOOLS)
    assert [llama.feed(p) for p in ["<", "b>bold", " text"]] == ["", "<b>bold", " text"]
    assert llama.finish() == ("", [])
    blank_first = ToolCallStream("llama3_json", TOOLS)   # a blank alone may come before a call
    assert [blank_first.feed(p) for p in ["\n", '{"name": "add", "parameters": {}}']] == ["", ""]
    assert blank_first.finish()[0] == ""
    tagged = ToolCallStream("llama3_json", TOOLS)
    assert [tagged.feed(p) for p in ["<|python", '_tag|>{"name": "add", "parameters": {"a": 1}}']] == ["", ""]
    assert tagged.finish()[1][0].name == "add"


def test_a_whole_chat_output_reads_as_its_stream():
    """The non-streamed message is read by the streamed path itself: the same reasoning,
    content and calls, whichever parser, tool choice or cut-off."""
    from types import SimpleNamespace

    from phalanx.serve.openai_server import ChatPlan, OpenAIServer, _ChoiceStream
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [
        (None, None, "qwen3", "<think>\nweigh it\n</think>\n\nYes."),
        (None, None, "qwen3", "Hello </think> world"),                    # no opening tag: all answer
        (None, None, "deepseek_r1", "plan it</think>done"),
        ("hermes", None, "none", 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'),
        ("deepseek_v3", None, "none", "Sure." + "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add"
                                      '\n```json\n{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
        ("deepseek_v31", None, "deepseek_r1", "plan</think>" + "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add"
                                              '<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
        (None, "required", "none", '[{"name": "add", "arguments": {"a": 1}}]'),
        (None, "required", "none", '[{"name": "add", "argu'),               # cut short: text comes back
        (None, named, "none", '{"city": "Rome"}'),
    ]
    for parser, forced, reasoning, text in cases:
        plan = ChatPlan([], TOOLS if parser or forced else None, forced, parser, None, None)
        message, called = OpenAIServer._chat_message(SimpleNamespace(reasoning_parser=reasoning), text, plan)
        stream, content, thought, calls = _ChoiceStream(plan, reasoning), "", "", {}
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        for i, piece in enumerate(pieces):
            delta, deltas = stream.feed(piece, i == len(pieces) - 1)
            content += delta.get("content", "")
            thought += delta.get("reasoning_content", "")
            for d in deltas:
                calls.setdefault(d["index"], ["", ""])
                calls[d["index"]][0] += d["function"].get("name", "")
                calls[d["index"]][1] += d["function"]["arguments"]
        got = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls", [])]
        assert got == [calls[i] for i in sorted(calls)], text
        assert (message["content"] or "").strip() == content.strip(), text
        assert (message.get("reasoning_content") or "") == thought.strip(), text
        assert called == stream.called == bool(got), text
    whole, _ = OpenAIServer._chat_message(SimpleNamespace(reasoning_parser="none"), '[{"name": "add", "argu',
                                          ChatPlan([], TOOLS, "required", None, None, None))
    assert whole["content"] == '[{"name": "add", "argu' and "tool_calls" not in whole
    # cut after a whole call: that call comes back as a call, not the grammar's JSON as text
    cut = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "argu'
    message, called = OpenAIServer._chat_message(SimpleNamespace(reasoning_parser="none"), cut,
                                                 ChatPlan([], TOOLS, "required", None, None, None))
    assert called and message["content"] is None, message
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("add", {"a": 1, "b": 2})]


def test_messages_reach_the_template_with_the_roles_and_reasoning_it_knows():
    """A developer message is a system message to a template that does not test for the role, and
    stays a developer one where it does (a quoted 'developer', not the word in any text); an
    assistant's reasoning_content goes to the template as it came."""
    from phalanx.serve.protocol import ChatMessage
    from phalanx.serve.tools import template_messages
    msgs = [ChatMessage.model_validate(m) for m in (
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet back", "annotations": []})]
    knows = "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}"
    mentions = "{{ 'You are a helpful developer assistant.' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    for template, role in ((knows, "developer"), (mentions, "system"), (None, "system")):
        out = template_messages(msgs, None, template)
        assert [m["role"] for m in out] == [role, "user", "assistant"]
        assert out[2]["reasoning_content"] == "greet back" and "reasoning_content" not in out[1]


def test_an_assistants_tool_calls_reach_the_template_once():
    """A template that prints ``message.tool_calls`` itself (Qwen2.5/3's, Hermes') gets the calls
    there only; one that prints only content gets them written in it. Rendered through
    transformers' chat-template renderer, the call appears once either way."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from phalanx.serve.protocol import ChatMessage
    from phalanx.serve.tools import template_messages
    msgs = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22C"})]
    qwen_like = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
                 "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}"
                 "<|im_end|>\n{% endfor %}")
    content_only = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    for template in (qwen_like, content_only):
        out = template_messages(msgs, None, template)
        text = render_jinja_template(conversations=[out], chat_template=template)[0][0]
        assert text.count("<tool_call>") == 1 and text.count('"Paris"') == 1, text
    assert not template_messages(msgs, None, qwen_like)[1]["content"]
    # DeepSeek's templates join the arguments to text with "+": they get the JSON text (an object
    # there fails the render), and the rendered call is the one the deepseek_v3 parser reads
    deepseek_like = ("{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}{% for tool in "
                     "m.tool_calls %}{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
                     "tool['function']['name'] + '\\n```json\\n' + tool['function']['arguments'] + '\\n```"
                     "<｜tool▁call▁end｜>'}}{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    out = template_messages(msgs, None, deepseek_like)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    filtered = "{% for m in messages %}{% for t in m.tool_calls or [] %}{{ 'x' + t.function.arguments | tojson }}" \
               "{% endfor %}{% endfor %}"      # filtered before the join: an object, as other templates take
    assert template_messages(msgs, None, filtered)[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = render_jinja_template(conversations=[out], chat_template=deepseek_like)[0][0]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    calls = parse_tool_calls(text, "deepseek_v3", tools)[1]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    import pytest
    with pytest.raises(TypeError):     # what the objects the other templates take would do here
        render_jinja_template(conversations=[template_messages(msgs, None, qwen_like)], chat_template=deepseek_like)


def test_a_tokenizer_with_named_chat_templates_renders_with_its_default_one():
    """transformers holds a dict where a tokenizer ships several named templates ("default",
    "tool_use"): the engine takes the default one as its template (its checks and renders need
    one string), and renders a chat with it."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from phalanx.llmapi.tokenizer import Tokenizer
    from phalanx.serve.tools import template_names_developer, template_renders_tool_calls
    rust = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "</s>", "hi", "user"])},
                                          unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>", eos_token="</s>")
    default = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
    hf.chat_template = {"tool_use": "{{ tools }}", "default": default}
    tok = Tokenizer(hf)
    assert tok.chat_template == default
    assert not template_names_developer(tok.chat_template) and not template_renders_tool_calls(tok.chat_template)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "user hi "


def test_a_think_tag_after_blanks_is_reasoning_however_the_blanks_arrive():
    for pieces in (["  <think>hm</think>Hi"], ["  ", "<think>hm</think>Hi"], [" ", " <th", "ink>hm</think>Hi"]):
        stream = ReasoningStream()
        parts = [stream.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert ("".join(r for r, _ in parts), "".join(a for _, a in parts)) == ("hm", "Hi"), pieces


B, E_, CB, CE, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", \
    "<｜tool▁sep｜>"


def v3_call(name: str, args: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


def v31_call(name: str, args: str) -> str:
    return f"{CB}{name}{SEP}{args}{CE}"


def test_deepseek_v3_and_v31_calls():
    """DeepSeek's marked calls: V3 / R1 (a json fence after the name) and V3.1 (the arguments right
    after the separator); the wrapper goes with the calls, the text before them is content; a call
    of another tool, or arguments that are not a JSON object, stay content; a cut inside the last
    call keeps the whole ones."""
    text = "Checking. " + B + v3_call("get_weather", '{"city": "Paris"}') + "\n" + v3_call("add", '{"a": 1}') + E_
    content, calls = parse_tool_calls(text, "deepseek_v3", TOOLS)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    text = B + v31_call("add", '{"a": 1, "b": "x```y"}') + v31_call("get_weather", '{"city": "Oslo"}') + E_
    content, calls = parse_tool_calls(text, "deepseek_v31", TOOLS)
    assert content is None and [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": "x```y"}
    for parser, call in (("deepseek_v3", v3_call), ("deepseek_v31", v31_call)):
        other = B + call("unknown", "{}") + E_
        assert parse_tool_calls(other, parser, TOOLS) == (other, [])
        assert parse_tool_calls(B + call("add", "[1, 2]") + E_, parser, TOOLS)[1] == []
        assert parse_tool_calls("No call here.", parser, TOOLS) == ("No call here.", [])
        cut = B + call("add", '{"a": 1}') + call("add", '{"a": 2}')[:-12]
        assert [json.loads(c.arguments) for c in parse_tool_calls(cut, parser, TOOLS)[1]] == [{"a": 1}]
    # a malformed call costs only itself: the calls after it stand
    broken_v3 = f"{CB}function{SEP}add\n```json\n{{\"a\": 0}}{CE}"           # no closing fence
    broken_v31 = f"{CB}add{{\"a\": 0}}{CE}"                                    # no separator
    for parser, call, broken in (("deepseek_v3", v3_call, broken_v3), ("deepseek_v31", v31_call, broken_v31)):
        calls = parse_tool_calls(B + broken + call("add", '{"a": 1}') + E_, parser, TOOLS)[1]
        assert [json.loads(c.arguments) for c in calls] == [{"a": 1}], parser
        # a call whose own end marker is missing ends at the wrapper's
        calls = parse_tool_calls(B + call("add", '{"a": 2}')[:-len(CE)] + E_, parser, TOOLS)[1]
        assert [json.loads(c.arguments) for c in calls] == [{"a": 2}], parser
    # the V3 format read as V3.1 finds no call (its fence is not JSON), and the other way round
    assert parse_tool_calls(B + v3_call("add", '{"a": 1}') + E_, "deepseek_v31", TOOLS)[1] == []
    assert parse_tool_calls(B + v31_call("add", '{"a": 1}') + E_, "deepseek_v3", TOOLS)[1] == []


def test_deepseek_parser_by_chat_template_and_stream():
    """``auto`` picks DeepSeek's parser from a template that writes its call markers (V3's json
    fence or V3.1's bare arguments); a stream holds back from the first marker (or a tail that may
    begin one) and reads the calls at the end."""
    from phalanx.serve.tools import choose_parser
    v3_template = "{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json\\n' + args}}"
    v31_template = "{{'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args + '<｜tool▁call▁end｜>'}}"
    assert choose_parser("auto", v3_template, "deepseek_v3") == "deepseek_v3"
    assert choose_parser("auto", v31_template, "deepseek_v3") == "deepseek_v31"
    assert choose_parser("auto", "{{ messages }}", "deepseek_v3") == "hermes"
    text = "Let me see." + B + v3_call("add", '{"a": 1, "b": 2}') + E_
    stream = ToolCallStream("deepseek_v3", TOOLS)
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    out = "".join(stream.feed(p) for p in pieces)
    assert out == "Let me see."
    rest, calls = stream.finish()
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    plain = ToolCallStream("deepseek_v31", TOOLS)
    assert "".join(plain.feed(p) for p in ["a <b>", " c <｜", "end"]) + plain.finish()[0] == "a <b> c <｜end"


def test_strict_deepseek_tools_are_held_by_a_structural_tag():
    """Strict tools under tool_choice "auto" with DeepSeek's parsers: each call begins at its call
    marker and is written as the parser reads it."""
    from phalanx.serve.tools import strict_tools_tag
    strict = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object"}}}]
    fmt = strict_tools_tag(strict, "deepseek_v3")["format"]
    assert fmt["triggers"] == [CB]
    tag = fmt["tags"][0]
    assert tag["begin"] + "{}" + tag["end"] == v3_call("f", "{}")
    tag = strict_tools_tag(strict, "deepseek_v31")["format"]["tags"][0]
    assert tag["begin"] + "{}" + tag["end"] == v31_call("f", "{}")
    for parser, call in (("deepseek_v3", v3_call), ("deepseek_v31", v31_call)):
        assert parse_tool_calls(B + call("f", "{}") + E_, parser, strict)[1][0].name == "f"


def test_kimi_k2_calls():
    """Kimi K2's calls: ``functions.NAME:INDEX`` then the arguments, inside its section markers; the
    call keeps the id the model wrote (its template writes it back next turn); auto picks the
    parser from a template that writes the call marker; a stream holds back from the section."""
    from phalanx.serve.tools import choose_parser, strict_tools_tag
    sec, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"

    def call(name: str, i: int, args: str) -> str:
        return f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
    text = "I'll check." + sec + call("get_weather", 0, '{"city": "Paris"}') + call("add", 1, '{"a": 1}') + end
    content, calls = parse_tool_calls(text, "kimi_k2", TOOLS)
    assert content == "I'll check."
    assert [(c.name, c.id, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", "functions.get_weather:0", {"city": "Paris"}), ("add", "functions.add:1", {"a": 1})]
    broken = "<|tool_call_begin|>functions.add:0{\"a\": 0}<|tool_call_end|>"      # no argument marker
    assert [c.id for c in parse_tool_calls(sec + broken + call("add", 1, '{"a": 1}') + end, "kimi_k2",
                                           TOOLS)[1]] == ["functions.add:1"]
    other = sec + call("unknown", 0, "{}") + end
    assert parse_tool_calls(other, "kimi_k2", TOOLS) == (other, [])
    assert choose_parser("auto", "{{ '<|tool_call_begin|>' + tool_call['id'] }}", "deepseek_v3") == "kimi_k2"
    stream = ToolCallStream("kimi_k2", TOOLS)
    assert "".join(stream.feed(text[i:i + 5]) for i in range(0, len(text), 5)) == "I'll check."
    assert [c.name for c in stream.finish()[1]] == ["get_weather", "add"]
    # strict tools: a structural tag triggered by the call marker, the index then the argument marker
    tag = strict_tools_tag([{"type": "function", "function": {"name": "f", "strict": True}}], "kimi_k2")["format"]
    assert tag["triggers"] == ["<|tool_call_begin|>"]
    assert tag["tags"][0]["begin"] == "<|tool_call_begin|>functions.f:"
    assert [e["type"] for e in tag["tags"][0]["content"]["elements"]] == ["regex", "const_string", "json_schema"]


def test_long_blank_runs_inside_a_call_parse_in_linear_time():
    """A degenerate output (a call's arguments, then 200k blanks) is parsed in well under a second by
    every parser: no group before an end marker may take blanks that a following "\\s*" could too."""
    import time
    blanks = " " * 200_000
    outputs = {"hermes": '<tool_call>{"name": "add", "arguments": {"a": 1}}' + blanks,
               "deepseek_v3": f"{B}{CB}function{SEP}add\n```json\n{{\"a\": 1}}{blanks}",
               "deepseek_v31": f"{B}{CB}add{SEP}{{\"a\": 1}}{blanks}",
               "kimi_k2": '<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{"a": 1}' + blanks}
    for parser, text in outputs.items():
        t0 = time.perf_counter()
        parse_tool_calls(text, parser, TOOLS)
        assert time.perf_counter() - t0 < 1.0, parser


def test_deepseek_templates_get_the_tools_and_calls_as_they_read_them():
    """DeepSeek's templates render no tools: they are described with DeepSeek's own call format (the
    one its parser reads), not Hermes'; V3's and R1's print an assistant's calls only when its
    content is none, so a message of calls alone reaches them so."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from phalanx.serve.protocol import ChatMessage
    from phalanx.serve.tools import template_messages
    msgs = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "Add 1 and 2"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"})]
    v3_like = ("{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}{% elif m.role == 'assistant' and "
               "m['content'] is none %}{% for tool in m.tool_calls %}{{'<｜tool▁call▁begin｜>' + tool['type'] + "
               "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n```json\\n' + tool['function']['arguments'] + "
               "'\\n```<｜tool▁call▁end｜>'}}{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    out = template_messages(msgs, TOOLS, v3_like, "deepseek_v3")
    assert out[0]["role"] == "system" and "<tool_call>" not in out[0]["content"]
    assert f"{B}{CB}function{SEP}<function-name>" in out[0]["content"]
    assert out[2]["content"] is None
    text = render_jinja_template(conversations=[out], chat_template=v3_like)[0][0]
    assert [c.name for c in parse_tool_calls(text, "deepseek_v3", TOOLS)[1]] == ["add"]
    v31 = template_messages(msgs, TOOLS, v3_like, "deepseek_v31")[0]["content"]
    assert f"{B}{CB}<function-name>{SEP}<args-json-object>{CE}" in v31
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"     # no "is none": content stays text
    assert template_messages(msgs, TOOLS, plain, "hermes")[2]["content"] != None  # noqa: E711
    assert "<tool_call>" in template_messages(msgs, TOOLS, plain, "hermes")[0]["content"]


def test_kimi_forced_calls_take_its_ids_and_its_other_section_marker():
    """Under tool_choice "required" or a named function, Kimi K2's calls get ids of its own form
    (its template writes them back); its section markers' other spelling goes with the calls."""
    from phalanx.serve.openai_server import ChatPlan, decodes_call_markers
    calls = forced_tool_calls('[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {}}]',
                              "required", "kimi_k2")
    assert [c.id for c in calls] == ["functions.add:0", "functions.add:1"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_tool_calls('{"city": "Rome"}', named, "kimi_k2")[0].id == "functions.get_weather:0"
    assert forced_tool_calls('{"city": "Rome"}', named, "hermes")[0].id.startswith("call_")
    text = ("Sure.<|tool_call_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
            '{"a": 1}<|tool_call_end|><|tool_call_section_end|>')
    content, found = parse_tool_calls(text, "kimi_k2", TOOLS)
    assert content == "Sure." and [c.id for c in found] == ["functions.add:0"]
    stream = ToolCallStream("kimi_k2", TOOLS)
    assert "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3)) == "Sure."
    # markers a tokenizer marks special are decoded for every marked format's parser
    for parser, marker in (("deepseek_v3", B), ("deepseek_v31", CB), ("kimi_k2", "<|tool_call_begin|>")):
        plan = ChatPlan([], TOOLS, None, parser, None, None)
        assert decodes_call_markers(plan, [marker], set()) and not decodes_call_markers(plan, ["<x>"], set())


def test_a_markers_text_inside_an_argument_string_keeps_the_call():
    """An argument string holding an end marker's text (which a tools grammar admits, and a model
    may write): the call is read with its JSON whole, in every marked format, the calls after it
    too, and none of its text is left in the content; a call whose JSON is broken still costs only
    itself."""
    from phalanx.serve.tools import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP
    tricky = {"city": "a</tool_call>b<｜tool▁call▁end｜>c<|tool_call_end|>d<|tool_calls_section_end|>e```f"}
    forms = {
        "hermes": lambda a: f'<tool_call>\n{{"name": "get_weather", "arguments": {a}}}\n</tool_call>',
        "deepseek_v3": lambda a: f"{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n{a}\n```{DS_CALL_END}",
        "deepseek_v31": lambda a: f"{DS_CALL_BEGIN}get_weather{DS_SEP}{a}{DS_CALL_END}",
        "kimi_k2": lambda a: f"<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{a}"
                             "<|tool_call_end|>",
    }
    wrap = {"deepseek_v3": (DS_CALLS_BEGIN, DS_CALLS_END), "deepseek_v31": (DS_CALLS_BEGIN, DS_CALLS_END),
            "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")}
    for parser, form in forms.items():
        begin, end = wrap.get(parser, ("", ""))
        calls = form(json.dumps(tricky, ensure_ascii=False)) + form('{"city": "Rome"}')
        content, got = parse_tool_calls("Looking." + begin + calls + end, parser, TOOLS)
        assert content == "Looking.", (parser, content)
        assert [json.loads(c.arguments) for c in got] == [tricky, {"city": "Rome"}], parser
        broken = form('{"city": "x</tool_call><|tool_call_end|><｜tool▁call▁end｜>')   # a string never closed
        _, got = parse_tool_calls(begin + broken + form('{"city": "Oslo"}') + end, parser, TOOLS)
        assert [json.loads(c.arguments) for c in got][-1:] == [{"city": "Oslo"}], parser
    # a whole call of no tool stays content, and so does a call its argument string holds
    for parser, form in forms.items():
        begin, end = wrap.get(parser, ("", ""))
        text = begin + form(json.dumps({"x": form("{}")}, ensure_ascii=False)).replace("get_weather", "nope", 1) + end
        assert parse_tool_calls(text, parser, TOOLS) == (text, []), parser
    # brackets nested past the JSON decoder's depth (a degenerate output, or a client's arguments): no
    # error, and the call after them still reads
    deep = "[" * 5000
    for parser, form in forms.items():
        begin, end = wrap.get(parser, ("", ""))
        _, got = parse_tool_calls(begin + form(deep) + form('{"city": "Oslo"}') + end, parser, TOOLS)
        assert [json.loads(c.arguments) for c in got] == [{"city": "Oslo"}], parser
    assert parse_tool_calls(deep, "llama3_json", TOOLS) == (deep, [])
    from phalanx.serve.tools import _as_object, complete_forced_calls
    assert complete_forced_calls("[" + deep) == [] and _as_object(deep) == deep
    # a degenerate output of heads whose JSON never closes: each is decoded once, briefly
    import time
    for parser, unit in (("hermes", '<tool_call>{"name": "get_weather", "arguments": [[1, '),
                         ("kimi_k2", '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"a": "'),
                         ("deepseek_v31", f'{DS_CALL_BEGIN}get_weather{DS_SEP}{{"a": [1, ')):
        t0 = time.perf_counter()
        assert parse_tool_calls(unit * (200_000 // len(unit)), parser, TOOLS)[1] == []
        assert time.perf_counter() - t0 < 1.0, parser
