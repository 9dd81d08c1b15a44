"""Beam search, as vLLM's ``LLM.beam_search`` runs it: over the engine's own requests, one token at
a time. Each step submits every live beam (its prompt and output so far) as a request for one
greedy token with the 2·W likeliest next tokens' logprobs (W: the beam width), extends each beam
by each of them, and keeps a prompt's W best extensions by score; an extension that ends in an
end-of-sequence token is a finished candidate (unless ``ignore_eos``). After ``max_tokens``
steps, or once no beam is live, a prompt's W best of its finished candidates and live beams are
its answer, best first. The beams of a prompt share their prompt's KV blocks through the prefix
cache, so a step computes a beam's last partial block and its new token.

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
    alternatives at each output position, ``text`` the output's text."""

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
    token not counted) ** length_penalty."""
    n = len(beam.tokens) - (1 if beam.tokens[-1] in eos else 0)
    return beam.cum_logprob / (n ** length_penalty)


def beam_search(llm: LLM, prompts: Sequence[PromptInput], params: BeamSearchParams,
                loras: list[LoRARequest | None] | None, use_tqdm: bool) -> list[BeamSearchOutput]:
    """``LLM.beam_search`` (module docstring)."""
    from phalanx.llmapi.llm import PreparedPrompt, _progress
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    params.validate()
    eos = frozenset(llm._eos_token_ids())
    width = params.beam_width
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True, detokenize=False)
    starts = [llm._prepare(p, step).token_ids for p in prompts]
    for i, ids in enumerate(starts):
        if len(ids) + params.max_tokens > llm.max_seq_len:
            raise ValueError(f"max_tokens: prompt {i} has {len(ids)} tokens, and {params.max_tokens} more exceed "
                             f"max_seq_len {llm.max_seq_len}")
    live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(list(ids))] for ids in starts]
    done: list[list[BeamSearchSequence]] = [[] for _ in starts]
    key = _key(eos, params.length_penalty)
    for _ in _progress(list(range(params.max_tokens)), use_tqdm):
        beams = [(i, b) for i, bs in enumerate(live) for b in bs]
        if not beams:
            break
        futures = llm._submit_all([PreparedPrompt(None, b.tokens, step) for _, b in beams], None,
                                  loras=[loras[i] for i, _ in beams] if loras is not None else None)
        try:
            outs = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.abort()
            raise
        grown: list[list[BeamSearchSequence]] = [[] for _ in starts]
        for (i, b), out in zip(beams, outs, strict=True):
            o = out.outputs[0]
            if o.finish_reason not in ("length", "stop") or not o.logprobs:
                raise RuntimeError(f"beam search: a step of prompt {i} finished {o.finish_reason!r}")
            alternatives = o.logprobs[0]
            for token, lp in alternatives.items():
                nb = BeamSearchSequence(b.tokens + [token], b.logprobs + [alternatives], b.cum_logprob + lp.logprob)
                if token in eos and not params.ignore_eos:
                    nb.finish_reason, nb.stop_reason = "stop", token
                    done[i].append(nb)
                else:
                    grown[i].append(nb)
        live = [sorted(g, key=key, reverse=True)[:width] for g in grown]
    results = []
    for ids, finished, beams_left in zip(starts, done, live, strict=True):
        for b in beams_left:
            b.finish_reason = "length"
        best = sorted(finished + beams_left, key=key, reverse=True)[:width]
        for b in best:
            out_ids = b.tokens[len(ids):]
            if b.finish_reason == "stop" and not params.include_stop_str_in_output:
                out_ids = out_ids[:-1]
            b.text = llm.tokenizer.decode(out_ids, skip_special_tokens=False) if llm.tokenizer is not None else None
        results.append(BeamSearchOutput(best))
    return results


def _key(eos: frozenset[int], length_penalty: float) -> Any:
    def key(beam: BeamSearchSequence) -> float:
        s = score(beam, eos, length_penalty)
        return s if math.isfinite(s) else -math.inf
    return key
