"""``LoRARequest``: the adapter a request runs with (vLLM's and TensorRT-LLM's name and fields).
Pure Python: no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name`` names the adapter in outputs and errors; ``lora_int_id`` (1 or more) is its
    identity on the ranks — one id, one adapter: its prefix cache is its own; ``lora_path`` a
    PEFT directory (``adapter_config.json`` and ``adapter_model.safetensors``), read on the ranks
    the first time a request names the id — or empty for an adapter ``LLM.add_lora`` added (from
    a directory or from a trainer's tensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not 1 <= len(self.lora_name) <= 256:
            raise ValueError("lora_request.lora_name must be a string of 1 to 256 characters")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or \
                not 1 <= self.lora_int_id < 2**63:
            raise ValueError(f"lora_request.lora_int_id must be an integer from 1 to 2**63 - 1, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or len(self.lora_path) > 4096:
            raise ValueError("lora_request.lora_path must be a string of at most 4096 characters (a PEFT adapter "
                             "directory, or empty for an adapter added with LLM.add_lora)")

    def to_wire(self) -> list[Any]:
        return [self.lora_name, self.lora_int_id, self.lora_path]


def per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    """One adapter (or none) for every prompt, or a list of one a prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, Sequence) or isinstance(lora_request, (str, bytes)):
        raise ValueError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
    if len(lora_request) != n:
        raise ValueError(f"lora_request: {len(lora_request)} given for {n} prompts")
    for r in lora_request:
        if r is not None and not isinstance(r, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or a list of them, got a list holding "
                             f"{type(r).__name__}")
    return list(lora_request)
