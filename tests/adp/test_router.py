"""The attention-DP router: exact placements from tables; conversations stick to their rank;
no sharing balances. Pure Python."""

import pytest

from phalanx.attention_dp.router import RouterConfig, place


@pytest.mark.parametrize("lens,matches,loads,caps,cfg,expected", [
    # no cache anywhere: least loaded, ties to the lowest rank
    ([100, 100, 100], [[0, 0, 0], [0, 0, 0]], [0, 0], [8, 8], RouterConfig(), [0, 1, 0]),
    ([100], [[0], [0]], [3, 1], [8, 8], RouterConfig(), [1]),
    # rank 1 holds 90 of 100 tokens: the cache wins over a small load difference
    ([100], [[0], [90]], [0, 2], [8, 8], RouterConfig(), [1]),
    # ... but not over a large one: score0 = 100, score1 = 10 + 100 * 7/8 = 97.5 -> still 1; at 8/8 it is full
    ([100], [[0], [90]], [0, 8], [8, 8], RouterConfig(balance_threshold=100), [0]),
    ([100], [[0], [90]], [0, 7], [8, 8], RouterConfig(balance_threshold=100), [1]),
    # a load gap of balance_threshold overrides the cache
    ([100], [[0], [90]], [0, 4], [64, 64], RouterConfig(), [0]),
    ([100], [[0], [90]], [0, 3], [64, 64], RouterConfig(), [1]),
    # a burst sharing a prefix held by rank 0 fills it up to the threshold, then spreads
    ([50] * 8, [[40] * 8, [0] * 8], [0, 0], [64, 64], RouterConfig(), [0, 0, 0, 0, 1, 0, 1, 0]),
    # β = 0: cache only, even when loaded (below the balance threshold)
    ([100], [[0], [90]], [0, 3], [8, 8], RouterConfig(load_balance_weight=0.0), [1]),
    # load-only routing ignores the cache
    ([100], [[0], [90]], [0, 2], [8, 8], RouterConfig(load_only=True), [0]),
    # every rank full: still placed (least loaded share)
    ([10, 10], [[0, 0], [0, 0]], [4, 4], [4, 4], RouterConfig(), [0, 1]),
    # three ranks, per-request matches
    ([64, 64, 64], [[60, 0, 0], [0, 60, 0], [0, 0, 60]], [0, 0, 0], [16, 16, 16], RouterConfig(), [0, 1, 2]),
])
def test_placement_table(lens, matches, loads, caps, cfg, expected):
    assert place(lens, matches, loads, caps, cfg) == expected


def test_no_sharing_balances_within_one():
    ranks = place([50] * 37, [[0] * 37, [0] * 37, [0] * 37], [0, 0, 0], [64, 64, 64])
    counts = [ranks.count(r) for r in range(3)]
    assert max(counts) - min(counts) <= 1
