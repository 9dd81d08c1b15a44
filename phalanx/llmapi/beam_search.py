"""Beam search, as vLLM's ``LLM.beam_search`` runs it: over the engine's own requests, one token at
a time. Each step submits every live beam (its prompt and output so far) as a request for one
greedy token with the 2·W likeliest next tokens' logprobs (W: the beam width), extends each beam
by each of them, and keeps a prompt's W best extensions by score; an extension that ends in an
end-of-sequence token is a finished candidate (unless ``ignore_eos``). After ``max_tokens``
steps, or once no beam is live, a prompt's W best of its finished candidates and live beams are
its answer, best first; a beam's text is its prompt's and its output's, as vLLM's. The beams of
a prompt share their prompt's KV blocks through the prefix cache, so a step computes a beam's
last partial block and its new token.

The score (vLLM's) is the cumulative logprob over the length of prompt and output to the power
``length_penalty``, an end-of-sequence token not counted; beams of one length rank by their
cumulative logprob alone, as in transformers' beam search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phalanx.llmapi.outputs import Logprob
from phalanx.llmapi.sampling_params import MAX_LOGPROBS, SamplingParams, _check, _int, _real

if TYPE_CHECKING:
    from phalanx.llmapi.llm import LLM, PromptInput
    from phalanx.llmapi.lora_request import LoRARequest
    from phalanx.llmapi.outputs import RequestOutput

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2   # each step asks for 2·W alternatives


@dataclass
class BeamSearchParams:
    """How a beam search runs (vLLM's names). ``temperature`` must be 0: beams rank by the
    model's own log-probabilities. ``include_stop_str_in_output``: a finished beam's text keeps
    its end-of-sequence token's text."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def validate(self) -> None:
        _int(self.beam_width, "beam_width", 1, MAX_BEAM_WIDTH)
        _int(self.max_tokens, "max_tokens", 1, 2**31 - 1)
        _real(self.temperature, "temperature", 0.0, 0.0,
              rule="must be 0: beam search ranks beams by the model's own log-probabilities")
        _real(self.length_penalty, "length_penalty", -100.0, 100.0)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), name, "must be a bool", getattr(self, name))


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` the prompt's and the output's (vLLM's), ``logprobs`` the
    alternatives at each output position, ``text`` the text of ``tokens`` (``BeamSearch.results``)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None   # "stop" (an end-of-sequence token) or "length"
    stop_reason: int | None = None     # the end-of-sequence token


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]


def score(beam: BeamSearchSequence, eos: frozenset[int], length_penalty: float) -> float:
    """vLLM's beam score: the cumulative logprob over (prompt + output length, an end-of-sequence
    token not counted) ** length_penalty (±inf or 0 where that power leaves a float's range)."""
    n = _length(beam, eos)
    try:
        return beam.cum_logprob * math.exp(-length_penalty * math.log(n))
    except OverflowError:
        return -math.inf if beam.cum_logprob < 0 else 0.0


class BeamAborted(RuntimeError):
    """A step's request finished without its token (aborted, or failed): the search cannot go on."""


class BeamSearch:
    """One beam search over a batch of prompts (module docstring), a step at a time: ``step()``
    gives the live beams' requests (none once no beam is live, or after each prompt's
    ``max_tokens`` steps), ``advance(outputs)`` takes their finished outputs, ``results()``
    gives the answer. ``LLM.beam_search`` runs it; the server runs it without blocking its
    loop, each prompt with its own output limit (``limits``)."""

    def __init__(self, llm: LLM, prompts: Sequence[PromptInput], params: BeamSearchParams,
                 loras: list[LoRARequest | None] | None, limits: list[int] | None = None) -> None:
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        params.validate()
        self.llm, self.params, self.loras = llm, params, loras
        self.eos = frozenset(llm._eos_token_ids())
        self.width = params.beam_width
        self.request = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.width, ignore_eos=True,
                                      detokenize=False)
        self.starts = [llm._prepare(p, self.request).token_ids for p in prompts]
        self.limits = [min(params.max_tokens, m) for m in limits] if limits is not None else \
            [params.max_tokens] * len(self.starts)
        for i, (ids, m) in enumerate(zip(self.starts, self.limits, strict=True)):
            if len(ids) + m > llm.max_seq_len:
                raise ValueError(f"max_tokens: prompt {i} has {len(ids)} tokens, and {m} more exceed max_seq_len "
                                 f"{llm.max_seq_len}")
        self.live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(list(ids))] for ids in self.starts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in self.starts]
        self.steps = 0
        self.key = _key(self.eos, params.length_penalty)
        self._asked: list[tuple[int, BeamSearchSequence]] = []

    def step(self) -> list[list[int]]:
        """This step's requests (one a live beam of a prompt below its limit: its tokens, each to
        run with ``self.request``, and ``step_loras``' adapter); none once the search is over."""
        self._asked = [(i, b) for i, bs in enumerate(self.live) if self.steps < self.limits[i] for b in bs]
        return [b.tokens for _, b in self._asked]

    def step_loras(self) -> list[LoRARequest | None] | None:
        """The adapter of each of this step's requests (None: no prompt has one)."""
        return [self.loras[i] for i, _ in self._asked] if self.loras is not None else None

    def advance(self, outs: list[RequestOutput]) -> None:
        """Grow the beams by the step's outputs (``step``'s requests, finished, in order). A
        prompt keeps the best ``beam_width`` of its finished candidates only: a finished beam's
        score does not change, so the others could never be chosen."""
        grown: dict[int, list[BeamSearchSequence]] = {i: [] for i, _ in self._asked}
        for (i, b), out in zip(self._asked, outs, strict=True):
            o = out.outputs[0]
            if o.finish_reason not in ("length", "stop") or not o.logprobs:
                raise BeamAborted(f"beam search: a step of prompt {i} finished {o.finish_reason!r}")
            alternatives = o.logprobs[0]
            for token, lp in alternatives.items():
                nb = BeamSearchSequence(b.tokens + [token], b.logprobs + [alternatives], b.cum_logprob + lp.logprob)
                if token in self.eos and not self.params.ignore_eos:
                    nb.finish_reason, nb.stop_reason = "stop", token
                    self.done[i].append(nb)
                else:
                    grown[i].append(nb)
        for i, g in grown.items():
            self.live[i] = sorted(g, key=self.key, reverse=True)[:self.width]
            self.done[i] = sorted(self.done[i], key=self.key, reverse=True)[:self.width]
        self.steps += 1

    def results(self, with_prompt: bool = True, skip_special_tokens: bool = False) -> list[BeamSearchOutput]:
        """Each prompt's best ``beam_width`` of its finished candidates and live beams, best
        first. Their text is the prompt's and the output's, as vLLM's ``LLM.beam_search`` gives
        it (the output's alone without ``with_prompt``: the server's), an end-of-sequence token's
        left out unless ``include_stop_str_in_output``, special tokens kept unless
        ``skip_special_tokens``."""
        results = []
        for ids, finished, beams_left in zip(self.starts, self.done, self.live, strict=True):
            for b in beams_left:
                b.finish_reason = "length"
            best = sorted(finished + beams_left, key=self.key, reverse=True)[:self.width]
            for b in best:
                shown = b.tokens if with_prompt else b.tokens[len(ids):]
                if b.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    shown = shown[:-1]
                b.text = self.llm.tokenizer.decode(shown, skip_special_tokens) if self.llm.tokenizer is not None \
                    else None
            results.append(BeamSearchOutput(best))
        return results


def beam_search(llm: LLM, prompts: Sequence[PromptInput], params: BeamSearchParams,
                loras: list[LoRARequest | None] | None, use_tqdm: bool) -> list[BeamSearchOutput]:
    """``LLM.beam_search``: the search run to its end, each step's requests waited for."""
    from phalanx.llmapi.llm import PreparedPrompt, _progress
    search = BeamSearch(llm, prompts, params, loras)
    for _ in _progress(list(range(params.max_tokens)), use_tqdm, "Beam search steps"):
        asked = search.step()
        if not asked:
            break
        futures = llm._submit_all([PreparedPrompt(None, ids, search.request) for ids in asked], None,
                                  loras=search.step_loras())
        try:
            outs = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.abort()
            raise
        search.advance(outs)
    return search.results()


def _key(eos: frozenset[int], length_penalty: float) -> Any:
    """A sort key that orders beams as ``score`` does without leaving a float's range: for a
    negative cumulative logprob, −(log(−cum) − length_penalty · log(n)); a beam of logprob 0
    (probability 1) first."""
    def key(beam: BeamSearchSequence) -> float:
        if beam.cum_logprob >= 0:
            return math.inf
        return -(math.log(-beam.cum_logprob) - length_penalty * math.log(_length(beam, eos)))
    return key


def _length(beam: BeamSearchSequence, eos: frozenset[int]) -> int:
    """The length the score divides by: prompt and output, an end-of-sequence token not counted."""
    return len(beam.tokens) - (1 if beam.tokens[-1] in eos else 0)
