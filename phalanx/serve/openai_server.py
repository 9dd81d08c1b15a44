"""The OpenAI-compatible HTTP server (FastAPI). Handlers are thin: parse, tokenize, call
``LLM.generate_async``, shape the response.

What a hostile or careless client cannot do:
- fail anyone else's request: a body is parsed and checked whole (``protocol.parse_body``)
  before anything reaches the engine; every prompt of a request is tokenized and checked before
  any is submitted, and if one submit fails the others are aborted;
- stall other clients: tokenization and chat templates run in a thread pool, off the event
  loop; bodies are capped at ``max_body_bytes`` however they are sent (chunked included);
- leave work behind: a client that goes away, streaming or not, has its requests aborted on
  every rank;
- get anything but an OpenAI-shaped error (``{"error": {"message", "type", "param",
  "code"}}``), whatever raised it: routing errors, bad JSON, validation, the engine.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import contextvars
import copy
import hmac
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from phalanx import __version__
from phalanx.llmapi.beam_search import BeamAborted, BeamSearch, BeamSearchOutput, BeamSearchParams
from phalanx.llmapi.llm import LLM, PreparedPrompt
from phalanx.llmapi.lora_request import LoRARequest
from phalanx.llmapi.outputs import RequestError, RequestOutput
from phalanx.llmapi.sampling_params import GuidedDecodingParams, SamplingParams, plain_token_ids
from phalanx.llmapi.tokenizer import Tokenizer
from phalanx.serve import lora_routes, messages_routes, native_routes, responses_routes, rollout_routes, tools
from phalanx.serve.item_stream import ItemStream
from phalanx.serve.messages import Conversation, MessagesRequest
from phalanx.serve.messages import error_body as anthropic_error
from phalanx.serve.metrics import ServerMetrics
from phalanx.serve.protocol import (
    TEMPLATE_FIELDS,
    BodyError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    NamedToolChoice,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
    parse_body,
    parse_tokenize,
)
from phalanx.serve.responses import ResponsesRequest, ResponseStore

logger = logging.getLogger("phalanx")

OPEN_PATHS = ("/health", "/health_generate", "/metrics")   # answered without the API key (probes, scrapers)
GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "regex", "ebnf")
T = TypeVar("T")


@dataclass
class ChatPlan:
    """How a chat request is prompted and its output read back (see serve/tools.py)."""

    messages: list[dict[str, Any]]        # for the chat template
    tools: list[dict[str, Any]] | None     # the tools in play (None: none, or tool_choice "none")
    forced: Any                            # "required" / {"function": ...} when the grammar forces a call
    parser: str | None                     # the tool-call parser of a free-running output
    guided: GuidedDecodingParams | None    # the output's grammar
    guided_field: str | None               # the request field it came from
    shown: list[dict[str, Any]] | None = None   # the tools the prompt shows (also under tool_choice "none")
    continued: bool = False                # the output goes on writing the final message (continue_final_message)


class _ChoiceStream:
    """One streamed choice: its text split into reasoning, content and tool-call deltas."""

    def __init__(self, plan: ChatPlan, reasoning_parser: str, include_reasoning: bool = True) -> None:
        self.plan = plan
        # a continued message did not open a <think> block the template would have (no generation prompt)
        self.reasoning = (tools.ReasoningStream(reasoning_parser == "deepseek_r1" and not plan.continued)
                          if reasoning_parser != "none" else None)
        self.include_reasoning = include_reasoning     # False: the reasoning is read off and left out
        self.tool_stream = (tools.ToolCallStream(plan.parser, plan.tools)
                            if plan.tools is not None and plan.parser is not None and plan.forced is None else None)
        self.forced_text = ""
        self.named: tools.ToolCall | None = None
        self.called = False

    def feed(self, text: str, final: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(the delta's reasoning/content fields, its tool_calls) for new text."""
        delta: dict[str, Any] = {}
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, final)
            if thought and self.include_reasoning:
                delta["reasoning_content"] = thought
        if self.plan.forced is not None:
            forced = self._forced(text, final)
            if final and self.plan.forced == "required" and not self.called and self.forced_text:
                delta["content"] = self.forced_text      # cut short before a whole call: what it wrote, as text
            return delta, forced
        if self.tool_stream is None:
            if text:
                delta["content"] = text
            return delta, []
        content = self.tool_stream.feed(text)
        calls: list[dict[str, Any]] = []
        if final:
            rest, found = self.tool_stream.finish()
            content += rest
            calls = [c.to_openai(i) for i, c in enumerate(found)]
            self.called = bool(found)
        if content:
            delta["content"] = content
        return delta, calls

    def _forced(self, text: str, final: bool) -> list[dict[str, Any]]:
        """A named function's arguments stream as they come; "required" is read at the end."""
        forced = self.plan.forced
        if forced != "required":
            if self.named is None and not text and not final:
                return []            # nothing of the call yet (a reasoning parser took the text so far)
            if self.named is None:   # the call's first delta: its id, name and what arguments there are yet
                name = forced["function"]["name"]
                self.named = tools.ToolCall(name, "", tools.call_id(self.plan.parser, name, 0))
                self.called = True
                return [dict(self.named.to_openai(0), function={"name": self.named.name, "arguments": text})]
            return [{"index": 0, "function": {"arguments": text}}] if text else []
        self.forced_text += text
        if not final:
            return []
        try:
            found = tools.forced_tool_calls(self.forced_text, forced, self.plan.parser)
        except (ValueError, KeyError, TypeError, RecursionError):   # cut short (length, a stop string): its whole calls
            found = tools.complete_forced_calls(self.forced_text, self.plan.parser)
        self.called = bool(found)
        return [c.to_openai(i) for i, c in enumerate(found)]



class _TextOffsets:
    """Where each token starts in a choice's text, in characters (completions' ``text_offset``):
    the tokens' bytes decoded as they come, so a token that holds part of a character starts
    where that character does."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    @classmethod
    def echoing(cls, text: str, prompt_bytes: list[bytes]) -> _TextOffsets:
        """Offsets into an echoed prompt ``text``: its tokens' bytes can hold more than the text
        (a BOS's text, the space SentencePiece marks the start with), at the front, so the count
        starts that much below zero (and no offset is below zero)."""
        return cls(min(0, len(text) - len(b"".join(prompt_bytes).decode("utf-8", "replace"))))

    def advance(self, token_bytes: bytes) -> int:
        offset = max(0, self.chars)
        self.chars += len(self._utf8.decode(token_bytes))
        return offset


def decodes_call_markers(plan: ChatPlan, special_strings: list[str], fields_set: set[str]) -> bool:
    """Whether a chat output is decoded with its special tokens: free-running tools whose parser
    opens a call with a marker the tokenizer marks special (some Hermes models' ``<tool_call>``,
    DeepSeek's ``<｜tool▁calls▁begin｜>`` where its tokenizer marks it so),
    which decoding would otherwise drop, so that the parser never saw the call (vLLM decodes them
    so too); not where the request set ``skip_special_tokens`` itself."""
    return (plan.parser in tools.MARKED_CALLS and plan.tools is not None
            and plan.forced is None and "skip_special_tokens" not in fields_set
            and any(m in special_strings for m in tools.CALL_MARKERS[plan.parser]))


def _chat_finish(finish: str | None, called: bool, plan: ChatPlan) -> str | None:
    """A chat choice's finish_reason: "tool_calls" where the model chose to call (tool_choice auto
    or required) and stopped; a named function's forced call stops as "stop" (OpenAI, vLLM)."""
    if finish == "stop" and called and not isinstance(plan.forced, dict):
        return "tool_calls"
    return finish


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class BodyTooLarge(Exception):
    """The client sent more body bytes than the server accepts."""


def _err(status: int, message: str, param: str | None = None, path: str = "") -> JSONResponse:
    """An error in the shape of the API the route belongs to: Anthropic's on its Messages
    routes, OpenAI's everywhere else."""
    if path.startswith(messages_routes.PATH):
        return JSONResponse(anthropic_error(status, message), status_code=status)
    return JSONResponse(error_body(message, status, param), status_code=status)


class Guard:
    """ASGI middleware in front of every route: the API key and the body-size limit.

    Written against ASGI directly (not as an ``@app.middleware("http")`` function, whose
    wrapper hides the client's disconnect from the handlers). The size limit is enforced on
    the bytes actually received, so a chunked upload without a Content-Length is cut off too.
    """

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope["path"]
        if self.api_key and path not in OPEN_PATHS:
            given = headers.get("authorization", "")
            # (Anthropic's clients send the key as x-api-key)
            token = given[7:] if given.lower().startswith("bearer ") else headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return await _err(401, "Invalid or missing API key (send 'Authorization: Bearer <key>' or "
                                       "'x-api-key: <key>')", path=path)(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await _err(413, f"the request body of {length} bytes exceeds the limit of "
                                   f"{self.max_body_bytes}", path=path)(scope, receive, send)
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(f"the request body exceeds the limit of {self.max_body_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)


# the LoRA adapter the request being answered named as its model (``_check_model``): a request is
# answered in one task (a stream's in a task started from it), whose context holds it
_ADAPTER: contextvars.ContextVar[LoRARequest | None] = contextvars.ContextVar("adapter", default=None)


class OpenAIServer:
    def __init__(self, llm: LLM, model_name: str, api_key: str | None = None, chat_template: str | None = None,
                 max_body_bytes: int = 8 << 20, debug_endpoints: bool = False, tokenizer_threads: int = 4,
                 tool_call_parser: str = "auto", reasoning_parser: str = "none",
                 allowed_origins: list[str] | None = None, responses_store_size: int = 1024,
                 lora_modules: dict[str, LoRARequest] | None = None, runtime_lora_updating: bool = False,
                 trust_request_chat_template: bool = False) -> None:
        self.llm, self.model_name, self.api_key = llm, model_name, api_key
        # a chat request's own chat_template is rendered (vLLM's --trust-request-chat-template), else refused
        self.trust_request_chat_template = trust_request_chat_template
        # adapters served as models of their own (vLLM's --lora-modules): a request names one as its model
        self.lora_modules = dict(lora_modules or {})
        self.runtime_lora_updating = runtime_lora_updating   # /v1/load_lora_adapter and /v1/unload_lora_adapter
        if (self.lora_modules or runtime_lora_updating) and llm.args.lora is None:
            raise ValueError("lora_modules: the engine serves no LoRA adapters (enable_lora or lora_config)")
        if model_name in self.lora_modules:
            raise ValueError(f"lora_modules: {model_name!r} is the base model's name")
        self.responses = ResponseStore(responses_store_size)   # for previous_response_id and GET /v1/responses/{id}
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.model_type = llm.source.config.model_type
        self.debug_endpoints = debug_endpoints
        self.chat_template, self.max_body_bytes = chat_template, max_body_bytes
        self.created = int(time.time())
        sum_ranks = bool(getattr(llm.args, "enable_attention_dp", False))
        self.metrics = ServerMetrics(model_name, llm.latest_stats, sum_ranks)
        self._text_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="phalanx-tokenize")
        self._in_flight: weakref.WeakSet[RequestOutput] = weakref.WeakSet()   # every submitted request
        self._stopping = False   # the drain time is over: nothing new is submitted
        self.app = FastAPI(title="phalanx", version=__version__)
        self._routes()
        self.app.openapi = self._openapi   # type: ignore[method-assign]
        self.app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
        if allowed_origins:   # outside the guard: a browser's preflight carries no key
            self.app.add_middleware(CORSMiddleware, allow_origins=allowed_origins,
                                    allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"])

    # -- plumbing ------------------------------------------------------------------------------------
    def _routes(self) -> None:
        app = self.app

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException):
            path = request.url.path
            if exc.status_code == 404:
                return _err(404, f"there is no route {request.method} {path}", path=path)
            if exc.status_code == 405:
                return _err(405, f"method {request.method} is not allowed on {path}", path=path)
            return _err(exc.status_code, str(exc.detail), path=path)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError):
            errors = exc.errors()
            first = errors[0] if errors else {}
            loc = [str(x) for x in first.get("loc", []) if x not in ("body", "path", "query")]
            param = ".".join(loc) or None
            msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
            return _err(400, f"{param}: {msg}" if param else msg, param, request.url.path)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, exc: ApiError):
            return _err(exc.status, exc.message, exc.param, request.url.path)

        @app.exception_handler(BodyTooLarge)
        async def too_large(request: Request, exc: BodyTooLarge):
            return _err(413, str(exc), path=request.url.path)

        @app.exception_handler(Exception)
        async def internal(request: Request, exc: Exception):
            logger.exception("internal error")
            return _err(500, f"internal error: {type(exc).__name__}", path=request.url.path)

        app.get("/health")(self.health)
        app.get("/health_generate")(self.health_generate)
        app.get("/version")(lambda: {"version": __version__})
        app.get("/metrics")(lambda: Response(self.metrics.render(), media_type="text/plain; version=0.0.4"))
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}")(self.model_card_route)
        app.post("/v1/completions", openapi_extra=_body_doc(CompletionRequest))(self.completions)
        app.post("/v1/chat/completions", openapi_extra=_body_doc(ChatCompletionRequest))(self.chat)
        app.post("/tokenize", openapi_extra=_body_doc(TokenizeCompletionRequest, TokenizeChatRequest))(self.tokenize)
        app.post("/detokenize", openapi_extra=_body_doc(DetokenizeRequest))(self.detokenize)
        rollout_routes.add_routes(self)   # the RL hand-off: pause, sleep, weight updates
        native_routes.add_routes(self)    # SGLang's /generate and /abort_request (RL trainers' rollouts)
        if self.runtime_lora_updating:
            lora_routes.add_routes(self)  # adapters loaded and unloaded while serving
        responses_routes.add_routes(self)  # OpenAI's Responses API, run as chat requests
        messages_routes.add_routes(self)   # Anthropic's Messages API, run as chat requests
        if self.debug_endpoints:   # inspection for tests and operators; off by default
            app.get("/debug/check_integrity")(self.debug_integrity)
            app.get("/debug/stats")(self.debug_stats)

    def _openapi(self) -> dict[str, Any]:
        """The OpenAPI document with the answers the server really gives: request bodies as
        parsed by ``protocol``, and OpenAI-shaped errors (400, never FastAPI's 422)."""
        if self.app.openapi_schema:
            return self.app.openapi_schema
        doc = get_openapi(title="phalanx", version=__version__, routes=self.app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
                      DetokenizeRequest, ResponsesRequest, MessagesRequest, Conversation, ErrorResponse):
            defs = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(defs.pop("$defs", {}))
            schemas[model.__name__] = defs
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for path, ops in doc.get("paths", {}).items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                codes = ["401", "500", "503"] if path not in OPEN_PATHS else ["503"]
                if op.get("requestBody") or "{" in path:
                    codes += ["400", "404", "413"]
                for code in codes:
                    responses.setdefault(code, {"description": "An OpenAI-shaped error", **error})
        self.app.openapi_schema = doc
        return doc

    async def _text(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer / template work in the text pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, lambda: fn(*args))

    async def _parse(self, request: Request, model: type[T]) -> T:
        raw = await request.body()
        try:
            return parse_body(raw, model)   # type: ignore[type-var]
        except BodyError as e:
            raise ApiError(400, e.message, e.param) from None

    def _check_model(self, model: str | None) -> None:
        """The request's model: the base model, or a LoRA adapter it serves (which the request then
        runs with: ``_submit_all``, and which its answer names); a 404 naming the field otherwise."""
        if model is None or model == self.model_name:
            _ADAPTER.set(None)
            return
        adapter = self.lora_modules.get(model)
        if adapter is None:
            served = ", ".join(repr(m) for m in (self.model_name, *self.lora_modules))
            raise ApiError(404, f"The model '{model}' does not exist; this server serves {served}", "model")
        _ADAPTER.set(adapter)

    @property
    def answering_model(self) -> str:
        """The model a response names: the adapter the request asked for, or the base model."""
        adapter = _ADAPTER.get()
        return self.model_name if adapter is None else adapter.lora_name

    # -- simple routes -------------------------------------------------------------------------------
    async def health(self):
        if self.llm.is_alive:
            return Response(status_code=200)
        return _err(503, f"the engine is not running: {self.llm.dead_error}")

    async def health_generate(self):
        if not self.llm.is_alive:
            return _err(503, f"the engine is not running: {self.llm.dead_error}")
        eos = self.llm._eos_token_ids()
        # submitted as the API's requests are (tracked, refused once the server stops: an ApiError)
        [fut] = self._submit_all([([eos[0] if eos else 0],
                                   SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))], None, "prompt")
        timeout = 30.0
        try:
            await asyncio.wait_for(fut.aresult(), timeout=timeout)
        except asyncio.TimeoutError:
            return _err(503, f"no token within {timeout:.0f}s")
        except Exception as e:
            return _err(503, f"generation failed: {e}")
        finally:   # timed out, or this handler cancelled: nobody waits for the probe
            if not fut.done:
                fut.abort()
        if fut.outputs[0].finish_reason == "abort":
            return _err(503, "the server is shutting down")
        return Response(status_code=200)

    def _model_card(self, adapter: LoRARequest | None = None) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "phalanx",
                "root": self.model_name, "max_model_len": self.llm.max_seq_len}
        if adapter is not None:   # vLLM's card of an adapter: its parent is the base model
            card.update(id=adapter.lora_name, root=adapter.lora_name, parent=self.model_name)
        return card

    async def models(self):
        return {"object": "list", "data": [self._model_card(), *map(self._model_card, self.lora_modules.values())]}

    async def model_card_route(self, model_id: str):
        self._check_model(model_id)
        return self._model_card(_ADAPTER.get())

    async def debug_integrity(self):
        res = await asyncio.to_thread(self.llm.control, "check_integrity")
        return JSONResponse({"ok": res.ok, "per_rank": res.per_rank}, status_code=200 if res.ok else 500)

    async def debug_stats(self):
        return await asyncio.to_thread(self.llm.stats)

    # -- shared pieces ---------------------------------------------------------------------------------
    def _sampling(self, req: Any, max_tokens: int | None, logprobs: int | None,
                  prompt_logprobs: int | None = None, guided: GuidedDecodingParams | None = None,
                  skip_special_tokens: bool | None = None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens, min_tokens=req.min_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, seed=req.seed, n=req.n,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty or 1.0, logit_bias=req.logit_bias,
                allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, guided_decoding=guided,
                skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens)
        except ValueError as e:
            raise ApiError(400, str(e), str(e).split(" ", 1)[0]) from None

    def _output_limit(self, prompt_len: int, asked: int | None, what: str, field: str = "max_tokens") -> int:
        """The output's token limit: ``asked`` (the client's ``field``), or what the context leaves."""
        limit = self.llm.max_seq_len
        if prompt_len >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your {what} has "
                                f"{prompt_len} tokens, leaving no room for output.", what)
        if asked is None:
            return limit - prompt_len
        if prompt_len + asked > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_len + asked} tokens ({prompt_len} in the {what}, {asked} in the "
                                f"completion). Please reduce the length of the {what} or the completion.",
                           field)
        return asked

    def _submit_all(self, jobs: list[tuple[list[int], SamplingParams]], salt: str | None,
                    what: str, prepared: bool = False) -> list[RequestOutput]:
        """Submit checked prompts; if one is refused, the ones already submitted are aborted.
        ``prepared``: the LLM class checked them before (a beam search's steps), so they go in as
        they are, in one call."""
        if self._stopping:
            raise ApiError(503, "the server is shutting down")
        futs: list[RequestOutput] = []
        try:
            adapter = _ADAPTER.get()
            if prepared:
                futs = self.llm._submit_all([PreparedPrompt(None, ids, sp) for ids, sp in jobs], salt, True,
                                            [adapter] * len(jobs) if adapter is not None else None)
                self._in_flight.update(futs)
            else:
                for ids, sp in jobs:
                    futs.append(self.llm.generate_async(ids, sp, streaming=True, cache_salt=salt,
                                                        lora_request=adapter))
                    self._in_flight.add(futs[-1])
        except ValueError as e:   # named by its field where it begins with one (stop_token_ids past the vocabulary)
            _abort(futs)
            named = str(e).split(" ", 1)[0].rstrip(":")
            raise ApiError(400, str(e), named if named in _PARAM_FIELDS else what) from None
        except RuntimeError as e:
            _abort(futs)
            raise ApiError(503, f"the engine is not running: {e}") from None
        except BaseException:
            _abort(futs)
            raise
        return futs

    def abort_in_flight(self) -> int:
        """Abort every request still running (the server stops and its drain time is over): each
        ends as an aborted request does (finish reason "abort", the tokens so far), so that its
        handler answers in full and a stream ends with its last chunk and ``[DONE]``, instead of
        being cancelled mid-response; a request not yet submitted (its body still arriving, its
        prompt being tokenized) is refused (503) when it would be. The number aborted."""
        self._stopping = True
        left = [f for f in self._in_flight if not f.done]
        for f in left:
            f.abort()
        if left:
            logger.warning("phalanx serve: the drain time is over; %d requests in flight aborted", len(left))
        return len(left)

    async def _collect(self, futs: list[RequestOutput], request: Request) -> list[RequestOutput]:
        """Wait for every request; abort all of them if the client goes away."""
        async def disconnected() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        done: asyncio.Future[list[RequestOutput]] = asyncio.ensure_future(asyncio.gather(*(f.aresult() for f in futs)))
        watch: asyncio.Future[None] = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([done, watch], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        finally:   # the client left, or this handler was cancelled: nothing may keep running
            watch.cancel()
            gone = not done.done()
            if gone:
                _abort(futs)
                done.cancel()
                self.metrics.client_aborts.labels(self.model_name).inc()
        if gone:
            raise ApiError(499, "client disconnected")
        try:
            return done.result()
        except RequestError as e:   # one failed: the others of the request stop too
            _abort(futs)
            raise ApiError(503 if not self.llm.is_alive else 500, f"generation failed: {e}") from None

    def _observe(self, fut: RequestOutput) -> None:
        self.metrics.observe(fut._state, len(fut.prompt_token_ids), sum(len(o.token_ids) for o in fut.outputs),
                             [o.finish_reason for o in fut.outputs])

    def _usage(self, futs: list[RequestOutput], shown: bool = True) -> dict[str, Any]:
        """Usage of these requests; none of their tokens when they are not ``shown`` (echo alone)."""
        prompt = sum(len(f.prompt_token_ids) for f in futs)
        completion = sum(len(o.token_ids) for f in futs for o in f.outputs) if shown else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in futs)}}

    def _token_str(self, token_id: int) -> str:
        return self.llm.tokenizer.token_text(token_id) if self.llm.tokenizer else str(token_id)

    def _token_piece(self, token_id: int) -> bytes:
        """A token's own UTF-8 bytes (part of a character's where it holds part of one)."""
        return self.llm.tokenizer.token_bytes(token_id) if self.llm.tokenizer else str(token_id).encode()

    def _error_event(self, error: Exception) -> str:
        return _sse(error_body(f"generation failed: {error}", 500 if self.llm.is_alive else 503))

    # -- /v1/completions -------------------------------------------------------------------------------
    async def completions(self, request: Request):
        body = await self._parse(request, CompletionRequest)
        self._check_model(body.model)
        if body.use_beam_search:
            return await self._beam_completions(body, request)
        if body.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if body.best_of not in (None, body.n):
            raise ApiError(400, "best_of must equal n (best-of selection is not supported)", "best_of")
        keep = self._kept_prompt_tokens(body.truncate_prompt_tokens)
        if _has_text(body.prompt) or body.echo:     # tokenizer work: in the text pool
            prompts = await self._text(self._prompts, body.prompt, body.echo, keep, body.add_special_tokens)
        else:                                          # token ids only: checked here, no hop
            prompts = self._prompts(body.prompt, body.echo, keep)
        # the prompt's logprobs: echoed ones and vLLM's prompt_logprobs (the widest ask of the two)
        prompt_lp = max((k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None),
                        default=None)
        try:
            guided = tools.guided_params(body, None)
        except ValueError as e:
            raise ApiError(400, str(e), str(e).split(":", 1)[0]) from None
        # echo alone (max_tokens 0): the prompt's pass samples one token, which is not shown (vLLM's way)
        asked = 1 if body.echo_only else body.max_tokens
        jobs = [(ids, self._sampling(body, self._output_limit(len(ids), asked, "prompt"), body.logprobs,
                                     prompt_lp, guided)) for _, ids in prompts]
        if jobs:
            field = next((f for f in GUIDED_FIELDS if getattr(body, f, None) is not None), None)
            await self._check_grammar(jobs[0][1], field)
        await self._tokenize_bad_words(body.bad_words, [sp for _, sp in jobs])
        futs = self._submit_all(jobs, body.cache_salt, "prompt")
        texts = [text for text, _ in prompts]
        rid = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        if body.stream:
            return self._sse(self._stream_completions(rid, body, futs, texts))
        outs = await self._collect(futs, request)
        choices, name = [], self._namer(body)
        for i, (out, text) in enumerate(zip(outs, texts, strict=True)):
            self._observe(out)
            for o in (_unsampled(out) if body.echo_only else out).outputs:
                prefix = (text or "") if body.echo else ""
                choice = {"index": i * body.n + o.index, "text": prefix + o.text, "finish_reason": o.finish_reason,
                          "stop_reason": o.stop_reason, "logprobs": None}
                if body.logprobs is not None:
                    choice["logprobs"] = self._completion_logprobs(out, o, body.echo, text, body.logprobs, name)
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(out, body.prompt_logprobs)
                _add_ids(choice, body, o, out.prompt_token_ids)
                choices.append(choice)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.answering_model,
                "choices": choices, "usage": self._usage(outs, not body.echo_only),
                "weight_version": _weight_version(outs)}

    def _kept_prompt_tokens(self, truncate_prompt_tokens: int | None) -> int | None:
        try:
            return self.llm.kept_prompt_tokens(truncate_prompt_tokens)
        except ValueError as e:
            raise ApiError(400, str(e), "truncate_prompt_tokens") from None

    def _prompts(self, prompt: Any, with_text: bool, keep: int | None = None,
                 add_special_tokens: bool = True) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of every prompt; all are checked before any is submitted. The text
        of a token-id prompt is decoded only ``with_text`` (echo): otherwise it is None. With
        ``keep`` (truncate_prompt_tokens) a longer prompt keeps its last ``keep`` tokens, and
        its text is theirs."""
        out = self._whole_prompts(prompt, with_text, keep is not None, add_special_tokens)
        if keep is None or all(len(ids) <= keep for _, ids in out):
            return out
        tok = self.llm.tokenizer
        return [(text, ids) if len(ids) <= keep else
                (tok.decode(ids[-keep:], skip_special_tokens=False) if tok and with_text else None, ids[-keep:])
                for text, ids in out]

    def _whole_prompts(self, prompt: Any, with_text: bool, unbounded: bool,
                       add_special_tokens: bool) -> list[tuple[str | None, list[int]]]:
        tok = self.llm.tokenizer
        if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        out: list[tuple[str | None, list[int]]] = []
        for i, p in enumerate(prompt):
            where = "prompt" if len(prompt) == 1 else f"prompt.{i}"
            if not p:
                raise ApiError(400, f"{where} must not be empty", "prompt")
            if isinstance(p, str):
                if tok is None:
                    raise ApiError(400, "this server has no tokenizer: send token ids", "prompt")
                try:
                    out.append((p, tok.encode(p, add_special_tokens,
                                              max_tokens=None if unbounded else self.llm.max_seq_len - 1)))
                except ValueError as e:
                    raise ApiError(400, f"{where}: {e}; this model's maximum context length is "
                                        f"{self.llm.max_seq_len} tokens", "prompt") from None
            else:
                bad = None if plain_token_ids(p, self.llm.vocab_size) else next(
                    (t for t in p if not 0 <= t < self.llm.vocab_size), None)
                if bad is not None:
                    raise ApiError(400, f"{where}: token id {bad} is outside the vocabulary [0, "
                                        f"{self.llm.vocab_size})", "prompt")
                out.append((tok.decode(p, skip_special_tokens=False) if tok and with_text else None, list(p)))
        return out

    def _namer(self, body: Any) -> Callable[[int], str]:
        """How a request's logprobs name tokens: their text, or ``token_id:<id>`` with vLLM's
        ``return_tokens_as_token_ids`` (a token that is part of a character, or whose text
        several tokens share, is then told apart)."""
        return _token_id_name if body.return_tokens_as_token_ids else self._token_str

    def _prompt_logprobs(self, out: RequestOutput, k: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first), the ``k`` likeliest
        tokens and the prompt's own, keyed by id: {logprob, rank in the vocabulary, decoded_token
        (its text, also under return_tokens_as_token_ids, as vLLM's)}."""
        return [None if entry is None else {str(t): {"logprob": x.logprob, "rank": x.rank,
                                                     "decoded_token": self._token_str(t)}
                                            for t, x in _with_chosen(entry, tid, k)}
                for tid, entry in zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=False)]

    def _completion_logprobs(self, out: RequestOutput, o: Any, echo: bool, text: str | None,
                             k: int, name: Callable[[int], str]) -> dict[str, Any]:
        """OpenAI's completion logprobs (``k`` alternatives a token): with ``echo`` the prompt's
        tokens come first (the very first one has no logprob), then the generated ones."""
        lp: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offsets = self._add_echo_logprobs(lp, out, text, k, name) if echo else _TextOffsets()
        self._add_logprobs(lp, o.token_ids, o.logprobs or [], offsets, k, name)
        return lp

    def _add_echo_logprobs(self, lp: dict[str, list], out: RequestOutput, text: str | None, k: int,
                           name: Callable[[int], str]) -> _TextOffsets:
        """The echoed prompt's logprobs, its offsets into ``text``; the offsets to go on from."""
        pieces = [self._token_piece(t) for t in out.prompt_token_ids]
        offsets = _TextOffsets.echoing(text or "", pieces)
        self._add_logprobs(lp, out.prompt_token_ids, out.prompt_logprobs or [], offsets, k, name, pieces)
        return offsets

    def _add_logprobs(self, lp: dict[str, list], token_ids: list[int], entries: list, offsets: _TextOffsets,
                      k: int, name: Callable[[int], str], pieces: list[bytes] | None = None) -> None:
        for i, (tid, entry) in enumerate(zip(token_ids, entries, strict=False)):
            lp["tokens"].append(name(tid))
            lp["token_logprobs"].append(entry[tid].logprob if entry is not None else None)
            lp["top_logprobs"].append(None if entry is None else
                                      {name(t): x.logprob for t, x in _with_chosen(entry, tid, k)})
            lp["text_offset"].append(offsets.advance(pieces[i] if pieces is not None else self._token_piece(tid)))

    async def _stream_completions(self, rid: str, body: CompletionRequest, futs: list[RequestOutput],
                                  texts: list[str | None]) -> AsyncIterator[str]:
        created = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.answering_model}
        # echo: the prompt goes first; with logprobs it waits for all of the prompt's logprobs (they
        # come a prefill chunk at a time, all of them before the first token) and carries them
        echo_due = [body.echo] * len(futs)
        offsets = [_TextOffsets() for _ in range(len(futs) * body.n)]
        sent_ids, sent_chars = [0] * (len(futs) * body.n), [0] * (len(futs) * body.n)   # per choice
        ended = [False] * (len(futs) * body.n)     # a choice's finish sent (as it ends, not with the last)
        running = body.stream_options is not None and body.stream_options.continuous
        name = self._namer(body)

        def usage(i: int, index: int) -> dict[str, Any]:   # vLLM's continuous usage: this choice's so far
            return {"usage": _running_usage(len(futs[i].prompt_token_ids), sent_ids[index])} if running else {}
        if body.echo and body.logprobs is None:
            for i, text in enumerate(texts):
                for k in range(body.n):
                    yield _sse({**base, "choices": [{"index": i * body.n + k, "text": text or "", "logprobs": None,
                                                     "finish_reason": None}], **usage(i, i * body.n + k)})
                    offsets[i * body.n + k] = _TextOffsets(len(text or ""))
            echo_due = [False] * len(futs)
        async for i, out in _merge(futs):
            if isinstance(out, Exception):
                yield self._error_event(out)
                break
            if body.echo_only:
                out = _unsampled(out)
            if echo_due[i] and (out.finished or len(out.prompt_logprobs or ()) >= len(out.prompt_token_ids)):
                echo_due[i] = False
                for k in range(body.n):
                    lp: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                    offsets[i * body.n + k] = self._add_echo_logprobs(lp, out, texts[i], body.logprobs or 0, name)
                    yield _sse({**base, "choices": [{"index": i * body.n + k, "text": texts[i] or "", "logprobs": lp,
                                                     "finish_reason": None}], **usage(i, i * body.n + k)})
            if echo_due[i]:
                continue   # with n > 1 another sequence may have tokens already: they follow the echo
            for o in out.outputs:
                index = i * body.n + o.index
                finishing = o.finish_reason is not None and not ended[index]
                ended[index] = ended[index] or finishing
                # what this choice has not sent yet (counted, not the pull's diffs: a pull held back
                # for the echo is not lost)
                new_ids, text = o.token_ids[sent_ids[index]:], o.text[sent_chars[index]:]
                if not text and not new_ids and not finishing:
                    continue
                choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                                          "finish_reason": o.finish_reason if finishing else None}
                if body.logprobs is not None:
                    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                    new_lps = (o.logprobs or [])[sent_ids[index]:sent_ids[index] + len(new_ids)]
                    self._add_logprobs(lp, new_ids, new_lps, offsets[index], body.logprobs, name)
                    choice["logprobs"] = lp
                sent_ids[index] += len(new_ids)
                sent_chars[index] += len(text)
                if finishing:
                    choice["stop_reason"] = o.stop_reason
                if body.return_token_ids:
                    choice["token_ids"] = new_ids
                yield _sse({**base, "choices": [choice], "weight_version": out.weight_version, **usage(i, index)})
        for f in futs:
            self._observe(f)
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({**base, "choices": [], "usage": self._usage(futs, not body.echo_only)})
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions --------------------------------------------------------------------------
    async def chat(self, request: Request):
        body = await self._parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        if body.use_beam_search:
            return await self._beam_chat(body, request)
        fut, plan = await self._submit_chat(body, "messages", body.output_limit_field)
        rid = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        if body.stream:
            return self._sse(self._stream_chat(rid, body, fut, plan))
        [out] = await self._collect([fut], request)
        self._observe(out)
        choices = []
        for o in out.outputs:
            (message, called), finish = self._chat_message(o.text, plan, body.include_reasoning), o.finish_reason
            finish = _chat_finish(finish, called, plan)
            if _echoed(body):
                message["content"] = _echoed(body) + (message["content"] or "")
            choice = {"index": o.index, "message": message, "finish_reason": finish, "stop_reason": o.stop_reason,
                      "logprobs": None}
            if body.logprobs:
                choice["logprobs"] = {"content": self._chat_logprobs(o.token_ids, o.logprobs or [],
                                                                     body.top_logprobs or 0, self._namer(body))}
            _add_ids(choice, body, o, None)
            choices.append(choice)
        response = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.answering_model,
                    "choices": choices, "usage": self._usage([out]), "weight_version": _weight_version([out])}
        if body.return_token_ids:
            response["prompt_token_ids"] = out.prompt_token_ids
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = self._prompt_logprobs(out, body.prompt_logprobs)
        return response

    async def _submit_chat(self, body: ChatCompletionRequest, what: str,
                           limit_field: str) -> tuple[RequestOutput, ChatPlan]:
        """Render, tokenize, check and submit a chat request (also what a Responses request runs
        as: ``what`` and ``limit_field`` are the fields a context-length error names)."""
        tokenizer = self._tokenizer("chat needs one", what)
        ids, plan = await self._chat_prompt(body, what)
        k = (body.top_logprobs or 0) if body.logprobs else None
        keep = decodes_call_markers(plan, tokenizer.special_strings(), body.model_fields_set)
        sp = self._sampling(body, self._output_limit(len(ids), body.output_limit, what, limit_field),
                            k, body.prompt_logprobs, guided=plan.guided, skip_special_tokens=False if keep else None)
        await self._check_grammar(sp, plan.guided_field)
        await self._tokenize_bad_words(body.bad_words, [sp])
        [fut] = self._submit_all([(ids, sp)], body.cache_salt, what)
        return fut, plan

    async def _chat_prompt(self, body: ChatCompletionRequest, what: str) -> tuple[list[int], ChatPlan]:
        """A chat request's prompt ids (truncated as it asks) and its plan."""
        tokenizer = self._tokenizer("chat needs one", what)
        plan = self._chat_plan(body, await self._template(body, tokenizer))
        keep = self._kept_prompt_tokens(body.truncate_prompt_tokens)
        ids = await self._chat_ids(plan.messages, plan.shown, body, self.llm.max_seq_len - 1 if keep is None else None)
        return (ids[-keep:] if keep is not None else ids), plan

    # -- beam search (vLLM's use_beam_search: n beams, the n best answers) ---------------------------
    async def _beams(self, prompts: list[list[int]], body: CompletionRequest | ChatCompletionRequest, what: str,
                     limit_field: str, request: Request) -> tuple[list[BeamSearchOutput], list[int]]:
        """Each prompt's ``body.n`` best beams (``llmapi/beam_search.py``), each within its own
        output limit, each step's requests submitted and awaited here (a client that leaves
        aborts them), and each prompt's cached tokens at the first step."""
        asked = body.output_limit if isinstance(body, ChatCompletionRequest) else body.max_tokens
        limits = [self._output_limit(len(ids), asked, what, limit_field) for ids in prompts]
        params = BeamSearchParams(beam_width=body.n, max_tokens=max(limits), ignore_eos=body.ignore_eos,
                                  length_penalty=body.length_penalty,
                                  include_stop_str_in_output=body.include_stop_str_in_output)
        try:
            search = BeamSearch(self.llm, prompts, params, None, limits)
        except ValueError as e:
            raise ApiError(400, str(e), what) from None
        except RuntimeError as e:
            raise ApiError(503, f"the engine is not running: {e}") from None
        cached = [0] * len(prompts)
        while step := search.step():
            futs = self._submit_all([(ids, search.request) for ids in step], None, what, prepared=True)
            outs = await self._collect(futs, request)
            if search.steps == 0:
                cached = [o.cached_tokens for o in outs]
            try:
                search.advance(outs)
            except BeamAborted:
                raise ApiError(503, "the server is shutting down" if self._stopping else
                               "a step of the beam search was aborted") from None
        return search.results(with_prompt=False, skip_special_tokens=body.skip_special_tokens), cached

    def _beam_usage(self, prompts: list[list[int]], outs: list[BeamSearchOutput], cached: list[int]) -> dict[str, Any]:
        prompt = sum(len(ids) for ids in prompts)
        completion = sum(len(s.tokens) - len(ids) for ids, o in zip(prompts, outs, strict=True) for s in o.sequences)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached)}}

    async def _beam_completions(self, body: CompletionRequest, request: Request) -> dict[str, Any]:
        if _has_text(body.prompt):
            prompts = await self._text(self._prompts, body.prompt, False, None, body.add_special_tokens)
        else:
            prompts = self._prompts(body.prompt, False, None)
        ids = [p for _, p in prompts]
        outs, cached = await self._beams(ids, body, "prompt", "max_tokens", request)
        choices = []
        for i, (p, out) in enumerate(zip(ids, outs, strict=True)):
            for j, seq in enumerate(out.sequences):
                choice: dict[str, Any] = {"index": i * body.n + j, "text": seq.text, "finish_reason": seq.finish_reason,
                                          "stop_reason": seq.stop_reason, "logprobs": None}
                if body.return_token_ids:
                    choice["token_ids"], choice["prompt_token_ids"] = seq.tokens[len(p):], p
                choices.append(choice)
        return {"id": f"cmpl-{body.request_id or uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.answering_model, "choices": choices,
                "usage": self._beam_usage(ids, outs, cached)}

    async def _beam_chat(self, body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
        ids, plan = await self._chat_prompt(body, "messages")
        [out], cached = await self._beams([ids], body, "messages", body.output_limit_field, request)
        choices = []
        for j, seq in enumerate(out.sequences):
            message, _ = self._chat_message(seq.text or "", plan, body.include_reasoning)
            choice: dict[str, Any] = {"index": j, "message": message, "finish_reason": seq.finish_reason,
                                      "stop_reason": seq.stop_reason, "logprobs": None}
            if body.return_token_ids:
                choice["token_ids"] = seq.tokens[len(ids):]
            choices.append(choice)
        response = {"id": f"chatcmpl-{body.request_id or uuid.uuid4().hex}", "object": "chat.completion",
                    "created": int(time.time()), "model": self.answering_model, "choices": choices,
                    "usage": self._beam_usage([ids], [out], cached)}
        if body.return_token_ids:
            response["prompt_token_ids"] = ids
        return response

    async def _chat_ids(self, messages: list[dict[str, Any]], active_tools: list[dict[str, Any]] | None,
                        body: ChatCompletionRequest | TokenizeChatRequest, limit: int | None) -> list[int]:
        """A conversation's token ids as the chat template renders it (with the tools where the
        template renders them, ending inside the final message with ``continue_final_message``),
        in the text pool; at most ``limit`` (a 400 naming messages)."""
        tokenizer = self.llm.tokenizer
        assert tokenizer is not None
        kwargs = dict(body.chat_template_kwargs or {})
        template = await self._template(body, tokenizer)
        if active_tools is not None and tools.template_renders_tools(template):
            kwargs["tools"] = active_tools
        for field in TEMPLATE_FIELDS:     # documents, reasoning_effort: only to a template that reads them
            value = getattr(body, field)
            if value is not None:
                if not template or field not in template:
                    raise ApiError(400, f"{field}: this model's chat template does not read {field}", field)
                kwargs[field] = value
        if body.continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            return await self._text(lambda: tokenizer.encode_chat(
                messages, body.add_generation_prompt, template, limit, **kwargs))
        except ValueError as e:
            if body.continue_final_message and "continue_final_message" in str(e):   # (its text holds the prompt)
                raise ApiError(400, "the chat template cannot continue the final message: it does not end the "
                                    "prompt with that message's text", "messages") from None
            raise ApiError(400, str(e), "messages") from None
        except Exception as e:  # template errors (e.g. roles it does not accept)
            own = getattr(body, "chat_template", None) is not None   # (the request's own template failed)
            raise ApiError(400, f"the chat template failed: {e}", "chat_template" if own else "messages") from None

    async def tokenize(self, request: Request):
        """vLLM's ``/tokenize``: a prompt's ids as a completion would run on them, or (with
        ``messages``) a conversation's as the chat endpoint renders it."""
        try:
            body = parse_tokenize(await request.body())
        except BodyError as e:
            raise ApiError(400, e.message, e.param) from None
        self._check_model(body.model)
        chat = isinstance(body, TokenizeChatRequest)
        tokenizer = self._tokenizer("/tokenize needs one", "messages" if chat else "prompt")
        if isinstance(body, TokenizeChatRequest):
            shown = _tool_defs(body.tools)
            template = await self._template(body, tokenizer)
            parser = tools.choose_parser(self.tool_call_parser, template, self.model_type) if shown else None
            messages = tools.template_messages(body.messages, shown, template, parser)
            ids = await self._chat_ids(messages, shown, body, None)
        else:
            ids = await self._text(tokenizer.encode, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.llm.max_seq_len, "tokens": ids,
                "token_strs": tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    async def detokenize(self, request: Request):
        """vLLM's ``/detokenize``: token ids back to text (special tokens included)."""
        body = await self._parse(request, DetokenizeRequest)
        self._check_model(body.model)
        tokenizer = self._tokenizer("/detokenize needs one", "tokens")
        vocab = self.llm.vocab_size    # what a prompt of ids may hold (a padded vocabulary's ids decode to "")
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})", "tokens")
        return {"prompt": await self._text(tokenizer.decode, body.tokens, False)}

    def _tokenizer(self, why: str, field: str) -> Tokenizer:
        """The model's tokenizer; a server started without one answers 400 (``why``, naming ``field``)."""
        if self.llm.tokenizer is None:
            raise ApiError(400, f"this server has no tokenizer: {why}", field)
        return self.llm.tokenizer

    async def _template(self, body: ChatCompletionRequest | TokenizeChatRequest, tokenizer: Tokenizer) -> str | None:
        """The chat template a request renders with: its own ``chat_template`` where the server
        trusts requests' templates (a 400 naming it where not, or where it does not parse;
        compiled in the text pool, as rendering is), else the server's ``--chat_template``, else
        the tokenizer's."""
        own = getattr(body, "chat_template", None)
        if own is None:
            return self.chat_template or tokenizer.chat_template
        if not self.trust_request_chat_template:
            raise ApiError(400, "chat_template: this server renders only its own chat template (start it with "
                                "--trust-request-chat-template to take a request's)", "chat_template")
        from phalanx.serve.cli import compile_template
        try:
            await self._text(compile_template, own)
        except Exception as e:   # jinja2's syntax errors, and what the sandbox refuses to compile
            raise ApiError(400, f"chat_template: not a valid Jinja template ({e})", "chat_template") from None
        return own

    def _chat_plan(self, body: ChatCompletionRequest, template: str | None) -> ChatPlan:
        """What a chat request asks of the output: its grammar, and how to read the text back
        (``template``: the chat template it renders with, ``_template``)."""
        tool_defs = _tool_defs(body.tools)
        choice: Any = body.tool_choice
        if isinstance(choice, NamedToolChoice):
            choice = choice.model_dump()
        active = tool_defs if tool_defs and choice != "none" else None
        # the prompt shows the tools under tool_choice "none" too (as OpenAI and vLLM), described in the
        # parser's format; the output is then read as content only
        shown_parser = tools.choose_parser(self.tool_call_parser, template, self.model_type) if tool_defs else None
        parser = shown_parser if active else None
        auto = choice in (None, "auto")     # the output runs free (strict tools held by a structural tag)
        try:
            constraint = (tools.forced_tool_grammar(active, choice, body.parallel_tool_calls, parser)
                          if active else None)
            guided = tools.guided_params(body, constraint, "tools" if auto else "tool_choice")
        except ValueError as e:
            named = str(e).split(":", 1)[0].split(" ", 1)[0]
            raise ApiError(400, str(e), named if named in type(body).model_fields else
                           ("tools" if auto else "tool_choice")) from None
        field = (("tools" if auto else "tool_choice") if constraint is not None else
                 next((f for f in GUIDED_FIELDS if getattr(body, f, None) is not None), None))
        return ChatPlan(tools.template_messages(body.messages, tool_defs, template, shown_parser), active,
                        choice if constraint is not None and not auto else None, parser, guided, field, tool_defs,
                        body.continue_final_message)

    async def _tokenize_bad_words(self, words: list[str] | None, params: list[SamplingParams]) -> None:
        """Tokenize a request's bad words in the text pool, once, and give the sequences to its
        prompts' params (their submissions, on the event loop, then tokenize nothing)."""
        if words:
            try:
                seqs = await self._text(self.llm.bad_word_ids, tuple(words))
                for sp in params:
                    sp.bad_words = None
                    sp.add_bad_word_ids(seqs)
            except ValueError as e:
                named = str(e).split(" ", 1)[0]
                raise ApiError(400, str(e), named if named in _PARAM_FIELDS else "bad_words") from None

    async def _check_grammar(self, sp: SamplingParams, field: str | None) -> None:
        """Compile the request's grammar in the text pool; one that does not compile is a 400."""
        if sp.guided_decoding is None:
            return
        try:
            await self._text(self.llm.check_grammar, sp)
        except ValueError as e:
            raise ApiError(400, f"{field}: {e}" if field else str(e), field or "guided_decoding") from None

    def _chat_message(self, text: str, plan: ChatPlan, include_reasoning: bool = True) -> tuple[dict[str, Any], bool]:
        return chat_message(text, plan, self.reasoning_parser, include_reasoning)

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict], k: int,
                       name: Callable[[int], str]) -> list[dict[str, Any]]:
        out = []
        for tid, entry in zip(token_ids, entries, strict=False):
            out.append({"token": name(tid), "logprob": entry[tid].logprob, "bytes": list(self._token_piece(tid)),
                        "top_logprobs": [{"token": name(t), "logprob": lp.logprob,
                                          "bytes": list(self._token_piece(t))} for t, lp in _alternatives(entry, k)]})
        return out

    async def _stream_chat(self, rid: str, body: ChatCompletionRequest, fut: RequestOutput,
                           plan: ChatPlan) -> AsyncIterator[str]:
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.answering_model}
        running = body.stream_options is not None and body.stream_options.continuous
        sent, name = [0] * body.n, self._namer(body)

        def usage(k: int) -> dict[str, Any]:   # vLLM's continuous usage: this choice's tokens so far
            return {"usage": _running_usage(len(fut.prompt_token_ids), sent[k])} if running else {}
        for k in range(body.n):
            yield _sse({**base, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}], **usage(k)})
        if _echoed(body):
            for k in range(body.n):
                yield _sse({**base, "choices": [{"index": k, "delta": {"content": _echoed(body)}, "logprobs": None,
                                                 "finish_reason": None}], **usage(k)})
        streams = [_ChoiceStream(plan, self.reasoning_parser, body.include_reasoning) for _ in range(body.n)]
        ended = [False] * body.n        # a choice's finish sent (as it ends, not with the last choice)
        async for _, out in _merge([fut]):
            if isinstance(out, Exception):
                yield self._error_event(out)
                break
            for o in out.outputs:
                finishing = o.finish_reason is not None and not ended[o.index]
                ended[o.index] = ended[o.index] or finishing
                if not o.text_diff and not o.token_ids_diff and not finishing:
                    continue
                sent[o.index] = len(o.token_ids)
                delta, calls = streams[o.index].feed(o.text_diff, finishing)
                finish = _chat_finish(o.finish_reason, streams[o.index].called, plan) if finishing else None
                if calls:
                    delta["tool_calls"] = calls
                choice: dict[str, Any] = {"index": o.index, "delta": delta, "logprobs": None, "finish_reason": finish}
                if finishing:
                    choice["stop_reason"] = o.stop_reason
                if body.logprobs and o.token_ids_diff:
                    choice["logprobs"] = {"content": self._chat_logprobs(o.token_ids_diff, o.logprobs_diff,
                                                                         body.top_logprobs or 0, name)}
                if body.return_token_ids:
                    choice["token_ids"] = o.token_ids_diff
                if finishing and calls:
                    # the finish in a chunk of its own, as OpenAI's: clients close a call's arguments on
                    # it (the openai client's arguments.done event)
                    last = {"index": o.index, "delta": {}, "logprobs": None, "finish_reason": finish,
                            "stop_reason": choice.pop("stop_reason")}
                    choice["finish_reason"] = None
                    yield _sse({**base, "choices": [choice], "weight_version": out.weight_version, **usage(o.index)})
                    yield _sse({**base, "choices": [last], "weight_version": out.weight_version, **usage(o.index)})
                elif delta or finishing or choice["logprobs"] or choice.get("token_ids"):
                    yield _sse({**base, "choices": [choice], "weight_version": out.weight_version, **usage(o.index)})
        self._observe(fut)
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({**base, "choices": [], "usage": self._usage([fut])})
        yield "data: [DONE]\n\n"

    def _sse(self, gen: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(self._counting_aborts(gen), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _counting_aborts(self, gen: AsyncIterator[str]) -> AsyncIterator[str]:
        """Pass a stream through; count it in /metrics if the client leaves before its end."""
        finished = False
        try:
            async for chunk in gen:
                yield chunk
            finished = True
        finally:
            if not finished:
                self.metrics.client_aborts.labels(self.model_name).inc()
                await gen.aclose()   # type: ignore[attr-defined]


def chat_message(text: str, plan: ChatPlan, reasoning_parser: str,
             include_reasoning: bool = True) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole output, read by the same ``_ChoiceStream`` that
    streamed outputs go through (so both read the same reasoning, content and calls), and
    whether it made tool calls."""
    stream = _ChoiceStream(plan, reasoning_parser, include_reasoning)
    delta, deltas = stream.feed(text, True)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:        # a named function streams its header, then its arguments
        i = d["index"]
        if i not in calls:
            calls[i] = {k: (dict(v) if k == "function" else v) for k, v in d.items() if k != "index"}
        else:
            calls[i]["function"]["arguments"] += d["function"]["arguments"]
    content: str | None = delta.get("content", "")
    if calls and not (content or "").strip():
        content = None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning_parser != "none":
        message["reasoning_content"] = delta.get("reasoning_content", "").strip() or None
        if content and not plan.continued:    # (a continued message's text goes on as written)
            message["content"] = content.lstrip()
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, stream.called


# the fields of SamplingParams (a submission's ValueError that begins with one names it)
_PARAM_FIELDS = {f.name for f in dataclass_fields(SamplingParams) if f.init}


def _tool_defs(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """A request's tools as the template and the grammar take them (None: no tools)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _weight_version(outs: list[RequestOutput]) -> str:
    """The weights of the latest tokens of these outputs."""
    return next((o.weight_version for o in reversed(outs) if o.weight_version), "")


def _unsampled(out: RequestOutput) -> RequestOutput:
    """A request of ``echo`` alone (``max_tokens: 0``) as the client sees it: its one sampled
    token taken out of each choice (text, ids, logprobs), each ended by its length (an abort or
    a failure stays what it was)."""
    shown = copy.copy(out)
    shown.outputs = [replace(o, text="", token_ids=[], logprobs=[] if o.logprobs is not None else None,
                             text_diff="", token_ids_diff=[], logprobs_diff=[],
                             finish_reason="length" if o.finish_reason in ("length", "stop") else o.finish_reason,
                             stop_reason=None)
                     for o in out.outputs]
    return shown


def _add_ids(choice: dict[str, Any], body: Any, o: Any, prompt_token_ids: list[int] | None) -> None:
    """Per choice: its token ids (``return_token_ids``), and the weight versions it spans when
    the weights changed while it was generated ([[first token index, version], ...])."""
    if body.return_token_ids:
        choice["token_ids"] = o.token_ids
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = prompt_token_ids
    if len(o.weight_versions) > 1:
        choice["weight_versions"] = [list(span) for span in o.weight_versions]


def _abort(futs: list[RequestOutput]) -> None:
    for f in futs:
        if not f.done:
            f.abort()


def _body_doc(*models: type) -> dict[str, Any]:
    """The request body of a route whose handler parses it itself (see protocol.parse_body): one
    model, or one of several."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}}}}


def _has_text(prompt: Any) -> bool:
    """Whether a completion's prompt field holds a string (tokenizer work) anywhere."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and str in set(map(type, prompt)))


async def _merge(futs: list[RequestOutput]) -> AsyncGenerator[tuple[int, RequestOutput | Exception], None]:
    """Stream several requests as one: (index, snapshot) in arrival order. If the consumer
    stops early (client gone, server stopping), every unfinished request is aborted.

    One request (every chat, most completions) is its own stream: the consumer handles each yield
    before the next pull, so it needs no pump task, no queue and no copies (~30 µs a yield less on
    a CPU), and a consumer held up by a slow client takes what came meanwhile in one pull."""
    if len(futs) == 1:
        try:
            async for out in futs[0]:
                yield 0, out
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer, as the pumps do
            yield 0, e
        finally:
            _abort(futs)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, fut: RequestOutput) -> None:
        try:
            async for out in fut:   # the future changes itself at every pull: queue a copy (its _diff
                                    # fields are that pull's own; token_ids and logprobs are shared lists)
                snap = copy.copy(out)
                snap.outputs = [copy.copy(o) for o in out.outputs]
                await queue.put((i, snap, None))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, None, e))
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, f)) for i, f in enumerate(futs)]
    live = len(futs)
    try:
        while live:
            i, out, err = await queue.get()
            if err is not None:
                yield i, err
                return
            if out is None:
                live -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        _abort(futs)


async def item_events(fut: RequestOutput, stream: _ChoiceStream, items: ItemStream,
                      logprobs: Callable[[Any], list[dict[str, Any]]] | None = None,
                      ) -> AsyncGenerator[str | Exception, None]:
    """A streamed chat output's events as items (``item_stream.ItemStream``, the Responses and
    Messages APIs' streams): each pull's text through the choice's stream, then the items; a
    failure is yielded, last. The future holds the final output afterwards. Closed early (the
    client gone), it closes the request's stream at once, which aborts the request."""
    async with contextlib.aclosing(_merge([fut])) as pulls:
        async for _, out in pulls:
            if isinstance(out, Exception):
                yield out
                return
            o = out.outputs[0]
            final = o.finish_reason is not None
            if not o.text_diff and not o.token_ids_diff and not final:
                continue
            lps = logprobs(o) if logprobs is not None and o.token_ids_diff else []
            delta, calls = stream.feed(o.text_diff, final)
            for chunk in items.feed(delta, calls, lps):
                yield chunk


# one encoder for every event: ``json.dumps`` with a non-default argument builds a new one a call
# (~18 µs an event against ~10 on a CPU, every streamed token of every request)
_ENCODE = json.JSONEncoder(ensure_ascii=False).encode


def _echoed(body: ChatCompletionRequest) -> str:
    """What a chat answer starts with under vLLM's ``echo``: the final message's text where it
    has the answer's role, the assistant's, else nothing. (vLLM gives an answer without a
    generation prompt the final message's role, and echoes that message; phalanx's answers are
    the assistant's.)"""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def _alternatives(entry: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    """A token's logprob entry's ``k`` likeliest tokens, likeliest first. The chosen token is in
    the entry with its rank in the vocabulary: outside the top k that rank is above k (every one
    of them is at least as likely), so it is left out here."""
    return sorted(((t, x) for t, x in entry.items() if x.rank is not None and x.rank <= k), key=lambda tx: tx[1].rank)


def _with_chosen(entry: dict[int, Any], chosen: int, k: int) -> list[tuple[int, Any]]:
    """The legacy completions' top logprobs: the ``k`` likeliest and the chosen token where it is
    not among them (up to k + 1 entries, as OpenAI's and vLLM's)."""
    top = _alternatives(entry, k)
    return top if any(t == chosen for t, _ in top) else [*top, (chosen, entry[chosen])]


def _running_usage(prompt: int, completion: int) -> dict[str, int]:
    """A streamed chunk's usage under ``continuous_usage_stats`` (vLLM's): its prompt, and its
    choice's tokens so far."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {_ENCODE(obj)}\n\n"

