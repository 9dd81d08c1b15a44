"""Benchmark arithmetic on synthetic timelines, dataset generators, and the three prefix
indexes on hand-built traces with known hit counts. No server, no torch."""


import pytest

from phalanx.bench.datasets import multi_turn_requests, random_requests, shared_prefix_requests
from phalanx.bench.metrics import per_user_rate, percentile, request_latencies, summarize
from phalanx.bench.prefix import HashedBlocks, OurRadix, TokenRadix, replay
from phalanx.bench.serve import Record, arrival_gaps, parse_goodput, summarize_run


def test_request_latencies_on_a_known_timeline():
    lat = request_latencies(10.0, [10.5, 10.6, 10.8, 11.1])
    assert lat["ttft"] == pytest.approx(0.5)
    assert lat["e2e"] == pytest.approx(1.1)
    assert lat["itl"] == pytest.approx([0.1, 0.2, 0.3])
    assert lat["tpot"] == pytest.approx(0.2)          # (1.1 - 0.5) / 3


def test_percentiles_interpolate_like_numpy():
    xs = [1, 2, 3, 4]
    assert percentile(xs, 50) == 2.5 and percentile(xs, 0) == 1 and percentile(xs, 100) == 4
    assert percentile(xs, 99) == pytest.approx(3.97)
    s = summarize([0.1, 0.2, 0.3], 1000)
    assert s["mean"] == pytest.approx(200) and s["median"] == pytest.approx(200)


def test_summary_throughput_goodput_and_cached_share():
    recs = [Record(0.0, [0.1, 0.2, 0.3], 3, 100, 50),         # ttft 100 ms, tpot 100 ms
            Record(0.0, [0.6, 0.65, 0.7], 3, 100, 0),         # ttft 600 ms, tpot 50 ms
            Record(0.0, [], 0, 0, 0, error="HTTP 500")]
    s = summarize_run(recs, 2.0, parse_goodput(["ttft:500", "tpot:120"]))
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["goodput_req_s"] == pytest.approx(0.5)           # only the first meets both SLOs
    assert s["cached_token_share"] == pytest.approx(0.25)
    assert s["ttft_ms"]["mean"] == pytest.approx(350)
    assert s["tpot_ms"]["median"] == pytest.approx(75)


def test_tpot_uses_token_counts_when_chunks_carry_several():
    s = summarize_run([Record(0.0, [1.0, 2.0], 5, 10, 0)], 2.0, {})
    assert s["tpot_ms"]["mean"] == pytest.approx(250)          # (2 - 1) / (5 - 1)


def test_per_user_rate_leaves_out_requests_whose_tokens_came_in_one_chunk():
    """A consumer slower than the engine can get a request's every token in one chunk: its TPOT
    is 0 and it has no per-token rate (this divided by zero once)."""
    whole = request_latencies(0.0, [0.5, 0.5, 0.5, 0.5])
    assert whole["tpot"] == 0.0
    assert per_user_rate([whole["tpot"], 0.01, 0.02]) == pytest.approx((100 + 50) / 2)
    assert per_user_rate([0.0]) is None and per_user_rate([]) is None


def test_goodput_spec_is_validated():
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_arrival_gaps_mean_rate_and_infinite_rate():
    gaps = arrival_gaps(4000, rate=20.0, burstiness=1.0, seed=1)
    assert sum(gaps) / len(gaps) == pytest.approx(0.05, rel=0.06)
    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    bursty = arrival_gaps(4000, rate=20.0, burstiness=0.25, seed=1)
    var = lambda g: sum((x - 0.05) ** 2 for x in g) / len(g)  # noqa: E731
    assert var(bursty) > 2 * var(gaps)                          # same mean, burstier


def test_random_dataset_lengths():
    fixed = random_requests(50, 100, 20, 0.0, 5000, seed=3)
    assert all(len(r.prompt_ids) == 100 and r.output_len == 20 for r in fixed)
    ranged = random_requests(200, 100, 20, 0.5, 5000, seed=3)
    assert all(50 <= len(r.prompt_ids) <= 150 and 10 <= r.output_len <= 30 for r in ranged)
    assert len({len(r.prompt_ids) for r in ranged}) > 10


def test_shared_prefix_dataset_shares_exactly_the_system_prompt():
    reqs = shared_prefix_requests(groups=4, per_group=5, system_len=64, question_len=16, output_len=8,
                                  vocab=5000, seed=0)
    assert len(reqs) == 20 and all(len(r.prompt_ids) == 80 for r in reqs)
    by_group = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(r.prompt_ids)
    for prompts in by_group.values():
        assert len(prompts) == 5 and len({tuple(p[:64]) for p in prompts}) == 1
        assert len({tuple(p[64:]) for p in prompts}) == 5
    assert len({tuple(p[0][:64]) for p in by_group.values()}) == 4


def test_multi_turn_dataset_shape():
    convs = multi_turn_requests(conversations=3, turns=4, first_len=50, user_len=10, output_len=8, vocab=5000)
    assert len(convs) == 3 and all(len(c) == 4 for c in convs)
    assert [len(t.prompt_ids) for t in convs[0]] == [50, 10, 10, 10]
    assert [t.turn for t in convs[1]] == [0, 1, 2, 3]


# -- the prefix study's indexes on hand-built traces ---------------------------------------------------
A = list(range(1, 41))                      # 40 tokens
B = A + [90, 91, 92, 93, 94]                # extends A
C = list(range(1, 21)) + list(range(500, 510))   # diverges from A at token 20


@pytest.mark.parametrize("index,after_b,after_c", [
    (HashedBlocks(10_000), 32, 16),          # full 16-token blocks only
    (OurRadix(10_000), 40, 20),              # full 32-token blocks + partial copy of the next
    (TokenRadix(10_000), 40, 20),            # token granular
])
def test_known_hit_counts(index, after_b, after_c):
    assert index.lookup(A) == 0
    index.insert(A)
    assert index.lookup(B) == after_b
    index.insert(B)
    assert index.lookup(C) == after_c


def test_replay_counts_and_last_token_never_hit():
    for idx in (HashedBlocks(1000), OurRadix(1000), TokenRadix(1000)):
        r = replay(idx, [(A, []), (A, [])])
        assert r["prompt_tokens"] == 80
        assert r["hit_tokens"] == {"hashed16": 32, "radix32": 39, "token_radix": 39}[idx.name]


def test_lru_eviction_under_pressure():
    # room for about one prompt: the older one goes
    old, new = list(range(1000, 1064)), list(range(2000, 2064))
    for idx in (HashedBlocks(64), OurRadix(64), TokenRadix(64)):
        idx.insert(old)
        idx.insert(new)
        assert idx.lookup(new + [1]) > 0 and idx.lookup(old + [1]) == 0, idx.name
        assert idx.evictions > 0


def test_a_host_tier_keeps_multi_turn_conversations_that_the_device_pool_evicts():
    """At a quarter of the working set, conversations come back after the device pool has
    evicted them: with a host tier three times its size they are found there."""
    import random

    from phalanx.bench.prefix import OurRadixHost, trace_multi_turn, working_set
    trace = trace_multi_turn(random.Random(0))
    cap = working_set(trace) // 4
    device, host = replay(OurRadix(cap), trace), replay(OurRadixHost(cap), trace)
    assert device["hit_rate"] < 0.2 < 0.7 < host["hit_rate"]
    assert host["evictions"] == device["evictions"]   # the device pool evicts as often; the tier keeps them
