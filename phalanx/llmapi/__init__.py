"""The user-facing Python API: LLM, SamplingParams, RequestOutput (loaded lazily)."""

from __future__ import annotations

from typing import Any

_LAZY = {
    "LLM": "phalanx.llmapi.llm",
    "SamplingParams": "phalanx.llmapi.sampling_params",
    "GuidedDecodingParams": "phalanx.llmapi.sampling_params",
    "LoRARequest": "phalanx.llmapi.lora_request",
    "RequestOutput": "phalanx.llmapi.outputs",
    "CompletionOutput": "phalanx.llmapi.outputs",
    "RequestError": "phalanx.llmapi.outputs",
    "BeamSearchParams": "phalanx.llmapi.beam_search",
    "BeamSearchOutput": "phalanx.llmapi.beam_search",
    "BeamSearchSequence": "phalanx.llmapi.beam_search",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
