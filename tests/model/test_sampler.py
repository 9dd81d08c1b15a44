"""Sampler semantics on hand-made logits, and seeded sampling through the engine."""

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.pyexecutor.request import Request
from phalanx.pyexecutor.sampler import RowSettings, Sampler, costliest_rows

CPU = torch.device("cpu")


def req(rid=1, prompt=(1, 2, 3), output=(), eos=(0,), **sp) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=50, **sp), eos, 100)
    for t in output:
        r.append_token(t)
    return r


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.0]])
    r = req(logprobs=2)
    out = Sampler(5, CPU).sample(logits, [r])
    assert out.token_ids.tolist() == [1]
    chosen, rank, top = out.host_logprobs()[0]
    lp = logits.log_softmax(-1)[0]
    assert chosen == pytest.approx(lp[1].item()) and rank == 1
    assert [t for t, _ in top] == [1, 3] and top[1][1] == pytest.approx(lp[3].item())


def test_a_sampled_tokens_rank_counts_the_whole_vocabulary():
    """The sampled token's rank is over every token, not only the alternatives asked for
    (vLLM's count: the tokens at least as likely, so ties rank as the worst of them)."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.0, 2.0]]).repeat(64, 1)
    rows = [req(logprobs=i % 2, temperature=50.0, seed=i) for i in range(64)]
    out = Sampler(6, CPU).sample(logits, rows)
    lp = logits[0].log_softmax(-1)
    ranks = []
    for i, (tok, (chosen, rank, top)) in enumerate(zip(out.token_ids.tolist(), out.host_logprobs(), strict=True)):
        assert chosen == pytest.approx(lp[tok].item()) and len(top) == i % 2
        assert rank == int((lp >= lp[tok]).sum())
        ranks.append(rank)
    assert set(ranks) == {2, 3, 4, 5, 6}      # rows sampled every token; the tied top two rank 2


def test_allowed_token_ids_are_the_only_tokens_drawn_and_logprobs_stay_raw():
    """vLLM's allowed_token_ids: greedy takes the likeliest allowed token, sampling draws only
    allowed ones (a hot temperature over a flat distribution reaches every one of them), the
    logprobs are the model's own; a min_tokens ban that would leave nothing is lifted; the
    request does not decode speculatively (its verify step would not mask)."""
    from phalanx.pyexecutor.speculative import speculates
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.0, 0.3]]).repeat(64, 1)
    greedy = req(allowed_token_ids=[0, 2, 5], logprobs=1)
    hot = [req(rid=i, allowed_token_ids=[2, 4], temperature=50.0, seed=i) for i in range(63)]
    out = Sampler(6, CPU).sample(logits, [greedy, *hot])
    assert out.token_ids[0].item() == 5 and set(out.token_ids[1:].tolist()) == {2, 4}
    chosen, rank, top = out.host_logprobs()[0]
    assert chosen == pytest.approx(logits[0].log_softmax(-1)[5].item()) and top[0][0] == 1   # raw: 1 is likeliest
    only_eos = req(allowed_token_ids=[4], min_tokens=3, eos=(4,))   # eos (4) banned for three tokens: lifted
    assert Sampler(6, CPU).sample(logits[:1], [only_eos]).token_ids.tolist() == [4]
    banned = req(allowed_token_ids=[4, 3], min_tokens=3, eos=(4,))  # another token left: the ban holds
    assert Sampler(6, CPU).sample(logits[:1], [banned]).token_ids.tolist() == [3]
    sampler = Sampler(6, CPU)                                     # the allowed ids reach the device once:
    sampler.sample(logits[:1], [greedy])                          # later steps use the request's index
    assert greedy.allowed_index is not None and greedy.allowed_index.tolist() == [0, 2, 5]
    greedy.allowed_index = torch.tensor([1])       # (a stand-in: what a later step masks with shows which)
    assert sampler.sample(logits[:1], [greedy]).token_ids.tolist() == [1]
    assert speculates(SamplingParams()) and not speculates(SamplingParams(allowed_token_ids=[1]))


def test_a_bad_word_s_last_token_is_masked_where_the_output_ends_with_the_rest():
    """Bad words as vLLM applies them: a one-token word is never drawn; a longer word's last
    token is masked only where the output already ends with the rest of it."""
    from phalanx.pyexecutor.sampler import _completing
    words = ((4,), (1, 2), (3, 1, 5))
    assert _completing(words, []) == [4]
    assert _completing(words, [7, 1]) == [2, 4]
    assert _completing(words, [3, 1]) == [2, 4, 5]
    assert _completing(words, [1, 3]) == [4]
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.5, 9.0, 4.0]])
    for output, want in (((), 2), ((1,), 5), ((3, 1), 1)):
        r = req(output=output, bad_words_token_ids=[list(w) for w in words])
        assert Sampler(6, CPU).sample(logits, [r]).token_ids.tolist() == [want], output
    # a bad-word ban that would leave no allowed token is lifted: after 1, only 2 is allowed and
    # (1, 2) bans it; with 3 allowed too, the ban holds
    for allowed, want in (([2], 2), ([2, 3], 3)):
        r = req(output=(1,), bad_words_token_ids=[[1, 2]], allowed_token_ids=allowed)
        assert Sampler(6, CPU).sample(logits, [r]).token_ids.tolist() == [want]
    long_output = req(output=(9,) * 50 + (1,), bad_words_token_ids=[[1, 2]])    # only the tail is read
    assert Sampler(10, CPU).sample(torch.tensor([[0.0, 1.0, 5.0] + [0.0] * 7]), [long_output]).token_ids.tolist() == [1]
    at_edge = req(output=(9,) * 50 + (7, 8), bad_words_token_ids=[[7, 8, 2], [5]])   # the tail: exactly 7, 8
    assert Sampler(10, CPU).sample(torch.tensor([[0.0, 1.0, 5.0] + [0.0] * 7]), [at_edge]).token_ids.tolist() == [1]
    # min_tokens' ban and a bad word together would leave no allowed token: min_tokens' is lifted
    both = req(allowed_token_ids=[3, 4], bad_words_token_ids=[[3]], min_tokens=3, eos=(4,))
    assert Sampler(6, CPU).sample(logits, [both]).token_ids.tolist() == [4]
    assert not SamplingParams(bad_words_token_ids=[[4]]).needs_history      # one token: no history read
    assert SamplingParams(bad_words_token_ids=[[4], [1, 2]]).needs_history


def test_scaled_logprobs_are_of_the_logits_over_the_temperature():
    """scaled_logprobs (SGLang's logprobs): log-softmax of the logits / temperature for sampled
    rows, the raw ones for greedy rows and for rows that do not ask."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.0]]).repeat(3, 1)
    rows = [req(rid=1, logprobs=2, temperature=0.5, seed=1, scaled_logprobs=True),
            req(rid=2, logprobs=2, temperature=0.0, scaled_logprobs=True),
            req(rid=3, logprobs=2, temperature=0.5, seed=1)]
    out = Sampler(5, CPU).sample(logits, rows)
    got = out.host_logprobs()
    for (chosen, _, top), tok, t in zip(got, out.token_ids.tolist(), (0.5, 1.0, 1.0), strict=True):
        want = (logits[0] / t).log_softmax(-1)
        assert chosen == pytest.approx(want[tok].item(), abs=1e-5)
        assert [lp for _, lp in top] == pytest.approx(want.topk(2).values.tolist(), abs=1e-5)


def test_the_costliest_rows_take_every_path_of_the_sampler():
    """The KV pool is sized after sampling these rows (the profiling run): every setting a row
    can have is on, and every row is seeded (its keyed noise holds more than the shared
    generator's draw), so no step allocates more for its sampling than they do. A setting added
    to RowSettings and left off here fails this."""
    import dataclasses
    rows = costliest_rows(4, 300)
    settings = [RowSettings.of(r, 300) for r in rows]
    for f in dataclasses.fields(RowSettings):
        default = f.default if f.default is not dataclasses.MISSING else None
        assert any(getattr(s, f.name) != default for s in settings), f"{f.name} is off in every row"
    assert all(s.seed is not None and not s.greedy for s in settings)
    assert all(s.top_k and s.top_p < 1 and s.min_p and s.penalties and s.banned for s in settings)
    out = Sampler(300, CPU).sample(torch.randn(4, 320), rows)
    assert out.top_ids is not None and out.top_ids.shape == (4, 20)


def _peak_bytes(fn) -> int:
    """The most bytes that ``fn``'s torch ops held at once beyond what existed before, from the
    profiler's allocation records (each op's own allocations at its start, frees where they fall)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    moves = []
    for e in prof.events():
        n = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if n:
            moves.append((e.time_range.start if n > 0 else e.time_range.end, n))
    held = peak = 0
    for _, n in sorted(moves):
        held += n
        peak = max(peak, held)
    return peak


def test_sampling_the_costliest_rows_holds_at_most_seven_copies_of_their_logits():
    """What a step's sampling holds beside its logits is what the KV pool's profiling run sets
    aside (sampled the same way), so the sampler works in place where it can: the penalties,
    the temperature and the filters on the rows' own copy, top-k from a top-k instead of a sort,
    top-p's sorted softmax once, the keyed noise's integer steps in place. Every setting on, a
    seed each: 6.25 copies of the rows' float32 logits at the most (10.75 before)."""
    V, R = 32000, 64
    logits = torch.randn(R, V)
    rows = costliest_rows(R, V)
    s = Sampler(V, CPU)
    s.sample(logits, rows)   # (anything made once)
    peak = _peak_bytes(lambda: s.sample(logits, rows))
    assert 3 * R * V * 4 < peak <= 7 * R * V * 4   # (the floor: the records were there to read)


def test_rows_sampled_a_chunk_at_a_time_equal_one_pass(monkeypatch):
    """A batch larger than the sampler's chunk is sampled a chunk at a time (the temporaries are
    [rows, vocabulary] each). Seeded rows draw noise keyed by position, so their tokens and every
    row's logprobs are those of one pass over the batch: greedy and sampled rows, penalties, a
    bias, logprobs of different widths (none in some chunks), and grammar masks on rows in some
    chunks only, over fewer ids than the output layer has (the rest masked too)."""
    import numpy as np

    from phalanx.pyexecutor.sampler import TokenMask
    V, S = 300, 45
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(S, 320, generator=g) * 3
    kinds = [dict(), dict(temperature=0.8, top_k=40, seed=1), dict(temperature=1.1, top_p=0.8, min_p=0.02, seed=2),
             dict(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={5: 3.0}, temperature=0.9, seed=3)]
    rows = [req(rid=i, prompt=(i % V, 7), output=(i % 13,), **kinds[i % 4],
                **({"logprobs": i % 6} if 10 <= i < 30 else {})) for i in range(S)]
    masked = [3, 4, 17, 40]
    words = np.zeros((S, (V + 31) // 32), dtype=np.uint32)
    for r in masked:
        for t in range(r, V, 7):           # a few allowed ids a row
            words[r, t // 32] |= np.uint32(1 << (t % 32))
    mask = TokenMask(torch.from_numpy(words.view(np.int32)), masked, V - 10)   # ids V - 10 .. V - 1: never
    logits[masked, V - 10:] = 50.0                                              # (they would win)
    passes = []
    real = Sampler._sample_rows
    monkeypatch.setattr(Sampler, "_sample_rows", lambda self, lg, *a: passes.append(len(lg)) or real(self, lg, *a))
    one = Sampler(V, CPU, chunk_rows=1024).sample(logits, rows, bitmask=mask)
    assert passes == [S]
    for chunk in (4, 16):
        passes.clear()
        got = Sampler(V, CPU, chunk_rows=chunk).sample(logits, rows, bitmask=mask)
        assert passes == [chunk] * (S // chunk) + [S % chunk]
        assert got.token_ids.tolist() == one.token_ids.tolist()
        assert got.logprob_rows == one.logprob_rows == list(range(10, 30))
        for a, b in zip(got.host_logprobs(), one.host_logprobs(), strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert a[0] == pytest.approx(b[0], abs=1e-5) and a[1] == b[1]
                assert [t for t, _ in a[2]] == [t for t, _ in b[2]]
    assert all(one.token_ids[r] % 7 == r % 7 and one.token_ids[r] < V - 10 for r in masked)   # kept to their ids


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 1.0, 0.0, 4.0]])
    s = Sampler(4, CPU)
    assert s.sample(logits, [req(eos=(0,), min_tokens=1)]).token_ids.tolist() == [3]
    assert s.sample(logits, [req(eos=(0,), min_tokens=2, stop_token_ids=[3], output=[2])]).token_ids.tolist() == [1]
    assert s.sample(logits, [req(eos=(0,), min_tokens=1, output=[2])]).token_ids.tolist() == [0]
    assert s.sample(logits, [req(eos=(0,), min_tokens=5, ignore_eos=True)]).token_ids.tolist() == [0]


def test_repetition_presence_frequency_penalties():
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5]])
    s = Sampler(4, CPU)

    def process(r):
        return s._process(logits.clone(), [r], [RowSettings.of(r, 4)])
    out = process(req(prompt=(0, 1), repetition_penalty=4.0))
    assert out[0].tolist() == pytest.approx([0.5, -4.0, 1.0, 0.5])
    out = process(req(prompt=(1,), output=(2, 2, 3), presence_penalty=0.5, frequency_penalty=0.25))
    assert out[0].tolist() == pytest.approx([2.0, -1.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25])
    out = process(req(logit_bias={3: 10.0}))
    assert out[0, 3].item() == pytest.approx(10.5)


def test_top_k_top_p_min_p_filters():
    from phalanx.pyexecutor.sampler import _filter
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    def keep(sp):
        return torch.isfinite(_filter(logits.clone(), [RowSettings.of(req(**sp), 4)]))[0].tolist()
    assert keep(dict(top_k=2)) == [True, True, False, False]
    assert keep(dict(top_k=2**31 - 1)) == [True, True, True, True]   # above the vocabulary: off
    assert keep(dict(top_p=0.7)) == [True, True, False, False]
    assert keep(dict(top_p=0.5)) == [True, False, False, False]
    assert keep(dict(min_p=0.5)) == [True, True, False, False]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    s = Sampler(3, CPU, seed=1)
    toks = s.sample(logits, [req(i, temperature=1.0) for i in range(4000)]).token_ids
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        yield llm


def test_seed_gives_the_same_tokens_whatever_the_batch(tiny_llm):
    prompt = [5, 6, 7, 8, 9]
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    alone = tiny_llm.generate(prompt, sp, use_tqdm=False).outputs[0].token_ids
    others = [[i, i + 1, i + 2] for i in range(10, 16)]
    batch = tiny_llm.generate(others[:3] + [prompt] + others[3:],
                              [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)] * 3 + [sp]
                              + [SamplingParams(max_tokens=20, temperature=0.9, ignore_eos=True)] * 3,
                              use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    other_seed = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=43, ignore_eos=True),
                                   use_tqdm=False)
    assert other_seed.outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(tiny_llm):
    prompt = [3, 1, 4, 1, 5]
    greedy = tiny_llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    topk1 = tiny_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True),
                              use_tqdm=False)
    assert greedy.outputs[0].token_ids == topk1.outputs[0].token_ids


def test_n_sequences_with_a_seed_are_distinct_and_reproducible(tiny_llm):
    sp = SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=7, ignore_eos=True)
    a = tiny_llm.generate([1, 2, 3], sp, use_tqdm=False)
    b = tiny_llm.generate([1, 2, 3], sp, use_tqdm=False)
    seqs = [o.token_ids for o in a.outputs]
    assert len(seqs) == 3 and len({tuple(s) for s in seqs}) == 3
    assert seqs == [o.token_ids for o in b.outputs]
    assert [o.index for o in a.outputs] == [0, 1, 2]


def test_stop_token_ids_and_max_tokens_finish_reasons(tiny_llm):
    prompt = [9, 8, 7]
    greedy = tiny_llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False).outputs[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 6
    stop_at = greedy.token_ids[2]
    first = greedy.token_ids.index(stop_at)
    out = tiny_llm.generate(prompt, SamplingParams(max_tokens=6, stop_token_ids=[stop_at], ignore_eos=True),
                            use_tqdm=False).outputs[0]
    assert out.token_ids == greedy.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_logprobs_through_the_engine(tiny_llm):
    out = tiny_llm.generate([4, 4, 4], SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True),
                            use_tqdm=False).outputs[0]
    assert len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in entry and len(entry) >= 3
        assert entry[tok].logprob == max(lp.logprob for lp in entry.values())   # greedy: the top one
    chosen = [e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True)]
    assert out.cumulative_logprob == pytest.approx(sum(chosen))
    assert all(e[t].rank == 1 for t, e in zip(out.token_ids, out.logprobs, strict=True))
    hot = tiny_llm.generate([4, 4, 4], SamplingParams(max_tokens=8, logprobs=0, temperature=5.0, seed=3,
                                                      ignore_eos=True), use_tqdm=False).outputs[0]
    ranks = [e[t].rank for t, e in zip(hot.token_ids, hot.logprobs, strict=True)]
    assert all(len(e) == 1 for e in hot.logprobs) and all(isinstance(r, int) and r >= 1 for r in ranks)
    assert max(ranks) > 1     # a token outside the (empty) top list keeps its rank in the vocabulary
