"""phalanx: an LLM inference engine in Python.

Top-level names load lazily, so ``import phalanx.kv_manager`` pulls in no torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "phalanx.llmapi.llm",
    "SamplingParams": "phalanx.llmapi.sampling_params",
    "GuidedDecodingParams": "phalanx.llmapi.sampling_params",
    "LoRARequest": "phalanx.llmapi.lora_request",
    "RequestOutput": "phalanx.llmapi.outputs",
    "CompletionOutput": "phalanx.llmapi.outputs",
    "BeamSearchParams": "phalanx.llmapi.beam_search",
    "KvCacheConfig": "phalanx.config",
    "SchedulerConfig": "phalanx.config",
    "CudaGraphConfig": "phalanx.config",
    "AttentionDpConfig": "phalanx.config",
    "LlmArgs": "phalanx.config",
    "LoraConfig": "phalanx.config",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
