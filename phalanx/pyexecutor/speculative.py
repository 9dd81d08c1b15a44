"""Speculative decoding on the device, with the overlap loop kept on.

The state a verify step needs lives on the device, one row per request slot, so step n + 1
can be queued before the host has read step n::

    length[s]          L: the request's tokens known on the device (prompt + accepted outputs);
                       the last one's KV is not written yet
    next_tokens[s]     [k + 1]: that last token, then k drafts — step n + 1's input ids
    limit[s]           its length limit (L stops there)
    history[s, :L]     its tokens (NGram only: the proposer matches in them)

A verify row computes positions L − 1 .. L − 1 + k; positions, KV slots and sequence lengths
are filled in on the device (``place``) from ``length`` and the row's block table, which the
scheduler grew for the largest L the host cannot rule out. After the forward, ``verify``
draws the target's own token at every position as the plain sampler would and accepts the
drafts while they equal it (exact for greedy and sampled rows: each position's token is a
draw from the target given the tokens before it), ``advance`` appends the accepted tokens,
moves L and asks the proposer for the next k drafts. Only the accepted tokens and their count
go to the host, read one step later like every other token. A step may also verify no drafts
(k = 0: one token from the device state, a decode CUDA graph) when ``SpecPolicy`` (scheduler)
finds that drafts do not pay.

Rejected drafts' KV stays in private blocks past L − 1 and is overwritten by the next verify;
the scheduler commits only positions below the accepted length, so the radix tree never holds
a rejected token.

Proposers (``Proposer``) get the rows that sampled this step and return k drafts each:

NGram        the latest earlier occurrence of the last n tokens (n = max_matching_ngram_size
             .. min_matching_ngram_size) in the history; its continuation, extended
             periodically where it runs into the present (a text that repeats keeps being
             predicted); no match: the last token.
DraftTarget  a draft model (the target's vocabulary) runs greedily k steps over its own KV pool,
             which uses the target's block ids; every target forward also runs the draft on the
             same inputs, so its KV follows the target's (prompts, prefix hits, verify steps).
Eagle3       an EAGLE-3 head (models/eagle3.py) over its own one-layer KV pool (the target's
             block ids). Its entry at position p takes the target's hidden state h_p and the
             token x_{p+1}. Every target forward runs the head over the same rows with the
             input ids shifted by one (each row's last takes the next prompt token where the
             host knows it, else 0: that entry is written again below) and keeps h of every
             row. After sampling, the first draft step writes the entry at L − 2 again from
             (h_{L−2}, x_{L−1}) — for a verify row h at q0 + n − 1, its last accepted
             position within the length limit (a row already at its limit writes nothing) — and
             drafts; each later step takes the head's own g in place of
             h. Entries the target rejects lie past L − 2 and are written again by the next
             verify, which covers L − 1 .. L − 1 + k. A prefix-cache hit's last cached position
             keeps the entry its first request wrote (drafts only: tokens never depend on it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from phalanx.kernels.metadata import AttentionMetadata
from phalanx.pyexecutor.sampler import device_ints, joined_noise, seeded_exponential, tempered_probs

if TYPE_CHECKING:
    from phalanx.models.eagle3 import Eagle3Head
    from phalanx.models.llama import CausalLM
    from phalanx.models.parallel import TPGroup
    from phalanx.pyexecutor.kv_pool import KVPool
    from phalanx.pyexecutor.sampler import RowSettings, Sampler


def speculates(params) -> bool:
    """Whether a request with these SamplingParams decodes speculatively. Settings the verify
    step does not apply to k + 1 positions at once (penalties, logit bias, allowed tokens, bad
    words, min_tokens, logprobs, grammars) keep the request on plain one-token steps: honoured, not
    sped up."""
    return (not params.needs_penalties and not params.logit_bias and not params.min_tokens
            and params.logprobs is None and params.guided_decoding is None and not params.allowed_token_ids
            and not params.bad_words_token_ids)


@dataclass
class SpecStep:
    """One step's speculative rows (device tensors built by ``ModelRunner.prepare``).

    Verify rows come in batch order; each has k + 1 packed query rows from ``q0``.
    First rows: rows of speculative requests that sample their first token (their prompt
    is complete): ``advance`` sets their device state. Prompt rows (NGram): packed rows whose
    input ids go into the history at their positions."""

    verify_rows: list[int]                 # batch rows
    verify_q0: torch.Tensor                # [Sv] first packed query row
    verify_slots: torch.Tensor             # [Sv]
    first_rows: list[int]                  # batch rows
    first_sample_idx: torch.Tensor         # [F] their index among the plain sampling rows
    table_rows: torch.Tensor               # [Sv + F] verify rows, then first rows (``advance``'s order)
    first_slots: torch.Tensor              # [F]
    first_length: torch.Tensor             # [F] L after their first token
    first_limit: torch.Tensor              # [F]
    first_last_row: torch.Tensor           # [F] the packed row of their last input
    max_length: int                        # no row's L (or draft position + 1) exceeds this
    block_tables: torch.Tensor             # the step's [S, M] block tables
    k: int = 0                             # drafts each verify row checks (0: one token, no drafts)
    propose: bool = True                   # ask the proposer for the next step's drafts
    settings: list[RowSettings] | None = None   # the verify rows' sampling settings
    prompt_src: torch.Tensor | None = None  # [N] packed rows (NGram history)
    prompt_slot: torch.Tensor | None = None
    prompt_pos: torch.Tensor | None = None
    cached_tokens: torch.Tensor | None = None   # NGram history: prompt tokens found in the prefix cache
    cached_slot: torch.Tensor | None = None
    cached_pos: torch.Tensor | None = None
    drafts: torch.Tensor | None = None     # [Sv, k] the drafts verified (set by ``place``)
    accepted: torch.Tensor | None = None   # [Sv] 1 .. k + 1 (set after sampling)
    tokens: torch.Tensor | None = None     # [Sv, k + 1]
    host: torch.Tensor | None = None       # [Sv, k + 2]: tokens, then the count (on the host)
    draft_hidden: torch.Tensor | None = None   # [T, H] every packed row's target hidden state (EAGLE-3)

    @property
    def verify_rows_t(self) -> torch.Tensor:
        """The verify rows' batch rows on the device (the head of ``table_rows``)."""
        return self.table_rows[:len(self.verify_rows)]


@dataclass
class HeadRows:
    """An EAGLE-3 head's entry at L − 2 of each advanced row: the target's hidden state there, the
    token x_{L−1} and whether the row moved (a row already at its length limit writes nothing)."""

    hidden: torch.Tensor     # [R, H]
    token: torch.Tensor      # [R]
    moved: torch.Tensor      # [R] bool


class Proposer(Protocol):
    reads_hidden: bool    # the step's inputs carry ``tails`` and the step keeps ``draft_hidden`` (EAGLE-3)

    def propose(self, spec: SpecDecoder, slots: torch.Tensor, length: torch.Tensor,
                block_tables: torch.Tensor, max_length: int, head_rows: HeadRows | None = None) -> torch.Tensor:
        """[R, k] drafts for the rows of ``slots`` whose device state was just advanced
        (``head_rows``: what the head's entry at each one's L − 2 takes, where ``reads_hidden``)."""
        ...

    def after_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      tails: torch.Tensor | None) -> torch.Tensor | None:
        """Every target forward's inputs (a draft keeps its KV in step); returns the hidden
        states ``propose`` takes rows of, where ``reads_hidden``."""
        ...

    def copy_blocks(self, copy_ops: list) -> None:
        """The target pool's copies (partial reuse, the host tier's moves), for a pool of the
        proposer's own."""
        ...


class SpecDecoder:
    def __init__(self, k: int, proposer: Proposer, vocab_size: int, max_seq_len: int, max_position: int,
                 tokens_per_block: int, scratch_block: int, device: torch.device, keep_history: bool,
                 tp: TPGroup | None = None) -> None:
        self.tp = tp
        self.k, self.proposer, self.vocab_size = k, proposer, vocab_size
        self.scratch_block = scratch_block        # the pool's block no request owns
        self.max_position = max_position          # the target's rope length: rows past it (dropped) are clamped
        self.tokens_per_block = tokens_per_block
        self.device = device
        self.keep_history = keep_history
        self.cols = max_seq_len + 2 * k + 2        # history columns; the last one takes unaccepted writes
        self.rows = 0
        self.length = torch.zeros(0, dtype=torch.long, device=device)
        self.limit = torch.zeros(0, dtype=torch.long, device=device)
        self.next_tokens = torch.zeros(0, k + 1, dtype=torch.long, device=device)
        self.history = torch.zeros(0, self.cols if keep_history else 1, dtype=torch.int32, device=device)
        self.offsets = torch.arange(k + 1, device=device)
        self.ones = torch.ones(0, dtype=torch.long, device=device)

    def ensure_rows(self, num_slots: int) -> None:
        """Room for slots 0 .. num_slots − 1 (doubling; the slots in use are the low ones)."""
        if num_slots <= self.rows:
            return
        n = max(16, self.rows)
        while n < num_slots:
            n *= 2
        grow = n - self.rows

        def more(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(grow, *t.shape[1:])])
        self.length, self.limit = more(self.length), more(self.limit)
        self.next_tokens, self.history = more(self.next_tokens), more(self.history)
        self.ones = torch.ones(n, dtype=torch.long, device=self.device)
        self.rows = n

    # -- before the forward ----------------------------------------------------------------------
    def place(self, step: SpecStep, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Fill the verify rows' input ids, positions, KV slots and lengths from the device state,
        and the history with the prompt rows' tokens."""
        if step.cached_tokens is not None:
            self.history[step.cached_slot, step.cached_pos] = step.cached_tokens.to(torch.int32)
        if step.prompt_src is not None:
            self.history[step.prompt_slot, step.prompt_pos] = input_ids[step.prompt_src].to(torch.int32)
        if not step.verify_rows:
            return
        k = step.k
        offsets = self.offsets[:k + 1]
        slots = step.verify_slots
        base = self.length[slots] - 1                                  # the last token's position
        pos = base[:, None] + offsets                                  # [Sv, k + 1]
        idx = step.verify_q0[:, None] + offsets
        rows = step.verify_rows_t
        inputs = self.next_tokens[slots, :k + 1]
        input_ids[idx] = inputs
        positions[idx] = pos.clamp(max=self.max_position - 1)
        meta.slot_mapping[idx] = self.kv_slots(meta.block_tables[rows], pos)
        meta.seq_lens[rows] = (base + k + 1).to(meta.seq_lens.dtype)
        step.drafts = inputs[:, 1:]

    def kv_slots(self, tables: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Pool slots of positions ``pos`` [R] or [R, n] of rows with block tables [R, M]; a
        position past a table (a row past its length limit, whose tokens are dropped) writes
        into the scratch block."""
        B = self.tokens_per_block
        blk = pos // B
        inside = blk < tables.shape[1]
        squeeze = pos.dim() == 1
        if squeeze:
            blk, inside = blk[:, None], inside[:, None]
        block = tables.long().gather(1, blk.clamp(max=tables.shape[1] - 1))
        block = torch.where(inside, block, self.scratch_block)
        out = block * B + (pos[:, None] if squeeze else pos) % B
        return out.squeeze(1) if squeeze else out

    # -- after the forward -----------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, drafts: torch.Tensor, settings: list[RowSettings],
               sampler: Sampler, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [Sv·(k + 1), V] of the verify rows -> (tokens [Sv, k + 1], accepted [Sv]).

        At every position the target's own token is drawn as the plain sampler draws it
        (greedy: the argmax; sampled: the exponential race over the row's temperature, top-k,
        top-p and min-p distribution, a seeded row's noise keyed by the token's position). A
        draft is accepted while it equals that token; row i keeps tokens[i, :accepted[i]]: the
        accepted drafts, then the target's token at the first mismatch (or after the last
        draft). Each position's token is a draw from the target's distribution given the tokens
        before it, so the output is distributed as plain sampling's (a draft equal to the target's
        draw is accepted with probability p(draft), as in rejection sampling with a
        deterministic proposal); seeded rows give exactly plain sampling's tokens."""
        Sv, k = drafts.shape
        V = self.vocab_size
        logits = logits[:, :V].reshape(Sv, k + 1, V)
        out = logits.argmax(dim=-1)                                    # [Sv, k + 1]
        sampled = [i for i, s in enumerate(settings) if not s.greedy]
        per = max(1, sampler.chunk_rows // (k + 1))   # rows drawn at once: [rows · (k + 1), V] temporaries
        for lo in range(0, len(sampled), per):
            rows = sampled[lo:lo + per]
            rows_t = device_ints(rows, logits.device)
            out[rows_t] = self._draw(logits, rows, rows_t, settings, sampler, slots)
        if k == 0:
            return out, self.ones[:Sv]
        lead = (out[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)   # drafts accepted
        return out, lead + 1

    def _draw(self, logits: torch.Tensor, rows: list[int], rows_t: torch.Tensor, settings: list[RowSettings],
              sampler: Sampler, slots: torch.Tensor) -> torch.Tensor:
        """The target's own tokens [len(rows), k + 1] at every position of the sampled verify
        ``rows`` (logits [Sv, k + 1, V]): the exponential race over each row's filtered
        distribution, a seeded row's noise keyed by the token's position."""
        k, V = logits.shape[1] - 1, logits.shape[2]
        params = [settings[i] for i in rows]
        probs = tempered_probs(logits[rows_t].reshape(len(rows) * (k + 1), V),
                               [p for p in params for _ in range(k + 1)]).reshape(len(rows), k + 1, V)
        shared = [j for j, s in enumerate(params) if s.seed is None]
        seeded = [j for j, s in enumerate(params) if s.seed is not None]
        draw = keyed = None
        if shared:
            draw = torch.empty(len(shared), k + 1, V, device=logits.device).exponential_(
                generator=sampler.generator)
        if seeded:
            at = device_ints([rows[j] for j in seeded], logits.device)
            pos = self.length[slots[at]][:, None] + self.offsets[None, :k + 1]
            seeds = device_ints([int(params[j].seed or 0) for j in seeded], logits.device)
            keyed = seeded_exponential(seeds, pos, V)
        noise = joined_noise(probs, shared, draw, seeded, keyed)
        return probs.div_(noise).argmax(dim=-1)

    def advance(self, step: SpecStep, first_tokens: torch.Tensor | None) -> None:
        """Append the accepted tokens (verify rows) or the first token (first rows), move L, and
        propose the next drafts."""
        k = step.k
        slots_parts, length_parts, last_parts = [], [], []
        if step.verify_rows:
            assert step.tokens is not None and step.accepted is not None
            slots = step.verify_slots
            L = self.length[slots]
            if self.keep_history:
                offsets = self.offsets[:k + 1]
                pos = torch.where(offsets[None, :] < step.accepted[:, None], L[:, None] + offsets, self.cols - 1)
                self.history[slots[:, None].expand(-1, k + 1), pos] = step.tokens.to(torch.int32)
            slots_parts.append(slots)
            length_parts.append(torch.minimum(L + step.accepted, self.limit[slots]))
            last_parts.append(step.tokens.gather(1, (step.accepted - 1)[:, None]).squeeze(1))
        if step.first_rows:
            assert first_tokens is not None
            self.limit[step.first_slots] = step.first_limit
            if self.keep_history:
                self.history[step.first_slots, step.first_length - 1] = first_tokens.to(torch.int32)
            slots_parts.append(step.first_slots)
            length_parts.append(step.first_length)
            last_parts.append(first_tokens)
        if not slots_parts:
            return
        if len(slots_parts) == 1:
            slots, length, last = slots_parts[0], length_parts[0], last_parts[0]
        else:
            slots, length, last = torch.cat(slots_parts), torch.cat(length_parts), torch.cat(last_parts)
        head_rows = self._head_rows(step, first_tokens) if step.draft_hidden is not None else None
        self.length[slots] = length
        self.next_tokens[slots, 0] = last
        if not step.propose and isinstance(self.proposer, Eagle3Proposer) and head_rows is not None:
            # no drafts next step, but the head's entry at L − 2 still takes the true x_{L−1}
            self.proposer.write_entry(self, length, step.block_tables[step.table_rows], head_rows)
        if step.propose:
            tables = step.block_tables[step.table_rows]
            drafts = self.proposer.propose(self, slots, length, tables, step.max_length, head_rows)
            if self.tp is not None and self.tp.size > 1:   # every rank verifies the same inputs: rank 0's
                torch.distributed.broadcast(drafts, src=0, group=self.tp.group)
            self.next_tokens[slots, 1:] = drafts

    def _head_rows(self, step: SpecStep, first_tokens: torch.Tensor | None) -> HeadRows:
        """What the head's entry at L − 2 takes, for the verify rows then the first rows (before
        ``length`` moves): a verify row's last accepted position within its length limit — the
        target's hidden state at q0 + moved − 1 and the token it accepted there."""
        assert step.draft_hidden is not None
        rows, tokens, moved = [], [], []
        if step.verify_rows:
            assert step.tokens is not None and step.accepted is not None
            slots = step.verify_slots
            L = self.length[slots]
            n = torch.minimum(L + step.accepted, self.limit[slots]) - L      # tokens the row moved by
            last = (n - 1).clamp(min=0)
            rows.append(step.verify_q0 + last)
            tokens.append(step.tokens.gather(1, last[:, None]).squeeze(1))
            moved.append(n > 0)
        if step.first_rows:
            assert first_tokens is not None
            rows.append(step.first_last_row)
            tokens.append(first_tokens)
            moved.append(torch.ones_like(first_tokens, dtype=torch.bool))
        return HeadRows(step.draft_hidden[torch.cat(rows)], torch.cat(tokens), torch.cat(moved))


class NGramProposer:
    """Prompt lookup on the device (see the module docstring)."""

    reads_hidden = False

    def __init__(self, k: int, max_ngram: int, min_ngram: int = 1) -> None:
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram

    def propose(self, spec: SpecDecoder, slots: torch.Tensor, length: torch.Tensor,
                block_tables: torch.Tensor, max_length: int, head_rows: HeadRows | None = None) -> torch.Tensor:
        width = min(max_length, spec.cols - 1)
        hist = spec.history[slots, :width].long()                      # [R, W]
        R = hist.shape[0]
        dev = hist.device
        best = torch.full((R,), -1, dtype=torch.long, device=dev)      # first continuation position
        for n in range(min(self.max_ngram, width - 1), self.min_ngram - 1, -1):
            windows = hist.unfold(1, n, 1)                             # [R, W − n + 1, n]
            suffix = hist.gather(1, (length - n).clamp(min=0)[:, None] + torch.arange(n, device=dev))
            j = torch.arange(windows.shape[1], device=dev)
            # an earlier occurrence with at least one token after it, before the suffix itself
            hit = (windows == suffix[:, None, :]).all(dim=-1) & (j[None, :] + n <= length[:, None] - 1)
            hit &= (length > n)[:, None]
            latest = torch.where(hit, j[None, :], -1).max(dim=1).values
            best = torch.where((best < 0) & (latest >= 0), latest + n, best)
        last = hist.gather(1, (length - 1).clamp(min=0)[:, None])
        start = best.clamp(min=0)
        period = (length - start).clamp(min=1)
        idx = start[:, None] + torch.arange(self.k, device=dev)[None, :] % period[:, None]
        drafts = hist.gather(1, idx.clamp(max=width - 1))
        return torch.where(best[:, None] >= 0, drafts, last.expand(-1, self.k))

    def after_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      tails: torch.Tensor | None) -> None:
        return None

    def copy_blocks(self, copy_ops: list) -> None:
        return None


class DraftModelProposer:
    """A small model drafting greedily over its own KV pool (see the module docstring)."""

    reads_hidden = False

    def __init__(self, k: int, model: CausalLM, pool: KVPool, vocab_size: int, max_position: int) -> None:
        self.k, self.model, self.pool = k, model, pool
        self.vocab_size = vocab_size
        self.max_position = max_position

    @torch.inference_mode()
    def after_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      tails: torch.Tensor | None) -> None:
        self.model(input_ids, positions.clamp(max=self.max_position - 1), dataclasses.replace(meta, cache={}),
                   self.pool.tensor)

    def copy_blocks(self, copy_ops: list) -> None:
        self.pool.copy_blocks(copy_ops)

    @torch.inference_mode()
    def propose(self, spec: SpecDecoder, slots: torch.Tensor, length: torch.Tensor,
                block_tables: torch.Tensor, max_length: int, head_rows: HeadRows | None = None) -> torch.Tensor:
        R = slots.shape[0]
        B = self.pool.tokens_per_block
        dev = slots.device
        token = spec.next_tokens[slots, 0]
        query_start = torch.arange(R + 1, dtype=torch.int32, device=dev)
        drafts = []
        for i in range(self.k):
            pos = length - 1 + i
            meta = AttentionMetadata(
                slot_mapping=spec.kv_slots(block_tables, pos), query_start=query_start,
                seq_lens=(pos + 1).to(torch.int32), block_tables=block_tables, max_query_len=1,
                max_seq_len=max_length + self.k, tokens_per_block=B, is_decode_only=True)
            hidden = self.model(token, pos.clamp(max=self.max_position - 1), meta, self.pool.tensor)
            token = self.model.compute_logits(hidden)[:, :self.vocab_size].argmax(dim=-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)


class Eagle3Proposer:
    """An EAGLE-3 head drafting greedily over its own one-layer KV pool (see the module
    docstring). ``aux``: the target's captured hidden states (``DecoderModel.capture_hidden``)."""

    reads_hidden = True

    def __init__(self, k: int, head: Eagle3Head, pool: KVPool, aux: torch.Tensor) -> None:
        self.k, self.head, self.pool, self.aux = k, head, pool, aux
        self.max_position = head.max_positions
        self.scratch_slot = (pool.num_blocks - 1) * pool.tokens_per_block   # the block no request owns

    @torch.inference_mode()
    def after_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      tails: torch.Tensor | None) -> torch.Tensor:
        """The head's K/V of every row's entry (its output is read by no draft) -> the rows' h."""
        T = input_ids.shape[0]
        shifted = torch.zeros_like(input_ids)          # the token after each row's input
        shifted[:-1] = input_ids[1:]
        if tails is not None:
            shifted[meta.query_start[1:].long() - 1] = tails
        hidden = self.head.fc(self.aux[:T])
        self.head.write_kv(shifted, positions.clamp(max=self.max_position - 1), hidden, meta.slot_mapping,
                           self.pool.tensor)
        return hidden

    def copy_blocks(self, copy_ops: list) -> None:
        self.pool.copy_blocks(copy_ops)

    @torch.inference_mode()
    def propose(self, spec: SpecDecoder, slots: torch.Tensor, length: torch.Tensor,
                block_tables: torch.Tensor, max_length: int, head_rows: HeadRows | None = None) -> torch.Tensor:
        """The entry at L − 2 from (h_{L−2}, x_{L−1}) gives the first draft; each later entry takes
        the last one's g and draft."""
        assert head_rows is not None
        token, hidden = head_rows.token, head_rows.hidden
        drafts = []
        R = slots.shape[0]
        query_start = torch.arange(R + 1, dtype=torch.int32, device=slots.device)
        for i in range(self.k):                       # the entry at L − 2 + i
            pos = length - 2 + i
            meta = AttentionMetadata(
                slot_mapping=self._slots(spec, pos, block_tables, head_rows.moved if i == 0 else None),
                query_start=query_start, seq_lens=(pos + 1).to(torch.int32), block_tables=block_tables,
                max_query_len=1, max_seq_len=max_length + self.k, tokens_per_block=self.pool.tokens_per_block,
                is_decode_only=True)
            out, hidden = self.head(token, pos.clamp(max=self.max_position - 1), hidden, meta, self.pool.tensor)
            token = self.head.draft_tokens(out)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    @torch.inference_mode()
    def write_entry(self, spec: SpecDecoder, length: torch.Tensor, block_tables: torch.Tensor,
                    head_rows: HeadRows) -> None:
        """The entry at L − 2 from (h_{L−2}, x_{L−1}), without drafting (a step that verifies none next)."""
        pos = length - 2
        self.head.write_kv(head_rows.token, pos.clamp(max=self.max_position - 1), head_rows.hidden,
                           self._slots(spec, pos, block_tables, head_rows.moved), self.pool.tensor)

    @torch.inference_mode()
    def write_sampled(self, rows: SampledRows, tokens: torch.Tensor) -> None:
        """Rows that sampled without speculating (prompts' last rows, plain decoding): their last
        entry takes the token sampled, so that blocks the prefix cache keeps hold right entries."""
        self.head.write_kv(tokens, rows.positions.clamp(max=self.max_position - 1), rows.hidden, rows.slots,
                           self.pool.tensor)

    def _slots(self, spec: SpecDecoder, pos: torch.Tensor, block_tables: torch.Tensor,
               moved: torch.Tensor | None) -> torch.Tensor:
        """The pool slots of one entry a row at positions ``pos``; a row that did not move writes
        into the scratch block (its entry at L − 2 is already right)."""
        slots = spec.kv_slots(block_tables, pos)
        return slots if moved is None else torch.where(moved, slots, self.scratch_slot)


@dataclass
class SampledRows:
    """The head's entries of a step's plain sampling rows (``ModelRunner.launch``): each row's
    last input position, the target's h there and its pool slot."""

    positions: torch.Tensor
    hidden: torch.Tensor
    slots: torch.Tensor
