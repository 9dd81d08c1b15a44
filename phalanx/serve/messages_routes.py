"""Anthropic's Messages API on ``phalanx serve``: ``POST /v1/messages`` (streamed or not) and
``POST /v1/messages/count_tokens``; errors on these routes are Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``), and the key may come as ``x-api-key``.

A message runs as the chat request it amounts to (``messages.MessagesRequest``), through the
chat path's rendering, checks, grammar and output reading (thinking, tool calls). The answer is
``{"id": "msg_...", "type": "message", "role": "assistant", "content": [thinking, text,
tool_use blocks], "stop_reason", "stop_sequence", "usage"}``; a stream is Anthropic's events,
each with its ``event:`` line: ``message_start``, per block ``content_block_start``, its
``content_block_delta`` events (``text_delta``, ``thinking_delta``, ``input_json_delta``) and
``content_block_stop``, then ``message_delta`` (the stop reason, the usage) and
``message_stop``; a failure mid-stream is an ``error`` event.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from phalanx.llmapi.outputs import RequestOutput
from phalanx.serve import messages as ms
from phalanx.serve.protocol import BodyError, ChatCompletionRequest, _validate

if TYPE_CHECKING:
    from phalanx.serve.openai_server import ChatPlan, OpenAIServer

PATH = "/v1/messages"


def add_routes(server: OpenAIServer) -> None:
    from phalanx.serve.openai_server import ApiError, _body_doc

    def renamed(e: ApiError | BodyError) -> ApiError:
        """A chat error as the Messages field it comes from (a chat message's index is not a
        message's: the system message and tool results shift it)."""
        param = e.param or ""
        if param.startswith("response_format.json_schema.schema"):    # (the schema sits one level up here)
            param = param.replace("response_format.json_schema.schema", "output_config.format.schema", 1)
            return ApiError(getattr(e, "status", 400), e.message.replace(e.param or "", param, 1), param)
        head, _, rest = param.partition(".")
        new = "messages" if head == "messages" else ms.CHAT_TO_MESSAGES.get(head)
        status = getattr(e, "status", 400)
        if new is None:
            return ApiError(status, e.message, e.param)
        named = new if head == "messages" else new + ("." + rest if rest else "")
        message = named + e.message[len(param):] if param and e.message.startswith(param) else e.message
        return ApiError(status, message, named)

    async def conversation(request: Request, model: type[ms.Conversation]) -> Any:
        body = await server._parse(request, model)
        server._check_model(body.model)
        try:   # (the blocks' own errors name their message: messages.3.content.0.type)
            data = body.generation_body() if isinstance(body, ms.MessagesRequest) else body.chat_body(1)
        except BodyError as e:
            raise ApiError(400, e.message, e.param) from None
        try:
            chat = _validate(data, ChatCompletionRequest)
        except BodyError as e:
            raise renamed(e) from None
        return body, chat

    async def create(request: Request):
        body, chat = await conversation(request, ms.MessagesRequest)
        try:
            fut, plan = await server._submit_chat(chat, "messages", "max_tokens")
        except ApiError as e:
            raise renamed(e) from None
        message_id = ms.new_id()
        if body.stream:
            return server._sse(_events(server, body, plan, fut, message_id))
        [out] = await server._collect([fut], request)
        server._observe(out)
        o = out.outputs[0]
        message, called = server._chat_message(o.text, plan)
        stop, sequence = ms.stop_of(o.finish_reason, o.stop_reason, called, body.stop_sequences)
        return {"id": message_id, "type": "message", "role": "assistant", "model": server.answering_model,
                "content": ms.content_blocks(message), "stop_reason": stop, "stop_sequence": sequence,
                "usage": ms.usage(len(out.prompt_token_ids), out.cached_tokens, len(o.token_ids))}

    async def count_tokens(request: Request):
        _, chat = await conversation(request, ms.Conversation)
        tokenizer = server._tokenizer("counting needs one", "messages")
        try:
            plan = server._chat_plan(chat, await server._template(chat, tokenizer))
            ids = await server._chat_ids(plan.messages, plan.shown, chat, None)
        except ApiError as e:
            raise renamed(e) from None
        return {"input_tokens": len(ids)}

    server.app.post(PATH, openapi_extra=_body_doc(ms.MessagesRequest))(create)
    server.app.post(PATH + "/count_tokens", openapi_extra=_body_doc(ms.Conversation))(count_tokens)


async def _events(server: OpenAIServer, body: ms.MessagesRequest, plan: ChatPlan, fut: RequestOutput,
                  message_id: str) -> AsyncIterator[str]:
    from phalanx.serve.openai_server import _ChoiceStream, item_events
    ev = ms.MessageEvents(strip=server.reasoning_parser != "none" and not plan.continued,
                          named=isinstance(plan.forced, dict))
    start: dict[str, Any] = {
        "id": message_id, "type": "message", "role": "assistant", "model": server.answering_model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": ms.usage(len(fut.prompt_token_ids), 0, 0)}
    yield ev.sse("message_start", message=start)
    stream = _ChoiceStream(plan, server.reasoning_parser)
    async with contextlib.aclosing(item_events(fut, stream, ev)) as chunks:
        async for chunk in chunks:
            if isinstance(chunk, Exception):
                server._observe(fut)
                yield ev.sse("error", error={"type": "api_error", "message": f"generation failed: {chunk}"})
                return
            yield chunk
    server._observe(fut)
    o = fut.outputs[0]
    for chunk in ev.finish("completed"):
        yield chunk
    stop, sequence = ms.stop_of(o.finish_reason, o.stop_reason, stream.called, body.stop_sequences)
    yield ev.sse("message_delta", delta={"stop_reason": stop, "stop_sequence": sequence},
                 usage=ms.usage(len(fut.prompt_token_ids), fut.cached_tokens, len(o.token_ids)))
    yield ev.sse("message_stop")
