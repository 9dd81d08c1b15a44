"""RequestOutput and CompletionOutput: what ``LLM.generate`` returns.

``RequestOutput`` is also the future ``generate_async`` returns: ``.result()``, ``await
.aresult()``, and ``async for out in fut`` (streaming). Its fields change only in the caller's
thread, when it waits or iterates, so a reader never sees a half-applied update. While
streaming, ``text_diff`` / ``token_ids_diff`` / ``logprobs_diff`` hold what is new since the
previous yield (new lists each yield). ``token_ids``, ``logprobs`` and ``prompt_logprobs`` are one
list each for the request's life, extended in place at each yield, as vLLM's cumulative outputs
are: a pull costs what is new, not the whole output (copy a list to keep it as it was).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.executor.result import GenerationResult


class RequestError(RuntimeError):
    """The request failed on the engine side (bad input found late, engine failure, ...)."""


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None          # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None       # the stop token id or stop string
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)
    logprobs_diff: list[dict[int, Logprob]] = field(default_factory=list)
    # (index of the first token, weight version) for each run of tokens from the same weights:
    # one entry unless the weights were updated while this sequence was generated
    weight_versions: list[tuple[int, str]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.token_ids)


class RequestOutput:
    """One request's output, and a future of it."""

    def __init__(self, state: GenerationResult, streaming: bool = True) -> None:
        self._state = state
        self._streaming = streaming   # False: iterating yields once, the finished output
        self.request_id: int = state.request_id
        self.prompt: str | None = state.prompt
        self.prompt_token_ids: list[int] = state.prompt_token_ids
        self.outputs: list[CompletionOutput] = [CompletionOutput(i) for i in range(state.n)]
        self.finished = False
        self.cached_tokens = 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.error: str | None = None
        self.metrics: dict[str, float] = {}
        self.weight_version = ""   # the weights of the latest token ("" before the first)
        self._version = 0   # the state starts at version 0: wait for its first change
        # the lists handed out, extended in place at each pull, and how much of each is taken
        self._token_ids: list[list[int]] = [o.token_ids for o in self.outputs]
        self._logprobs: list[list[dict[int, Logprob]]] = [[] for _ in self.outputs]
        self._seen = [0] * state.n            # tokens taken, per sequence
        self._seen_logprobs = [0] * state.n   # logprobs taken, per sequence
        self._prompt_logprobs: list[dict[int, Logprob] | None] = []

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, finished={self.finished}, "
                f"cached_tokens={self.cached_tokens}, outputs={self.outputs!r})")

    # -- future protocol -------------------------------------------------------------------------
    @property
    def num_cached_tokens(self) -> int:
        """vLLM's name for ``cached_tokens``: the prompt's tokens read from the prefix cache."""
        return self.cached_tokens

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until finished; raises RequestError if the request failed."""
        if not self._state.wait_done(timeout):
            raise TimeoutError(f"request {self.request_id} not finished within {timeout}s")
        self._pull()
        return self._checked()

    async def aresult(self) -> RequestOutput:
        await self._state.await_done()
        self._pull()
        return self._checked()

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        task = asyncio.current_task()
        try:
            if not self._streaming:
                yield await self.aresult()
                return
            while True:
                await self._state.await_change(self._version)
                self._pull()
                yield self._checked()
                if self.finished:
                    return
        except asyncio.CancelledError:
            # the consuming task was cancelled (its client gone, a timeout) while it waited here:
            # nobody reads the rest, so no rank computes it (as vLLM's generate)
            if not self._state.is_done:
                self.abort()
            raise
        except GeneratorExit:
            # closed: by a task cancelled in its loop's body (the same), or by a loop merely left
            # (a break), which keeps the request: the future still gives .result()
            if task is not None and task.cancelling() and not self._state.is_done:
                self.abort()
            raise

    def __iter__(self):
        """Synchronous streaming (blocking)."""
        if not self._streaming:
            yield self.result()
            return
        while True:
            self._state.wait_change(self._version)
            self._pull()
            yield self._checked()
            if self.finished:
                return

    def abort(self) -> None:
        self._state.abort()

    @property
    def done(self) -> bool:
        return self._state.is_done

    # -- internals -------------------------------------------------------------------------------
    def _checked(self) -> RequestOutput:
        if self.error is not None:
            raise RequestError(self.error)
        return self

    def _pull(self) -> None:
        snap = self._state.snapshot(self._seen, self._seen_logprobs, len(self._prompt_logprobs))
        self._version = snap.version
        self.finished, self.cached_tokens, self.error = snap.finished, snap.cached_tokens, snap.error
        self.metrics = snap.metrics
        self.weight_version = snap.weight_version
        if snap.new_prompt_logprobs is not None:
            self._prompt_logprobs.extend(snap.new_prompt_logprobs)
            self.prompt_logprobs = self._prompt_logprobs
        for i, (out, s) in enumerate(zip(self.outputs, snap.seqs, strict=True)):
            new = s.new_token_ids
            self._seen[i] += len(new)
            self._token_ids[i].extend(new)
            out.text_diff = s.text[len(out.text):]
            out.token_ids_diff = new
            if s.new_logprobs is not None:
                self._seen_logprobs[i] += len(s.new_logprobs)
                self._logprobs[i].extend(s.new_logprobs)
                out.logprobs_diff = s.new_logprobs
                out.logprobs = self._logprobs[i]
                out.cumulative_logprob = s.cumulative_logprob
            out.text, out.token_ids = s.text, self._token_ids[i]
            out.finish_reason, out.stop_reason = s.finish_reason, s.stop_reason
            out.weight_versions = s.weight_versions
