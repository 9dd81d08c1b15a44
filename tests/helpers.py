"""Factories for tests: requests, tiny KV managers and schedulers, a fake runner (no torch)."""

from __future__ import annotations

import itertools

from phalanx.kv_manager import KVCacheManager
from phalanx.llmapi.sampling_params import SamplingParams
from phalanx.pyexecutor.request import Request
from phalanx.pyexecutor.scheduler import GUARANTEED_NO_EVICT, ScheduledBatch, Scheduler, SchedulerLimits

_ids = itertools.count(1000)


def make_request(prompt: list[int] | int, max_tokens: int = 4, request_id: int | None = None,
                 eos: tuple[int, ...] = (), extra_key: bytes = b"", **params) -> Request:
    if isinstance(prompt, int):
        prompt = list(range(1, prompt + 1))
    sp = SamplingParams(max_tokens=max_tokens, **params)
    rid = next(_ids) if request_id is None else request_id
    return Request(rid, list(prompt), sp, eos, len(prompt) + max_tokens, extra_key=extra_key)


def tiny_kv(num_blocks: int = 16, tokens_per_block: int = 4, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, tokens_per_block, **kw)


def tiny_scheduler(num_blocks: int = 16, tokens_per_block: int = 4, max_batch_size: int = 8,
                   max_num_tokens: int = 64, max_seq_len: int = 256, policy: str = GUARANTEED_NO_EVICT,
                   chunked: bool = True, prefill_while_decoding: int | None = None, **kv) -> Scheduler:
    limits = SchedulerLimits(max_batch_size, max_num_tokens, max_seq_len, policy, chunked, prefill_while_decoding)
    return Scheduler(limits, tiny_kv(num_blocks, tokens_per_block, **kv))


def fake_token(req: Request) -> int:
    """A deterministic 'model': the next token depends only on the request's tokens so far."""
    return (sum(req.token_ids) * 31 + len(req.token_ids)) % 97 + 3


class FakeRunner:
    """Stands in for the model runner in scheduler tests: samples ``fake_token`` per sampling row."""

    def __init__(self) -> None:
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        self.batches.append(batch)
        return [fake_token(r) if s else None for r, s in zip(batch.requests, batch.samples, strict=True)]


def run_to_completion(sched: Scheduler, runner: FakeRunner | None = None, max_steps: int = 10_000) -> FakeRunner:
    runner = runner or FakeRunner()
    for _ in range(max_steps):
        if not sched.has_work:
            return runner
        batch = sched.schedule()
        sched.update(batch, runner.execute(batch))
        sched.kv.check_integrity()
    raise AssertionError("scheduler did not finish (livelock?)")
