"""A rank's LoRA adapters: read from disk when a request first names one, kept in host memory
while requests use them (and up to ``max_cpu_loras`` more, least recently used first out), and
written into the model's ``max_loras`` slots as steps need them (models/lora.py).

The scheduler lets a step run requests of at most ``max_loras`` adapters, so ``slots`` always
finds room. Every rank sees the same requests in the same order and the same steps, so every rank
puts the same adapter in the same slot; a read from disk that fails on any rank fails on all
(``agree``: the ranks' outcomes gathered), so their schedulers keep the same requests. A slot is
written on the step's stream, after the steps queued before it: a slot taken from an adapter the
previous (still running) step reads is written once that step is done with it. Host copies are in
the model's dtype, pinned on a GPU, so that writing a slot does not wait for the step in flight.

A ``lora_int_id`` names one adapter (its name and directory) for the engine's life: its prefix
cache is keyed by the id, so the id is never given to another adapter, held or not.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

from phalanx.config import LoraConfig
from phalanx.llmapi.lora_request import LoRARequest
from phalanx.models.config import ModelConfig
from phalanx.models.lora import Adapter, LoraState, read_adapter_for, write_slot


def check_lora_request(lora: object) -> tuple[str, int, str]:
    """A request's ``lora`` as it crossed the wire, [name, int id, path], checked as the ``LLM``
    class checks its ``LoRARequest``."""
    if not (isinstance(lora, (list, tuple)) and len(lora) == 3):
        raise TypeError("lora_request must be [lora_name, lora_int_id, lora_path]")
    r = LoRARequest(*lora)
    return r.lora_name, r.lora_int_id, r.lora_path


class LoraManager:
    def __init__(self, state: LoraState, cfg: LoraConfig, model_cfg: ModelConfig) -> None:
        self.state, self.cfg = state, cfg
        self.max_cpu = cfg.max_cpu_loras or cfg.max_loras
        self.model_cfg = model_cfg
        self.adapters: OrderedDict[int, Adapter] = OrderedDict()   # lora id -> adapter, least recent first
        self.users: dict[int, int] = {}          # lora id -> live requests naming it
        self.of_request: dict[int, int] = {}     # request id -> its lora id
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # lora id -> slot, least recent first
        self.free_slots = list(range(cfg.max_loras - 1, -1, -1))
        self.known: dict[int, tuple[str, str]] = {}   # lora id -> (name, directory), for the engine's life
        # the ranks' outcomes of one read, gathered (set by a multi-rank executor): each rank's error or ""
        self.agree: Callable[[str], list[str]] | None = None
        self.num_loads = 0                       # adapters read from disk
        self.num_slot_writes = 0                 # adapters written into a slot

    def register(self, request_id: int, lora: object) -> int:
        """A new request names ``lora``: read it unless held; its lora id. A ValueError or
        TypeError naming the field where it cannot be served (the request fails alone, on every
        rank); nothing changes then."""
        name, lid, path = check_lora_request(lora)
        if request_id in self.of_request:
            raise ValueError(f"request id {request_id} is already running")
        where = os.path.realpath(path)
        if self.known.get(lid, (name, where)) != (name, where):
            raise ValueError(f"lora_request.lora_int_id {lid} names adapter {self.known[lid][0]!r} already; another "
                             "adapter needs another id")
        if lid not in self.adapters:
            self.adapters[lid] = self._read(name, path)
            self.known[lid] = (name, where)
            self.num_loads += 1
        self.adapters.move_to_end(lid)
        self.users[lid] = self.users.get(lid, 0) + 1
        self.of_request[request_id] = lid
        self._trim()
        return lid

    def _read(self, name: str, path: str) -> Adapter:
        """The adapter from disk in the model's dtype (pinned on a GPU), or the error of the
        first rank that could not read it, on every rank."""
        adapter, error = None, ""
        try:   # (read_adapter turns whatever goes wrong into a ValueError naming the adapter)
            adapter = read_adapter_for(name, path, self.model_cfg, self.cfg)
            pin = self.state.device.type == "cuda"
            dtype = self.state.dtype
            adapter.weights = {k: tuple(t.to(dtype).pin_memory() if pin else t.to(dtype)   # type: ignore[misc]
                                        for t in ab) for k, ab in adapter.weights.items()}
        except Exception as e:  # noqa: BLE001 - decided on every rank alike below
            adapter, error = None, str(e) or type(e).__name__
        if self.agree is not None:
            error = next((e for e in self.agree(error) if e), "")
        if error or adapter is None:
            raise ValueError(error or f"lora_request {name!r}: not readable on another rank")
        return adapter

    def release(self, request_id: int) -> None:
        """A request ended (or was refused after ``register``)."""
        lid = self.of_request.pop(request_id, None)
        if lid is None:
            return
        self.users[lid] -= 1
        if not self.users[lid]:
            del self.users[lid]
        self._trim()

    def _trim(self) -> None:
        idle = [lid for lid in self.adapters if lid not in self.users]
        for lid in idle[:max(0, len(idle) - self.max_cpu)]:
            del self.adapters[lid]
            slot = self.slot_of.pop(lid, None)
            if slot is not None:
                self.free_slots.append(slot)

    def stats(self) -> dict[str, int]:
        """For the heartbeat (SGLang's load report): adapter slots holding an adapter, of all."""
        return {"lora_slots_used": len(self.slot_of), "lora_slots_total": self.cfg.max_loras,
                "lora_adapters_held": len(self.adapters), "lora_loads": self.num_loads}

    def slots(self, lora_ids: list[int]) -> list[int]:
        """Each row's slot (-1: no adapter), every adapter of the step written into one."""
        need = {lid for lid in lora_ids if lid}
        if len(need) > self.cfg.max_loras:
            raise RuntimeError(f"a step with {len(need)} adapters; max_loras is {self.cfg.max_loras}")
        for lid in need:
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
        for lid in sorted(need - self.slot_of.keys()):
            if self.free_slots:
                slot = self.free_slots.pop()
            else:   # the least recently used slot the step does not need
                victim = next(v for v in self.slot_of if v not in need)
                slot = self.slot_of.pop(victim)
            write_slot(self.state, slot, self.adapters[lid])
            self.num_slot_writes += 1
            self.slot_of[lid] = slot
        return [self.slot_of[lid] if lid else -1 for lid in lora_ids]
