"""OpenAI request bodies with their bounds, checked before anything is tokenized.

Types are strict, as OpenAI's API has them: a boolean is not an integer, a string is not a
boolean, a number is not a string. Every limit names its field when it is exceeded; the
handler turns the pydantic error into an OpenAI-shaped 400.

Unknown fields are refused (400 naming the field): a field that would change what is generated
is never silently ignored. Fields that only label a request (``LABEL_FIELDS``) are accepted. A
null for an optional field is its default (``NullIsDefault``). Strings that cannot be encoded as
UTF-8 (lone surrogates such as ``"\\ud800"``, which JSON can spell) are refused wherever they
appear, and so is nesting deeper than ``MAX_DEPTH``.
"""

from __future__ import annotations

import functools
import json
import typing
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SkipValidation,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from phalanx.llmapi.beam_search import MAX_BEAM_WIDTH
from phalanx.llmapi.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_CACHE_SALT, plain_token_ids

MAX_N = 16
MAX_PROMPTS = 256
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_LOGIT_BIAS = 1024
MAX_MESSAGES = 4096
MAX_TEXT_CHARS = 4 * 1024 * 1024
MAX_PROMPT_TOKEN_IDS = 1 << 20
MAX_TOKENS_LIMIT = 1 << 20
MAX_DEPTH = 32
MAX_TEMPLATE_CHARS = 64 * 1024   # a request's own chat template (where the server takes one)
# explicit values of sampling fields that leave sampling as their defaults do (a beam search takes them)
_NEUTRAL: dict[str, Any] = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "stop": [],
                            "top_logprobs": 0, "stop_token_ids": [], "min_tokens": 0}
# what a beam search request may set besides its prompt or messages
BEAM_SEARCH_FIELDS = frozenset({"model", "n", "temperature", "ignore_eos", "include_stop_str_in_output",
                                "skip_special_tokens", "length_penalty", "use_beam_search", "request_id",
                                "return_token_ids", "user", "metadata", "store", "service_tier", "safety_identifier",
                                "prompt_cache_key"})
INT32_MAX = 2**31 - 1

LABEL_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class NullIsDefault(Strict):
    """A request body's top level (and its stream options): nulls for fields with defaults."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A null for a field that has a default and does not take null (``n``, ``stream``, the
        penalties, ``echo``, ...) is that default, as OpenAI's and vLLM's optional fields read it;
        a field where null means something (``max_tokens``: fill the context) keeps it."""
        if isinstance(data, dict):
            defaulted = _defaulted_fields(cls)
            if any(v is None and k in defaulted for k, v in data.items()):
                return {k: v for k, v in data.items() if not (v is None and k in defaulted)}
        return data


@functools.cache
def _defaulted_fields(cls: type[BaseModel]) -> frozenset[str]:
    """The fields of ``cls`` with a default that do not take None (decided once a class)."""
    return frozenset(name for name, f in cls.model_fields.items()
                     if not f.is_required() and type(None) not in typing.get_args(f.annotation)
                     and f.annotation is not type(None) and f.default is not None)


class StreamOptions(NullIsDefault):
    # stream_options given without it: a usage chunk, as vLLM's default; null: none, as vLLM reads it
    include_usage: bool | None = True
    # vLLM's: every chunk carries the usage so far (its choice's tokens), where include_usage is on
    continuous_usage_stats: bool = False

    @property
    def continuous(self) -> bool:
        return bool(self.include_usage) and self.continuous_usage_stats


class JsonSchemaFormat(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TagStructure(Strict):
    """One structure of vLLM's first form of a structural tag: text from ``begin`` to ``end``
    whose middle follows ``schema``."""

    begin: str = Field(..., min_length=1, max_length=1024)
    schema_: dict[str, Any] = Field(..., alias="schema")
    end: str = Field(..., max_length=1024)


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # type structural_tag (vLLM's two forms): xgrammar's ``format``, or ``structures`` and ``triggers``
    format: dict[str, Any] | None = None
    structures: list[TagStructure] | None = Field(None, min_length=1, max_length=128)
    triggers: list[str] | None = Field(None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is json_schema")
        tag_fields = [f for f in ("format", "structures", "triggers") if getattr(self, f) is not None]
        if self.type != "structural_tag" and tag_fields:
            raise ValueError(f"{tag_fields[0]}: only with type structural_tag")
        if self.type == "structural_tag" and tag_fields not in (["format"], ["structures", "triggers"]):
            raise ValueError("type structural_tag takes either format (xgrammar's structural tag) or structures "
                             f"and triggers, got {tag_fields or 'neither'}")
        if self.structures is not None and self.triggers is not None:
            loose = next((s.begin for s in self.structures if not any(s.begin.startswith(t) for t in self.triggers)),
                         None)
            if loose is not None:
                raise ValueError(f"structures: the begin {loose[:40]!r} starts with none of the triggers")
            if any(not t for t in self.triggers):
                raise ValueError("triggers: each must be a non-empty string")
        return self

    def structural_tag(self) -> dict[str, Any]:
        """xgrammar's structural tag for type structural_tag: the ``format`` given, or the
        structures as tags that free text may open at their triggers, any number of times."""
        if self.format is not None:
            return {"type": "structural_tag", "format": self.format}
        assert self.structures is not None and self.triggers is not None
        tags = [{"begin": s.begin, "content": {"type": "json_schema", "json_schema": s.schema_}, "end": s.end}
                for s in self.structures]
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": self.triggers,
                                                     "tags": tags}}


class FunctionDef(Strict):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str = Field(..., max_length=64)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(Strict):
    name: str = Field(..., max_length=64)
    arguments: str = Field(..., max_length=MAX_TEXT_CHARS)


class MessageToolCall(Strict):
    index: int | None = Field(None, ge=0, le=127)   # a streamed call's position, kept by clients that send it back
    id: str = Field(..., max_length=256)
    type: Literal["function"]
    function: CalledFunction


class SamplingFields(NullIsDefault):
    """Fields shared by completions and chat (OpenAI plus the extension fields of API.md)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # labels only: accepted, never change what is generated
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool | None = None
    service_tier: str | None = Field(None, max_length=64)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256)    # (the prefix cache needs no key)
    # extensions
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)   # keep the last k (-1: the context's)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)   # words the output may not contain (vLLM's)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT)
    return_token_ids: bool = False        # choices carry their token ids (and the prompt's, when not streamed)
    return_tokens_as_token_ids: bool = False   # logprobs name tokens "token_id:<id>" (vLLM's)
    request_id: str | None = Field(None, min_length=1, max_length=256)   # the response's id is built on it (vLLM's)
    priority: int = 0     # vLLM's; only 0: requests are scheduled first come, first served
    prompt_logprobs: int | None = Field(None, ge=0, le=20)   # every prompt token's (vLLM's; not streamed)
    # structured output: response_format, or one extension field (vLLM's guided_*, SGLang's regex / ebnf)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # vLLM's beam search: n beams, the n best answers (llmapi/beam_search.py); only with the fields
    # of BEAM_SEARCH_FIELDS (and the request type's own ``beam_fields``) at other than their defaults
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0)   # the beams' score: / length ** length_penalty
    beam_fields: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="after")
    def _beam_search_fields(self) -> SamplingFields:
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise ValueError("length_penalty: only with use_beam_search")
            return self
        fields = type(self).model_fields
        neutral = {**_NEUTRAL, "best_of": self.n}   # values that ask for nothing beyond the default
        other = sorted(f for f in self.model_fields_set - BEAM_SEARCH_FIELDS - self.beam_fields
                       if getattr(self, f) not in (fields[f].default, neutral.get(f, fields[f].default)))
        if other:
            raise ValueError(f"{other[0]}: not with use_beam_search (beam search takes "
                             f"{', '.join(sorted(BEAM_SEARCH_FIELDS | self.beam_fields))})")
        if self.temperature not in (None, 0.0):
            raise ValueError("temperature: must be 0 or unset with use_beam_search (beams rank by the model's own "
                             "log-probabilities)")
        if self.n > MAX_BEAM_WIDTH:
            raise ValueError(f"n: the beam width, at most {MAX_BEAM_WIDTH} with use_beam_search")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s or len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"each stop sequence must have 1 to {MAX_STOP_LEN} characters")
        return stops

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(not 0 <= t <= INT32_MAX for t in v):
            raise ValueError("token ids must be integers >= 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_bounds(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for k, b in v.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 10):
                raise ValueError(f"keys must be token ids written as decimal integers, got {k[:20]!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"values must be in [-100, 100], got {b}")
        return v

    @field_validator("priority")
    @classmethod
    def _first_come(cls, v: int) -> int:
        if v != 0:
            raise ValueError("only 0 is supported: requests are scheduled first come, first served (vLLM's "
                             "default policy, under which it refuses other priorities too)")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be -1 (the model's context) or at least 1")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as vLLM's)")
        return self


class CompletionRequest(SamplingFields):
    # the form is checked once, by _prompt_shape; pydantic's own union check of a 2k-id list
    # (trying each member, one error per element for the list of strings) took ~0.7 ms a request
    prompt: SkipValidation[str | list[str] | list[int] | list[list[int]]]
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKENS_LIMIT)
    echo: bool = False
    add_special_tokens: bool = True     # a text prompt's BOS and the like (vLLM's)
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    beam_fields: ClassVar[frozenset[str]] = frozenset({"prompt", "max_tokens", "add_special_tokens"})

    @model_validator(mode="after")
    def _nothing_generated_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 is taken with echo: the prompt alone, with its "
                             "logprobs, as OpenAI's and vLLM's scoring idiom)")
        if self.max_tokens == 0 and self.min_tokens:
            raise ValueError("min_tokens must be 0 with max_tokens 0 (echo alone generates nothing)")
        return self

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt (and its logprobs) back, nothing generated."""
        return self.echo and self.max_tokens == 0

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        """One of: a string, a list of strings, a list of token ids, a list of token-id lists."""
        if isinstance(v, str):
            if len(v) > MAX_TEXT_CHARS:
                raise ValueError(f"at most {MAX_TEXT_CHARS} characters")
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("must be a non-empty string, or a non-empty list of strings, token ids or "
                             "token-id lists")
        if _token_ids(v):
            if len(v) > MAX_PROMPT_TOKEN_IDS:
                raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS} token ids")
            return v
        if len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts")
        if all(isinstance(p, str) for p in v):
            if any(len(p) > MAX_TEXT_CHARS for p in v):
                raise ValueError(f"each prompt must have at most {MAX_TEXT_CHARS} characters")
            return v
        if all(isinstance(p, list) and _token_ids(p) for p in v):
            if sum(len(p) for p in v) > MAX_PROMPT_TOKEN_IDS:
                raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS} token ids in all")
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids (integers >= 0) or a list of "
                         "token-id lists; these forms do not mix")


EMPTY_ONLY_MESSAGE_FIELDS = ("refusal", "audio", "function_call", "annotations", "parsed")   # annotations: [] too


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = Field(None, validate_default=True)   # an assistant's may be null
    name: str | None = Field(None, max_length=256)
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=128)     # an assistant's calls
    tool_call_id: str | None = Field(None, max_length=256, validate_default=True)   # a tool message's call
    # an assistant's reasoning as phalanx returned it (--reasoning_parser), for templates that render it
    reasoning_content: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    # fields of a returned assistant message that OpenAI's SDK sends back as they came: empty only
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: None = None
    parsed: None = None

    @field_validator(*EMPTY_ONLY_MESSAGE_FIELDS, mode="wrap")
    @classmethod
    def _empty_only(cls, v: Any, handler: Any, info: ValidationInfo) -> None:
        if v is not None and not (info.field_name == "annotations" and v == []):
            raise ValueError(f"only null is supported (phalanx does not render an assistant's {info.field_name})")
        return None

    @field_validator("reasoning_content")
    @classmethod
    def _reasoning_is_the_assistants(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, v: list[MessageToolCall] | None, info: ValidationInfo) -> Any:
        if v is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool calls")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _ids_are_the_tools(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("role") != "tool":
            raise ValueError("only tool messages carry a tool_call_id")
        if v is None and info.data.get("role") == "tool":
            raise ValueError("required in a tool message")
        return v

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: str | list[dict[str, Any]] | None,
                    info: ValidationInfo) -> str | list[dict[str, Any]] | None:
        role = info.data.get("role")
        if v is None and role is not None and role != "assistant":
            raise ValueError(f"required in a {role} message")
        if not isinstance(v, list):
            return v
        for i, part in enumerate(v):
            if part.get("type") != "text":
                raise ValueError(f"part {i}: only parts of type 'text' are supported, got {part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: 'text' must be a string")
            extra = set(part) - {"type", "text"}
            if extra:
                raise ValueError(f"part {i}: unsupported field(s) {sorted(extra)}")
        return v

    def text(self) -> str:
        """The message's text; parts of a list joined by newlines, as vLLM renders them."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p["text"] for p in self.content)

    def num_chars(self) -> int:
        if isinstance(self.content, list):
            return sum(len(p["text"]) for p in self.content) + max(0, len(self.content) - 1)
        return len(self.content or "")


def _check_tools(tools: list[ToolDef] | None, tool_choice: Any) -> None:
    """A chat's tools and tool_choice agree (a choice other than none/auto needs tools; names distinct)."""
    if tool_choice not in (None, "none", "auto") and not tools:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    if tools and len({t.function.name for t in tools}) != len(tools):
        raise ValueError("tools must have distinct function names")
    if isinstance(tool_choice, NamedToolChoice) and tools and tool_choice.function.name not in {
            t.function.name for t in tools}:
        raise ValueError(f"tool_choice names the function {tool_choice.function.name!r}, which is not among the "
                         f"tools ({sorted(t.function.name for t in tools)})")


# what the chat template is called with besides the request's own kwargs: set by fields of the
# request (or by the server), never through chat_template_kwargs
RENDERING_ARGUMENTS = frozenset({"add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
                                 "messages", "conversation", "tools"})


def _check_rendering(add_generation_prompt: bool, continue_final_message: bool,
                     template_kwargs: dict[str, Any] | None) -> None:
    """A conversation ends either with the assistant's turn opened (``add_generation_prompt``)
    or inside its last message (``continue_final_message``, which the model then goes on
    writing), not both (vLLM's and transformers' rule); the template's own arguments come from
    the fields that name them."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message cannot be true while add_generation_prompt is true (the default): "
                         "set add_generation_prompt to false to continue the final message")
    taken = sorted(RENDERING_ARGUMENTS & set(template_kwargs or {}))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken[0]}"
                         f"{' (set the field of that name)' if taken[0] in _RENDERING_FIELDS else ''}")


_RENDERING_FIELDS = frozenset({"add_generation_prompt", "continue_final_message", "messages", "tools"})
# request fields handed to the chat template under their own names (where the template reads them)
TEMPLATE_FIELDS = ("documents", "reasoning_effort")
MAX_DOCUMENTS = 128


def _check_template_fields(body: Any, template_kwargs: dict[str, Any] | None) -> None:
    """A template field is given once: as the field or in ``chat_template_kwargs``, not both."""
    twice = next((f for f in TEMPLATE_FIELDS if getattr(body, f) is not None and f in (template_kwargs or {})), None)
    if twice:
        raise ValueError(f"{twice}: given twice, as the field and in chat_template_kwargs")
    if body.documents is not None and sum(len(k) + len(v) for d in body.documents for k, v in d.items()) \
            > MAX_TEXT_CHARS:
        raise ValueError(f"documents: at most {MAX_TEXT_CHARS} characters in all")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False      # the final message, when the assistant's, goes first in the answer (vLLM's)
    include_reasoning: bool = True     # False: the reasoning parser's reasoning is left out (vLLM's)
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=32)
    # the request's own Jinja template (vLLM's): only where the server was started with
    # --trust-request-chat-template, refused by name otherwise
    chat_template: str | None = Field(None, min_length=1, max_length=MAX_TEMPLATE_CHARS)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # given to the chat template, where it reads them (refused where it does not): vLLM's
    documents: list[dict[str, str]] | None = Field(None, min_length=1, max_length=MAX_DOCUMENTS)
    reasoning_effort: str | None = Field(None, pattern=r"^[a-z]{1,16}$")
    beam_fields: ClassVar[frozenset[str]] = frozenset({
        "messages", "max_tokens", "max_completion_tokens", "add_generation_prompt", "continue_final_message",
        "chat_template_kwargs", "chat_template", "documents", "reasoning_effort", "include_reasoning"})

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        _check_tools(self.tools, self.tool_choice)
        _check_rendering(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)
        _check_template_fields(self, self.chat_template_kwargs)
        return self

    @field_validator("messages")
    @classmethod
    def _messages_present(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("must contain at least one message")
        if sum(m.num_chars() for m in v) > MAX_TEXT_CHARS:
            raise ValueError(f"at most {MAX_TEXT_CHARS} characters in all")
        return v

    @model_validator(mode="after")
    def _logprob_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:     # (0 without logprobs asks for nothing, as vLLM takes it)
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def output_limit_field(self) -> str:
        """The field ``output_limit`` comes from (an error about it names what the client sent)."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class TokenizeCompletionRequest(NullIsDefault):
    """``/tokenize`` of a text: the ids a completion of this prompt would run on."""

    model: str | None = None
    prompt: str = Field(..., max_length=MAX_TEXT_CHARS)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(NullIsDefault):
    """``/tokenize`` of a conversation: the ids the chat endpoint would run on (its template,
    tools and ``chat_template_kwargs`` rendered the same way)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=32)
    chat_template: str | None = Field(None, min_length=1, max_length=MAX_TEMPLATE_CHARS)   # (as the chat endpoint's)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    documents: list[dict[str, str]] | None = Field(None, min_length=1, max_length=MAX_DOCUMENTS)
    reasoning_effort: str | None = Field(None, pattern=r"^[a-z]{1,16}$")
    return_token_strs: bool = False

    @field_validator("messages")
    @classmethod
    def _not_too_long(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if sum(m.num_chars() for m in v) > MAX_TEXT_CHARS:
            raise ValueError(f"at most {MAX_TEXT_CHARS} characters in all")
        return v

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> TokenizeChatRequest:
        _check_tools(self.tools, self.tool_choice)
        _check_rendering(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)
        _check_template_fields(self, self.chat_template_kwargs)
        return self

    @field_validator("add_special_tokens")
    @classmethod
    def _template_tokens_only(cls, v: bool) -> bool:
        if v:
            raise ValueError("only false is supported: a conversation gets its template's special tokens, as the "
                             "chat endpoint renders it")
        return v


class DetokenizeRequest(NullIsDefault):
    model: str | None = None
    tokens: list[int] = Field(..., max_length=MAX_PROMPT_TOKEN_IDS)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error the server answers, whatever raised it."""

    error: ErrorDetail


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
               413: "BadRequestError", 500: "InternalServerError", 501: "NotImplementedError",
               503: "ServiceUnavailableError"}


def error_body(message: str, status: int, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind or ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}


class BodyError(ValueError):
    """A request body that cannot be served: the message and the field it names."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


Body = TypeVar("Body", bound=BaseModel)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """Bytes of a JSON body -> a validated ``model``; raises BodyError naming the field."""
    return _validate(_json_object(raw), model)


def parse_tokenize(raw: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A ``/tokenize`` body: a conversation's form when it has ``messages``, else a prompt's."""
    data = _json_object(raw)
    if "messages" in data:
        return _validate(data, TokenizeChatRequest)
    return _validate(data, TokenizeCompletionRequest)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"the body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise BodyError(f"the body is nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as e:
        raise BodyError(f"the body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    if not isinstance(data, dict):
        raise BodyError("the body must be a JSON object")
    _check_values(data, "", 0)
    return data


def _validate(data: dict[str, Any], model: type[Body]) -> Body:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BodyError(*describe(e, model)) from None


def describe(e: ValidationError, model: type[BaseModel] | None = None) -> tuple[str, str | None]:
    """(message, param) of a pydantic error: the first problem, its field path as the param
    (for a check across fields, the field its message starts with)."""
    first = e.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if not _is_type_tag(p)]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return f"{param}: this field is not supported by phalanx", param
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    first_word = msg.split(" ", 1)[0].rstrip(":")
    if param is None and model is not None and first_word in model.model_fields:
        return msg, first_word
    return (f"{param}: {msg}" if param else msg), param


def _is_type_tag(p: Any) -> bool:
    """Pydantic puts the union member tried ('str', 'list[int]', ...) into error locations."""
    return isinstance(p, str) and (p in ("str", "int", "float", "bool", "list", "dict", "none") or "[" in p)


def _token_ids(v: list) -> bool:
    """Whether every item of a non-empty list is a token id."""
    return plain_token_ids(v) or all(_is_token_id(t) for t in v)


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _numbers_only(items: list) -> bool:
    """Whether a list holds only numbers (its items' types gathered in C: a 2k-id prompt ~40 µs
    against ~300 visiting each)."""
    return set(map(type, items)) <= _NUMBER_TYPES


_NUMBER_TYPES = frozenset({int, float, bool})


def _check_values(value: Any, path: str, depth: int) -> None:
    """Refuse strings UTF-8 cannot encode and nesting deeper than MAX_DEPTH, naming the path."""
    if depth > MAX_DEPTH:
        raise BodyError(f"{path or 'body'}: nested deeper than {MAX_DEPTH} levels", path or None)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BodyError(f"{path or 'body'}: the text has a lone surrogate (U+{ord(value[e.start]):04X} at index "
                            f"{e.start}) and is not valid Unicode", path or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_values(k, path, depth + 1)
            _check_values(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(value, list):
        if depth + 1 <= MAX_DEPTH and _numbers_only(value):   # a token-id prompt: thousands of ints, no walk
            return
        for i, v in enumerate(value):   # numbers need no check
            if isinstance(v, (str, dict, list)) or depth + 1 > MAX_DEPTH:
                _check_values(v, f"{path}.{i}" if path else str(i), depth + 1)
