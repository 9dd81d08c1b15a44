"""The RL hand-off over HTTP: the LLM class's rollout methods as routes of ``phalanx serve``
(the names SGLang and vLLM servers use; the API key applies to every one).

    POST /pause_generation               {"mode": "abort" | "wait" | "keep"}
    POST /continue_generation            {}
    POST /sleep                          {"level": 1 | 2}
    POST /wake_up                        {"tags": ["weights", "kv_cache"]}
    POST /release_memory_occupation      {"tags"?}   SGLang's sleep: everything at once (level 1)
    POST /resume_memory_occupation       {"tags"?}   SGLang's wake_up ("cuda_graph" comes with "kv_cache")
    GET  /is_sleeping                    -> {"is_sleeping": bool}
    GET  /weight_version                 -> {"weight_version": str}
    POST /update_weights_from_disk       {"model_path", "weight_version"?}
    POST /update_weights_from_tensor     {"tensors": [spec, ...], "weight_version"?}
    POST /init_weights_update_group      {"master_address", "master_port", "rank_offset", "world_size", "backend"?}
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "weight_version"?, "bucket_bytes"?}
    POST /destroy_weights_update_group   {}
    POST /reset_prefix_cache             {}   (also SGLang's GET or POST /flush_cache)

Tensor specs are those of ``weight_transfer.share_tensors`` with their bytes fields (CUDA IPC
handles) in base64. A refused call (bad name, shape, dtype, mode) is a 400 naming the field and
changes nothing; the engine's answer comes back as JSON with ``"success": true``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable, Iterable
from typing import Any, Literal

from fastapi import Request
from pydantic import Field, field_validator

from phalanx.serve.protocol import BodyError, Strict, parse_body

_IPC_BYTES = ("handle", "ref_counter_handle", "event_handle")


class PauseBody(Strict):
    mode: Literal["abort", "wait", "keep"] = "abort"


class EmptyBody(Strict):
    pass


class SleepBody(Strict):
    level: Literal[1, 2] = 1

    @field_validator("level", mode="before")
    @classmethod
    def _not_a_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("must be the integer 1 or 2, not a bool")
        return v


class WakeUpBody(Strict):
    tags: list[Literal["weights", "kv_cache"]] | None = Field(None, min_length=1, max_length=2)


class MemoryTagsBody(Strict):
    """SGLang's memory tags; phalanx's CUDA graphs are freed and recaptured with its KV cache."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = Field(None, min_length=1, max_length=3)


class DiskBody(Strict):
    model_path: str = Field(min_length=1, max_length=4096)
    weight_version: str | None = Field(None, min_length=1, max_length=256)


class CudaIpcSpec(Strict):
    """Where a CUDA tensor of the trainer lives (``weight_transfer.share_tensors``; the handles
    base64 over HTTP)."""
    device_uuid: str = Field(min_length=1, max_length=64)
    handle: str = Field(max_length=1024)
    storage_bytes: int = Field(ge=0)
    storage_offset_bytes: int = Field(ge=0)
    ref_counter_handle: str = Field(max_length=4096)
    ref_counter_offset: int = Field(ge=0)
    event_handle: str = Field("", max_length=1024)
    event_sync_required: bool
    element_offset: int = Field(ge=0)

    @field_validator(*_IPC_BYTES)
    @classmethod
    def _base64(cls, v: str) -> str:
        try:
            base64.b64decode(v, validate=True)
        except (binascii.Error, TypeError):
            raise ValueError("must be base64") from None
        return v

    def spec(self) -> dict[str, Any]:
        """The engine's form: handles as bytes."""
        out = self.model_dump()
        for key in _IPC_BYTES:
            out[key] = base64.b64decode(out[key])
        return out


class TensorSpec(Strict):
    name: str = Field(min_length=1, max_length=512)
    dtype: str = Field(max_length=32)
    shape: list[int] = Field(max_length=8)
    shm: str | None = Field(None, max_length=255)
    offset: int | None = Field(None, ge=0)
    cuda_ipc: CudaIpcSpec | None = None

    def spec(self) -> dict[str, Any]:
        """The engine's form (``weight_transfer.open_tensors``)."""
        return {**self.model_dump(exclude_none=True, exclude={"cuda_ipc"}),
                **({"cuda_ipc": self.cuda_ipc.spec()} if self.cuda_ipc is not None else {})}


class TensorsBody(Strict):
    tensors: list[TensorSpec] = Field(min_length=1, max_length=100_000)
    weight_version: str | None = Field(None, min_length=1, max_length=256)


class GroupBody(Strict):
    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=4096)
    world_size: int = Field(ge=2, le=4096)
    backend: Literal["nccl", "gloo"] | None = None


class DistributedBody(Strict):
    names: list[str] = Field(min_length=1, max_length=100_000)
    dtypes: list[str] = Field(min_length=1, max_length=100_000)
    shapes: list[list[int]] = Field(min_length=1, max_length=100_000)
    weight_version: str | None = Field(None, min_length=1, max_length=256)
    bucket_bytes: int | None = Field(None, ge=1 << 20, le=1 << 36)


def add_routes(server: Any) -> None:
    """Register the routes on an ``OpenAIServer`` (its app, LLM, body parser and errors)."""
    from phalanx.serve.openai_server import ApiError
    app, llm = server.app, server.llm

    async def call(fn: Callable[..., Any], *args: Any, body: Strict | None = None) -> Any:
        """``fn(*args)`` off the loop; a refusal is a 400 naming the field of ``body`` it is about."""
        try:
            return await asyncio.to_thread(fn, *args)
        except ValueError as e:
            message = str(e).split(": ", 1)[-1] if ": " in str(e) else str(e)
            raise ApiError(400, str(e), _named_field(message, type(body).model_fields if body else {})) from None
        except RuntimeError as e:
            raise ApiError(503 if not llm.is_alive else 500, str(e)) from None

    async def body(request: Request, model: type[Strict]) -> Any:
        raw = await request.body()
        try:
            return parse_body(raw if raw.strip() else b"{}", model)
        except BodyError as e:
            raise ApiError(400, e.message, e.param) from None

    @app.post("/pause_generation")
    async def pause(request: Request):
        b = await body(request, PauseBody)
        await call(llm.pause_generation, b.mode, body=b)
        return {"success": True}

    @app.post("/continue_generation")
    async def resume(request: Request):
        await body(request, EmptyBody)
        await call(llm.continue_generation)
        return {"success": True}

    @app.post("/sleep")
    async def sleep(request: Request):
        b = await body(request, SleepBody)
        await call(llm.sleep, b.level, body=b)
        return {"success": True}

    @app.post("/wake_up")
    async def wake_up(request: Request):
        b = await body(request, WakeUpBody)
        await call(llm.wake_up, list(b.tags) if b.tags is not None else None, body=b)
        return {"success": True}

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request):
        b = await body(request, MemoryTagsBody)
        if b.tags is not None and not {"weights", "kv_cache"} <= set(b.tags):
            raise ApiError(400, "tags: phalanx releases its weights (to host memory), KV cache and CUDA graphs "
                                f"together; give all of them or none, got {b.tags}", "tags")
        await call(llm.sleep, 1, body=b)
        return {"success": True}

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request):
        b = await body(request, MemoryTagsBody)
        tags = None if b.tags is None else sorted(set(b.tags) - {"cuda_graph"})
        if tags == []:
            raise ApiError(400, "tags: CUDA graphs come back with the KV cache (tag kv_cache)", "tags")
        await call(llm.wake_up, tags, body=b)
        return {"success": True}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": await call(llm.is_sleeping)}

    @app.get("/weight_version")
    async def weight_version():
        return {"weight_version": await call(lambda: llm.weight_version)}

    @app.post("/update_weights_from_disk")
    async def from_disk(request: Request):
        b = await body(request, DiskBody)
        version = await call(llm.update_weights_from_disk, b.model_path, b.weight_version, body=b)
        return {"success": True, "weight_version": version}

    @app.post("/update_weights_from_tensor")
    async def from_tensor(request: Request):
        b = await body(request, TensorsBody)
        specs = [t.spec() for t in b.tensors]
        version = await call(llm.update_weights_from_tensors, specs, b.weight_version, body=b)
        return {"success": True, "weight_version": version}

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        b = await body(request, GroupBody)
        await call(llm.init_weights_update_group, b.master_address, b.master_port, b.rank_offset, b.world_size,
                   b.backend, body=b)
        return {"success": True}

    @app.post("/update_weights_from_distributed")
    async def from_distributed(request: Request):
        b = await body(request, DistributedBody)
        version = await call(llm.update_weights_from_distributed, b.names, b.dtypes, b.shapes, b.weight_version,
                             b.bucket_bytes, body=b)
        return {"success": True, "weight_version": version}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        await body(request, EmptyBody)
        await call(llm.destroy_weights_update_group)
        return {"success": True}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        await body(request, EmptyBody)
        await call(llm.reset_prefix_cache)
        return {"success": True}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):   # SGLang's name (slime calls it after a weight update)
        return await reset_prefix_cache(request)


def _named_field(message: str, fields: Iterable[str]) -> str | None:
    """The field of the route's body an engine refusal is about: "tensor 'x': ..." -> "tensors",
    "path ..." -> "model_path", "mode must ..." -> "mode"; None when it names none of them (a
    refusal of the call itself, such as sleeping twice)."""
    first = message.split(" ", 1)[0].strip(":,")
    first = {"tensor": "tensors", "path": "model_path"}.get(first, first)
    return first if first in fields else None
