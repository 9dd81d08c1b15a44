"""LoRA adapters loaded and unloaded while serving (vLLM's routes under
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; SGLang's names without ``/v1``), on a server started with
``--allow_runtime_lora_updating``:

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}   (also /load_lora_adapter)
    POST /v1/unload_lora_adapter  {"lora_name"}                (also /unload_lora_adapter)
    POST /load_lora_adapter_from_tensors  {"lora_name", "config_dict", "tensors": [spec, ...]}

The last is SGLang's route for a trainer that trains a LoRA: its PEFT state dict handed over in
place (``weight_transfer.share_tensors``' specs, CUDA IPC handles in base64, as
``/update_weights_from_tensor`` takes them; SGLang's pickled ``serialized_tensors`` are refused)
with its PEFT config; the ranks read it now and hold it (``LLM.add_lora``) until it is unloaded.

A loaded adapter is read and checked here first (a 400 names what cannot be served), then served
as a model of its own, as ``--lora_modules``' are, under a new id: a name unloaded and loaded
again from another directory never meets the old one's cache. An unloaded adapter's requests
already running finish with it. The path is read by the server, so the routes are off unless the
flag is given (and take the API key).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import Field

from phalanx.llmapi.lora_request import LoRARequest
from phalanx.serve.protocol import Strict
from phalanx.serve.rollout_routes import TensorSpec

if TYPE_CHECKING:
    from phalanx.serve.openai_server import OpenAIServer


class LoadBody(Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class TensorsBody(Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    config_dict: dict[str, Any]
    tensors: list[TensorSpec] | None = Field(None, min_length=1, max_length=10_000)
    serialized_tensors: Any = None   # SGLang's pickled form: refused by name


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


def _refused_field(message: str, name: str) -> tuple[str, str]:
    """An ``add_lora`` refusal of a body's tensors -> (the body's field it is about, the reason as
    the route's fields name things): what follows the adapter's name says which."""
    reason = message.removeprefix("add_lora: ").removeprefix(f"lora_request {name!r}: ")
    about_tensors = reason.startswith(("tensor ", "layer ", "the adapter's tensors", "the tensors hold"))
    return ("tensors" if about_tensors else "config_dict"), reason.replace("in peft_config", "in config_dict")


def add_routes(server: OpenAIServer) -> None:
    from phalanx.serve.openai_server import ApiError
    app, llm = server.app, server.llm
    ids = itertools.count(max((a.lora_int_id for a in server.lora_modules.values()), default=0) + 1)
    lock = asyncio.Lock()

    def check_free(name: str) -> None:
        if name == server.model_name or name in server.lora_modules:
            raise ApiError(400, f"lora_name: the adapter {name!r} is already served", "lora_name")

    async def load(request: Request):
        b = await server._parse(request, LoadBody)
        async with lock:
            check_free(b.lora_name)
            try:
                await asyncio.to_thread(check_adapter, llm, b.lora_name, b.lora_path)
            except ValueError as e:
                raise ApiError(400, f"lora_path: {e}", "lora_path") from None
            server.lora_modules[b.lora_name] = LoRARequest(b.lora_name, next(ids), b.lora_path)
        return {"success": True, "message": f"LoRA adapter {b.lora_name!r} added"}

    async def from_tensors(request: Request):
        b = await server._parse(request, TensorsBody)
        if b.serialized_tensors is not None:
            raise ApiError(400, "serialized_tensors: pickled tensors are not loaded; share them with "
                           "phalanx.llmapi.weight_transfer.share_tensors and send its specs as tensors",
                           "serialized_tensors")
        if b.tensors is None:
            raise ApiError(400, "tensors: the adapter's tensor specs are required", "tensors")
        async with lock:
            check_free(b.lora_name)
            adapter = LoRARequest(b.lora_name, next(ids))
            specs = [t.spec() for t in b.tensors]
            try:
                await asyncio.to_thread(llm.add_lora, adapter, specs, b.config_dict)
            except ValueError as e:   # (refused on the ranks: nothing was added)
                field, reason = _refused_field(str(e), b.lora_name)
                raise ApiError(400, f"{field}: {reason}", field) from None
            except (Exception, asyncio.CancelledError):   # (a timeout, a cancelled handler: the ranks may still
                # add it; let them drop it)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(llm.remove_lora, adapter.lora_int_id)
                raise
            server.lora_modules[b.lora_name] = adapter
        return {"success": True, "message": f"LoRA adapter {b.lora_name!r} added"}

    async def unload(request: Request):
        b = await server._parse(request, UnloadBody)
        async with lock:
            adapter = server.lora_modules.get(b.lora_name)
            if adapter is None:
                raise ApiError(404, f"lora_name: no adapter {b.lora_name!r} is served", "lora_name")
            if not adapter.lora_path:    # held by the ranks (from tensors): they let it go
                with contextlib.suppress(ValueError):   # (not held there: nothing to let go)
                    await asyncio.to_thread(llm.remove_lora, adapter.lora_int_id)
            del server.lora_modules[b.lora_name]
        return {"success": True, "message": f"LoRA adapter {b.lora_name!r} removed"}

    for prefix in ("/v1", ""):
        app.post(prefix + "/load_lora_adapter")(load)
        app.post(prefix + "/unload_lora_adapter")(unload)
    app.post("/load_lora_adapter_from_tensors")(from_tensors)
