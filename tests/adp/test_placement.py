"""Attention DP's placement of arrivals, apart from the ranks: how many an iteration takes."""

from types import SimpleNamespace

from phalanx.attention_dp.executor import AdpExecutor
from phalanx.config import AttentionDpConfig
from phalanx.executor.messages import GenerationRequest
from phalanx.pyexecutor.py_executor import INTAKE_STEPS


def test_a_burst_is_placed_a_capped_slice_at_a_time_and_its_rest_does_not_wait():
    """AdpExecutor takes at most INTAKE_STEPS steps' prompt tokens of every rank, and a batch of
    rows a rank, per iteration (at least one request); what a cap leaves is placed next iteration
    even where the balance wait would hold back fewer requests than ranks."""
    ex = AdpExecutor.__new__(AdpExecutor)   # the placement's bookkeeping alone: no ranks, no model
    ex.scheduler = SimpleNamespace(limits=SimpleNamespace(max_num_tokens=50, max_batch_size=3))
    ex.dist = SimpleNamespace(size=2)
    token_cap = INTAKE_STEPS * 50 * 2
    ex.pending = [GenerationRequest(i, [1] * 20, {}) for i in range(10)]
    assert ex._num_to_place() == 6                          # 3 rows a rank, 2 ranks
    ex.pending = [GenerationRequest(i, [1] * 90, {}) for i in range(10)]
    assert ex._num_to_place() == -(-token_cap // 90)        # until the tokens reach the cap
    ex.pending = [GenerationRequest(0, [1] * 10_000, {}), GenerationRequest(1, [1], {})]
    assert ex._num_to_place() == 1                          # one too long for the cap still goes
    ex.pending = [GenerationRequest(0, b"\x01\x02\x03", {})]   # ids the ranks will refuse count 0
    assert ex._num_to_place() == 1

    placed: list[list[int]] = []
    ex.adp = AttentionDpConfig(enable_balance=True, batching_wait_iters=5, timeout_iters=5)
    ex.waited, ex.num_placements, ex.rank = 0, 0, 0
    def refuse(msg: GenerationRequest) -> None:   # what was taken to place, then refused: no router here
        placed[-1].append(msg.request_id)
        raise ValueError("refused")

    ex._make_request = refuse
    ex._emit = lambda obj: None
    ex.pending = [GenerationRequest(i, [1] * 20, {}) for i in range(7)]
    for _ in range(2):
        placed.append([])
        ex._place(any_work=True)
    assert placed == [[0, 1, 2, 3, 4, 5], [6]] and not ex.pending   # the one left over did not wait
    ex.pending = [GenerationRequest(9, [1] * 20, {})]
    placed.append([])
    ex._place(any_work=True)
    assert placed[-1] == [] and ex.pending and ex.waited == 1       # a lone arrival still waits for company
