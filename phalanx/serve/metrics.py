"""Prometheus metrics (prefix ``phalanx:``, semantics as vLLM's).

Latencies are observed in the server per request (from arrival); engine state — running and
waiting requests, KV usage, prefix-cache queries and hits, preemptions — comes from the ranks'
latest heartbeats, so a scrape answers at once even while the engine is busy or stalled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from itertools import pairwise
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger("phalanx")

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)


class EngineCollector:
    """Reads engine stats at scrape time (sums over ranks that own their own requests)."""

    def __init__(self, stats: Callable[[], list[dict[str, Any]]], model: str, sum_ranks: bool) -> None:
        self.stats, self.model, self.sum_ranks = stats, model, sum_ranks

    def collect(self):
        try:
            per_rank = self.stats()
        except Exception as e:  # a dead engine still answers a scrape
            logger.debug("engine stats unavailable: %s", e)
            return
        ranks = per_rank if self.sum_ranks else per_rank[:1]
        total = lambda k: float(sum(r.get(k, 0) for r in ranks))  # noqa: E731
        labels = ["model_name"]
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", total("num_running")),
            ("num_requests_waiting", "Requests waiting to be scheduled.", total("num_waiting")),
            ("kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).",
             sum(r.get("kv_usage", 0.0) for r in ranks) / max(1, len(ranks))),
        ):
            g = GaugeMetricFamily(f"phalanx:{name}", doc, labels=labels)
            g.add_metric([self.model], value)
            yield g
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", total("prefix_queried_tokens")),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", total("prefix_hit_tokens")),
            ("num_preemptions", "Requests preempted (recomputed later).", total("num_preemptions")),
            ("kv_offloaded_blocks", "KV blocks copied from the pool into the host tier (host_cache_size).",
             total("kv_offloaded_blocks")),
            ("kv_onboarded_blocks", "KV blocks a prefix hit copied back from the host tier.",
             total("kv_onboarded_blocks")),
            ("spec_decode_num_drafts", "Speculative verify rows (a request's drafts checked in one step).",
             total("spec_verify_rows")),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", total("spec_draft_tokens")),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted: the acceptance rate is this over "
             "spec_decode_num_draft_tokens; the mean accepted length 1 + this over spec_decode_num_drafts.",
             total("spec_accepted_drafts")),
        ):
            c = CounterMetricFamily(f"phalanx:{name}", doc, labels=labels)
            c.add_metric([self.model], value)
            yield c


class ServerMetrics:
    def __init__(self, model: str, stats: Callable[[], list[dict[str, Any]]], sum_ranks: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        lab = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("phalanx:prompt_tokens", "Prompt tokens processed.", lab, registry=r)
        self.generation_tokens = Counter("phalanx:generation_tokens", "Tokens generated.", lab, registry=r)
        self._generated = 0.0   # (the same count, read back by /get_server_info)
        self.request_success = Counter("phalanx:request_success", "Finished requests.", lab + ["finished_reason"],
                                       registry=r)
        self.client_aborts = Counter("phalanx:client_aborts", "Requests aborted because their client went away "
                                     "before the answer was complete.", lab, registry=r)
        self.ttft = Histogram("phalanx:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("phalanx:inter_token_latency_seconds", "Time between output tokens.", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("phalanx:e2e_request_latency_seconds", "Arrival to last token.", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("phalanx:request_queue_time_seconds", "Arrival to first scheduled.", lab,
                               buckets=LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(stats, model, sum_ranks))

    def generated_tokens(self) -> float:
        """Output tokens of the requests finished so far (``phalanx:generation_tokens``)."""
        return self._generated

    def observe(self, state: Any, num_prompt_tokens: int, num_generated: int, finish_reasons: list[str | None]) -> None:
        """Record one finished request from its GenerationResult (``num_generated``: the output
        tokens of all its sequences)."""
        m = self.model
        self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.generation_tokens.labels(m).inc(num_generated)
        self._generated += num_generated
        for reason in finish_reasons:
            self.request_success.labels(m, reason or "abort").inc()
        if state.first_token_time is not None:
            self.ttft.labels(m).observe(state.first_token_time - state.arrival_time)
        itl = self.itl.labels(m)   # (a lookup under a lock: once, not once a token)
        for times in state.token_times:     # between a sequence's chunks of tokens, as vLLM's per step
            for a, b in pairwise(times):
                itl.observe(b - a)
        if state.finish_time is not None:
            self.e2e.labels(m).observe(state.finish_time - state.arrival_time)
        if state.first_scheduled_time is not None:
            self.queue.labels(m).observe(max(0.0, state.first_scheduled_time - state.arrival_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_stats(per_rank: list[str]) -> list[dict[str, Any]]:
    return [json.loads(s) for s in per_rank]
