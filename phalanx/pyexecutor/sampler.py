"""Sampler: logits of the sampling rows -> one token id per row (+ logprobs when asked).

Order per row: a grammar's mask, allowed_token_ids (every other token masked), logit_bias,
min_tokens (EOS and stop ids masked, unless a grammar or the allowed ids leave nothing else),
bad words (the token that would complete one masked), repetition / presence / frequency
penalties, then greedy argmax or temperature → top-k → top-p → min-p → a draw.
Logprobs are those of the raw model distribution (log-softmax of the unprocessed logits).

Per-request work is done on the host first, one row at a time (``RowSettings.of``): every
value a row contributes to the batched tensors is converted and checked there, so a request
whose settings cannot be turned into tensors fails alone (``Sampler.plan`` names its row)
instead of failing the batched operations of everyone sampled with it.

A row with a ``seed`` draws its noise from a counter-based generator keyed by (seed, the
token's position, token id) (``seeded_exponential``), so its tokens depend neither on what else
is in the batch nor on how the steps are cut (a speculative verify step samples several
positions at once, and the same tokens come out). Other rows share the sampler's generator;
every rank holds the same one, so all ranks sample the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from phalanx.llmapi.sampling_params import MAX_LOGPROBS, SamplingParams
from phalanx.pyexecutor.request import Request


class TokenMask(NamedTuple):
    """The grammar rows' allowed tokens for one sampling step (GuidedDecoder.bitmask)."""

    bits: torch.Tensor        # [rows, ceil(vocab_size / 32)] int32, on the host or already on the device
    rows: list[int]           # the sampling rows it constrains
    vocab_size: int           # ids it covers; the model's ids past it are never allowed

    def chunk(self, lo: int, hi: int) -> TokenMask | None:
        """The mask of sampling rows lo..hi-1, numbered from lo (None: no grammar row there)."""
        rows = [r - lo for r in self.rows if lo <= r < hi]
        return TokenMask(self.bits[lo:hi], rows, self.vocab_size) if rows else None


@dataclass
class SampleOutput:
    """Device tensors; nothing here has been copied to the host yet."""

    token_ids: torch.Tensor                       # [S]
    logprob_rows: list[int] | None = None         # rows (of S) that asked for logprobs
    chosen_logprobs: torch.Tensor | None = None   # [R] logprob of the sampled token
    chosen_ranks: torch.Tensor | None = None      # [R] its rank in the vocabulary (1: the likeliest)
    top_ids: torch.Tensor | None = None           # [R, k]
    top_logprobs: torch.Tensor | None = None      # [R, k]
    top_k: list[int] | None = None                # [R] alternatives each row asked for

    @classmethod
    def join(cls, parts: list[SampleOutput], rows: int) -> SampleOutput:
        """One step's output from its chunks' (each of ``rows`` rows but the last; their top
        logprobs of one width)."""
        out = cls(torch.cat([p.token_ids for p in parts]))
        with_lp = [(i, p) for i, p in enumerate(parts) if p.logprob_rows is not None]
        if with_lp:
            out.logprob_rows = [i * rows + r for i, p in with_lp for r in p.logprob_rows or ()]
            out.top_k = [n for _, p in with_lp for n in p.top_k or ()]
            out.chosen_logprobs = torch.cat([p.chosen_logprobs for _, p in with_lp if p.chosen_logprobs is not None])
            out.chosen_ranks = torch.cat([p.chosen_ranks for _, p in with_lp if p.chosen_ranks is not None])
            out.top_ids = torch.cat([p.top_ids for _, p in with_lp if p.top_ids is not None])
            out.top_logprobs = torch.cat([p.top_logprobs for _, p in with_lp if p.top_logprobs is not None])
        return out

    def host_logprobs(self) -> list | None:
        """Per row: (chosen logprob, its rank, [(id, logprob), ...]) or None. Synchronizes."""
        if self.logprob_rows is None:
            return None
        assert self.chosen_logprobs is not None and self.top_ids is not None and self.top_logprobs is not None
        assert self.top_k is not None and self.chosen_ranks is not None
        chosen, ranks = self.chosen_logprobs.tolist(), self.chosen_ranks.tolist()
        ids, vals = self.top_ids.tolist(), self.top_logprobs.tolist()
        out: list = [None] * len(self.token_ids)
        for j, (i, n) in enumerate(zip(self.logprob_rows, self.top_k, strict=True)):
            out[i] = (chosen[j], ranks[j], list(zip(ids[j][:n], vals[j][:n], strict=True)))
        return out


@dataclass(frozen=True)
class RowSettings:
    """One row's sampling settings as plain, checked Python values (built on the host)."""

    greedy: bool
    temperature: float = 1.0
    top_k: int = 0                    # 0: off (values above the vocabulary are off too)
    top_p: float = 1.0
    min_p: float = 0.0
    allowed: tuple[int, ...] = ()     # the only tokens that may be drawn (empty: all)
    bias_ids: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()
    banned: tuple[int, ...] = ()      # masked at this step (min_tokens not reached)
    bad_words: tuple[tuple[int, ...], ...] = ()   # token sequences whose last token may not complete them
    bad_tail: int = 0                 # output tokens the bad words look back at (the longest's, less one)
    penalties: tuple[float, float, float] | None = None   # (repetition, frequency, presence)
    seed: int | None = None
    logprobs: int | None = None
    logprob_temperature: float = 1.0  # the logprobs' distribution is of logits / this (scaled_logprobs)

    @property
    def needs_processing(self) -> bool:
        return bool(self.allowed or self.bias_ids or self.banned or self.bad_words or self.penalties)

    @classmethod
    def of(cls, r: Request, vocab_size: int) -> RowSettings:
        """A request's settings at this step: built once for each of its two states (min_tokens
        still banning its stop tokens, or not) and kept on the request — its sampling parameters
        do not change, and at hundreds of rows a step building them anew cost ~0.7 ms of host time.
        Raises (ValueError, TypeError, OverflowError) for settings no tensor can hold."""
        banning = r.sampling.min_tokens > 0 and _num_before(r) < r.sampling.min_tokens
        settings = r.row_settings[banning]
        if settings is None:
            settings = r.row_settings[banning] = cls._build(r, vocab_size, banning)
        return settings

    @classmethod
    def _build(cls, r: Request, vocab_size: int, banning: bool) -> RowSettings:
        sp = r.sampling
        bias_ids = tuple(int(t) for t in (sp.logit_bias or {}))
        banned: tuple[int, ...] = ()
        if banning:
            banned = tuple(sorted({int(t) for t in sp.stop_token_ids or []}
                                  | (set() if sp.ignore_eos else {int(t) for t in r.eos_token_ids})))
        allowed = tuple(sorted({int(t) for t in sp.allowed_token_ids or ()}))
        if allowed and set(allowed) <= set(banned):
            banned = ()     # a ban that would leave no token to draw is lifted (as a grammar's)
        bad_words = tuple(tuple(int(t) for t in seq) for seq in sp.bad_words_token_ids or ())
        for t in bias_ids + banned + allowed + tuple(t for seq in bad_words for t in seq):
            if not 0 <= t < vocab_size:
                raise ValueError(f"token id {t} is outside the vocabulary [0, {vocab_size})")
        top_k = int(sp.top_k or 0)
        settings = cls(
            greedy=sp.is_greedy, temperature=float(sp.effective_temperature),
            top_k=top_k if 0 < top_k < vocab_size else 0,
            top_p=float(sp.top_p) if sp.top_p is not None else 1.0, min_p=float(sp.min_p or 0.0),
            allowed=allowed, bias_ids=bias_ids,
            bias_values=tuple(float(v) for v in (sp.logit_bias or {}).values()), banned=banned, bad_words=bad_words,
            bad_tail=max(map(len, bad_words), default=1) - 1,
            penalties=((float(sp.repetition_penalty), float(sp.frequency_penalty), float(sp.presence_penalty))
                       if sp.needs_penalties else None),
            seed=None if sp.seed is None else int(sp.seed) & 0xFFFF_FFFF_FFFF,
            logprobs=None if sp.logprobs is None else int(sp.logprobs),
            logprob_temperature=float(sp.effective_temperature) if sp.scaled_logprobs and not sp.is_greedy else 1.0)
        if not settings.greedy and not settings.temperature > 0.0:
            raise ValueError(f"temperature {settings.temperature} cannot scale logits")
        return settings


# Rows sampled at once. The filters, penalties, keyed noise and logprobs hold [rows, vocabulary]
# temporaries (up to ~6 float32 copies of the rows' logits at once, counted on the CPU; a GPU's
# sort and top-k take scratch space besides); 256 rows of a 128k vocabulary hold ~0.8 GB, and a
# larger batch is sampled a chunk at a time, so what sampling holds beside the logits is bounded
# whatever the batch (the KV pool is sized after it: pyexecutor/creator.py).
SAMPLE_CHUNK_ROWS = 256


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0, chunk_rows: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.chunk_rows = chunk_rows or SAMPLE_CHUNK_ROWS
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def plan(self, requests: list[Request]) -> tuple[list[RowSettings], dict[int, str]]:
        """Every row's settings, and {row: error} for the rows whose settings failed."""
        settings: list[RowSettings] = []
        failed: dict[int, str] = {}
        for i, r in enumerate(requests):
            try:
                settings.append(RowSettings.of(r, self.vocab_size))
            except (ValueError, TypeError, OverflowError) as e:
                failed[i] = f"sampling settings: {type(e).__name__}: {e}"
        return settings, failed

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, requests: list[Request], settings: list[RowSettings] | None = None,
               bitmask: TokenMask | None = None) -> SampleOutput:
        """logits: [S, V] float32 (one row per sampling request) -> SampleOutput.

        ``settings`` comes from ``plan`` (which the model runner calls before the forward);
        without it the rows are planned here and a bad row raises. ``bitmask``: the grammar rows'
        allowed tokens (GuidedDecoder.bitmask), applied before everything else; logprobs stay
        those of the model's own distribution."""
        if settings is None:
            settings = [RowSettings.of(r, self.vocab_size) for r in requests]
        logits = logits[:, :self.vocab_size]
        S, C = logits.shape[0], self.chunk_rows
        if S <= C or (bitmask is None and all(s.greedy and not s.needs_processing and s.logprobs is None
                                              for s in settings)):
            return self._sample_rows(logits, requests, settings, bitmask)
        # a chunk of rows at a time: the temporaries below are [rows, vocabulary] each; their top
        # logprobs of the step's widest ask, so that they join
        width = max((s.logprobs or 0 for s in settings), default=0)
        parts = [self._sample_rows(logits[lo:lo + C], requests[lo:lo + C], settings[lo:lo + C],
                                   None if bitmask is None else bitmask.chunk(lo, lo + C), width)
                 for lo in range(0, S, C)]
        return SampleOutput.join(parts, C)

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request], settings: list[RowSettings],
                     bitmask: TokenMask | None, top_width: int | None = None) -> SampleOutput:
        """One pass over these rows: a step's, or a chunk of them."""
        raw = logits
        if bitmask is not None:
            import xgrammar as xgr
            logits = logits.clone()
            xgr.apply_token_bitmask_inplace(logits, bitmask.bits.to(logits.device, non_blocking=True),
                                            vocab_size=bitmask.vocab_size, indices=bitmask.rows)
            if bitmask.vocab_size < self.vocab_size:   # the output layer's padding ids
                logits[:, bitmask.vocab_size:].index_fill_(0, device_ints(bitmask.rows, logits.device), float("-inf"))
        if any(s.needs_processing for s in settings):
            logits = self._process(logits if bitmask is not None else logits.clone(), requests, settings,
                                   frozenset(bitmask.rows) if bitmask is not None else frozenset())
        token_ids = self._draw(logits, requests, settings)
        del logits   # (the processed copy, if any: logprobs are the raw distribution's)
        out = SampleOutput(token_ids)
        if any(s.logprobs is not None for s in settings):
            _logprobs(out, raw, settings, top_width)
        return out

    # -- logit processing ---------------------------------------------------------------------
    def _process(self, logits: torch.Tensor, requests: list[Request], settings: list[RowSettings],
                 grammar_rows: frozenset[int] = frozenset()) -> torch.Tensor:
        """Logit bias, banned tokens and penalties, in place. Host lists reach the device through
        device_ints/device_floats and fills take Python scalars: nothing here waits for the stream.
        A grammar row's ban (min_tokens, bad words) holds while its grammar allows another token:
        where the grammar allows only what is banned (its end, EOS), the ban is lifted and the
        grammar goes on; a bad-word ban that would leave no allowed token is lifted too."""
        dev = logits.device
        for i, s in enumerate(settings):
            if s.allowed:
                r = requests[i]
                if r.allowed_index is None or r.allowed_index.device != dev:   # once a request
                    r.allowed_index = device_ints(s.allowed, dev)
                values = logits[i].index_select(0, r.allowed_index)
                logits[i].fill_(float("-inf")).index_copy_(0, r.allowed_index, values)
            if s.bias_ids:
                bias = device_floats(s.bias_values, dev).to(logits.dtype)
                logits[i].index_add_(0, device_ints(s.bias_ids, dev), bias)
            banned = s.banned
            if s.bad_words:
                r = requests[i]
                tail = r.token_ids[max(len(r.prompt_token_ids), len(r.token_ids) - s.bad_tail):]
                completing = _completing(s.bad_words, tail)
                if completing:
                    banned = _bans(s.allowed, s.banned, completing)
            if banned:
                ids = device_ints(banned, dev)
                kept = logits[i].index_select(0, ids) if i in grammar_rows else None
                logits[i].index_fill_(0, ids, float("-inf"))
                if kept is not None:   # on the device, no wait: every token masked -> the banned ones back
                    logits[i].index_copy_(0, ids, torch.where(torch.isneginf(logits[i].amax()), kept,
                                                              torch.full_like(kept, float("-inf"))))
        rows = [i for i, s in enumerate(settings) if s.penalties is not None]
        if len(rows) == len(settings):
            _apply_penalties(logits, requests, [s.penalties for s in settings], self.vocab_size)
        elif rows:
            index = device_ints(rows, dev)
            some = logits.index_select(0, index)
            _apply_penalties(some, [requests[i] for i in rows], [settings[i].penalties for i in rows], self.vocab_size)
            logits.index_copy_(0, index, some)
        return logits

    # -- drawing --------------------------------------------------------------------------------
    def _draw(self, logits: torch.Tensor, requests: list[Request], settings: list[RowSettings]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(settings) if not s.greedy]
        if not rows:
            return greedy
        dev = logits.device
        rows_t = device_ints(rows, dev)      # host lists reach the device asynchronously (no stream wait)
        params = [settings[i] for i in rows]
        probs = tempered_probs(logits[rows_t], params)
        shared = [j for j, s in enumerate(params) if s.seed is None]
        seeded = [j for j, s in enumerate(params) if s.seed is not None]
        noise = torch.empty(len(shared), probs.shape[1], device=dev).exponential_(generator=self.generator)
        keyed = None
        if seeded:   # the position of the token drawn: the tokens before it, in flight ones included
            seeds = [int(params[j].seed or 0) for j in seeded]
            pos = [requests[rows[j]].num_prompt_tokens + _num_before(requests[rows[j]]) for j in seeded]
            keyed = seeded_exponential(device_ints(seeds, dev), device_ints(pos, dev)[:, None], probs.shape[1])[:, 0]
        noise = joined_noise(probs, shared, noise, seeded, keyed)
        # Exponential race: argmax p_i / E_i draws i with probability p_i.
        greedy[rows_t] = probs.div_(noise).argmax(dim=-1)
        return greedy


def tempered_probs(rows: torch.Tensor, params: list[RowSettings]) -> torch.Tensor:
    """softmax of ``rows`` [R, V] (the caller's own copy: scaled and filtered in place) over each
    row's temperature, after its top-k / top-p / min-p."""
    rows.div_(device_floats([s.temperature for s in params], rows.device)[:, None])
    return _filter(rows, params).softmax(dim=-1)


def joined_noise(like: torch.Tensor, shared: list[int], shared_noise: torch.Tensor | None, seeded: list[int],
                 keyed: torch.Tensor | None) -> torch.Tensor:
    """The exponential race's noise for rows of both kinds: the generator's for rows ``shared``,
    the seeded rows' keyed noise for rows ``seeded``, in one tensor shaped as ``like`` where both
    kinds are there."""
    if not seeded:
        assert shared_noise is not None
        return shared_noise
    assert keyed is not None
    if not shared:
        return keyed
    assert shared_noise is not None
    both = torch.empty_like(like)
    both[device_ints(shared, like.device)] = shared_noise
    both[device_ints(seeded, like.device)] = keyed
    return both


def costliest_rows(rows: int, vocab_size: int) -> list[Request]:
    """``rows`` requests whose sampling takes every path of the sampler at once: temperature,
    top-k, top-p and min-p, allowed tokens, a logit bias, min_tokens banning, bad words, the
    three penalties, a seed (its keyed noise holds more than the shared generator's) and the
    most logprobs. Sampling them
    allocates the most that a step sampling that many rows can (its [rows, vocabulary]
    temporaries); the KV pool is sized after it (``pyexecutor/creator.py``)."""
    ids = [i % vocab_size for i in range(8)]
    return [Request(i, ids, SamplingParams(
        temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.1,
        presence_penalty=0.1, logit_bias={ids[1]: 1.0}, allowed_token_ids=ids, min_tokens=1, stop_token_ids=[ids[2]],
        bad_words_token_ids=[[ids[4]], [ids[5], ids[6]]], scaled_logprobs=True,
        seed=i, logprobs=MAX_LOGPROBS), max_total_tokens=len(ids) + 1, eos_token_ids=(ids[3],))
        for i in range(rows)]


_MASK64 = (1 << 64) - 1


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


_K_SEED, _K_POS, _K_TOKEN = _signed(0x9E3779B97F4A7C15), _signed(0xC2B2AE3D27D4EB4F), _signed(0x165667B19E3779F9)
_MIX1, _MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's is arithmetic), in one new tensor."""
    t = x >> s
    t &= (1 << (64 - s)) - 1
    return t


def seeded_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [R, P, vocab] float32, a pure function of (seeds [R], positions [R, P], token
    id): splitmix64 of seed·K1 + position·K2 + token·K3 (int64 arithmetic wraps), its top 53
    bits a uniform u in (0, 1), then −log u."""
    tok = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    x = (seeds[:, None, None] * _K_SEED + positions[..., None] * _K_POS) + tok * _K_TOKEN
    # in place: each int64 [R, P, vocab] temporary is twice a float32 copy of the logits
    x ^= _shr(x, 30)
    x *= _MIX1
    x ^= _shr(x, 27)
    x *= _MIX2
    x ^= _shr(x, 31)
    x = _shr(x, 11)
    u = x.double()
    del x
    return u.add_(0.5).mul_(2.0 ** -53).log_().neg_().float()


def device_ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the stream (pinned, asynchronous)."""
    t = torch.tensor(values, dtype=torch.long)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def device_floats(values: Sequence[float], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _num_before(r: Request) -> int:
    """Output tokens that precede the one being sampled now (some may still be in flight)."""
    return r.num_output_tokens + max(0, r.num_inflight_tokens - 1)


def _bans(allowed: tuple[int, ...], banned: tuple[int, ...], completing: list[int]) -> tuple[int, ...]:
    """A row's bans at this step: min_tokens' and the bad words' about to complete. Where they
    would leave none of its allowed tokens, min_tokens' is lifted (a bad word is never drawn);
    where the bad words alone leave none, theirs is (the sizes first: a large allowed list is
    never walked while the bans are fewer)."""
    both = set(completing).union(banned)
    if allowed and len(allowed) <= len(both) and both.issuperset(allowed):
        alone = set(completing)
        return banned if len(allowed) <= len(alone) and alone.issuperset(allowed) else tuple(sorted(alone))
    return tuple(sorted(both))


def _completing(bad_words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word now: a sequence's last token where the output
    (its last ``bad_tail`` tokens here) ends with the rest of it (a one-token word's always). The
    output is known up to the token being sampled (rows with several-token words wait for
    in-flight ones: ``needs_history``)."""
    return sorted({seq[-1] for seq in bad_words
                   if len(seq) == 1 or (len(seq) - 1 <= len(output) and tuple(output[1 - len(seq):]) == seq[:-1])})


def _apply_penalties(logits: torch.Tensor, requests: list[Request], penalties: list, vocab: int) -> None:
    """HF-style repetition penalty over prompt + output; OpenAI presence/frequency over output.
    In place on ``logits`` (rows of the caller's own), one [rows, vocabulary] float temporary at
    a time beside the masks and counts."""
    dev = logits.device
    S = len(requests)
    seen = torch.zeros(S, vocab, dtype=torch.bool, device=dev)
    out_counts = torch.zeros(S, vocab, dtype=logits.dtype, device=dev)
    for i, r in enumerate(requests):
        seen[i].index_fill_(0, device_ints(r.token_ids, dev), True)
        out = r.output_token_ids
        if out:
            out_counts[i].index_add_(0, device_ints(out, dev), torch.ones(len(out), dtype=logits.dtype, device=dev))
    rep, freq, pres = (device_floats(col, dev).to(logits.dtype)[:, None] for col in zip(*penalties, strict=True))
    positive = logits > 0
    logits.div_(torch.where(seen & positive, rep, 1.0))     # a seen token's positive logit / rep ...
    logits.mul_(torch.where(seen & ~positive, rep, 1.0))    # ... and any other seen one × rep
    del seen, positive
    present = (out_counts > 0).to(logits.dtype)
    logits.sub_(out_counts.mul_(freq))
    logits.sub_(present.mul_(pres))


def _filter(logits: torch.Tensor, params: list[RowSettings]) -> torch.Tensor:
    """Top-k, then top-p, then min-p, each only where asked; filtered logits become -inf, in
    place (``logits`` is the caller's own), which is returned. Top-k takes the k-th value from a
    top-k of the largest k asked, not a sort of the whole vocabulary."""
    V = logits.shape[1]
    ks = [s.top_k if s.top_k > 0 else V for s in params]
    limited = [k for k in ks if k < V]
    if limited:
        kmax = max(limited)
        kth = logits.topk(kmax, dim=-1).values.gather(1, (device_ints([min(k, kmax) for k in ks], logits.device)
                                                          - 1)[:, None])
        if len(limited) < len(ks):   # rows without top-k keep every value
            kth[device_ints([i for i, k in enumerate(ks) if k >= V], logits.device)] = float("-inf")
        logits.masked_fill_(logits < kth, float("-inf"))
    ps = [s.top_p for s in params]
    if any(p < 1.0 for p in ps):
        top_p = device_floats(ps, logits.device)[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        del sorted_logits
        drop_sorted = probs.cumsum(dim=-1).sub_(probs) >= top_p   # keep the token that crosses p
        del probs
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        del order, drop_sorted
        logits.masked_fill_(drop, float("-inf"))
    mins = [s.min_p for s in params]
    if any(m > 0.0 for m in mins):
        probs = logits.softmax(dim=-1)
        floor = device_floats(mins, logits.device)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits.masked_fill_(probs < floor, float("-inf"))
    return logits


def logprob_ranks(lp: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The rank of each row's chosen logprob in the row [R, V] -> [R]: how many tokens are at
    least as likely (1: none likelier; ties rank as the worst of them, as vLLM counts)."""
    return (lp >= chosen[:, None]).sum(dim=-1)


def _logprobs(out: SampleOutput, raw: torch.Tensor, settings: list[RowSettings], width: int | None) -> None:
    """Raw-distribution logprobs of the sampled token, its rank (``logprob_ranks``) and the top
    ``width`` (the rows' widest ask when None), left on the device; a row with
    ``logprob_temperature`` (scaled_logprobs) has those of its logits divided by it."""
    rows = [i for i, s in enumerate(settings) if s.logprobs is not None]
    lp = raw if len(rows) == len(settings) else raw[rows]
    scales = [settings[i].logprob_temperature for i in rows]
    if any(t != 1.0 for t in scales):
        lp = lp / device_floats(scales, lp.device).to(lp.dtype)[:, None]
    lp = lp.log_softmax(dim=-1)
    out.logprob_rows = rows
    out.top_k = [settings[i].logprobs or 0 for i in rows]
    out.chosen_logprobs = lp.gather(1, out.token_ids[rows][:, None]).squeeze(1)
    out.chosen_ranks = logprob_ranks(lp, out.chosen_logprobs)
    k = min(max(out.top_k) if width is None else width, lp.shape[1])
    if k > 0:
        out.top_logprobs, out.top_ids = lp.topk(k, dim=-1)
    else:
        out.top_logprobs, out.top_ids = lp[:, :0], lp[:, :0].long()
