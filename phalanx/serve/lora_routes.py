"""LoRA adapters loaded and unloaded while serving (vLLM's routes under
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; SGLang's names without ``/v1``), on a server started with
``--allow_runtime_lora_updating``:

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}   (also /load_lora_adapter)
    POST /v1/unload_lora_adapter  {"lora_name"}                (also /unload_lora_adapter)

A loaded adapter is read and checked here first (a 400 names what cannot be served), then served
as a model of its own, as ``--lora_modules``' are, under a new id: a name unloaded and loaded
again from another directory never meets the old one's cache. An unloaded adapter's requests
already running finish with it. The path is read by the server, so the routes are off unless the
flag is given (and take the API key).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import Field

from phalanx.llmapi.lora_request import LoRARequest
from phalanx.serve.protocol import Strict

if TYPE_CHECKING:
    from phalanx.serve.openai_server import OpenAIServer


class LoadBody(Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadBody(Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None   # vLLM's body may carry it; the name decides


def check_adapter(llm: Any, name: str, path: str) -> None:
    """Read an adapter as the ranks will (its shapes, rank and settings, the layers whose MLP is a
    mixture of experts taking none there); a ValueError naming what cannot be served."""
    from phalanx.models.lora import read_adapter_for
    if llm.args.lora is None:
        raise ValueError("the engine serves no LoRA adapters")
    read_adapter_for(name, path, llm.source.config, llm.args.lora)


def add_routes(server: OpenAIServer) -> None:
    from phalanx.serve.openai_server import ApiError
    app, llm = server.app, server.llm
    ids = itertools.count(max((a.lora_int_id for a in server.lora_modules.values()), default=0) + 1)
    lock = asyncio.Lock()

    async def load(request: Request):
        b = await server._parse(request, LoadBody)
        async with lock:
            if b.lora_name == server.model_name or b.lora_name in server.lora_modules:
                raise ApiError(400, f"lora_name: the adapter {b.lora_name!r} is already served", "lora_name")
            try:
                await asyncio.to_thread(check_adapter, llm, b.lora_name, b.lora_path)
            except ValueError as e:
                raise ApiError(400, f"lora_path: {e}", "lora_path") from None
            server.lora_modules[b.lora_name] = LoRARequest(b.lora_name, next(ids), b.lora_path)
        return {"success": True, "message": f"LoRA adapter {b.lora_name!r} added"}

    async def unload(request: Request):
        b = await server._parse(request, UnloadBody)
        async with lock:
            if server.lora_modules.pop(b.lora_name, None) is None:
                raise ApiError(404, f"lora_name: no adapter {b.lora_name!r} is served", "lora_name")
        return {"success": True, "message": f"LoRA adapter {b.lora_name!r} removed"}

    for prefix in ("/v1", ""):
        app.post(prefix + "/load_lora_adapter")(load)
        app.post(prefix + "/unload_lora_adapter")(unload)
