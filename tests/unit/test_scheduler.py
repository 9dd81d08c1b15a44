import pytest

from helpers import FakeRunner, fake_token, make_request, run_to_completion, tiny_scheduler
from phalanx.pyexecutor.request import RequestStatus
from phalanx.pyexecutor.scheduler import GUARANTEED_NO_EVICT, MAX_UTILIZATION


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What the fake model generates for ``prompt`` alone."""
    req = make_request(prompt, max_tokens)
    for _ in range(max_tokens):
        req.append_token(fake_token(req))
    return req.output_token_ids


def test_prefill_then_decode_one_token_per_step():
    s = tiny_scheduler()
    r = make_request(6, max_tokens=3)
    s.add_request(r)
    b = s.schedule()
    assert b.num_scheduled_tokens == [6] and b.samples == [True] and b.num_computed_tokens == [0]
    s.update(b, [7])
    b = s.schedule()
    assert b.num_scheduled_tokens == [1] and b.num_computed_tokens == [6] and b.is_decode_only
    s.update(b, [8])
    s.update(s.schedule(), [9])
    assert r.output_token_ids == [7, 8, 9] and r.status == RequestStatus.FINISHED_LENGTH
    assert not s.has_work and s.kv.pool.num_available == s.kv.num_blocks


def test_token_budget_chunks_a_long_prompt():
    s = tiny_scheduler(max_num_tokens=5)
    r = make_request(12, max_tokens=2)
    s.add_request(r)
    sizes = []
    while s.has_work:
        b = s.schedule()
        sizes.append(b.num_scheduled_tokens[0])
        s.update(b, [fake_token(r) if x else None for x in b.samples])
    assert sizes == [5, 5, 2, 1]
    assert r.output_token_ids == expected_output(list(range(1, 13)), 2)


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    s = tiny_scheduler(max_num_tokens=8, chunked=False)
    a, b_ = make_request(6, max_tokens=3), make_request([9] * 5, max_tokens=1)
    s.add_request(a)
    s.add_request(b_)
    b = s.schedule()
    assert [r.request_id for r in b.requests] == [a.request_id]   # 6 + 5 > 8: b waits
    s.update(b, [1])
    b = s.schedule()
    assert b.num_scheduled_tokens == [1, 5]                      # decode first, then the prompt


def test_prompt_longer_than_budget_without_chunking_is_refused():
    s = tiny_scheduler(max_num_tokens=4, chunked=False)
    assert "max_num_tokens" in s.add_request(make_request(6))


def test_max_batch_size_caps_requests_per_step():
    s = tiny_scheduler(max_batch_size=2)
    reqs = [make_request(3, max_tokens=2) for _ in range(3)]
    for r in reqs:
        s.add_request(r)
    b = s.schedule()
    assert len(b) == 2 and reqs[2].status == RequestStatus.WAITING


def test_decode_first_then_running_prefill_then_new():
    s = tiny_scheduler(num_blocks=32, max_num_tokens=6)
    a = make_request(2, max_tokens=5)
    s.add_request(a)
    s.update(s.schedule(), [1])                       # a is decoding
    b_ = make_request(9, max_tokens=1)
    s.add_request(b_)
    batch = s.schedule()                              # a: 1 decode, b: 5 of 9 prompt tokens
    assert [r.request_id for r in batch.requests] == [a.request_id, b_.request_id]
    assert batch.num_scheduled_tokens == [1, 5]
    s.update(batch, [2, None])
    c = make_request(3, max_tokens=1)
    s.add_request(c)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == [a.request_id, b_.request_id, c.request_id]
    assert batch.num_scheduled_tokens == [1, 4, 1]


def test_guaranteed_no_evict_reserves_blocks_to_completion():
    # 8 blocks of 4: each request needs ceil((4 + 8) / 4) = 3 blocks to finish
    s = tiny_scheduler(num_blocks=8)
    reqs = [make_request(4, max_tokens=8) for _ in range(3)]
    for r in reqs:
        s.add_request(r)
    b = s.schedule()
    assert len(b) == 2                                # 3 + 3 reserved; 2 left < 3
    assert reqs[2].status == RequestStatus.WAITING
    s.update(b, FakeRunner().execute(b))
    run_to_completion(s)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert s.num_preemptions == 0


def test_max_utilization_preempts_the_latest_and_recomputes_identically():
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(4)]
    s = tiny_scheduler(num_blocks=7, policy=MAX_UTILIZATION)
    reqs = [make_request(p, max_tokens=10) for p in prompts]
    for r in reqs:
        s.add_request(r)
    run_to_completion(s)
    assert s.num_preemptions > 0
    assert max(r.num_preemptions for r in reqs) > 0
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == expected_output(p, 10)
    assert s.kv.pool.num_available == s.kv.num_blocks


def test_preemption_victim_is_the_most_recently_started():
    s = tiny_scheduler(num_blocks=4, policy=MAX_UTILIZATION)
    first, second = make_request([1, 2, 3], max_tokens=8), make_request([4, 5, 6], max_tokens=8)
    s.add_request(first)
    s.add_request(second)
    victims = []
    for _ in range(10):
        b = s.schedule()
        victims += [r.request_id for r in b.preempted]
        s.update(b, [fake_token(r) if x else None for r, x in zip(b.requests, b.samples, strict=True)])
    assert victims and set(victims) == {second.request_id}


def test_abort_frees_blocks_and_other_requests_continue():
    s = tiny_scheduler()
    a, b_ = make_request(6, max_tokens=5), make_request(6, max_tokens=5)
    s.add_request(a)
    s.add_request(b_)
    s.update(s.schedule(), [1, 2])
    held = s.kv.num_held_blocks(a.request_id)
    assert held == 2
    s.finish(a.request_id, RequestStatus.FINISHED_ABORTED)
    assert a.request_id not in s.kv and a.status == RequestStatus.FINISHED_ABORTED
    s.kv.check_integrity()
    run_to_completion(s)
    assert b_.num_output_tokens == 5


def test_abort_of_a_waiting_request():
    s = tiny_scheduler(max_batch_size=1)
    a, b_ = make_request(3), make_request(3)
    s.add_request(a)
    s.add_request(b_)
    s.schedule()
    assert s.finish(b_.request_id, RequestStatus.FINISHED_ABORTED) is b_
    assert list(s.waiting) == []


def test_request_larger_than_the_pool_is_refused_with_a_reason():
    s = tiny_scheduler(num_blocks=2)
    msg = s.add_request(make_request(6, max_tokens=10))
    assert "needs 4 KV blocks" in msg and "has 2" in msg
    assert not s.has_work


def test_duplicate_request_id_refused():
    s = tiny_scheduler()
    s.add_request(make_request(3, request_id=5))
    assert "already in use" in s.add_request(make_request(3, request_id=5))


def test_eos_and_stop_token_ids_respect_min_tokens():
    s = tiny_scheduler()
    r = make_request(3, max_tokens=10, eos=(7,), min_tokens=2, stop_token_ids=[9])
    s.add_request(r)
    for tok in [7, 9]:                 # below min_tokens: neither stops
        s.update(s.schedule(), [tok])
    assert r.status == RequestStatus.RUNNING
    s.update(s.schedule(), [9])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_ignore_eos_runs_to_max_tokens():
    s = tiny_scheduler()
    r = make_request(3, max_tokens=3, eos=(7,), ignore_eos=True)
    s.add_request(r)
    for _ in range(3):
        s.update(s.schedule(), [7])
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [7, 7, 7]


def test_prefix_hit_skips_computed_tokens():
    s = tiny_scheduler()
    a = make_request(list(range(1, 11)), max_tokens=1)
    s.add_request(a)
    run_to_completion(s)
    b_ = make_request(list(range(1, 11)) + [50, 51], max_tokens=1)
    s.add_request(b_)
    batch = s.schedule()
    assert b_.num_cached_tokens == 10 and batch.num_scheduled_tokens == [2]
    assert batch.copy_ops and batch.copy_ops[0].num_tokens == 2    # rows 8, 9 of block 2
    assert s.kv.num_hit_tokens == 10 and s.kv.num_queried_tokens == 22


@pytest.mark.parametrize("policy", [GUARANTEED_NO_EVICT, MAX_UTILIZATION])
def test_a_partial_hit_whose_copy_source_does_not_fit_runs_on_its_whole_blocks(policy):
    """A partial prefix hit holds its copy source beside the request's own blocks until the copy
    runs: where the pool cannot hold that one block more (a request whose reservation is the whole
    pool), the request is admitted on its whole-block hit instead of waiting forever (with
    MAX_UTILIZATION nothing is reserved ahead: the copy runs first and its source goes back)."""
    s = tiny_scheduler(num_blocks=4, policy=policy)
    prompt = [5, 6, 7, 8, 9, 10]
    first = make_request(prompt, max_tokens=10)       # 16 positions: the whole pool of 4 blocks
    s.add_request(first)
    run_to_completion(s)
    again = make_request(prompt, max_tokens=10)
    assert s.add_request(again) is None
    match = s.kv.match(again.token_ids)
    assert match.tree_match.partial_node is not None and match.num_tokens == 5    # a hit, partly in a block
    assert s.kv.num_blocks_to_admit(match, again.kv_limit) > s.kv.num_available_blocks
    run_to_completion(s, max_steps=50)
    assert again.output_token_ids == first.output_token_ids
    assert again.num_cached_tokens == (4 if policy == GUARANTEED_NO_EVICT else 5)   # without the partial block


def test_digest_changes_with_the_decision():
    s1, s2 = tiny_scheduler(), tiny_scheduler()
    for s, n in ((s1, 5), (s2, 6)):
        s.add_request(make_request(n, request_id=1))
    d1, d2 = s1.schedule().digest(), s2.schedule().digest()
    assert d1 != d2
    s3 = tiny_scheduler()
    s3.add_request(make_request(5, request_id=1))
    assert s3.schedule().digest() == d1


@pytest.mark.parametrize("policy", ["GUARANTEED_NO_EVICT", MAX_UTILIZATION])
def test_many_requests_all_finish_exactly(policy):
    s = tiny_scheduler(num_blocks=12, max_num_tokens=7, policy=policy)
    prompts = [[(i * 7 + j) % 40 + 1 for j in range(2 + i % 9)] for i in range(30)]
    reqs = [make_request(p, max_tokens=1 + i % 5) for i, p in enumerate(prompts)]
    for r in reqs:
        assert s.add_request(r) is None
    run_to_completion(s, FakeRunner())
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == expected_output(p, r.sampling.max_tokens)
    assert s.kv.pool.num_available == s.kv.num_blocks


def test_overlap_schedules_the_next_step_on_a_placeholder():
    """Step n+1 is scheduled before step n's token is known: one decode position whose input
    is the in-flight token; update(n) then resolves it."""
    s = tiny_scheduler()
    r = make_request([5, 6, 7], max_tokens=4)
    s.add_request(r)
    b0 = s.schedule()                                # prefill, samples token 3
    assert r.num_inflight_tokens == 1 and r.num_computed_tokens == 3
    b1 = s.schedule()                                # scheduled before b0 was read
    assert b1.num_computed_tokens == [3] and b1.num_scheduled_tokens == [1] and b1.samples == [True]
    assert r.num_inflight_tokens == 2 and r.num_total_tokens == 5
    s.update(b0, [40])
    assert r.token_ids == [5, 6, 7, 40] and r.num_inflight_tokens == 1
    s.update(b1, [41])
    assert r.output_token_ids == [40, 41] and r.num_inflight_tokens == 0


def test_overlap_stray_token_of_a_finished_request_is_discarded():
    s = tiny_scheduler()
    r = make_request([5, 6, 7], max_tokens=4, eos=(40,))
    s.add_request(r)
    b0 = s.schedule()
    b1 = s.schedule()                                # stray: r will have finished by EOS at b0
    s.update(b0, [40])
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert s.kv.pool.num_available == s.kv.num_blocks   # its extra slot is free again
    s.update(b1, [41])
    assert r.output_token_ids == [40]
    s.kv.check_integrity()


def test_overlap_never_schedules_past_max_tokens():
    s = tiny_scheduler()
    r = make_request([5, 6, 7], max_tokens=2)
    s.add_request(r)
    b0, b1 = s.schedule(), s.schedule()              # tokens 1 and 2 in flight
    assert len(b1) == 1
    b2 = s.schedule()                                # the last token is in flight: nothing to do
    assert len(b2) == 0
    s.update(b0, [1])
    s.update(b1, [2])
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [1, 2]


def test_prompts_take_at_most_the_cap_of_a_step_that_decodes():
    """max_prefill_tokens_while_decoding: with rows decoding, new prompts and running prompts'
    chunks share the cap; with none decoding a prompt takes the whole budget; every request
    still ends with the tokens it would have alone."""
    s = tiny_scheduler(num_blocks=64, max_num_tokens=40, prefill_while_decoding=6)
    a = make_request([5] * 30, max_tokens=8)
    s.add_request(a)
    b = s.schedule()
    assert b.num_scheduled_tokens == [30]                       # nothing decodes: the whole prompt
    s.update(b, [fake_token(a)])
    c, d = make_request([7] * 10, max_tokens=2), make_request([9] * 10, max_tokens=2)
    s.add_request(c)
    s.add_request(d)
    sizes = []
    while s.has_work:
        b = s.schedule()
        decoding = [n for r, n, c in zip(b.requests, b.num_scheduled_tokens, b.num_computed_tokens, strict=True)
                    if c >= r.num_prompt_tokens]
        prompts = sum(b.num_scheduled_tokens) - sum(decoding)
        assert prompts <= (6 if decoding else 40), (b.num_scheduled_tokens, decoding)
        sizes.append(b.num_scheduled_tokens)
        s.update(b, [fake_token(r) if x else None for r, x in zip(b.requests, b.samples, strict=True)])
    assert sizes[0] == [1, 6] and sizes[1] == [1, 4, 2]          # c in chunks of what the cap leaves, then d
    for r, p, n in ((a, [5] * 30, 8), (c, [7] * 10, 2), (d, [9] * 10, 2)):
        assert r.output_token_ids == expected_output(p, n)


def test_the_prefill_cap_leaves_prompts_whole_without_chunked_prefill():
    s = tiny_scheduler(num_blocks=64, max_num_tokens=40, chunked=False, prefill_while_decoding=4)
    a = make_request([5] * 8, max_tokens=4)
    s.add_request(a)
    s.update(s.schedule(), [1])
    s.add_request(make_request([6] * 10, max_tokens=1))
    assert s.schedule().num_scheduled_tokens == [1, 10]          # a prompt longer than the cap still starts


def test_a_preempted_request_recomputing_its_output_is_prompt_work():
    """After preemption a request recomputes its prompt and the output tokens it had: all of
    those positions are prompt work — after the decode rows and within
    max_prefill_tokens_while_decoding while a row decodes — and its tokens stay what they were."""
    s = tiny_scheduler(num_blocks=32, max_num_tokens=40, policy=MAX_UTILIZATION, prefill_while_decoding=2,
                       enable_block_reuse=False)      # nothing cached: b computes every position again
    a, b = make_request([5] * 6, max_tokens=30), make_request([9] * 6, max_tokens=20)

    def advance():
        step = s.schedule()
        s.update(step, [fake_token(r) if x else None for r, x in zip(step.requests, step.samples, strict=True)])
        return step
    s.add_request(b)
    for _ in range(7):                        # b: its prompt, then 6 output tokens
        advance()
    s.add_request(a)
    while a.num_output_tokens < 2:            # a decoding
        step = advance()
    s._preempt(b, step)                       # b recomputes its 6 + 10 positions while a decodes
    recompute = []
    while s.has_work:
        step = s.schedule()
        for i, (r, n, c) in enumerate(zip(step.requests, step.num_scheduled_tokens, step.num_computed_tokens,
                                          strict=True)):
            if r is b and c + n < b.num_tokens:       # b still catching up
                assert i == len(step) - 1 and n <= 2, (step.num_scheduled_tokens, c)
                recompute.append(c)
        s.update(step, [fake_token(r) if x else None for r, x in zip(step.requests, step.samples, strict=True)])
    assert any(c >= b.num_prompt_tokens for c in recompute), recompute   # output positions recomputed too
    assert b.output_token_ids == expected_output([9] * 6, 20) and a.output_token_ids == expected_output([5] * 6, 30)


@pytest.mark.parametrize("k,concurrency", [(4, None), (3, 64), (1, None), (7, 8)])
@pytest.mark.parametrize("max_batch,max_tokens", [(2048, 8192), (256, 8192), (64, 512), (512, 300)])
def test_most_sampled_rows_is_the_most_the_draft_length_rule_allows(k, concurrency, max_batch, max_tokens):
    """The KV pool's profiling run samples SpecPolicy.most_sampled_rows rows: the most any step
    can, found here by asking the policy's own rule (draft_len) at every count of ready rows."""
    from phalanx.pyexecutor.scheduler import SpecPolicy
    bound = SpecPolicy(k, concurrency).most_sampled_rows(max_batch, max_tokens)
    most = 0
    for ready in range(1, max_batch + 1):
        policy = SpecPolicy(k, concurrency, adaptive=False)
        verify = policy.draft_len(ready, max_tokens)
        most = max(most, min(max_tokens, max_batch + verify * ready))
    assert bound == most


def test_a_step_runs_the_requests_of_at_most_max_loras_adapters():
    """Running requests use at most max_loras adapters (the model's slots); a waiting request of
    one more adapter waits, with the LoRA requests behind it (even of a running adapter: the
    running ones drain), and runs once one of them has finished; requests without an adapter
    behind it are admitted meanwhile."""
    from helpers import tiny_kv
    from phalanx.pyexecutor.scheduler import Scheduler, SchedulerLimits
    s = Scheduler(SchedulerLimits(8, 64, 256, max_loras=2), tiny_kv(48, 4))
    reqs = [make_request(3, max_tokens=m) for m in (2, 6, 6, 6, 6, 6)]
    for r, lora in zip(reqs, (1, 2, 2, 3, 0, 1), strict=True):
        r.lora_id = lora
        s.add_request(r)
    runner = FakeRunner()
    first = s.schedule()
    assert [r.lora_id for r in first.requests] == [1, 2, 2, 0]   # adapter 3 waits, and adapter 1's second with it
    assert [r.lora_id for r in s.waiting] == [3, 1] and s.num_held == 2   # in their order (intake skips them)
    seen = []
    while s.has_work:
        b = s.schedule() if seen else first
        seen.append(b)
        assert len({r.lora_id for r in b.requests if r.lora_id}) <= 2
        s.update(b, runner.execute(b))
        s.kv.check_integrity()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    # adapter 3 started once adapter 1's first request (2 tokens) had finished, before adapter 2's ended
    start3 = next(i for i, b in enumerate(seen) if reqs[3] in b.requests)
    assert start3 > 0 and reqs[1] in seen[start3].requests
    # adapter 1's second request, held behind adapter 3's, then waited for a slot: adapter 2's to drain
    start5 = next(i for i, b in enumerate(seen) if reqs[5] in b.requests)
    assert start5 > start3 and not any(reqs[5] in b.requests and reqs[1] in b.requests for b in seen)
