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
    """Device tensors; nothing here has been copied to the host yet."""

    token_ids: torch.Tensor                       # [S]
    logprob_rows: list[int] | None = None         # rows (of S) that asked for logprobs
    chosen_logprobs: torch.Tensor | None = None   # [R] logprob of the sampled token
    top_ids: torch.Tensor | None = None           # [R, k]
    top_logprobs: torch.Tensor | None = None      # [R, k]

    def host_logprobs(self, requests: list[Request]) -> list | None:
        """Per row: (chosen logprob, [(id, logprob), ...]) or None. Synchronizes."""
        if self.logprob_rows is None:
            return None
        chosen = self.chosen_logprobs.tolist()
        ids, vals = self.top_ids.tolist(), self.top_logprobs.tolist()
        out: list = [None] * len(requests)
        for j, i in enumerate(self.logprob_rows):
            n = requests[i].sampling.logprobs
            out[i] = (chosen[j], list(zip(ids[j][:n], vals[j][:n])))
        return out


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
        out = SampleOutput(token_ids)
        if any(r.sampling.logprobs is not None for r in requests):
            _logprobs(out, raw, requests)
        return out

    # -- logit processing ---------------------------------------------------------------------
    def _process(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        for i, r in enumerate(requests):
            sp = r.sampling
            if sp.logit_bias:
                ids = torch.tensor(list(sp.logit_bias), device=logits.device)
                logits[i].index_add_(0, ids, torch.tensor(list(sp.logit_bias.values()), device=logits.device))
            if _num_before(r) < sp.min_tokens:
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


def _num_before(r: Request) -> int:
    """Output tokens that precede the one being sampled now (some may still be in flight)."""
    return r.num_output_tokens + max(0, r.num_inflight_tokens - 1)


def _needs_processing(r: Request) -> bool:
    sp = r.sampling
    return bool(sp.logit_bias) or _num_before(r) < sp.min_tokens or sp.needs_penalties


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


def _logprobs(out: SampleOutput, raw: torch.Tensor, requests: list[Request]) -> None:
    """Raw-distribution logprobs of the sampled token and the top-k, left on the device."""
    rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
    lp = raw[rows].log_softmax(dim=-1)
    out.logprob_rows = rows
    out.chosen_logprobs = lp.gather(1, out.token_ids[rows][:, None]).squeeze(1)
    k = max(requests[i].sampling.logprobs for i in rows)
    if k > 0:
        out.top_logprobs, out.top_ids = lp.topk(k, dim=-1)
    else:
        out.top_logprobs, out.top_ids = lp[:, :0], lp[:, :0].long()
