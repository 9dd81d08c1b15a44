"""Tool calling and structured output for the chat and completion routes.

What a request asks for becomes at most one ``GuidedDecodingParams``:

    response_format json_object / json_schema      -> json_object / json (the schema)
    guided_json, guided_regex, guided_choice,        (vLLM's extension fields)
    guided_grammar, regex, ebnf                      (and SGLang's)
    tool_choice "required"                         -> json: an array of one call (or more, with
                                                      parallel_tool_calls) of the listed tools
    tool_choice {"function": {"name": f}}          -> json: f's parameters

A forced choice is turned back into ``tool_calls`` from the JSON the grammar produced. With
``tool_choice="auto"`` the model writes freely and its own format is parsed: Hermes / Qwen2.5 /
Qwen3 ``<tool_call>{...}</tool_call>`` blocks, Llama 3.x JSON (``{"name": ..., "parameters":
...}``, optionally after ``<|python_tag|>``), or DeepSeek's marked calls — V3 / R1
(``deepseek_v3``)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {ARGUMENTS}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and V3.1 (``deepseek_v31``): ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGUMENTS}<｜tool▁call▁end｜>``
inside the same pair; or Kimi K2's (``kimi_k2``): ``<|tool_call_begin|>functions.NAME:INDEX
<|tool_call_argument_begin|>{ARGUMENTS}<|tool_call_end|>`` inside ``<|tool_calls_section_begin|>``
… ``<|tool_calls_section_end|>``, the call's id as the model wrote it. A chat template that does
not render ``tools`` gets them described in a system message, with how to call them in the
parser's format (Hermes', or DeepSeek's for DeepSeek's templates), which the parser then reads.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from phalanx.llmapi.sampling_params import GuidedDecodingParams

PARSERS = ("hermes", "llama3_json", "deepseek_v3", "deepseek_v31", "kimi_k2")
# DeepSeek's markers, as its tokenizer spells them (full-width bars, U+2581 for blanks)
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# Kimi K2's: <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{ARGUMENTS}<|tool_call_end|>
KIMI_CALLS_BEGIN, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_SECTION = ("<|tool_call_section_begin|>", "<|tool_call_section_end|>")   # (a variant it writes too)
KIMI_CALL_BEGIN, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
# what opens a call in each free-running format (the stream holds text back from there; an output
# decoded for parsing keeps these where its tokenizer marks them special)
CALL_MARKERS = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>",),
                "deepseek_v3": (DS_CALLS_BEGIN, DS_CALL_BEGIN), "deepseek_v31": (DS_CALLS_BEGIN, DS_CALL_BEGIN),
                "kimi_k2": (KIMI_CALLS_BEGIN, KIMI_CALL_SECTION[0], KIMI_CALL_BEGIN)}


@dataclass
class ToolCall:
    name: str
    arguments: str              # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


# -- requests -> one grammar -------------------------------------------------------------------------
def guided_params(body: Any, tools_forced: GuidedDecodingParams | None,
                  tools_field: str = "tool_choice") -> GuidedDecodingParams | None:
    """The request's one constraint (ValueError naming the fields if it asks for more than one);
    ``tools_forced``: the tools' grammar, from the field ``tools_field``."""
    asked: dict[str, GuidedDecodingParams] = {}
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object":
        asked["response_format"] = GuidedDecodingParams(json_object=True)
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None
        schema = rf.json_schema.schema_ or {"type": "object"}
        asked["response_format"] = GuidedDecodingParams(json=schema)
    elif rf is not None and rf.type == "structural_tag":
        try:
            asked["response_format"] = GuidedDecodingParams(structural_tag=rf.structural_tag())
        except ValueError as e:
            raise ValueError(f"response_format: {e}") from None
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar"), ("ebnf", "grammar")):
        value = getattr(body, field, None)
        if value is not None:
            try:
                asked[field] = GuidedDecodingParams(**{kind: value})
            except ValueError as e:
                raise ValueError(f"{field}: {e}") from None
    if tools_forced is not None:
        asked[tools_field] = tools_forced
    if len(asked) > 1:
        raise ValueError(f"{sorted(asked)[0]}: only one output constraint per request, got {sorted(asked)}")
    return next(iter(asked.values()), None)


def forced_tool_grammar(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool = True,
                        parser: str | None = None) -> GuidedDecodingParams | None:
    """The grammar of a forced tool choice; under "auto" (``tool_choice`` None or "auto"), the
    grammar of ``strict`` tools (``strict_tools_tag``) or None where no tool is strict; None for
    "none". Under "auto" the output runs free, so ``parallel_tool_calls: false``, which only a
    grammar ending the output could hold, is refused rather than ignored."""
    if tool_choice in (None, "auto", "none"):
        if tool_choice == "none":
            return None
        if not parallel:
            raise ValueError("parallel_tool_calls: false is enforced only with tool_choice 'required' or a "
                             "named function (under 'auto' the output runs free: nothing ends it after a call)")
        if not any(t["function"].get("strict") for t in tools):
            return None
        return GuidedDecodingParams(structural_tag=strict_tools_tag(tools, parser or "hermes"))
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _parameters(f)},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, f in by_name.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return GuidedDecodingParams(json=schema)
    name = tool_choice["function"]["name"]
    if name not in by_name:
        raise ValueError(f"tool_choice: the function {name!r} is not among the tools ({sorted(by_name)})")
    return GuidedDecodingParams(json=_parameters(by_name[name]))


# free text that the Llama 3 parser cannot read as calls: empty, or not beginning with "{", with a
# character str.strip() removes (xgrammar's \s has fewer), or with "<|" (<|python_tag|>, as its
# token or spelled out, which the parser strips from the front)
@functools.cache
def _text_not_a_call() -> dict[str, str]:
    blanks = "".join(f"\\u{ord(c):04x}" for c in map(chr, range(0x110000)) if c.isspace())
    return {"type": "regex", "pattern": f"(([^{{<{blanks}]|<[^|])[\\s\\S]*|<)?"}


# how each parser's calls begin and end: (the trigger that marks a call off from free text, or
# None where nothing does; begin before the name; between name and arguments; end)
_CALL_FORMS: dict[str, tuple[str | None, str, str, str]] = {
    "hermes": ("<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"),
    "llama3_json": (None, '{"name": "', '", "parameters": ', "}"),
    "deepseek_v3": (DS_CALL_BEGIN, DS_CALL_BEGIN + "function" + DS_SEP, "\n```json\n", "\n```" + DS_CALL_END),
    "deepseek_v31": (DS_CALL_BEGIN, DS_CALL_BEGIN, DS_SEP, DS_CALL_END),
    # Kimi K2: the call's index between its name and the arguments (``_numbered``)
    "kimi_k2": (KIMI_CALL_BEGIN, KIMI_CALL_BEGIN + "functions.", ":", KIMI_CALL_END),
}
# formats whose calls number themselves after the name: the index, then this marker before the arguments
_NUMBERED_CALLS = {"kimi_k2": KIMI_ARGS}


def _call_content(parser: str, schema: dict[str, Any]) -> dict[str, Any]:
    """What follows a call's name in a strict-tools tag: the arguments (whitespace inside the JSON
    one blank at a time: no wandering into runs), after the call's index and its marker where the
    format numbers its calls (Kimi K2's ``functions.NAME:INDEX``)."""
    args = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    if parser not in _NUMBERED_CALLS:
        return args
    return {"type": "sequence", "elements": [{"type": "regex", "pattern": "(0|[1-9][0-9]{0,5})"},
                                             {"type": "const_string", "value": _NUMBERED_CALLS[parser]}, args]}


def strict_tools_tag(tools: list[dict[str, Any]], parser: str) -> dict[str, Any]:
    """Under tool_choice "auto" with ``strict`` tools: xgrammar's structural tag that holds each
    call to one of the tools, written as the parser reads it: a strict tool's arguments follow its
    ``parameters`` (checked for keywords the grammar does not enforce, naming the tool), another
    tool's are any JSON object (as OpenAI leaves them); whitespace inside the JSON one blank at a
    time. Hermes-style calls are marked off from text: the output runs free until ``<tool_call>``
    begins one. Llama 3's JSON calls are not (an answer's JSON starts the same way), and its
    parser reads an output as calls only when it begins with whole calls, ``;``-separated, once it
    has stripped blanks and ``<|python_tag|>`` from its ends: so the output either is such calls
    from its first character (or right after ``<|python_tag|>``), or is text that begins with
    none of ``{``, a blank (any character ``str.strip`` takes) or a special token's ``<|``."""
    from phalanx.llmapi.grammar import check_enforced
    if parser not in _CALL_FORMS:
        raise ValueError(f"tools: strict function arguments under tool_choice 'auto' need a tool-call parser "
                         f"({', '.join(sorted(_CALL_FORMS))}), not {parser!r}; force the call with tool_choice "
                         "'required' or a named function")
    trigger, begin, middle, end = _CALL_FORMS[parser]
    tags = []
    for i, t in enumerate(tools):
        f = t["function"]
        schema = _parameters(f) if f.get("strict") else {"type": "object"}
        try:
            check_enforced(schema, "")
        except ValueError as e:
            raise ValueError(f"tools: tools[{i}] ({f['name']!r}) parameters: {str(e).split(': ', 1)[-1]}") from None
        tags.append({"type": "tag", "begin": begin + f["name"] + middle, "end": end,
                     "content": _call_content(parser, schema)})
    if trigger is None:   # calls from the first character (or after the python tag), or text
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "; ", "at_least_one": True}
        tagged = {"type": "sequence", "elements": [{"type": "const_string", "value": "<|python_tag|>"}, calls]}
        return {"type": "structural_tag", "format": {"type": "or", "elements": [calls, tagged, _text_not_a_call()]}}
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [trigger], "tags": tags}}


def call_id(parser: str | None, name: str, index: int) -> str:
    """A forced call's id: Kimi K2's form (``functions.NAME:INDEX``, which its template writes back
    and its model reads) under its parser, else a fresh ``call_...``."""
    return f"functions.{name}:{index}" if parser == "kimi_k2" else ""


def forced_tool_calls(text: str, tool_choice: Any, parser: str | None = None) -> list[ToolCall]:
    """The calls in the output of a forced tool choice (the JSON its grammar produced)."""
    if tool_choice == "required":
        return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False), call_id(parser, c["name"], i))
                for i, c in enumerate(json.loads(text))]
    name = tool_choice["function"]["name"]
    return [ToolCall(name, text, call_id(parser, name, 0))]


def complete_forced_calls(text: str, parser: str | None = None) -> list[ToolCall]:
    """The whole calls at the start of a "required" output that was cut short (max_tokens, a stop
    string): of '[{"name": ..., "arguments": {...}}, {"na' the first call."""
    decoder, calls = json.JSONDecoder(), list[ToolCall]()
    at = text.find("[") + 1
    while at > 0:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            obj, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            break
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj):
            break
        calls.append(ToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False),
                              call_id(parser, obj["name"], len(calls))))
    return calls


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


# -- the prompt ------------------------------------------------------------------------------------------
def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template   # type: ignore[operator]


# how the tools' description tells a model to call, in the format its parser reads (DeepSeek's templates
# render no tools: they are described in DeepSeek's own call format, not in Hermes')
_CALL_INSTRUCTIONS = {
    "deepseek_v3": (f"For each call, write:\n{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}<function-name>\n"
                    f"```json\n<args-json-object>\n```{DS_CALL_END}{DS_CALLS_END}\n(several calls: one "
                    f"{DS_CALL_BEGIN}...{DS_CALL_END} after another inside the one pair)"),
    "deepseek_v31": (f"For each call, write:\n{DS_CALLS_BEGIN}{DS_CALL_BEGIN}<function-name>{DS_SEP}"
                     f"<args-json-object>{DS_CALL_END}{DS_CALLS_END}\n(several calls: one "
                     f"{DS_CALL_BEGIN}...{DS_CALL_END} after another inside the one pair)"),
}


def tools_system_prompt(tools: list[dict[str, Any]], parser: str | None = None) -> str:
    """The tools described for templates that do not render them, with how to call them in the
    format the parser reads (Hermes' ``<tool_call>`` blocks, or DeepSeek's markers)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    head = ("You may call one or more functions to help with the user's request. The functions are listed "
            f"within <tools></tools> tags:\n<tools>\n{listed}\n</tools>\n\n")
    if parser in _CALL_INSTRUCTIONS:
        return head + _CALL_INSTRUCTIONS[parser]
    return head + ("For each call, return a JSON object with the function name and its arguments within "
                   '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                   "<args-json-object>}\n</tool_call>")


def template_renders_tool_calls(template: str | None) -> bool:
    """Whether a chat template prints an assistant message's ``tool_calls`` itself (Qwen2.5/3's,
    Hermes', Llama 3's do); one that does not sees the calls in the message's content."""
    return bool(template) and "tool_calls" in template   # type: ignore[operator]


@functools.lru_cache(maxsize=16)
def template_names_developer(template: str | None) -> bool:
    """Whether a chat template tests for the role "developer" (a quoted 'developer'); OpenAI's
    developer messages are its newer models' system messages, and reach a template that does not
    know the role as "system" (decided once a template)."""
    return template is not None and re.search(r"""(['"])developer\1""", template) is not None


# a template that joins a call's arguments to text with "+" (DeepSeek's: ... + tool['function']['arguments'] + ...)
# (not one that filters them first: "+ tool.function.arguments | tojson")
_ARGUMENTS_JOINED = re.compile(r"""\+\s*\w+(?:\.function|\[(['"])function\1\])(?:\.arguments|\[(['"])arguments\2\])"""
                               r"""(?!\s*\|)|(?:\.arguments|\[(['"])arguments\3\])\s*\+""")


@functools.lru_cache(maxsize=16)
def template_joins_arguments(template: str | None) -> bool:
    """Whether a chat template adds a call's ``arguments`` to strings (DeepSeek's), so takes them as
    the JSON text they came as; others (Qwen's, Llama's: ``| tojson``) take objects. Decided once a
    template."""
    return template is not None and _ARGUMENTS_JOINED.search(template) is not None


_CONTENT_IS_NONE = re.compile(r"""content(?:'\]|"\])?\s+is\s+none""")


@functools.lru_cache(maxsize=16)
def template_tests_content_none(template: str | None) -> bool:
    """Whether a chat template prints an assistant's calls only when its content ``is none``
    (DeepSeek-V3's and R1's): such a message with no text reaches it as None, not "". Decided
    once a template."""
    return template is not None and _CONTENT_IS_NONE.search(template) is not None


def template_messages(messages: list[Any], tools: list[dict[str, Any]] | None,
                      template: str | None, parser: str | None = None) -> list[dict[str, Any]]:
    """Chat messages as templates expect them: assistant tool calls with their arguments as
    objects (as text where the template joins them to text: ``template_joins_arguments``), tool
    results with their call id, developer messages as system ones where the template does not know
    the role; the tools described in a system message where the template would not render them,
    with how to call them in ``parser``'s format."""
    out = []
    developer = "developer" if template_names_developer(template) else "system"
    calls_in_content = not template_renders_tool_calls(template)
    arguments = (lambda a: a) if template_joins_arguments(template) else _as_object
    none_content = template_tests_content_none(template)
    for m in messages:
        msg: dict[str, Any] = {"role": developer if m.role == "developer" else m.role, "content": m.text()}
        if none_content and m.tool_calls and not msg["content"]:
            msg["content"] = None
        if m.name:
            msg["name"] = m.name
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
            if not msg["content"] and calls_in_content:    # show the calls to templates that print only content
                msg["content"] = "\n".join(
                    "<tool_call>\n" + json.dumps({"name": c.function.name,
                                                  "arguments": _as_object(c.function.arguments)},
                                                 ensure_ascii=False) + "\n</tool_call>" for c in m.tool_calls)
        out.append(msg)
    if tools and not template_renders_tools(template):
        prompt = tools_system_prompt(tools, parser)
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + prompt)
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):   # (a client's arguments nested past the decoder's depth: as text)
        return arguments


# -- parsing the model's own format ----------------------------------------------------------------------
# a DeepSeek call: its name and its arguments' JSON, to the call's end marker (or the wrapper's end, or the
# output's); no part runs across another call's marker, so a malformed call costs only itself
_NOT_A_MARKER = "(?:(?!" + "|".join(map(re.escape, (DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_END))) + ").)"
_DS_END = "(?:" + re.escape(DS_CALL_END) + "|" + re.escape(DS_CALLS_END) + "|$)"
# a Kimi K2 call: its id (functions.NAME:INDEX, which its template writes back) and its arguments
_KIMI_ENDS = (KIMI_CALL_END, KIMI_CALLS_END, KIMI_CALL_SECTION[1])
_NOT_A_KIMI_MARKER = "(?:(?!" + "|".join(map(re.escape, (KIMI_CALL_BEGIN, *_KIMI_ENDS))) + ").)"
# each marked format's call as (its head: the markers and the name or id in front of the JSON; the rest:
# the JSON to the call's end). (The arguments' group is followed by a marker, not by blanks: a long run of
# blanks inside a call would make a lazy group then "\s*" try every split, quadratic in the run; the
# arguments are stripped after.)
_CALL_PARTS = {
    "hermes": (r"<tool_call>\s*+", r"(.*?)(?:</tool_call>|$)"),
    "deepseek_v3": (re.escape(DS_CALL_BEGIN) + _NOT_A_MARKER + "*?" + re.escape(DS_SEP)
                    + r"\s*+(?P<name>[^\s`]*)\s*+```(?:json)?", "(?P<args>" + _NOT_A_MARKER + r"*?)```\s*+" + _DS_END),
    "deepseek_v31": (re.escape(DS_CALL_BEGIN) + "(?P<name>" + _NOT_A_MARKER + "*?)" + re.escape(DS_SEP),
                     "(?P<args>" + _NOT_A_MARKER + "*?)" + _DS_END),
    "kimi_k2": (re.escape(KIMI_CALL_BEGIN) + r"\s*+(?P<id>[^\s<]*)\s*+" + re.escape(KIMI_ARGS),
                "(?P<args>" + _NOT_A_KIMI_MARKER + "*?)(?:" + "|".join(map(re.escape, _KIMI_ENDS)) + "|$)"),
}
_KIMI_ID = re.compile(r"^(?:functions\.)?(?P<name>.+?)(?::\d+)?$")


def _hermes_call(m: re.Match[str], names: set[str], raw: str | None = None) -> ToolCall | None:
    return _call_from(m.group(1) if raw is None else raw, names, "arguments")


def _deepseek_call(m: re.Match[str], names: set[str], raw: str | None = None) -> ToolCall | None:
    return _named_call(m.group("name").strip(), m.group("args") if raw is None else raw, names)


def _kimi_call(m: re.Match[str], names: set[str], raw: str | None = None) -> ToolCall | None:
    named = _KIMI_ID.match(m.group("id"))
    return (_named_call(named.group("name"), m.group("args") if raw is None else raw, names, m.group("id"))
            if named else None)


class MarkedCalls(NamedTuple):
    """A format whose calls are marked off from text: a call's pattern; its head (the markers, name
    or id in front of the JSON, with the pattern's groups for them); how a match reads as a call
    (its JSON given apart where ``parse_tool_calls`` read it whole past a marker's text inside a
    string); what may follow that JSON to the call's end; the wrapper markers that go with the
    calls."""

    pattern: re.Pattern[str]
    head: re.Pattern[str]
    read: Callable[..., ToolCall | None]
    closer: re.Pattern[str]
    wrapper: tuple[str, ...]


def _closer(*ends: str, fence: bool = False) -> re.Pattern[str]:
    return re.compile(r"\s*+" + ("```" + r"\s*+" if fence else "") + "(?:" + "|".join(map(re.escape, ends)) + "|$)")


def _marked(parser: str, read: Callable[..., ToolCall | None], closer: re.Pattern[str],
            wrapper: tuple[str, ...] = ()) -> MarkedCalls:
    head, rest = _CALL_PARTS[parser]
    return MarkedCalls(re.compile(head + rest, re.S), re.compile(head, re.S), read, closer, wrapper)


MARKED_CALLS: dict[str, MarkedCalls] = {
    "hermes": _marked("hermes", _hermes_call, _closer("</tool_call>")),
    "deepseek_v3": _marked("deepseek_v3", _deepseek_call, _closer(DS_CALL_END, DS_CALLS_END, fence=True),
                           (DS_CALLS_BEGIN, DS_CALLS_END)),
    "deepseek_v31": _marked("deepseek_v31", _deepseek_call, _closer(DS_CALL_END, DS_CALLS_END),
                            (DS_CALLS_BEGIN, DS_CALLS_END)),
    "kimi_k2": _marked("kimi_k2", _kimi_call, _closer(*_KIMI_ENDS),
                       (KIMI_CALLS_BEGIN, KIMI_CALLS_END, *KIMI_CALL_SECTION)),
}


def _read_marked(form: MarkedCalls, head: re.Match[str], text: str,
                 names: set[str]) -> tuple[ToolCall | None, int]:
    """The call whose head is ``head``, and where it ends (None: no call; the end is where the
    search goes on). The pattern ends a call at the first end marker, so a JSON string holding a
    marker's text (which a tools grammar admits) cuts it short or stops it matching: such a call
    is read again with its JSON decoded whole, ending past the marker that follows the JSON."""
    m = form.pattern.match(text, head.start())
    call = form.read(m, names) if m is not None else None
    if call is not None:
        assert m is not None
        return call, m.end()
    fallback = m.end() if m is not None else head.end()
    start = head.end()
    while start < len(text) and text[start].isspace():
        start += 1
    try:
        obj, end = json.JSONDecoder().raw_decode(text, start)
    except (ValueError, RecursionError):   # (brackets nested past the decoder's depth)
        return None, fallback
    closed = form.closer.match(text, end)
    if closed is None:
        return None, fallback
    # a whole call that is none of the tools' stays content, with what its strings hold
    return form.read(head, names, json.dumps(obj, ensure_ascii=False)), closed.end()


def choose_parser(name: str, template: str | None, model_type: str) -> str:
    """The tool-call parser to use: as named, or by the chat template / model family."""
    if name != "auto":
        return name
    if template and "<|python_tag|>" in template or (model_type == "llama" and template and "ipython" in template):
        return "llama3_json"
    if template and DS_CALL_BEGIN in template:     # V3's template writes the arguments in a json fence
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if template and KIMI_CALL_BEGIN in template:
        return "kimi_k2"
    return "hermes"


def parse_tool_calls(text: str, parser: str, tools: list[dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    """(content without the calls, the calls) found in a free-running output; calls naming a
    function that is not among the tools are left in the content. Llama 3's output is calls when
    all of it is whole calls of the tools, ``;``-separated, or whole calls and then the start of
    another object (an output cut short inside a call keeps the calls before it; the cut one is
    content); else all of it is content (a JSON object followed by prose is an answer)."""
    names = {t["function"]["name"] for t in tools}
    if parser in MARKED_CALLS:
        form = MARKED_CALLS[parser]
        calls, spans = [], []
        at = 0
        while (head := form.head.search(text, at)) is not None:
            call, end = _read_marked(form, head, text, names)
            if call is not None:
                calls.append(call)
                spans.append((head.start(), end))
            at = end
        if not calls:
            return text, []
        content = text
        for a, b in reversed(spans):
            content = content[:a] + content[b:]
        for marker in form.wrapper:   # the calls' wrapper goes with them
            content = content.replace(marker, "")
        return (content.strip() or None), calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = []
    decoder, at = json.JSONDecoder(), 0
    while at < len(body):                 # Llama 3.x: one JSON object per call, ";"-separated (a ";"
        try:                              # inside an argument's string is the argument's)
            obj, end = decoder.raw_decode(body, at)
            call = _call_from(json.dumps(obj), names, "parameters")
        except (ValueError, RecursionError):
            call = None
        if call is None:
            break
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    rest = body[at:].strip()
    if not calls or (rest and not rest.startswith("{")):   # prose after a JSON object: an answer
        return text, []
    return (rest or None), calls   # a cut inside a later call keeps the whole ones, as Hermes blocks do


def _named_call(name: str, raw: str, names: set[str], call_id: str = "") -> ToolCall | None:
    """A call whose name and arguments the format writes apart: a tool's name, a JSON object
    (``call_id``: the id the model wrote, which its template writes back); no arguments at all
    are an empty object."""
    try:
        args = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError):
        return None
    if name not in names or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False), call_id)


def _call_from(raw: str, names: set[str], key: str) -> ToolCall | None:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


# -- streaming ---------------------------------------------------------------------------------------------
class ReasoningStream:
    """Splits a streamed output into reasoning and answer deltas. ``starts_in_reasoning``: the
    prompt opened the <think> block (DeepSeek-R1 style); else reasoning is what the output puts
    between <think> and </think> at its start (Qwen3). A tail that may begin a tag is held back."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.state = "reasoning" if starts_in_reasoning else "start"
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, answer delta) for new text."""
        self.buf += text
        reasoning = answer = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith("<think>"):
                self.state, self.buf = "reasoning", head[len("<think>"):].lstrip("\n")
            elif "<think>".startswith(head) and not final:
                return "", ""                         # maybe the tag is still coming (blanks first, too)
            else:
                self.state = "answer"
        if self.state == "reasoning":
            end = self.buf.find("</think>")
            if end >= 0:
                reasoning, self.buf = self.buf[:end], self.buf[end + len("</think>"):].lstrip("\n")
                self.state = "answer"
            else:
                keep = 0 if final else _partial_tag(self.buf, "</think>")
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        if self.state == "answer":
            answer, self.buf = self.buf, ""
        return reasoning, answer


class ToolCallStream:
    """Streams the content of a free-running output with tools, holding back what may be a tool
    call (from the parser's marker on); at the end the held text is parsed for calls."""

    def __init__(self, parser: str, tools: list[dict[str, Any]]) -> None:
        self.parser, self.tools = parser, tools
        self.sent = ""          # content already streamed
        self.held = ""          # text from a (possible) call marker on
        self.text = ""

    def feed(self, text: str) -> str:
        """The content delta that is safe to stream now. Text held from a Hermes or DeepSeek marker
        on stays held; text held as a possible start of a Llama 3 call (a "<" that could begin
        ``<|python_tag|>``) is released once it no longer can."""
        self.text += text
        pending = self.text[len(self.sent):]
        if self._starts_call(pending) or (self.held and self.parser != "llama3_json"):
            self.held = pending
            return ""
        self.held = ""
        markers = CALL_MARKERS[self.parser] if self.parser != "llama3_json" else CALL_MARKERS["hermes"]
        at = min((i for i in (pending.find(m) for m in markers) if i >= 0), default=-1)
        if at >= 0:
            out, self.held = pending[:at], pending[at:]
        else:
            keep = max(_partial_tag(pending, m) for m in markers)
            out = pending[:len(pending) - keep]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content still to stream, the calls) once the output is complete."""
        rest = self.text[len(self.sent):]
        if not rest:
            return "", []
        content, calls = parse_tool_calls(rest, self.parser, self.tools)
        return (content or "") if calls else rest, calls

    def _starts_call(self, pending: str) -> bool:
        head = pending.lstrip()   # (blanks alone are held too: a call may follow them)
        return self.parser == "llama3_json" and self.sent.strip() == "" and (
            head.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(head))


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
