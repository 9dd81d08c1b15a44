"""One bad request never fails another: a request whose settings break on the rank fails
alone and the others in its batch keep their tokens; prompt log-probabilities equal
transformers' log-softmax over the prompt."""

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.kv_manager import KVCacheManager
from phalanx.llmapi.outputs import RequestError, RequestOutput
from phalanx.models.loader import build_model
from phalanx.models.source import resolve_model
from phalanx.pyexecutor import py_executor
from phalanx.pyexecutor.kv_pool import KVPool
from phalanx.pyexecutor.model_runner import ModelRunner, RequestFailures
from phalanx.pyexecutor.request import Request
from phalanx.pyexecutor.sampler import Sampler
from phalanx.pyexecutor.scheduler import Scheduler, SchedulerLimits

CPU = torch.device("cpu")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        yield llm


def _params():
    return [SamplingParams(max_tokens=10, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=10, logprobs=2, ignore_eos=True),
            SamplingParams(max_tokens=10, top_k=3, seed=5, ignore_eos=True)]


def test_a_request_whose_settings_break_on_the_rank_fails_alone(tiny_llm, monkeypatch):
    """The rank re-validates what arrives, but a value that passes and still cannot become a
    tensor (simulated: a temperature made NaN behind validation) must fail only its request."""
    alone = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, _params(), use_tqdm=False)]
    original = py_executor.SamplingParams.from_dict

    def tampered(d):
        sp = original(d)
        if sp.seed == 666:
            object.__setattr__(sp, "temperature", float("nan"))
        return sp
    monkeypatch.setattr(py_executor.SamplingParams, "from_dict", staticmethod(tampered))
    bad = SamplingParams(max_tokens=10, temperature=0.5, seed=666, ignore_eos=True)
    for round_ in range(3):
        futs = [tiny_llm.generate_async(p, sp) for p, sp in zip(PROMPTS[:2], _params()[:2], strict=True)]
        victim = tiny_llm.generate_async([3, 4, 5], bad)
        futs += [tiny_llm.generate_async(p, sp) for p, sp in zip(PROMPTS[2:], _params()[2:], strict=True)]
        with pytest.raises(RequestError, match="temperature"):
            victim.result(timeout=60)
        assert [f.result(timeout=60).outputs[0].token_ids for f in futs] == alone, round_
    stats = tiny_llm.stats()[0]
    assert stats["num_running"] == 0 and stats["num_available_blocks"] == stats["num_blocks"]


def test_the_runner_names_the_failing_rows_before_the_device_runs(tiny_models):
    source = resolve_model(tiny_models["llama"])
    cfg = source.config
    runner = ModelRunner(build_model(source, torch.float32, CPU),
                         KVPool(cfg.num_layers, 32, 8, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU),
                         Sampler(cfg.vocab_size, CPU), CPU)
    sched = Scheduler(SchedulerLimits(8, 64, 128), KVCacheManager(32, 8))
    reqs = [Request(i, p, SamplingParams(max_tokens=4, temperature=1.0, seed=i), max_total_tokens=len(p) + 4)
            for i, p in enumerate(PROMPTS)]
    object.__setattr__(reqs[1].sampling, "logit_bias", {cfg.vocab_size + 5: 1.0})   # past validation
    object.__setattr__(reqs[3].sampling, "seed", float("inf"))
    for r in reqs:
        sched.add_request(r)
    batch = sched.schedule()
    with pytest.raises(RequestFailures) as e:
        runner.launch(batch)
    assert sorted(e.value.errors) == [1, 3]
    assert "outside the vocabulary" in e.value.errors[1] and "OverflowError" in e.value.errors[3]
    rest = batch.without(e.value.errors)
    assert [r.request_id for r in rest.requests] == [0, 2]
    assert all(t is not None for t in runner.execute(rest).token_ids)


def test_a_request_whose_ids_cannot_be_read_fails_alone(tiny_models):
    """Prompt ids that arrive as bytes that are not whole uint32 ids (no proxy sends them; a
    client of the socket could) fail that request with an error naming the field; the loop
    takes the next request and computes it."""
    import msgpack

    from phalanx.executor.messages import GenerationRequest, pack, unpack
    source = resolve_model(tiny_models["llama"])
    cfg = source.config
    runner = ModelRunner(build_model(source, torch.float32, CPU),
                         KVPool(cfg.num_layers, 32, 8, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU),
                         Sampler(cfg.vocab_size, CPU), CPU)
    sent = []

    class Collect:
        def send_responses(self, responses):
            sent.extend(responses)

        def send(self, obj):
            sent.extend(obj)

    ex = py_executor.PyExecutor(Scheduler(SchedulerLimits(8, 64, 128), KVCacheManager(32, 8)), runner,
                                py_executor.RequestQueue(), Collect(), cfg.vocab_size, 128)
    raw = msgpack.unpackb(pack(GenerationRequest(1, [5, 6, 7], {"max_tokens": 2})))
    raw["b"]["prompt_token_ids"] = b"\x05\x00\x00\x00\x06"
    ex._add(unpack(msgpack.packb(raw)))
    raw["b"]["prompt_token_ids"], raw["b"]["request_id"] = None, 3     # no ids at all
    ex._add(unpack(msgpack.packb(raw)))
    ex._add(unpack(pack(GenerationRequest(2, [5, 6, 7], {"max_tokens": 2}))))
    ex._take_intake()
    assert [(r.request_id, r.finish_reason) for r in sent] == [(1, "error"), (3, "error")]
    assert "prompt_token_ids: 5 bytes" in sent[0].error and "at least one token" in sent[1].error
    batch = ex.scheduler.schedule()
    assert [r.request_id for r in batch.requests] == [2]
    assert runner.execute(batch).token_ids[0] is not None


@pytest.mark.parametrize("max_num_tokens", [16, 512])
def test_prompt_logprobs_equal_transformers(tiny_models, hf_models, max_num_tokens):
    torch.manual_seed(0)
    prompt = torch.randint(0, 256, (45,)).tolist()
    with torch.no_grad():
        ref = hf_models["llama"](torch.tensor([prompt])).logits[0].log_softmax(-1)
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             max_num_tokens=max_num_tokens) as llm:
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)          # its prefix is now cached
        out = llm.generate(prompt, SamplingParams(max_tokens=3, n=2, prompt_logprobs=3), use_tqdm=False)
        plp = out.prompt_logprobs
        assert plp[0] is None and len(plp) == len(prompt)
        for i in range(1, len(prompt)):
            assert plp[i][prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
            top = ref[i - 1].topk(3)
            ranked = sorted((lp.rank, t) for t, lp in plp[i].items() if lp.rank <= 3)
            assert [t for _, t in ranked] == top.indices.tolist()
            assert plp[i][prompt[i]].rank == int((ref[i - 1] >= ref[i - 1, prompt[i]]).sum())   # over the vocabulary
        one = llm.generate(prompt, SamplingParams(max_tokens=3, prompt_logprobs=0), use_tqdm=False)
        assert one.cached_tokens == 0          # every position computed, none reused
        assert [e[t].logprob for e, t in zip(one.prompt_logprobs[1:], prompt[1:], strict=True)] == \
            [e[t].logprob for e, t in zip(plp[1:], prompt[1:], strict=True)]
        plain = llm.generate(prompt, SamplingParams(max_tokens=3), use_tqdm=False)
        assert plain.prompt_logprobs is None and plain.cached_tokens > 0
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_burst_of_arrivals_is_taken_in_as_steps_admit_it(tiny_models):
    """Arrivals become the scheduler's requests only while its waiting queue holds less than
    two steps' prompt tokens (or a batch of rows): a burst does not stall one iteration. Every
    request of the burst still runs to its last token in arrival order; a bad one fails alone
    when it is taken in; one cancelled before it was taken in is answered and never runs; and
    the stats count what waits to be taken in."""
    from phalanx.executor.messages import GenerationRequest, TokenBatch
    source = resolve_model(tiny_models["llama"])
    cfg = source.config
    runner = ModelRunner(build_model(source, torch.float32, CPU),
                         KVPool(cfg.num_layers, 64, 8, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU),
                         Sampler(cfg.vocab_size, CPU), CPU)
    sent: list = []

    class Collect:
        def send_responses(self, responses):
            sent.extend(responses)

        def send(self, obj):
            if isinstance(obj, TokenBatch):
                sent.extend(obj.responses())
            elif isinstance(obj, list):
                sent.extend(obj)

    queue = py_executor.RequestQueue()
    ex = py_executor.PyExecutor(Scheduler(SchedulerLimits(8, 64, 128), KVCacheManager(64, 8)), runner,
                                queue, Collect(), cfg.vocab_size, 128)
    prompts = {i: [3 + (i + j) % 40 for j in range(16)] for i in range(30)}
    for i, p in prompts.items():
        queue.put_request(GenerationRequest(i, p, {"max_tokens": 3, "ignore_eos": True}))
        if i == 5:
            queue.put_request(GenerationRequest(100, [5, 6], {"max_tokens": 3, "temperature": -1.0}))
    queue.put_request(GenerationRequest(20, [7, 8], {"max_tokens": 3}))   # an id already waiting: refused alone
    queue.put_cancel(29)
    ex._fetch(idle=False)
    s = ex.scheduler
    # 2 x 64 prompt tokens: the first 8 requests of 16 tokens (the bad one, taken in among them,
    # fails at once); the other 21 wait to be taken in
    assert [r.request_id for r in s.waiting] == list(range(8))
    assert len(ex.intake) == 21 and ex.stats()["num_waiting"] == 29 and ex.num_unfinished() == 29
    assert [(r.request_id, r.finish_reason) for r in sent] == [(20, "error"), (29, "abort"), (100, "error")]
    assert "already in use" in sent[0].error and "temperature" in sent[2].error
    order: list[int] = []
    for _ in range(200):
        ex._fetch(idle=False)
        batch = ex._schedule()
        if batch is None:
            break
        order += [r.request_id for r in batch.requests if r.request_id not in order]
        ex._process(ex._launch(batch))
        assert len(s.waiting) <= 8 + 1 and len(ex.intake) + len(s.requests) <= 30
    assert not ex.intake and not s.requests and ex.num_unfinished() == 0
    ex._add(GenerationRequest(300, prompts[0], {"max_tokens": 1}))
    assert ex._has_steps and ex.num_unfinished() == 1    # arrived, not taken in: the loop must not idle-wait
    ex._take_intake()
    assert [r.request_id for r in s.waiting] == [300]
    assert order == list(range(29))                        # first come, first served; 29 never ran
    tokens: dict[int, list[int]] = {}
    for r in sent:
        tokens.setdefault(r.request_id, []).extend(r.token_ids)
    assert all(len(tokens[i]) == 3 for i in range(29)) and tokens[29] == []   # id 20: the one that came first ran
    assert [r.request_id for r in sent].count(100) == 1
    queue.put_request(GenerationRequest(200, prompts[1], {"max_tokens": 3}))
    for i in range(201, 230):
        queue.put_request(GenerationRequest(i, prompts[1], {"max_tokens": 3}))
    ex._fetch(idle=False)
    sent.clear()
    ex.abort_all()                                         # taken in or not, each is answered
    assert sorted(r.request_id for r in sent) == [*range(200, 230), 300]
    assert all(r.finish_reason == "abort" for r in sent) and ex.num_unfinished() == 0
    sent.clear()                                           # ids a client of the socket may send: refused alone
    queue.put_request(GenerationRequest([1], prompts[0], {"max_tokens": 1}))   # type: ignore[arg-type]
    queue.put_cancel([2])                                  # type: ignore[arg-type]
    queue.put_request(GenerationRequest(400, prompts[0], {"max_tokens": 1}))
    ex._fetch(idle=False)
    assert [(r.request_id, r.finish_reason) for r in sent] == [([1], "error")] and "integer" in sent[0].error
    assert [r.request_id for r in s.waiting] == [400]


def test_stop_strings_without_a_tokenizer_are_refused_by_name(tiny_llm):
    """They are matched in the output's text, and an LLM without a tokenizer has none."""
    with pytest.raises(ValueError, match="^stop needs a tokenizer"):
        tiny_llm.generate([5, 6, 7], SamplingParams(max_tokens=4, stop=["."]), use_tqdm=False)
    out = tiny_llm.generate([5, 6, 7], SamplingParams(max_tokens=4, stop_token_ids=[3]), use_tqdm=False)
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_an_abort_during_chunked_prefill_leaves_no_half_written_block_to_reuse(tiny_models):
    """RELIABILITY's chunked-prefill abort with block reuse on: a prompt computed 32 positions a
    step (10 steps) is aborted from inside the engine's thread as its k-th step is launched, for
    each k; the same prompt afterwards reuses only what was really written (its tokens equal a run
    from an empty cache, and at most the positions of the steps launched are reused) and the pool
    checks out."""
    import random
    rng = random.Random(1)
    prompt = [rng.randrange(3, 250) for _ in range(300)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess", max_num_tokens=32,
             kv_cache_config={"tokens_per_block": 16}) as llm:
        want = llm.generate(prompt, sp, use_tqdm=False).outputs[0].token_ids
        runner = llm._executor.engine.runner
        launch, armed = runner.launch, {}

        def launch_then_abort(batch, *args, **kwargs):
            step = launch(batch, *args, **kwargs)
            if armed:
                armed["launched"] += 1
                if armed["launched"] == armed["abort_at"]:    # as the request's own abort() does
                    llm._executor.abort(batch.requests[0].request_id)
            return step
        runner.launch = launch_then_abort
        cached = []
        for k in range(1, 11):
            llm.reset_prefix_cache()
            armed.update(launched=0, abort_at=k)
            out = llm.generate_async(prompt, sp).result(timeout=60)
            armed.clear()
            assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
            again = llm.generate(prompt, sp, use_tqdm=False)
            cached.append(again.cached_tokens)
            assert again.outputs[0].token_ids == want, (k, cached)
            assert again.cached_tokens <= 32 * k, (k, cached)
        runner.launch = launch
        llm.check_integrity()
    assert any(0 < c < 18 * 16 for c in cached), cached
    print("reused after an abort at each step:", cached)


def test_a_cache_salt_that_is_not_a_string_is_refused_and_fails_alone_on_the_rank(tiny_llm):
    """A cache_salt must be a string of at most 256 characters: the LLM class refuses others by
    name before anything is sent, and a rank that receives one anyway (a client of the socket)
    fails that request alone; the engine keeps serving."""
    sp = SamplingParams(max_tokens=3)
    for bad in (5, b"abc", "x" * 257):
        with pytest.raises(ValueError, match="cache_salt must be a string of at most 256"):
            tiny_llm.generate([1, 2, 3], sp, use_tqdm=False, cache_salt=bad)
    state = tiny_llm._executor.submit([1, 2, 3], sp, None, None, (0,), 7)    # past the LLM's check
    with pytest.raises(RequestError, match="cache_salt must be a string, got int"):
        RequestOutput(state, False).result(timeout=60)
    assert len(tiny_llm.generate([1, 2, 3], sp, use_tqdm=False).outputs[0].token_ids) == 3


def test_a_cache_salt_keeps_a_prefix_to_the_requests_that_share_it(tiny_llm):
    """cache_salt (a tenant's): a cached prefix is found only by requests with the same salt (or,
    unsalted, by unsalted ones), and the tokens are the same whichever way they were computed."""
    prompt = [(7 * i) % 250 + 3 for i in range(100)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    tiny_llm.reset_prefix_cache()
    run = lambda salt: tiny_llm.generate(prompt, sp, use_tqdm=False, cache_salt=salt)  # noqa: E731
    first = run("a")
    hits = [run(salt).cached_tokens for salt in ("b", None, "a", "b", None)]
    assert first.cached_tokens == 0 and hits[:2] == [0, 0] and all(h > 0 for h in hits[2:]), hits
    assert all(run(salt).outputs[0].token_ids == first.outputs[0].token_ids for salt in ("a", "c", None))


def test_a_pool_smaller_than_max_seq_len_is_named_at_start_up_and_its_requests_refused_alone(tiny_models,
                                                                                              caplog):
    """A KV pool of fewer tokens than max_seq_len starts (short requests fit it) with a warning
    naming both numbers and the settings that size the pool; a request needing more than the pool
    is refused by name, and one that fits runs beside it."""
    import logging
    with caplog.at_level(logging.WARNING, logger="phalanx"), \
            LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess", max_seq_len=256,
                kv_cache_config={"max_tokens": 128, "tokens_per_block": 16}) as llm:
        warned = [r.getMessage() for r in caplog.records if "the KV pool holds" in r.getMessage()]
        assert len(warned) == 1 and "holds 128 tokens, fewer than the 256 a request of max_seq_len (256)" in warned[0]
        assert "kv_cache_config.free_gpu_memory_fraction" in warned[0] and "without max_tokens" in warned[0]
        big = llm.generate_async([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        unbounded = llm.generate_async([5, 6, 7], SamplingParams(max_tokens=None, ignore_eos=True))
        small = llm.generate_async([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
        for refused in (big, unbounded):
            with pytest.raises(RequestError, match="KV pool has 8"):
                refused.result(timeout=60)
        assert len(small.result(timeout=60).outputs[0].token_ids) == 20
