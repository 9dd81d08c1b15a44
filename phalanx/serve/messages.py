"""Anthropic's Messages API (``/v1/messages``) as a chat request: the body, its content blocks
read as chat messages, the answer's content blocks, and the stream's events.

A Messages request runs as the chat request it amounts to (``MessagesRequest.generation_body``):
``system`` becomes a system message, ``text`` blocks a message's text, an assistant's
``tool_use`` blocks its tool calls, a user's ``tool_result`` blocks tool messages (in their
place among the user's text), an assistant's ``thinking`` its reasoning; custom tools
(``input_schema``) become function tools, ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``)
the chat's, ``stop_sequences`` the stop strings, ``output_config.format`` (a JSON schema) the
response format, ``output_config.effort`` the chat's ``reasoning_effort``; a final assistant
message is a prefill (chat's ``continue_final_message``: the answer goes on from it, read as
written, with no thinking opened). ``cache_control``
marks are taken: phalanx caches every prompt's blocks of 32 tokens, marked or not.

Refused by name, never ignored: image and document blocks, server tools (bash, web search,
...), ``thinking`` (phalanx has no thinking budget; a reasoning model's thinking comes back as
thinking blocks with ``--reasoning_parser``), redacted thinking, citations, ``container``, MCP
servers and the other fields Anthropic's API has and phalanx does not serve.

Nothing here imports torch or the server.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import from_json

from phalanx.serve.item_stream import CALL, REASONING, ItemStream
from phalanx.serve.protocol import (
    MAX_MESSAGES,
    MAX_STOP,
    MAX_TEXT_CHARS,
    BodyError,
    NullIsDefault,
    Strict,
    describe,
)

_ENCODE = json.JSONEncoder(ensure_ascii=False).encode
# a chat field an error names -> the Messages field the client sent
CHAT_TO_MESSAGES = {"stop": "stop_sequences", "response_format": "output_config.format",
                    "reasoning_effort": "output_config.effort", "parallel_tool_calls": "tool_choice",
                    "max_completion_tokens": "max_tokens"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 499: "invalid_request_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class CustomTool(Strict):
    type: Literal["custom"] | None = None
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=8192)
    input_schema: dict[str, Any]
    strict: bool | None = None
    cache_control: CacheControl | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, max_length=64)
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name: required with type tool, and only there")
        return self


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(NullIsDefault):
    format: JsonOutputFormat | None = None
    effort: str | None = Field(None, pattern=r"^[a-z]{1,16}$")


class Metadata(Strict):
    user_id: str | None = Field(None, max_length=256)


class Conversation(NullIsDefault):
    """What a Messages request and a token count share: the conversation and its tools."""

    model: str | None = None
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[Any] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: None = None

    @field_validator("thinking", mode="before")
    @classmethod
    def _no_budget(cls, v: Any) -> None:
        if v is not None:
            raise ValueError("phalanx has no thinking budget or switch (a reasoning model's thinking comes back as "
                             "thinking blocks with --reasoning_parser)")
        return None

    @field_validator("messages")
    @classmethod
    def _present(cls, v: list[Any]) -> list[Any]:
        if not v:
            raise ValueError("must contain at least one message")
        if len(v) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} messages")
        return v

    @field_validator("system")
    @classmethod
    def _system_blocks(cls, v: str | list[Any] | None) -> str | list[Any] | None:
        if isinstance(v, list) and not v:
            raise ValueError("must be a string or a non-empty list of text blocks")
        return v

    @model_validator(mode="after")
    def _choice_fits(self) -> Conversation:
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise ValueError(f"tool_choice: type {choice.type} needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in {
                t.get("name") for t in self.tools or [] if isinstance(t, dict)}:
            raise ValueError(f"tool_choice: names the tool {choice.name!r}, which is not among the tools")
        if choice is not None and choice.type == "auto" and choice.disable_parallel_tool_use:
            raise ValueError("tool_choice: disable_parallel_tool_use is enforced only where a call is forced (type "
                             "any; type tool makes one call): under auto the model may still write several")
        return self

    def chat_body(self, max_tokens: int | None = None) -> dict[str, Any]:
        """The chat request this conversation runs as (a dict for ``ChatCompletionRequest``)."""
        messages = self.chat_messages()
        body: dict[str, Any] = {"messages": messages}
        if messages[-1]["role"] == "assistant":   # a prefill: the answer goes on from it (Anthropic's reading)
            if "tool_calls" in messages[-1]:
                where = f"messages.{len(self.messages) - 1}.content"
                raise BodyError(f"{where}: a final assistant message is a prefill the answer goes on writing; it "
                                "cannot hold tool_use blocks", where)
            body.update(add_generation_prompt=False, continue_final_message=True)
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        tools = self.tool_defs()
        if tools:
            body["tools"] = [{"type": "function", "function": {k: v for k, v in (
                ("name", t.name), ("description", t.description), ("parameters", t.input_schema),
                ("strict", t.strict)) if v is not None}} for t in tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use and choice.type == "any":
                body["parallel_tool_calls"] = False
        elif tools:
            body["tool_choice"] = "auto"
        if self.output_config is not None:
            if self.output_config.format is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": self.output_config.format.schema_}}
            if self.output_config.effort is not None:
                body["reasoning_effort"] = self.output_config.effort
        return body

    def tool_defs(self) -> list[CustomTool]:
        out = []
        for i, t in enumerate(self.tools or []):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind not in (None, "custom"):
                raise BodyError(f"tools.{i}.type: only custom tools (name, input_schema) are supported by phalanx "
                                f"(it runs no server tools), got {kind!r}", f"tools.{i}.type")
            try:
                out.append(CustomTool.model_validate(t))
            except ValidationError as e:   # named by the tool's field
                msg, param = describe(e)
                raise BodyError(f"tools.{i}.{msg}" if param else f"tools.{i}: {msg}",
                                f"tools.{i}.{param}" if param else f"tools.{i}") from None
        return out

    def chat_messages(self) -> list[dict[str, Any]]:
        out = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else "\n".join(
                _text_block(b, f"system.{i}") for i, b in enumerate(self.system))
            out.append({"role": "system", "content": text})
        for i, m in enumerate(self.messages):
            out += _message(m, f"messages.{i}")
        return out


class MessagesRequest(Conversation):
    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None            # labels only
    service_tier: Literal["auto", "standard_only"] | None = None

    def generation_body(self) -> dict[str, Any]:
        """The chat request this message runs as: the conversation's, with the sampling fields."""
        body = self.chat_body(self.max_tokens)
        for k in ("temperature", "top_p", "top_k"):
            if getattr(self, k) is not None:
                body[k] = getattr(self, k)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.metadata is not None and self.metadata.user_id is not None:
            body["user"] = self.metadata.user_id
        return body


def _message(m: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(m, dict):
        raise BodyError(f"{where}: each message must be an object", where)
    extra = sorted(set(m) - {"role", "content"})
    if extra:
        raise BodyError(f"{where}.{extra[0]}: this field is not supported by phalanx", f"{where}.{extra[0]}")
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise BodyError(f"{where}.role: must be user or assistant, got {role!r}", f"{where}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not content:
        raise BodyError(f"{where}.content: must be a string or a non-empty list of blocks", f"{where}.content")
    return _user_blocks(content, where) if role == "user" else [_assistant_blocks(content, where)]


def _user_blocks(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user's blocks: text joins into user messages, each tool_result is a tool message, in
    their order."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []      # the run of text blocks not yet a message (joined once: linear in the blocks)

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_text_block(b, at))
        elif kind == "tool_result":
            flush()
            _keys(b, at, {"type", "tool_use_id", "content", "is_error", "cache_control"})
            result = b.get("content", "")
            if isinstance(result, list):
                result = "\n".join(_text_block(p, f"{at}.content.{k}") for k, p in enumerate(result))
            if not isinstance(result, str):
                raise BodyError(f"{at}.content: must be a string or a list of text blocks", f"{at}.content")
            if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
                raise BodyError(f"{at}.is_error: must be a boolean", f"{at}.is_error")
            out.append({"role": "tool", "tool_call_id": _string(b, "tool_use_id", at, 256),
                        "content": f"Error: {result}" if b.get("is_error") else result})
        else:
            raise BodyError(f"{at}.type: a user message takes text and tool_result blocks (phalanx reads text "
                            f"only), got {kind!r}", f"{at}.type")
    flush()
    return out


def _assistant_blocks(blocks: list[Any], where: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": None}
    texts = []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_text_block(b, at))
        elif kind == "tool_use":
            _keys(b, at, {"type", "id", "name", "input", "cache_control"})
            if not isinstance(b.get("input"), dict):
                raise BodyError(f"{at}.input: must be an object", f"{at}.input")
            message.setdefault("tool_calls", []).append({
                "id": _string(b, "id", at, 256), "type": "function",
                "function": {"name": _string(b, "name", at, 64), "arguments": json.dumps(b["input"])}})
        elif kind == "thinking":
            _keys(b, at, {"type", "thinking", "signature", "cache_control"})
            if not isinstance(b.get("signature", ""), str):
                raise BodyError(f"{at}.signature: must be a string", f"{at}.signature")
            thought = _string(b, "thinking", at, MAX_TEXT_CHARS, empty=True)
            message["reasoning_content"] = (message["reasoning_content"] + "\n" + thought
                                            if "reasoning_content" in message else thought)
        else:
            raise BodyError(f"{at}.type: an assistant message takes text, tool_use and thinking blocks, got "
                            f"{kind!r}", f"{at}.type")
    if texts:
        message["content"] = "\n".join(texts)
    if len(message.get("tool_calls", [])) > 128:
        raise BodyError(f"{where}.content: at most 128 tool_use blocks in a message", f"{where}.content")
    return message


def _text_block(b: Any, at: str) -> str:
    if not isinstance(b, dict) or b.get("type") != "text":
        raise BodyError(f"{at}: must be a text block", at)
    _keys(b, at, {"type", "text", "cache_control", "citations"})
    if b.get("citations"):
        raise BodyError(f"{at}.citations: phalanx does not cite", f"{at}.citations")
    return _string(b, "text", at, MAX_TEXT_CHARS, empty=True)


def _keys(b: dict[str, Any], at: str, allowed: set[str]) -> None:
    extra = sorted(set(b) - allowed)
    if extra:
        raise BodyError(f"{at}.{extra[0]}: this field is not supported by phalanx", f"{at}.{extra[0]}")
    cache = b.get("cache_control")
    if cache is not None:
        try:
            CacheControl.model_validate(cache)
        except ValidationError:
            raise BodyError(f"{at}.cache_control: must be {{\"type\": \"ephemeral\"}} with an optional ttl of "
                            f"\"5m\" or \"1h\"", f"{at}.cache_control") from None


def _string(b: dict[str, Any], key: str, at: str, limit: int, empty: bool = False) -> str:
    v = b.get(key)
    if not isinstance(v, str) or (not v and not empty) or len(v) > limit:
        raise BodyError(f"{at}.{key}: required, a string of at most {limit} characters", f"{at}.{key}")
    return v


# -- the answer ---------------------------------------------------------------------------------------

def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use input: the JSON object; where the output was cut inside
    it (stop_reason max_tokens), what of it is whole, as Anthropic's client reads a streamed
    input's pieces (pydantic's partial JSON: a value cut short is left out)."""
    try:
        value = from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's assistant message as content blocks: its thinking, its text (also when
    empty, if no call came), its tool_use blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        blocks.append({"type": "text", "text": message.get("content") or ""})
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                "input": tool_input(c["function"]["arguments"])} for c in calls]
    return blocks


def stop_of(finish_reason: str | None, stop_reason: Any, called: bool,
            stop_sequences: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for the output's finish: a call ends a tool_use turn."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason != "stop":
        return None, None        # aborted (the server stopping) or failed
    if called:
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in (stop_sequences or []):
        return "stop_sequence", stop_reason
    return "end_turn", None


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are those not read from the cache."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_read_input_tokens": cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": output_tokens}


class MessageEvents(ItemStream):
    """Anthropic's stream events of one output's content blocks (``item_stream.ItemStream``
    reads it as ``content_blocks`` reads the whole output)."""

    def __init__(self, strip: bool, named: bool = False) -> None:
        super().__init__(strip, named)
        self.blocks: list[dict[str, Any]] = []     # closed blocks, in order

    @staticmethod
    def sse(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {_ENCODE({'type': kind, **fields})}\n\n"

    def _opened(self, kind: str, call: dict[str, Any] | None) -> list[str]:
        if kind == CALL:
            assert call is not None
            block: dict[str, Any] = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                     "input": {}}
        elif kind == REASONING:
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        self.blocks.append(block)
        return [self.sse("content_block_start", index=self.closed, content_block=block)]

    def _added(self, kind: str, text: str, lps: list[dict[str, Any]]) -> list[str]:
        delta = ({"type": "input_json_delta", "partial_json": text} if kind == CALL else
                 {"type": "thinking_delta", "thinking": text} if kind == REASONING else
                 {"type": "text_delta", "text": text})
        return [self.sse("content_block_delta", index=self.closed, delta=delta)]

    def _closed(self, kind: str, text: str, status: str) -> list[str]:
        block = self.blocks[-1]
        if kind == CALL:
            block["input"] = tool_input(text)
        else:
            block["thinking" if kind == REASONING else "text"] = text
        return [self.sse("content_block_stop", index=self.closed)]
