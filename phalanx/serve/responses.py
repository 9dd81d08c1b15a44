"""OpenAI's Responses API (``/v1/responses``) as a chat request: the body, its input items read
as chat messages, the store behind ``previous_response_id``, and the output items.

A Responses request runs as the chat request it amounts to (``ResponsesRequest.chat_body``):
``instructions`` become a system message in front, the stored conversation of
``previous_response_id`` follows (its instructions are not carried over, as OpenAI's), then the
input's items; flat function tools become chat's nested ones, ``text.format`` becomes
``response_format``, ``max_output_tokens`` the output limit. The chat checks then apply whole,
and a 400 names the Responses field (``input``, ``max_output_tokens``, ``text.format``).

What phalanx does not do is refused by name, never ignored: tools other than functions (web
search, file search, MCP, ...), ``background``, ``conversation``, ``prompt``, encrypted
reasoning, image and file inputs, other ``include`` values, a reasoning summary.

Nothing here imports torch or the server: the conversions are plain data.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from phalanx.serve.item_stream import ANSWER, CALL, REASONING, ItemStream
from phalanx.serve.protocol import MAX_MESSAGES, MAX_TEXT_CHARS, BodyError, FunctionDef, NullIsDefault, Strict

_ENCODE = json.JSONEncoder(ensure_ascii=False).encode
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# chat fields a Responses body may carry as they are (vLLM's extensions); the chat checks bound them
PASSED_THROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "cache_salt", "priority",
                  "user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "parallel_tool_calls")
# a chat field an error names -> the Responses field the client sent
CHAT_TO_RESPONSES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
                     "truncate_prompt_tokens": "truncation", "logprobs": "include",
                     "reasoning_effort": "reasoning.effort"}


class FunctionTool(FunctionDef):
    """A Responses function tool: chat's function definition, flat, with its type."""

    type: Literal["function"]


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str = Field(..., max_length=64)


class TextFormat(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_fields(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type json_schema needs a name and a schema")
        if self.type != "json_schema" and (self.name, self.schema_, self.description, self.strict) != (None,) * 4:
            raise ValueError(f"type {self.type} takes no name, schema, description or strict")
        return self


class TextConfig(NullIsDefault):
    format: TextFormat | None = None
    verbosity: None = None

    @field_validator("verbosity", mode="before")
    @classmethod
    def _no_verbosity(cls, v: Any) -> None:
        if v is not None:
            raise ValueError("only null is supported (phalanx has no verbosity setting)")
        return None


class ReasoningConfig(NullIsDefault):
    effort: str | None = None         # the chat's reasoning_effort: to a template that reads it
    summary: None = None
    generate_summary: None = None

    @field_validator("summary", "generate_summary", mode="before")
    @classmethod
    def _none_only(cls, v: Any) -> None:
        if v is not None:
            raise ValueError("only null is supported (phalanx does not summarize reasoning; a reasoning model's "
                             "reasoning comes as a reasoning item)")
        return None


class ResponsesRequest(NullIsDefault):
    model: str | None = None
    input: str | list[Any]     # (the bounds: _input_present; a union's second error would be lost)
    instructions: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = Field(None, max_length=16)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: Literal["disabled", "auto"] = "disabled"
    store: bool = True
    stream: bool = False
    background: bool = False
    request_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]{1,200}$")   # the id is resp_<request_id>
    # passed to the chat request as they are (bounds checked there)
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    stop: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    cache_salt: Any = None
    priority: Any = None
    parallel_tool_calls: Any = None
    user: Any = None
    metadata: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v: Any) -> Any:
        for i, t in enumerate(v if isinstance(v, list) else []):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise ValueError(f"tool {i}: only function tools are supported by phalanx (it runs no built-in "
                                 f"tools), got type {kind!r}")
        return v

    @field_validator("include")
    @classmethod
    def _includable(cls, v: list[str] | None) -> list[str] | None:
        for item in v or []:
            if item != LOGPROBS_INCLUDE:
                raise ValueError(f"only {LOGPROBS_INCLUDE!r} is supported, got {item[:80]!r}")
        return v

    @field_validator("background")
    @classmethod
    def _foreground(cls, v: bool) -> bool:
        if v:
            raise ValueError("phalanx answers every response in the foreground (background: false)")
        return v

    @field_validator("input")
    @classmethod
    def _input_present(cls, v: str | list[Any]) -> str | list[Any]:
        if isinstance(v, str) and len(v) > MAX_TEXT_CHARS:
            raise ValueError(f"at most {MAX_TEXT_CHARS} characters")
        if isinstance(v, list) and len(v) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} items")
        if not v:
            raise ValueError("must be a non-empty string or a non-empty list of items")
        return v

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ResponsesRequest:
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError(f"tool_choice {self._choice_name()} needs tools")
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct names")
        if isinstance(self.tool_choice, FunctionChoice) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.name!r}, which is not among the "
                             f"tools ({sorted(names)})")
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs needs include to hold {LOGPROBS_INCLUDE!r}")
        return self

    def _choice_name(self) -> str:
        return repr(self.tool_choice if isinstance(self.tool_choice, str) else "function")

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request this response runs as (a dict for ``ChatCompletionRequest``):
        ``history`` (a stored conversation) between the instructions and the input's messages."""
        body: dict[str, Any] = {k: getattr(self, k) for k in PASSED_THROUGH if getattr(self, k) is not None}
        body["messages"] = ([{"role": "system", "content": self.instructions}] if self.instructions is not None
                            else []) + history + self.input_messages()
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                             for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str) else
                                   {"type": "function", "function": {"name": self.tool_choice.name}})
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = (
                {"type": "json_object"} if fmt.type == "json_object" else
                {"type": "json_schema", "json_schema": {k: v for k, v in (
                    ("name", fmt.name), ("schema", fmt.schema_), ("description", fmt.description),
                    ("strict", fmt.strict)) if v is not None}})
        if self.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.truncation == "auto":   # the input's last tokens that leave room for output (vLLM's reading)
            body["truncate_prompt_tokens"] = -1
        return body

    def input_messages(self) -> list[dict[str, Any]]:
        """The input's items as chat messages (a 400 naming the item's field where one does not fit)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return input_messages(self.input)


_ROLES = ("user", "system", "developer", "assistant")
MAX_CALLS = 128     # calls in one assistant turn (a chat message's bound)
_MESSAGE_KEYS = {"type", "role", "content", "id", "status"}


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages. A ``function_call`` joins the assistant message
    just before it (a new one if there is none); a ``reasoning`` item opens an assistant message
    that the next assistant message or call completes; ``function_call_output`` is a tool message."""
    out: list[dict[str, Any]] = []
    open_assistant: dict[str, Any] | None = None    # the assistant message items may still join
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise BodyError(f"{where}: each item must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            msg = _message(item, where)
            if msg["role"] == "assistant" and open_assistant is not None and open_assistant.get("content") is None \
                    and "tool_calls" not in open_assistant:
                open_assistant["content"] = msg["content"]
            else:
                out.append(msg)
                open_assistant = msg if msg["role"] == "assistant" else None
        elif kind == "function_call":
            _keys(item, where, {"type", "call_id", "name", "arguments", "id", "status"})
            call = {"id": _text(item, "call_id", where, 256), "type": "function",
                    "function": {"name": _text(item, "name", where, 64), "arguments": _text(item, "arguments", where)}}
            if open_assistant is None:
                open_assistant = {"role": "assistant", "content": None}
                out.append(open_assistant)
            if len(open_assistant.setdefault("tool_calls", [])) == MAX_CALLS:
                raise BodyError(f"{where}: at most {MAX_CALLS} function calls in a row (one assistant turn)", where)
            open_assistant["tool_calls"].append(call)
        elif kind == "function_call_output":
            _keys(item, where, {"type", "call_id", "output", "id", "status"})
            out.append({"role": "tool", "tool_call_id": _text(item, "call_id", where, 256),
                        "content": _output_text(item.get("output"), f"{where}.output")})
            open_assistant = None
        elif kind == "reasoning":
            _keys(item, where, {"type", "id", "summary", "content", "encrypted_content", "status"})
            if item.get("encrypted_content") is not None:
                raise BodyError(f"{where}.encrypted_content: phalanx does not encrypt reasoning; send its content",
                                f"{where}.encrypted_content")
            open_assistant = {"role": "assistant", "content": None, "reasoning_content": _reasoning_text(item, where)}
            out.append(open_assistant)
        else:
            raise BodyError(f"{where}.type: items of type message, function_call, function_call_output and "
                            f"reasoning are supported, got {kind!r}", f"{where}.type")
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    _keys(item, where, _MESSAGE_KEYS)
    role = item.get("role")
    if role not in _ROLES:
        raise BodyError(f"{where}.role: must be one of {list(_ROLES)}, got {role!r}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or not content:
        raise BodyError(f"{where}.content: must be a string or a non-empty list of text parts", f"{where}.content")
    texts = []
    allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    for j, part in enumerate(content):
        at = f"{where}.content.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise BodyError(f"{at}.type: a {role} message takes parts of type {' or '.join(allowed)} (phalanx reads "
                            f"text only), got {kind!r}", f"{at}.type")
        if kind == "refusal":
            raise BodyError(f"{at}.type: phalanx does not render an assistant's refusal", f"{at}.type")
        extra = set(part) - {"type", "text", "annotations", "logprobs"}
        if extra:
            raise BodyError(f"{at}: unsupported field(s) {sorted(extra)}", at)
        if part.get("annotations"):
            raise BodyError(f"{at}.annotations: only an empty list is supported", f"{at}.annotations")
        texts.append(_text(part, "text", at))
    return {"role": role, "content": "\n".join(texts) if len(texts) > 1 else texts[0]}


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and output and all(isinstance(p, dict) and p.get("type") == "input_text"
                                                   and isinstance(p.get("text"), str) and set(p) <= {"type", "text"}
                                                   for p in output):
        return "\n".join(p["text"] for p in output)
    raise BodyError(f"{where}: must be a string or a list of input_text parts", where)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary's text."""
    for field, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field)
        parts = [] if parts is None else parts
        if not isinstance(parts, list) or any(not isinstance(p, dict) or p.get("type") != kind
                                              or not isinstance(p.get("text"), str) for p in parts):
            raise BodyError(f"{where}.{field}: must be a list of {kind} parts", f"{where}.{field}")
        if parts:
            return "\n".join(p["text"] for p in parts)
    return ""


def _keys(item: dict[str, Any], where: str, allowed: set[str]) -> None:
    extra = sorted(set(item) - allowed)
    if extra:
        raise BodyError(f"{where}.{extra[0]}: this field is not supported by phalanx", f"{where}.{extra[0]}")


def _text(item: dict[str, Any], key: str, where: str, limit: int = MAX_TEXT_CHARS) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (limit < MAX_TEXT_CHARS and not v) or len(v) > limit:
        raise BodyError(f"{where}.{key}: required, a string of at most {limit} characters"
                        f"{'' if limit == MAX_TEXT_CHARS else ' (not empty)'}", f"{where}.{key}")
    return v


# -- output -------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OutputIds:
    """The ids of one response's output items, made once so that a stream's items and the
    final response carry the same ones."""

    reasoning: str
    message: str
    calls: list[str]

    @classmethod
    def new(cls) -> OutputIds:
        return cls(new_id("rs"), new_id("msg"), [])

    def call(self, i: int) -> str:
        while len(self.calls) <= i:
            self.calls.append(new_id("fc"))
        return self.calls[i]


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None, "status": status}


def message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def output_items(message: dict[str, Any], ids: OutputIds, status: str,
                 logprobs: list[dict[str, Any]] | None, named: bool = False) -> list[dict[str, Any]]:
    """A chat answer's assistant message as Responses output items, in the order they were
    written: its reasoning, its text (also when empty, if no call came), its calls. The item
    being written when the output ended takes ``status`` (``incomplete`` where the output limit
    cut it): the message, or with a ``named`` function (tool_choice naming one: its arguments
    are the output, cut or not) the call; other calls are whole ones (only those are read)."""
    calls = message.get("tool_calls") or []
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(ids.reasoning, message["reasoning_content"], "completed"))
    if message.get("content") or not calls:
        items.append(message_item(ids.message, message.get("content") or "", "completed" if calls else status,
                                  logprobs))
    items += [call_item(ids.call(i), c, status if named else "completed") for i, c in enumerate(calls)]
    return items


def conversation_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant message a later turn's chat template renders."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            message["content"] = item["content"][0]["text"]
        else:
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return [message]


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """(the response's status, its incomplete_details) for the output's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def reasoning_tokens(pieces: list[bytes], starts_in_reasoning: bool) -> int:
    """How many of an output's tokens (their UTF-8 pieces) are its reasoning: those up to and
    including the one that completes ``</think>``; all of them if it never closes but reasoning
    opened (a ``<think>`` first, or a prompt that opened it); none otherwise."""
    seen = b""
    for i, piece in enumerate(pieces):
        seen += piece
        if b"</think>" in seen:
            return i + 1
    return len(pieces) if starts_in_reasoning or seen.lstrip().startswith(b"<think>") else 0


class ResponseEvents(ItemStream):
    """The Responses API's typed events of one streamed output (``item_stream.ItemStream`` reads
    it as ``output_items`` reads the whole output, so the streamed items are the whole answer's,
    and so is what a later turn goes on from)."""

    def __init__(self, ids: OutputIds, logprobs: bool, strip: bool, named: bool = False) -> None:
        super().__init__(strip, named)
        self.ids, self.with_logprobs = ids, logprobs
        self.seq = 0
        self.items: list[dict[str, Any]] = []        # closed items, in output order
        self.open: dict[str, Any] | None = None      # the item being written
        self.logprobs: list[dict[str, Any]] = []     # the message's logprobs so far

    def sse(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {_ENCODE(data)}\n\n"

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": self.closed}

    def _opened(self, kind: str, call: dict[str, Any] | None) -> list[str]:
        part: dict[str, Any] | None = None
        if kind == CALL:
            assert call is not None
            self.open = {"id": self.ids.call(self.calls - 1), "type": "function_call", "call_id": call["id"],
                         "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
        elif kind == REASONING:
            self.open = {"id": self.ids.reasoning, "type": "reasoning", "summary": [], "content": [],
                         "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            self.open = {"id": self.ids.message, "type": "message", "role": "assistant", "status": "in_progress",
                         "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out = [self.sse("response.output_item.added", output_index=self.closed, item=self.open)]
        if part is not None:
            out.append(self.sse("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def _added(self, kind: str, text: str, lps: list[dict[str, Any]]) -> list[str]:
        if kind == CALL:
            return [self.sse("response.function_call_arguments.delta", **self._where(), delta=text)]
        if kind == REASONING:
            return [self.sse("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)]
        self.logprobs += lps
        return [self.sse("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=lps)]

    def _closed(self, kind: str, text: str, status: str) -> list[str]:
        item, where = self.open, self._where()
        assert item is not None
        out = []
        if kind == REASONING:
            done = reasoning_item(item["id"], text, status)
            out.append(self.sse("response.reasoning_text.done", **where, content_index=0, text=text))
            out.append(self.sse("response.content_part.done", **where, content_index=0, part=done["content"][0]))
        elif kind == ANSWER:
            self.logprobs += self.pending_lps     # tokens after the last text delta (a stop, a held tail)
            self.pending_lps = []
            done = message_item(item["id"], text, status, self.logprobs if self.with_logprobs else None)
            part = done["content"][0]
            out.append(self.sse("response.output_text.done", **where, content_index=0, text=text,
                                logprobs=part.get("logprobs", [])))
            out.append(self.sse("response.content_part.done", **where, content_index=0, part=part))
        else:
            done = {**item, "arguments": text, "status": status}
            out.append(self.sse("response.function_call_arguments.done", **where, name=item["name"], arguments=text))
        out.append(self.sse("response.output_item.done", **where, item=done))
        self.items.append(done)
        self.open = None
        return out


# -- the store ----------------------------------------------------------------------------------------

@dataclass
class Stored:
    response: dict[str, Any]              # as it was answered
    conversation: list[dict[str, Any]]    # the chat messages a later turn goes on from (no instructions)
    chars: int


class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``, in memory: the
    newest ``capacity`` responses that hold at most ``max_chars`` characters in all (their JSON and
    their conversations); the oldest go first. (A stored conversation holds all of its turns, so a long chain of
    turns counts each earlier turn again: the character bound is what holds the memory.)"""

    def __init__(self, capacity: int, max_chars: int = 16 * MAX_TEXT_CHARS) -> None:
        self.capacity, self.max_chars = capacity, max_chars
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.capacity == 0:
            return
        # all that is kept: the answer as sent (instructions, tools, logprobs...) and the conversation
        chars = len(_ENCODE(response)) + sum(_chars(m) for m in conversation)
        self.delete(response_id)
        self._items[response_id] = Stored(response, conversation, chars)
        self.chars += chars
        while len(self._items) > self.capacity or (self.chars > self.max_chars and len(self._items) > 1):
            _, old = self._items.popitem(last=False)
            self.chars -= old.chars

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        old = self._items.pop(response_id, None)
        if old is not None:
            self.chars -= old.chars
        return old is not None


def _chars(message: dict[str, Any]) -> int:
    n = len(message.get("content") or "") + len(message.get("reasoning_content") or "")
    return n + sum(len(c["function"]["arguments"]) + len(c["function"]["name"]) for c in message.get("tool_calls", []))
