"""GuidedDecoder: the grammar state of every request of this rank that has one.

Per request an xgrammar matcher follows the tokens appended so far (``accept``, called by the
scheduler's update for every token it appends). Before a step's sampling, ``bitmask`` fills, on
the host, one row of allowed tokens for each grammar row of the batch; the sampler applies it on
the device. Only the bitmask crosses to the device, so CUDA graphs (which end at the logits) are
unaffected, and requests with and without grammars share a batch.

Under the overlap scheduler, step n+1's forward is launched before step n's tokens are read; its
sampling waits (``ModelRunner.launch(defer_sampling=True)``) until the loop has read step n and
the matchers have accepted its tokens. The loop then fills step n+1's bitmask and queues its
sampling at once, before it answers step n's requests, so the host's grammar work (accept, then
fill) is all that stands between step n's tokens and step n+1's sampling, and it runs while step
n+1's forward does. A token never reaches a matcher before it is known on the host, so aborts,
preemption (an in-flight token dropped) and the overlap loop's stray step leave the state right.

Grammars compile once per constraint (xgrammar caches them by text); the tokenizer the compiler
needs is loaded on the first grammar request. The rows of a step fill in one call of xgrammar's
BatchGrammarMatcher on one thread, into a pinned buffer when a GPU is present so the copy to the
device does not stall the host. One thread, because xgrammar 0.2.9's batch fill measured slower
with more: 64 rows of a JSON schema over a 49k vocabulary took 0.75 ms on one thread of a
16-core host and 2.9 ms on two (0.54 and 2.2 ms on a 2-core one; 256 rows, 2.2 and 3.0 ms).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from phalanx.llmapi.grammar import GrammarCompiler
from phalanx.llmapi.sampling_params import GuidedDecodingParams
from phalanx.pyexecutor.request import Request
from phalanx.pyexecutor.sampler import TokenMask


class GuidedDecoder:
    def __init__(self, make_compiler: Callable[[], GrammarCompiler], max_rows: int = 256,
                 pin_memory: bool = False) -> None:
        self._make_compiler = make_compiler
        self._pin = pin_memory
        self._batch: Any = None                  # xgrammar BatchGrammarMatcher, made with the first mask
        self._compiler: GrammarCompiler | None = None
        self.matchers: dict[int, Any] = {}       # request id -> xgrammar GrammarMatcher
        self._bitmask: torch.Tensor | None = None
        self._max_rows = max_rows
        self._copied: torch.cuda.Event | None = None   # the last copy of the buffer to the device
        self.fill_seconds = 0.0                  # host time spent filling bitmasks (the cost per step)
        self.accept_seconds = 0.0                # host time advancing matchers by sampled tokens
        self.num_fills = 0

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler

    def compile(self, params: GuidedDecodingParams) -> Any:
        """The compiled grammar (ValueError naming the field if it does not compile)."""
        return self.compiler.compile(params)

    def add(self, req: Request) -> None:
        """Start following a request's compiled grammar (``req.grammar``, from ``compile``) once
        it joined this rank's scheduler."""
        import xgrammar as xgr
        self.matchers[req.request_id] = xgr.GrammarMatcher(req.grammar)

    def release(self, request_id: int) -> None:
        self.matchers.pop(request_id, None)

    def accept(self, req: Request, token: int) -> bool:
        """Advance the request's grammar by a token it was given; True when it must stop here:
        the grammar is complete (or, which a masked step cannot produce, refused the token)."""
        matcher = self.matchers.get(req.request_id)
        if matcher is None:
            return False
        t0 = time.perf_counter()
        stop = not matcher.accept_token(token) or bool(matcher.is_terminated())
        self.accept_seconds += time.perf_counter() - t0
        return stop

    def has_grammar(self, requests: list[Request]) -> bool:
        return bool(self.matchers) and any(r.request_id in self.matchers for r in requests)

    def bitmask(self, requests: list[Request], device: torch.device | None = None) -> TokenMask | None:
        """For the sampling rows ``requests``: the allowed tokens of the rows that have a grammar,
        copied to ``device`` without waiting (an event marks the copy: the host buffer is filled
        again only once it has been read), or None when no row has one."""
        work = self._plan(requests)
        mask = self._fill(*work) if work is not None else None
        if mask is None or device is None or device.type != "cuda":
            return mask
        bits = mask.bits.to(device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return mask._replace(bits=bits)

    def _plan(self, requests: list[Request]) -> tuple[torch.Tensor, list[int], list[Any]] | None:
        """On the loop's thread: the buffer, the rows to constrain and their matchers."""
        rows = [i for i, r in enumerate(requests) if r.request_id in self.matchers]
        if not rows:
            return None
        if self._copied is not None:   # the buffer's last copy has been read (at once in steady state)
            self._copied.synchronize()
            self._copied = None
        if self._bitmask is None or self._bitmask.shape[0] < len(requests):
            import xgrammar as xgr
            mask = xgr.allocate_token_bitmask(max(self._max_rows, len(requests)), self.compiler.vocab_size)
            self._bitmask = mask.pin_memory() if self._pin else mask
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        constrained, matchers = [], []
        for i in rows:
            matcher = self.matchers[requests[i].request_id]
            if matcher.is_terminated():     # the overlap loop's stray step: its token is discarded
                continue
            constrained.append(i)
            matchers.append(matcher)
        return self._bitmask[:len(requests)], constrained, matchers

    def _fill(self, mask: torch.Tensor, constrained: list[int],
              matchers: list[Any]) -> TokenMask | None:
        t0 = time.perf_counter()
        if matchers:
            self._batch.batch_fill_next_token_bitmask(matchers, mask, constrained)
        self.fill_seconds += time.perf_counter() - t0
        self.num_fills += 1
        return TokenMask(mask, constrained, self.compiler.vocab_size) if constrained else None

    def stats(self) -> dict[str, float]:
        per_step = 1e6 / self.num_fills if self.num_fills else 0.0
        return {"grammar_requests": len(self.matchers), "grammar_fills": self.num_fills,
                "grammar_fill_us_per_step": self.fill_seconds * per_step,
                "grammar_accept_us_per_step": self.accept_seconds * per_step}

