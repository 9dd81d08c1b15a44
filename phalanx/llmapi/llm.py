"""LLM: the Python entry point (names as TensorRT-LLM's LLM API).

    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))
    fut = llm.generate_async("Hi", streaming=True)

Text work (tokenization, chat templates, detokenization, stop strings) happens here, in the
caller's process; the executor sees token ids.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

from phalanx.config import LlmArgs, make_llm_args
from phalanx.llmapi.outputs import RequestOutput
from phalanx.llmapi.sampling_params import SamplingParams
from phalanx.llmapi.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("phalanx")

PromptInput = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, tokenizer: str | None = None, **kwargs: Any) -> None:
        t0 = time.monotonic()
        self.args: LlmArgs = make_llm_args(model=model, tokenizer=tokenizer, **kwargs)
        from phalanx.models.loader import resolve_model
        self.source = resolve_model(self.args.model, self.args.trust_remote_code)
        self.tokenizer: Tokenizer | None = (None if self.args.skip_tokenizer_init else
                                            load_tokenizer(self.source, self.args.tokenizer, self.args.trust_remote_code))
        self._executor = self._create_executor()
        self.engine_info = self._executor.info
        self.max_seq_len: int = self._executor.info.max_seq_len
        self.vocab_size: int = self._executor.info.vocab_size
        self.startup_seconds = time.monotonic() - t0
        self._closed = False
        _live.add(self)

    def _create_executor(self):
        if self.args.orchestrator_type == "inprocess":
            if self.args.world_size > 1:
                raise ValueError("orchestrator_type='inprocess' runs one rank: tensor_parallel_size must be 1")
            from phalanx.executor.inprocess import InProcessExecutor
            return InProcessExecutor(self.args, self.source)
        from phalanx.executor.proxy import MpiProxyExecutor
        return MpiProxyExecutor(self.args)

    # -- generation -----------------------------------------------------------------------------------
    def generate(self, inputs: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, cache_salt: str | None = None) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt or a batch; returns one RequestOutput per prompt (a single
        one for a single prompt). ``sampling_params`` is one for all or a list with one per prompt."""
        single = _is_single(inputs)
        prompts = [inputs] if single else list(inputs)  # type: ignore[list-item]
        params = _per_prompt(sampling_params, len(prompts))
        futures = [self.generate_async(p, sp, cache_salt=cache_salt) for p, sp in zip(prompts, params)]
        outs = [f.result() for f in _progress(futures, use_tqdm and len(futures) > 1)]
        return outs[0] if single else outs

    def generate_async(self, inputs: PromptInput, sampling_params: SamplingParams | None = None,
                       streaming: bool = False, cache_salt: str | None = None) -> RequestOutput:
        """Submit one prompt; returns a RequestOutput future (``.result()``, ``await .aresult()``,
        ``async for`` when streaming)."""
        self._check_open()
        params = sampling_params or SamplingParams()
        prompt, ids = self._tokenize(inputs)
        self._check_prompt(ids, params)
        eos = (params.end_id,) if params.end_id is not None else self._eos_token_ids()
        state = self._executor.submit(ids, params, self.tokenizer, prompt, eos, cache_salt)
        return RequestOutput(state)

    def _eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None:
            return self.tokenizer.eos_token_ids
        return tuple(self.source.config.eos_token_ids)

    def _tokenize(self, inputs: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(inputs, dict):
            if "prompt_token_ids" in inputs:
                return inputs.get("prompt"), list(inputs["prompt_token_ids"])
            inputs = inputs.get("prompt", "")
        if isinstance(inputs, str):
            if not inputs:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer (skip_tokenizer_init=True): pass token ids")
            return inputs, self.tokenizer.encode(inputs)
        if isinstance(inputs, (list, tuple)) and all(isinstance(t, int) for t in inputs):
            return None, list(inputs)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(inputs).__name__}")

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        from phalanx.executor.request import check_prompt
        check_prompt(ids, self.vocab_size, self.max_seq_len)
        params.check_vocab(self.vocab_size)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self.tokenizer is None:
            raise ValueError("apply_chat_template needs a tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **kwargs)

    # -- lifecycle --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._executor.shutdown()
        _live.discard(self)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM has been shut down")


def _is_single(inputs: Any) -> bool:
    if isinstance(inputs, (str, dict)):
        return True
    return isinstance(inputs, (list, tuple)) and len(inputs) > 0 and all(isinstance(t, int) for t in inputs)


def _per_prompt(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams | None]:
    if sp is None or isinstance(sp, SamplingParams):
        return [sp] * n
    sps = list(sp)
    if len(sps) != n:
        raise ValueError(f"sampling_params: got {len(sps)} for {n} prompts (give one, or one per prompt)")
    return sps


def _progress(items: list, enabled: bool):
    if not enabled:
        return items
    from tqdm import tqdm
    return tqdm(items, desc="Processed prompts", dynamic_ncols=True)


_live: weakref.WeakSet[LLM] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for llm in list(_live):
        try:
            llm.shutdown()
        except Exception:
            pass
