"""RELIABILITY's soak: thousands of requests through one engine (tiny model, CPU), with everything
that moves KV blocks at once: shared prefixes hit in the prefix cache, chunked prefill, a pool
small enough that running requests are preempted and recomputed, stop tokens, the overlap loop,
and aborts at random moments. Every request ends as it must (its full length, at its stop token,
or aborted), and once idle nothing is held: free + cached == the pool, every invariant checks out."""

import random
import threading
import time

from phalanx import LLM, SamplingParams

REQUESTS = 2000


def test_thousands_of_requests_with_aborts_leave_the_pool_whole(tiny_models):
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 250) for _ in range(rng.choice((16, 40, 72)))] for _ in range(8)]
    to_abort = set(rng.sample(range(REQUESTS), REQUESTS * 15 // 100))
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess", max_num_tokens=64,
             max_batch_size=32, kv_cache_config={"tokens_per_block": 8, "max_tokens": 512},
             scheduler_config={"capacity_scheduler_policy": "MAX_UTILIZATION"}) as llm:
        engine = llm._executor.engine
        futs: list = []

        def abort_at_random_moments():
            """In submission order (about the engine's): 30 % at once (queued, or in their prompt's
            steps), the others once a random number of their tokens, up to all but one, is out."""
            r = random.Random(8)
            for i in sorted(to_abort):
                while i >= len(futs):
                    time.sleep(0.001)
                fut, sp = futs[i]
                after = r.randrange(1, sp.max_tokens) if r.random() < 0.7 and sp.max_tokens > 1 else 0
                for out in fut if after else ():     # the stream of this request's outputs
                    if len(out.outputs[0].token_ids) >= after:
                        break
                fut.abort()
        aborter = threading.Thread(target=abort_at_random_moments)
        t0 = time.perf_counter()
        aborter.start()
        for _ in range(REQUESTS):
            prompt = list(rng.choice(prefixes))[:rng.randrange(8, 73)] + \
                [rng.randrange(3, 250) for _ in range(rng.randrange(1, 24))]
            stop = rng.sample(range(3, 250), 8) if rng.random() < 0.3 else None
            sp = SamplingParams(max_tokens=rng.randrange(1, 49), ignore_eos=True, stop_token_ids=stop)
            futs.append((llm.generate_async(prompt, sp, streaming=len(futs) in to_abort), sp))
        aborter.join()
        outs = [(f.result(timeout=600).outputs[0], sp) for f, sp in futs]
        took = time.perf_counter() - t0
        kv = engine.scheduler.kv
        stats = engine.stats()
        kv.check_integrity()
        assert not engine.scheduler.requests and stats["num_running"] == stats["num_waiting"] == 0
        assert kv.pool.num_available == kv.num_blocks == stats["num_available_blocks"]

    reasons = {"length": 0, "stop": 0, "abort": 0}
    aborted_midway = 0
    for i, (out, sp) in enumerate(outs):
        reasons[out.finish_reason] += 1
        n = len(out.token_ids)
        if out.finish_reason == "abort":
            assert i in to_abort and n < sp.max_tokens, (i, out)
            aborted_midway += n > 0
        elif out.finish_reason == "stop":
            assert out.token_ids[-1] in sp.stop_token_ids and n <= sp.max_tokens, (i, out)
            assert out.stop_reason == out.token_ids[-1] and not set(out.token_ids[:-1]) & set(sp.stop_token_ids)
        else:
            assert out.finish_reason == "length" and n == sp.max_tokens, (i, out)
            assert not set(out.token_ids) & set(sp.stop_token_ids or ()), (i, out)
    print(f"{REQUESTS} requests in {took:.1f} s: {reasons} ({aborted_midway} aborts after tokens); "
          f"preemptions {stats['num_preemptions']}, prefix hits {stats['prefix_hit_tokens']} of "
          f"{stats['prefix_queried_tokens']} tokens")
    assert reasons["abort"] > 0 and reasons["stop"] > 0 and reasons["length"] > 0
    assert stats["num_preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
