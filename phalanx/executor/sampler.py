"""Sampler: logits of the sampling rows -> one token id per row (+ logprobs when asked).

Order per row: logit_bias, min_tokens (EOS and stop ids masked), repetition / presence /
frequency penalties, then greedy argmax or temperature → top-k → top-p → min-p → a draw.
Logprobs are those of the raw model distribution (log-softmax of the unprocessed logits).

A row with a ``seed`` draws from its own generator, advanced by exactly one draw per token, so
its tokens do not depend on what else is in the batch. Other rows share the sampler's
generator; every rank holds the same one, so all ranks sample the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.executor.request import Request


@dataclass
class SampleOutput:
    token_ids: torch.Tensor                       # [S] on the device
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None  # per row, host


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[int, torch.Generator] = {}

    def release(self, request_id: int) -> None:
        """Forget a finished request's generator."""
        self._request_generators.pop(request_id, None)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleOutput:
        """logits: [S, V] float32 (one row per sampling request) -> SampleOutput."""
        logits = logits[:, :self.vocab_size]
        raw = logits
        if any(_needs_processing(r) for r in requests):
            logits = self._process(logits.clone(), requests)
        token_ids = self._draw(logits, requests)
        logprobs = None
        if any(r.sampling.logprobs is not None for r in requests):
            logprobs = _logprobs(raw, token_ids, requests)
        return SampleOutput(token_ids, logprobs)

    # -- logit processing ---------------------------------------------------------------------
    def _process(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        for i, r in enumerate(requests):
            sp = r.sampling
            if sp.logit_bias:
                ids = torch.tensor(list(sp.logit_bias), device=logits.device)
                logits[i].index_add_(0, ids, torch.tensor(list(sp.logit_bias.values()), device=logits.device))
            if r.num_output_tokens < sp.min_tokens:
                banned = set(sp.stop_token_ids or []) | (set() if sp.ignore_eos else set(r.eos_token_ids))
                if banned:
                    logits[i, torch.tensor(sorted(banned), device=logits.device)] = float("-inf")
        rows = [i for i, r in enumerate(requests) if r.sampling.needs_penalties]
        if rows:
            logits[rows] = _apply_penalties(logits[rows], [requests[i] for i in rows], self.vocab_size)
        return logits

    # -- drawing --------------------------------------------------------------------------------
    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(requests) if not r.sampling.is_greedy]
        if not rows:
            return greedy
        sub = logits[rows]
        params = [requests[i].sampling for i in rows]
        temps = torch.tensor([p.effective_temperature for p in params], device=sub.device)
        sub = _filter(sub / temps[:, None], params)
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs)
        shared = [j for j, i in enumerate(rows) if requests[i].sampling.seed is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator)
        for j, i in enumerate(rows):
            if requests[i].sampling.seed is not None:
                noise[j] = torch.empty(probs.shape[1], device=probs.device).exponential_(
                    generator=self._generator_for(requests[i]))
        # Exponential race: argmax p_i / E_i draws i with probability p_i.
        greedy[rows] = (probs / noise).argmax(dim=-1)
        return greedy

    def _generator_for(self, r: Request) -> torch.Generator:
        g = self._request_generators.get(r.request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(int(r.sampling.seed) & 0xFFFF_FFFF_FFFF)
            self._request_generators[r.request_id] = g
        return g


def _needs_processing(r: Request) -> bool:
    sp = r.sampling
    return bool(sp.logit_bias) or r.num_output_tokens < sp.min_tokens or sp.needs_penalties


def _apply_penalties(logits: torch.Tensor, requests: list[Request], vocab: int) -> torch.Tensor:
    """HF-style repetition penalty over prompt + output; OpenAI presence/frequency over output."""
    dev = logits.device
    S = len(requests)
    seen = torch.zeros(S, vocab, dtype=torch.bool, device=dev)
    out_counts = torch.zeros(S, vocab, dtype=logits.dtype, device=dev)
    for i, r in enumerate(requests):
        seen[i, torch.tensor(r.token_ids, device=dev)] = True
        out = r.output_token_ids
        if out:
            out_counts[i].index_add_(0, torch.tensor(out, device=dev), torch.ones(len(out), device=dev))
    rep = torch.tensor([r.sampling.repetition_penalty for r in requests], device=dev)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = torch.tensor([r.sampling.frequency_penalty for r in requests], device=dev)[:, None]
    pres = torch.tensor([r.sampling.presence_penalty for r in requests], device=dev)[:, None]
    return logits - freq * out_counts - pres * (out_counts > 0).to(logits.dtype)


def _filter(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Top-k, then top-p, then min-p, each only where asked; filtered logits are -inf."""
    V = logits.shape[1]
    ks = [p.top_k if p.top_k not in (None, 0, -1) else V for p in params]
    if any(k < V for k in ks):
        k = torch.tensor(ks, device=logits.device).clamp(max=V)
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    ps = [p.top_p if p.top_p is not None else 1.0 for p in params]
    if any(p < 1.0 for p in ps):
        top_p = torch.tensor(ps, device=logits.device)[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p  # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    mins = [p.min_p or 0.0 for p in params]
    if any(m > 0.0 for m in mins):
        probs = logits.softmax(dim=-1)
        floor = torch.tensor(mins, device=logits.device)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, requests: list[Request]):
    rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
    lp = raw[rows].log_softmax(dim=-1)
    chosen = lp.gather(1, token_ids[rows][:, None]).squeeze(1).tolist()
    k = max(requests[i].sampling.logprobs for i in rows)
    top_vals, top_ids = (lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long()))
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list = [None] * len(requests)
    for j, i in enumerate(rows):
        n = requests[i].sampling.logprobs
        out[i] = (chosen[j], list(zip(top_ids[j][:n], top_vals[j][:n])))
    return out
