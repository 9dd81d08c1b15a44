"""OpenAI's Responses API on ``phalanx serve``: ``POST /v1/responses`` (streamed or not),
``GET`` and ``DELETE /v1/responses/{id}`` (stored responses).

A response runs as the chat request it amounts to (``responses.ResponsesRequest.chat_body``),
through the chat path's rendering, checks, grammar and output reading (reasoning, tool calls).
Its output is read into items: a ``reasoning`` item, a ``message`` with one ``output_text``
part, one ``function_call`` item a call. A stream is OpenAI's typed events, each SSE with its
``event:`` line and a ``sequence_number``, no ``[DONE]``: ``response.created``,
``response.in_progress``, per item ``output_item.added``, its parts and deltas
(``reasoning_text``, ``output_text``, ``function_call_arguments``), their ``.done`` events and
``output_item.done``, then ``response.completed`` (``response.incomplete`` when the output
limit cut it, ``response.failed`` when generation failed). Item ids are made once, so the
streamed items and the final response carry the same ones.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from phalanx.llmapi.outputs import RequestOutput
from phalanx.serve import responses as rs
from phalanx.serve.protocol import BodyError, ChatCompletionRequest, _validate

if TYPE_CHECKING:
    from phalanx.serve.openai_server import ChatPlan, OpenAIServer


def add_routes(server: OpenAIServer) -> None:
    from phalanx.serve.openai_server import ApiError, _body_doc

    app, store = server.app, server.responses
    answering: set[str] = set()      # the ids of responses being answered (taken by no other request)

    def renamed(e: ApiError | BodyError, status: int = 400) -> ApiError:
        """A chat error as the Responses field it comes from (messages -> input, ...). A chat
        message's index is not an input item's (the instructions, the stored turns and calls
        joined into one message shift it), so a message's error names ``input`` alone."""
        param = e.param or ""
        head, _, rest = param.partition(".")
        new = rs.CHAT_TO_RESPONSES.get(head)
        if new is None:
            return ApiError(getattr(e, "status", status), e.message, e.param)
        named = new if head == "messages" else new + ("." + rest if rest else "")
        message = named + e.message[len(param):] if param and e.message.startswith(param) else e.message
        return ApiError(getattr(e, "status", status), message, named)

    def stored(response_id: str, field: str = "response_id") -> rs.Stored:
        found = store.get(response_id)
        if found is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", field)
        return found

    async def create(request: Request):
        body = await server._parse(request, rs.ResponsesRequest)
        server._check_model(body.model)
        if body.store and "store" in body.model_fields_set and store.capacity == 0:
            raise ApiError(400, "store: this server keeps no responses (--responses_store_size 0); send store: false",
                           "store")
        response_id = rs.new_id("resp") if body.request_id is None else f"resp_{body.request_id}"
        if store.get(response_id) is not None or response_id in answering:
            raise ApiError(400, f"request_id: another response has the id {response_id!r}", "request_id")
        answering.add(response_id)
        streaming = False
        try:
            history = stored(body.previous_response_id, "previous_response_id").conversation \
                if body.previous_response_id else []
            try:
                chat = _validate(body.chat_body(history), ChatCompletionRequest)
            except BodyError as e:
                raise renamed(e) from None
            try:
                fut, plan = await server._submit_chat(chat, "input", "max_output_tokens")
            except ApiError as e:
                raise renamed(e) from None
            turn = chat.model_dump(exclude_none=True)["messages"][1 if body.instructions is not None else 0:]
            responder = _Responder(server, body, plan, _head(server, body, response_id), turn)
            if body.stream:
                streaming = True
                return server._sse(_released(responder.events(fut), answering, response_id))
            [out] = await server._collect([fut], request)
            server._observe(out)
            return responder.finish(out)
        finally:
            if not streaming:
                answering.discard(response_id)

    async def retrieve(response_id: str):
        return stored(response_id).response

    async def delete(response_id: str):
        stored(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    app.post("/v1/responses", openapi_extra=_body_doc(rs.ResponsesRequest))(create)
    app.get("/v1/responses/{response_id}")(retrieve)
    app.delete("/v1/responses/{response_id}")(delete)


async def _released(events: AsyncIterator[str], answering: set[str], response_id: str) -> AsyncIterator[str]:
    """A response's stream; its id is free again once the stream ends (or its client leaves)."""
    try:
        async for chunk in events:
            yield chunk
    finally:
        answering.discard(response_id)
        await events.aclose()   # type: ignore[attr-defined]


def _head(server: OpenAIServer, body: rs.ResponsesRequest, response_id: str) -> dict[str, Any]:
    """A response's fields other than its output, status and usage: what the request asked."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "model": server.answering_model,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store and server.responses.capacity > 0,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, rs.FunctionChoice)
                            else body.tool_choice or "auto"),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text is not None and body.text.format is not None else {"type": "text"}},
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "truncation": body.truncation, "metadata": body.metadata or {},
            "user": body.user, "background": False, "top_logprobs": body.top_logprobs,
            "error": None, "incomplete_details": None}


class _Responder:
    """One response's answer: whole (``finish``) or as events (``events``); stores it."""

    def __init__(self, server: OpenAIServer, body: rs.ResponsesRequest, plan: ChatPlan, head: dict[str, Any],
                 turn: list[dict[str, Any]]) -> None:
        self.server, self.body, self.plan, self.head = server, body, plan, head
        self.turn = turn     # this request's chat messages after the instructions: the stored history and input
        self.ids = rs.OutputIds.new()

    def _response(self, out: RequestOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
        o = out.outputs[0]
        status, incomplete = rs.status_of(o.finish_reason)
        pieces = [self.server._token_piece(t) for t in o.token_ids] if self.server.reasoning_parser != "none" else []
        thought = rs.reasoning_tokens(pieces, self.server.reasoning_parser == "deepseek_r1") if pieces else 0
        response = {**self.head, "status": status, "incomplete_details": incomplete, "output": items,
                    "usage": rs.usage(len(out.prompt_token_ids), out.cached_tokens, len(o.token_ids), thought),
                    "weight_version": out.weight_version}
        if status == "completed":
            response["completed_at"] = int(time.time())
        elif status == "cancelled":
            response["error"] = {"code": "cancelled", "message": "the response was aborted (an abort, or the server "
                                                                 "stopping) before it ended"}
        self._store(response, items)
        return response

    def _store(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        if self.body.store and self.server.responses.capacity > 0:
            self.server.responses.put(response["id"], response, self.turn + rs.conversation_of(items))

    def _logprobs(self, token_ids: list[int], entries: list[dict]) -> list[dict[str, Any]]:
        return self.server._chat_logprobs(token_ids, entries, self.body.top_logprobs or 0, self.server._token_str)

    def finish(self, out: RequestOutput) -> dict[str, Any]:
        o = out.outputs[0]
        message, _ = self.server._chat_message(o.text, self.plan)
        status, _ = rs.status_of(o.finish_reason)
        lps = self._logprobs(o.token_ids, o.logprobs or []) if self.body.logprobs else None
        return self._response(out, rs.output_items(message, self.ids, _item_status(status), lps,
                                                   named=isinstance(self.plan.forced, dict)))

    async def events(self, fut: RequestOutput) -> AsyncIterator[str]:
        from phalanx.serve.openai_server import _ChoiceStream, item_events
        ev = rs.ResponseEvents(self.ids, self.body.logprobs,
                               strip=self.server.reasoning_parser != "none" and not self.plan.continued,
                               named=isinstance(self.plan.forced, dict))
        start = {**self.head, "status": "in_progress", "output": [], "usage": None}
        yield ev.sse("response.created", response=start)
        yield ev.sse("response.in_progress", response=start)
        lps = (lambda o: self._logprobs(o.token_ids_diff, o.logprobs_diff)) if self.body.logprobs else None
        async with contextlib.aclosing(item_events(fut, _ChoiceStream(self.plan, self.server.reasoning_parser), ev,
                                                   lps)) as chunks:
            async for chunk in chunks:
                if isinstance(chunk, Exception):
                    self.server._observe(fut)
                    for event in ev.finish("incomplete"):
                        yield event
                    failed = {**self.head, "status": "failed", "output": ev.items, "usage": None,
                              "error": {"code": "server_error", "message": f"generation failed: {chunk}"}}
                    yield ev.sse("response.failed", response=failed)
                    return
                yield chunk
        self.server._observe(fut)
        status, _ = rs.status_of(fut.outputs[0].finish_reason)
        for chunk in ev.finish(_item_status(status)):
            yield chunk
        response = self._response(fut, ev.items)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        yield ev.sse(kind, response=response)


def _item_status(response_status: str) -> str:
    return "completed" if response_status == "completed" else "incomplete"
