"""The OpenAI-compatible HTTP server (FastAPI). Handlers are thin: validate, tokenize, call
``LLM.generate_async``, shape the response. Errors are OpenAI-shaped; a bad request never
touches the engine, and a client that goes away has its request aborted on every rank.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from phalanx import __version__
from phalanx.llmapi.llm import LLM
from phalanx.llmapi.outputs import RequestError, RequestOutput
from phalanx.llmapi.sampling_params import SamplingParams
from phalanx.serve.metrics import ServerMetrics
from phalanx.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body

logger = logging.getLogger("phalanx")

OPEN_PATHS = ("/health", "/health_generate", "/metrics")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _err(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


class OpenAIServer:
    def __init__(self, llm: LLM, model_name: str, api_key: str | None = None, chat_template: str | None = None,
                 max_body_bytes: int = 8 << 20, debug_endpoints: bool = False) -> None:
        self.llm, self.model_name, self.api_key = llm, model_name, api_key
        self.debug_endpoints = debug_endpoints
        self.chat_template, self.max_body_bytes = chat_template, max_body_bytes
        self.created = int(time.time())
        sum_ranks = bool(getattr(llm.args, "enable_attention_dp", False))
        self.metrics = ServerMetrics(model_name, llm._executor.stats, sum_ranks)
        self.app = FastAPI(title="phalanx", version=__version__)
        self._routes()

    # -- plumbing ------------------------------------------------------------------------------------
    def _routes(self) -> None:
        app = self.app

        @app.middleware("http")
        async def guard(request: Request, call_next):
            if self.api_key and not request.url.path.startswith(OPEN_PATHS):
                given = request.headers.get("authorization", "")
                token = given[7:] if given.lower().startswith("bearer ") else ""
                if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                    return _err(401, "Invalid or missing API key (send 'Authorization: Bearer <key>')")
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                return _err(413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}")
            return await call_next(request)

        @app.exception_handler(RequestValidationError)
        async def invalid(_: Request, exc: RequestValidationError):
            first = exc.errors()[0] if exc.errors() else {}
            loc = [str(x) for x in first.get("loc", []) if x != "body"]
            msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
            param = ".".join(loc) or None
            return _err(400, f"{param}: {msg}" if param else msg, param)

        @app.exception_handler(ApiError)
        async def api_error(_: Request, exc: ApiError):
            return _err(exc.status, exc.message, exc.param)

        @app.exception_handler(Exception)
        async def internal(_: Request, exc: Exception):
            logger.exception("internal error")
            return _err(500, f"internal error: {type(exc).__name__}")

        app.get("/health")(self.health)
        app.get("/health_generate")(self.health_generate)
        app.get("/version")(lambda: {"version": __version__})
        app.get("/metrics")(lambda: Response(self.metrics.render(), media_type="text/plain; version=0.0.4"))
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        if self.debug_endpoints:   # inspection for tests and operators; off by default
            app.get("/debug/check_integrity")(self.debug_integrity)
            app.get("/debug/stats")(lambda: self.llm._executor.stats())

    async def debug_integrity(self):
        res = await asyncio.to_thread(self.llm._executor.control, "check_integrity")
        return JSONResponse({"ok": res.ok, "per_rank": res.per_rank}, status_code=200 if res.ok else 500)

    def _engine_alive(self) -> bool:
        return self.llm._executor.dead_error is None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'", "model")

    # -- simple routes -------------------------------------------------------------------------------
    async def health(self):
        if self._engine_alive():
            return Response(status_code=200)
        return _err(503, f"the engine is not running: {self.llm._executor.dead_error}")

    async def health_generate(self):
        if not self._engine_alive():
            return _err(503, "the engine is not running")
        try:
            ids = [self.llm._eos_token_ids()[0] if self.llm._eos_token_ids() else 0]
            fut = self.llm.generate_async(ids, SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
            await asyncio.wait_for(fut.aresult(), timeout=30)
        except Exception as e:
            return _err(503, f"generation failed: {e}")
        return Response(status_code=200)

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                             "owned_by": "phalanx", "root": self.model_name,
                                             "max_model_len": self.llm.max_seq_len}]}

    # -- shared pieces ---------------------------------------------------------------------------------
    def _sampling(self, req: Any, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        bias = {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None
        try:
            return SamplingParams(
                max_tokens=max_tokens, min_tokens=req.min_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, seed=req.seed, n=req.n,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty or 1.0, logit_bias=bias, logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens)
        except ValueError as e:
            raise ApiError(400, str(e), str(e).split(" ", 1)[0]) from None

    def _output_limit(self, prompt_len: int, asked: int | None, what: str) -> int:
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
                           "max_tokens")
        return asked

    def _submit(self, ids: list[int], sp: SamplingParams, salt: str | None) -> RequestOutput:
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        try:
            return self.llm.generate_async(ids, sp, streaming=True, cache_salt=salt)
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from None
        except RuntimeError as e:
            raise ApiError(503, f"the engine is not running: {e}") from None

    async def _collect(self, futs: list[RequestOutput], request: Request) -> list[RequestOutput]:
        """Wait for every request; abort all of them if the client goes away."""
        async def disconnected() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        done = asyncio.ensure_future(asyncio.gather(*(f.aresult() for f in futs)))
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({done, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not done.done():
            for f in futs:
                f.abort()
            done.cancel()
            raise ApiError(499, "client disconnected")
        try:
            return done.result()
        except RequestError as e:
            raise ApiError(500 if self._engine_alive() else 503, f"generation failed: {e}") from None

    def _observe(self, fut: RequestOutput) -> None:
        self.metrics.observe(fut._state, len(fut.prompt_token_ids), [o.finish_reason for o in fut.outputs])

    def _usage(self, futs: list[RequestOutput]) -> dict[str, Any]:
        prompt = sum(len(f.prompt_token_ids) for f in futs)
        completion = sum(len(o.token_ids) for f in futs for o in f.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in futs)}}

    def _token_str(self, token_id: int) -> str:
        return self.llm.tokenizer.token_text(token_id) if self.llm.tokenizer else str(token_id)

    # -- /v1/completions -------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        if body.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if body.best_of not in (None, body.n):
            raise ApiError(400, "best_of must equal n (best-of selection is not supported)", "best_of")
        prompts = self._prompts(body.prompt)
        futs, texts = [], []
        for text, ids in prompts:
            sp = self._sampling(body, self._output_limit(len(ids), body.max_tokens, "prompt"), body.logprobs)
            futs.append(self._submit(ids, sp, body.cache_salt))
            texts.append(text)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return self._sse(self._stream_completions(rid, body, futs, texts))
        outs = await self._collect(futs, request)
        choices = []
        for i, (out, text) in enumerate(zip(outs, texts)):
            self._observe(out)
            for o in out.outputs:
                prefix = (text or "") if body.echo else ""
                choice = {"index": i * body.n + o.index, "text": prefix + o.text, "finish_reason": o.finish_reason,
                          "stop_reason": o.stop_reason, "logprobs": None}
                if body.logprobs is not None:
                    choice["logprobs"] = self._completion_logprobs(o, len(prefix))
                choices.append(choice)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage(outs)}

    def _prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
        tok = self.llm.tokenizer
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise ApiError(400, "prompt must not be empty", "prompt")
                if tok is None:
                    raise ApiError(400, "this server has no tokenizer: send token ids", "prompt")
                out.append((p, tok.encode(p)))
            else:
                if not p:
                    raise ApiError(400, "prompt must not be empty", "prompt")
                bad = next((t for t in p if not 0 <= t < self.llm.vocab_size), None)
                if bad is not None:
                    raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {self.llm.vocab_size})", "prompt")
                out.append((tok.decode(p, skip_special_tokens=False) if tok else None, list(p)))
        return out

    def _completion_logprobs(self, o: Any, offset: int) -> dict[str, Any]:
        tokens, lps, tops, offsets = [], [], [], []
        pos = offset
        for tid, entry in zip(o.token_ids, o.logprobs or []):
            s = self._token_str(tid)
            tokens.append(s)
            lps.append(entry[tid].logprob)
            tops.append({self._token_str(t): lp.logprob for t, lp in entry.items() if lp.rank is not None})
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    async def _stream_completions(self, rid: str, body: CompletionRequest, futs: list[RequestOutput],
                                  texts: list[str | None]) -> AsyncIterator[str]:
        created = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        if body.echo:
            for i, text in enumerate(texts):
                for k in range(body.n):
                    yield _sse({**base, "choices": [{"index": i * body.n + k, "text": text or "", "logprobs": None,
                                                     "finish_reason": None}]})
        async for i, out in _merge(futs):
            if isinstance(out, Exception):
                yield _sse(error_body(f"generation failed: {out}", 500 if self._engine_alive() else 503))
                break
            for o in out.outputs:
                finishing = out.finished and o.finish_reason is not None
                if not o.text_diff and not finishing:
                    continue
                choice = {"index": i * body.n + o.index, "text": o.text_diff, "logprobs": None,
                          "finish_reason": o.finish_reason if finishing else None}
                if finishing:
                    choice["stop_reason"] = o.stop_reason
                yield _sse({**base, "choices": [choice]})
        for f in futs:
            self._observe(f)
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({**base, "choices": [], "usage": self._usage(futs)})
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions --------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        if self.llm.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: chat needs one", "messages")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = self.llm.tokenizer.encode_chat(messages, body.add_generation_prompt, self.chat_template,
                                                 **(body.chat_template_kwargs or {}))
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        except Exception as e:  # template errors (e.g. roles it does not accept)
            raise ApiError(400, f"the chat template failed: {e}", "messages") from None
        k = (body.top_logprobs or 0) if body.logprobs else None
        sp = self._sampling(body, self._output_limit(len(ids), body.output_limit, "messages"), k)
        fut = self._submit(ids, sp, body.cache_salt)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return self._sse(self._stream_chat(rid, body, fut))
        [out] = await self._collect([fut], request)
        self._observe(out)
        choices = []
        for o in out.outputs:
            choice = {"index": o.index, "message": {"role": "assistant", "content": o.text},
                      "finish_reason": o.finish_reason, "stop_reason": o.stop_reason, "logprobs": None}
            if body.logprobs:
                choice["logprobs"] = {"content": self._chat_logprobs(o.token_ids, o.logprobs or [])}
            choices.append(choice)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage([out])}

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict]) -> list[dict[str, Any]]:
        out = []
        for tid, entry in zip(token_ids, entries):
            s = self._token_str(tid)
            tops = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)
            out.append({"token": s, "logprob": entry[tid].logprob, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": self._token_str(t), "logprob": lp.logprob,
                                          "bytes": list(self._token_str(t).encode())} for t, lp in tops]})
        return out

    async def _stream_chat(self, rid: str, body: ChatCompletionRequest, fut: RequestOutput) -> AsyncIterator[str]:
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model_name}
        for k in range(body.n):
            yield _sse({**base, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        async for _, out in _merge([fut]):
            if isinstance(out, Exception):
                yield _sse(error_body(f"generation failed: {out}", 500 if self._engine_alive() else 503))
                break
            for o in out.outputs:
                finishing = out.finished and o.finish_reason is not None
                if not o.text_diff and not o.token_ids_diff and not finishing:
                    continue
                choice: dict[str, Any] = {"index": o.index, "delta": {"content": o.text_diff} if o.text_diff else {},
                                          "logprobs": None, "finish_reason": o.finish_reason if finishing else None}
                if body.logprobs and o.token_ids_diff:
                    choice["logprobs"] = {"content": self._chat_logprobs(o.token_ids_diff, o.logprobs_diff)}
                yield _sse({**base, "choices": [choice]})
        self._observe(fut)
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({**base, "choices": [], "usage": self._usage([fut])})
        yield "data: [DONE]\n\n"

    def _sse(self, gen: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _merge(futs: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Stream several requests as one: (index, snapshot) in arrival order. If the consumer
    stops early (client gone, server stopping), every unfinished request is aborted."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, fut: RequestOutput) -> None:
        try:
            async for out in fut:   # the future mutates itself on every pull: queue a copy
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
        for f in futs:
            if not f.done:
                f.abort()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
