"""SGLang's /v1/loads entries from the ranks' heartbeat stats (phalanx/serve/native_routes.loads)."""

from phalanx.serve.native_routes import loads

RANK = {"num_running": 2, "num_waiting": 1, "num_blocks": 100, "num_available_blocks": 60, "kv_usage": 0.4,
        "prefix_queried_tokens": 200, "prefix_hit_tokens": 50}


def test_each_attention_dp_rank_reports_its_own_and_unseen_requests_wait_on_rank_0():
    two = [RANK, {**RANK, "num_running": 5, "num_waiting": 0}]
    dp = loads(two, True, 32, 64, {"core"}, unseen=3)
    assert [(e["dp_rank"], e["num_running_reqs"], e["num_waiting_reqs"], e["num_total_reqs"]) for e in dp] == [
        (0, 2, 4, 6), (1, 5, 0, 5)]
    assert dp[0]["num_used_tokens"] == 40 * 32 and dp[0]["max_total_num_tokens"] == 3200
    assert dp[0]["cache_hit_rate"] == 0.25 and dp[0]["max_running_requests"] == 64
    # tensor parallel: every rank runs rank 0's batch, reported once
    [tp] = loads(two, False, 32, 64, {"core"})
    assert (tp["num_running_reqs"], tp["num_waiting_reqs"]) == (2, 1)


def test_sections_come_where_include_names_them():
    spec = {**RANK, "spec_verify_rows": 10, "spec_draft_tokens": 40, "spec_accepted_drafts": 20}
    [e] = loads([spec], False, 32, 64, {"core", "spec", "queues", "memory", "lora", "disagg"})
    assert e["speculative"] == {"accept_length": 3.0, "accept_rate": 0.5}
    assert e["queues"] == {"waiting": 1} and e["memory"] == {"token_capacity": 3200}
    assert e["lora"]["slots_total"] == 0 and "disaggregation" not in e
    [bare] = loads([spec], False, 32, 64, {"core"})
    assert not {"speculative", "queues", "memory", "lora"} & set(bare)
    [lora] = loads([{**RANK, "lora_slots_used": 3, "lora_slots_total": 4}], False, 32, 64, {"lora"})
    assert lora["lora"] == {"slots_used": 3, "slots_total": 4, "utilization": 0.75}
