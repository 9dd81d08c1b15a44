"""OpenAI request bodies with their bounds, checked before anything is tokenized.

Unknown fields are accepted and ignored (clients send many). Every limit here names the field
when it is exceeded; the handler turns the pydantic error into an OpenAI-shaped 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_PROMPTS = 256
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_LOGIT_BIAS = 1024
MAX_MESSAGES = 4096
MAX_TEXT_CHARS = 4 * 1024 * 1024
MAX_TOKENS_LIMIT = 1 << 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat (OpenAI plus the extension fields of API.md)."""

    model_config = ConfigDict(extra="allow")

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
    user: str | None = None
    # extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(None, max_length=256)

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

    @field_validator("logit_bias")
    @classmethod
    def _bias_bounds(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for k, b in v.items():
            if not str(k).lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {k!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"values must be in [-100, 100], got {b}")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_bounds(cls, v: Any) -> Any:
        if isinstance(v, str):
            if len(v) > MAX_TEXT_CHARS:
                raise ValueError(f"at most {MAX_TEXT_CHARS} characters")
            return v
        if isinstance(v, list) and len(v) > (MAX_PROMPTS if v and not isinstance(v[0], int) else MAX_TEXT_CHARS):
            raise ValueError(f"at most {MAX_PROMPTS} prompts")
        if isinstance(v, list) and v and isinstance(v[0], str) and any(len(p) > MAX_TEXT_CHARS for p in v):
            raise ValueError(f"each prompt must have at most {MAX_TEXT_CHARS} characters")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text":
                raise ValueError(f"content parts of type {p.get('type')!r} are not supported (text only)")
            parts.append(str(p.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages_present(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("must contain at least one message")
        if sum(len(m.content) if isinstance(m.content, str) else 0 for m in v) > MAX_TEXT_CHARS:
            raise ValueError(f"at most {MAX_TEXT_CHARS} characters in all")
        return v

    @model_validator(mode="after")
    def _logprob_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def error_body(message: str, status: int, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
             500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}
    return {"error": {"message": message, "type": kind or kinds.get(status, "Error"), "param": param, "code": status}}
