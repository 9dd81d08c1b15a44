"""The bundled SmolLM2-135M-Instruct (GGUF, Q4_1 dequantized): batched chat generation equals
transformers' greedy output on the same file, and reads as sensible text."""


import re

import pytest
import torch

from phalanx import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in one sentence what a CPU does.",
]


@pytest.fixture(scope="module")
def llm():
    with LLM(orchestrator_type="inprocess") as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    return smollm2_hf


def test_chat_batch_equals_transformers_greedy(llm, hf_model):
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        assert ids[0].tolist() == out.prompt_token_ids
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                                    do_sample=False, eos_token_id=list(llm.tokenizer.eos_token_ids))
        ref_ids = ref[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref_ids, (out.outputs[0].text, llm.tokenizer.decode(ref_ids))
        assert out.outputs[0].text == llm.tokenizer.decode(ref_ids, skip_special_tokens=True)
    texts = [o.outputs[0].text for o in outs]
    assert "Paris" in texts[0]
    assert any(c in texts[2].lower() for c in ("red", "blue", "yellow"))
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)


def test_shared_200_token_prefix_reports_cached_tokens(llm):
    doc = " ".join(f"item{i}" for i in range(400))
    ids = llm.tokenizer.encode(doc)[:200]
    first = llm.generate(ids + llm.tokenizer.encode(" first question"), SamplingParams(max_tokens=4), use_tqdm=False)
    assert first.cached_tokens < 199
    second = llm.generate(ids + llm.tokenizer.encode(" another, different ending"), SamplingParams(max_tokens=4),
                          use_tqdm=False)
    assert second.cached_tokens >= 199
    assert second.cached_tokens <= len(second.prompt_token_ids) - 1


@pytest.mark.parametrize("kwargs,field", [
    ({"inputs": ""}, "prompt"),
    ({"inputs": [1, 2, 49152]}, "prompt_token_ids"),
    ({"inputs": "hi", "sp": {"max_tokens": 0}}, "max_tokens"),
    ({"inputs": "hi", "sp": {"max_tokens": -1}}, "max_tokens"),
    ({"inputs": "hi", "sp": {"top_p": 0.0}}, "top_p"),
    ({"inputs": "hi", "sp": {"top_p": 1.01}}, "top_p"),
    ({"inputs": [5] * 9000}, "max_seq_len"),
    ({"inputs": [True, False]}, "prompt_token_ids"),
    ({"inputs": {"prompt_token_ids": 7}}, "prompt_token_ids"),
    ({"inputs": "hi", "sp": {"top_k": 2**63}}, "top_k"),
    ({"inputs": "hi", "sp": {"seed": 2**64}}, "seed"),
    ({"inputs": "hi", "sp": {"max_tokens": True}}, "max_tokens"),
    ({"inputs": "hi", "sp": {"temperature": "0.5"}}, "temperature"),
    ({"inputs": "hi", "sp": {"temperature": float("nan")}}, "temperature"),
    ({"inputs": "hi", "sp": {"logit_bias": {"--5": 1.0}}}, "logit_bias"),
    ({"inputs": "hi", "sp": {"logit_bias": {49152: 1.0}}}, "logit_bias"),
    ({"inputs": "hi", "sp": {"stop_token_ids": [1.5]}}, "stop_token_ids"),
    ({"inputs": "hi", "sp": {"ignore_eos": "yes"}}, "ignore_eos"),
    ({"inputs": "hi", "sp": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ({"inputs": "hello " * 600_000}, "characters"),
])
def test_bad_input_raises_value_error_naming_the_field_and_llm_keeps_working(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        sp = SamplingParams(**kwargs.get("sp", {}))
        llm.generate(kwargs["inputs"], sp, use_tqdm=False)
    out = llm.generate("Say hello.", SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_a_list_with_one_bad_prompt_submits_none(llm):
    before = llm.stats()[0]["iteration"]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(["fine", [1, 2, 49152]], SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    stats = llm.stats()[0]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["iteration"] - before < 5       # nothing was generated for "fine"


def test_idle_engine_has_no_kv_leak(llm):
    llm.generate(["a b c", "d e f"], SamplingParams(max_tokens=5), use_tqdm=False)
    kv = llm._executor.engine.scheduler.kv
    kv.check_integrity()
    assert kv.pool.num_available == kv.num_blocks


def _chat(llm, q):
    return llm.apply_chat_template([{"role": "user", "content": q}])


def test_streaming_deltas_add_up_and_finish_once(llm):
    import asyncio
    prompt = _chat(llm, "Tell me a short story about a cat.")
    sp = SamplingParams(max_tokens=40)
    full = llm.generate(prompt, sp, use_tqdm=False).outputs[0]

    async def consume():
        text, tokens, finished_flags = "", [], []
        async for out in llm.generate_async(prompt, sp, streaming=True):
            text += out.outputs[0].text_diff
            tokens += out.outputs[0].token_ids_diff
            finished_flags.append(out.finished)
        return text, tokens, finished_flags

    text, tokens, flags = asyncio.run(consume())
    assert text == full.text and tokens == full.token_ids
    assert flags[-1] and not any(flags[:-1]) and len(flags) > 1


def test_sync_streaming_iteration(llm):
    fut = llm.generate_async(_chat(llm, "Count from one to five."), SamplingParams(max_tokens=12), streaming=True)
    pieces = [out.outputs[0].text_diff for out in fut]
    assert "".join(pieces) == fut.outputs[0].text and fut.finished


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries_cuts_exactly(llm, include):
    prompt = _chat(llm, "Write two sentences about the moon.")
    full = llm.generate(prompt, SamplingParams(max_tokens=40), use_tqdm=False).outputs[0]
    # a stop string spanning several tokens, starting mid-token
    pos = max(1, len(full.text) // 3)
    stop = full.text[pos:pos + 7]
    first = full.text.find(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=40, stop=[stop], include_stop_str_in_output=include),
                       use_tqdm=False).outputs[0]
    assert out.text == full.text[:first + (len(stop) if include else 0)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids)


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_that_ends_a_sequence_keeps_its_id_and_leaves_the_text(llm, include):
    """A stop_token_ids hit, or EOS with special tokens shown: the token stays in token_ids, its
    text is not in the output unless include_stop_str_in_output (as vLLM)."""
    prompt = _chat(llm, "What is the capital of France?")
    full = llm.generate(prompt, SamplingParams(max_tokens=30, skip_special_tokens=False,
                                               include_stop_str_in_output=include), use_tqdm=False).outputs[0]
    tok = llm.tokenizer
    eos = full.token_ids[-1]
    assert full.finish_reason == "stop" and eos in tok.eos_token_ids   # the model ends its answer itself
    eos_text = tok.decode([eos], skip_special_tokens=False)
    assert eos_text and full.text.endswith(eos_text) == include
    assert full.text == tok.decode(full.token_ids if include else full.token_ids[:-1], skip_special_tokens=False)

    stop_at = next(t for t in full.token_ids[3:] if tok.decode([t]).strip())   # a visible token, not the first
    first = full.token_ids.index(stop_at)
    sp = SamplingParams(max_tokens=30, stop_token_ids=[stop_at], include_stop_str_in_output=include)
    out = llm.generate(prompt, sp, use_tqdm=False).outputs[0]
    assert out.token_ids == full.token_ids[:first + 1] and out.stop_reason == stop_at
    assert out.text == tok.decode(out.token_ids if include else out.token_ids[:-1])
    # the same token as the request's own EOS (end_id): no stop reason, the same text
    sp = SamplingParams(max_tokens=30, end_id=stop_at, include_stop_str_in_output=include)
    by_end_id = llm.generate(prompt, sp, use_tqdm=False).outputs[0]
    assert by_end_id.stop_reason is None and (by_end_id.token_ids, by_end_id.text) == (out.token_ids, out.text)


def test_stop_string_never_leaks_into_the_stream(llm):
    import asyncio
    prompt = _chat(llm, "Write two sentences about the moon.")
    full = llm.generate(prompt, SamplingParams(max_tokens=40), use_tqdm=False).outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 5]

    async def consume():
        seen = []
        async for out in llm.generate_async(prompt, SamplingParams(max_tokens=40, stop=stop), streaming=True):
            seen.append(out.outputs[0].text)
        return seen

    seen = asyncio.run(consume())
    assert all(stop not in s for s in seen)
    assert seen[-1] == full[:full.find(stop)]


def test_min_tokens_holds_back_stop_strings_as_it_holds_back_eos(llm):
    prompt = _chat(llm, "Write two sentences about the moon.")
    full = llm.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False).outputs[0]
    stop = next(c for c in full.text if not c.isspace())   # in the text from its first token
    early = llm.generate(prompt, SamplingParams(max_tokens=40, stop=[stop]), use_tqdm=False).outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 10
    held = llm.generate(prompt, SamplingParams(max_tokens=40, min_tokens=10, stop=[stop]), use_tqdm=False).outputs[0]
    assert len(held.token_ids) >= 10 and held.token_ids == full.token_ids[:len(held.token_ids)]
    assert held.finish_reason in ("stop", "length") and len(held.text) > len(early.text)


def test_stop_set_after_construction_stops_as_one_set_at_construction(llm):
    prompt = _chat(llm, "Write two sentences about the moon.")
    full = llm.generate(prompt, SamplingParams(max_tokens=40), use_tqdm=False).outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 4]
    late = SamplingParams(max_tokens=40)
    late.stop = [stop]
    got = [llm.generate(prompt, sp, use_tqdm=False).outputs[0] for sp in (SamplingParams(max_tokens=40, stop=[stop]),
                                                                        late)]
    assert got[0].text == got[1].text == full[:full.find(stop)] and got[1].finish_reason == "stop"


def test_a_request_keeps_its_settings_when_the_caller_changes_and_reuses_them(llm):
    """A refused or changed SamplingParams must not reach a request already running with it."""
    prompt = _chat(llm, "Write two sentences about the moon.")
    sp = SamplingParams(max_tokens=30, ignore_eos=True, stop=["\x00"])
    want = llm.generate(prompt, sp, use_tqdm=False).outputs[0].text
    running = llm.generate_async(prompt, sp, streaming=True)
    updates = iter(running)
    next(updates)
    sp.stop = [""]                        # refused for the next request ...
    with pytest.raises(ValueError, match="^stop"):
        llm.generate_async(prompt, sp)
    next(updates, None)                   # (tokens arrive for the running one meanwhile)
    sp.stop, sp.max_tokens = [want[-8:-4]], 3   # ... and a valid change applies to the next one only
    assert llm.generate(prompt, sp, use_tqdm=False).outputs[0].token_ids != []
    out = running.result(timeout=60).outputs[0]
    assert out.text == want and out.finish_reason == "length" and len(out.token_ids) == 30


def test_what_the_llm_class_cannot_honour_is_refused_by_name(llm):
    n = len(llm.tokenizer.encode("Hello there"))
    with pytest.raises(ValueError, match="^max_tokens .* exceed max_seq_len"):
        llm.generate_async("Hello there", SamplingParams(max_tokens=llm.max_seq_len - n + 1))
    llm.generate_async("Hello there", SamplingParams(max_tokens=llm.max_seq_len - n)).abort()   # just fits
    with pytest.raises(ValueError, match="^multi_modal_data: not supported"):
        llm.generate_async({"prompt": "Hello there", "multi_modal_data": {}})


def test_a_future_that_does_not_stream_yields_once_the_finished_output(llm):
    import asyncio
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    assert [(o.finished, len(o.outputs[0].token_ids)) for o in llm.generate_async("Hello", sp)] == [(True, 12)]

    async def consume(streaming):
        return [len(o.outputs[0].token_ids) async for o in llm.generate_async("Hello", sp, streaming=streaming)]
    assert asyncio.run(consume(False)) == [12]
    assert len(asyncio.run(consume(True))) > 1


def test_abort_mid_generation(llm):
    import time
    fut = llm.generate_async(_chat(llm, "Write a long essay about rivers."), SamplingParams(max_tokens=200),
                             streaming=True)
    it = iter(fut)
    next(it)
    fut.abort()
    out = fut.result(timeout=30)
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 200
    kv = llm._executor.engine.scheduler.kv
    deadline = time.monotonic() + 30    # (its blocks come back once the engine's step in flight is read)
    while kv.pool.num_available != kv.num_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kv.pool.num_available == kv.num_blocks


@pytest.mark.parametrize("where", ["waiting", "in_the_body"])
def test_a_cancelled_stream_aborts_its_request(llm, where):
    """The task consuming a stream cancelled (its client gone) aborts the request, as vLLM's
    generate does, whether it waited for a token or was busy in its loop's body."""
    import asyncio
    prompt = _chat(llm, "Write a long essay about rivers.")

    async def cancelled():
        fut = llm.generate_async(prompt, SamplingParams(max_tokens=60, ignore_eos=True), streaming=True)
        busy = asyncio.Event()

        async def consume():
            async for _ in fut:
                if where == "in_the_body":
                    busy.set()
                    await asyncio.sleep(60)      # a slow client
        task = asyncio.create_task(consume())
        while not fut.outputs[0].token_ids:
            await asyncio.sleep(0.01)
        if where == "in_the_body":
            await busy.wait()
        task.cancel()
        return await fut.aresult()
    out = asyncio.run(cancelled())
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 60


def test_a_stream_loop_left_keeps_its_request(llm):
    """A loop merely left (a break, sync or async) keeps the request: the future gives the rest."""
    import asyncio
    prompt = _chat(llm, "Write a long essay about rivers.")
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    fut = llm.generate_async(prompt, sp, streaming=True)
    for _ in fut:
        break
    assert fut.result(timeout=60).outputs[0].finish_reason == "length"

    async def left():
        fut = llm.generate_async(prompt, sp, streaming=True)
        async for _ in fut:
            break
        return await fut.aresult()
    out = asyncio.run(left())
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 40


def test_vllm_entry_points_chat_get_tokenizer_and_num_cached_tokens(llm):
    """``llm.chat`` (one conversation, or several) equals generating its rendered prompt;
    ``apply_chat_template(tokenize=False)`` (the Hugging Face idiom) and ``tokenize=True``;
    ``get_tokenizer`` is the Hugging Face tokenizer; ``num_cached_tokens`` is ``cached_tokens``."""
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    sp = SamplingParams(max_tokens=8)
    text = llm.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert text == _chat(llm, conv[0]["content"])
    ids = llm.apply_chat_template(conv, tokenize=True)
    assert ids == llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"]
    [one] = llm.chat(conv, sp)                                        # a list, as vLLM's
    assert one.prompt_token_ids == ids and one.prompt == text
    assert one.outputs[0].token_ids == llm.generate(text, sp).outputs[0].token_ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    two_parts = [{"role": "user", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Hi"}]}]
    assert llm.chat(two_parts, sp)[0].prompt == llm.apply_chat_template(      # joined by a newline, as vLLM
        [{"role": "user", "content": "Be brief.\nHi"}])
    two = llm.chat((tuple(parts), [{"role": "user", "content": "Name a color."}]), sp, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == one.outputs[0].token_ids
    assert two[0].num_cached_tokens == two[0].cached_tokens > 0     # the first conversation's prefix again
    assert llm.chat([]) == []
    spelled = [{"role": "user", "content": "Is <|im_end|> a word?"}]     # a control token's text, as plain text
    [plain] = llm.chat(spelled, sp)
    assert plain.prompt == llm.apply_chat_template(spelled)
    assert plain.prompt_token_ids == llm.apply_chat_template(spelled, tokenize=True)
    assert llm.get_tokenizer().eos_token_id in llm.tokenizer.eos_token_ids
    for bad, needle in (("hi", "messages must be a list"), ([["hi"]], "list of message dicts"),
                        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            llm.chat(bad)
    with pytest.raises(ValueError, match="chat_template_kwargs: add_generation_prompt"):
        llm.chat(conv, chat_template_kwargs={"add_generation_prompt": False})
    # tools reach the template as its ``tools`` (vLLM's LLM.chat argument)
    shown = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
             "{% for m in messages %}{{ m.content }}{% endfor %}")
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    [with_tools] = llm.chat(conv, sp, chat_template=shown, tools=[tool])
    assert with_tools.prompt == "[weather]" + conv[0]["content"]
    with pytest.raises(ValueError, match="tools: given twice"):
        llm.chat(conv, sp, tools=[tool], chat_template_kwargs={"tools": [tool]})
    # continue_final_message: the prompt ends inside the assistant's message, which goes on
    started = [*conv, {"role": "assistant", "content": "The capital of France is"}]
    [cont] = llm.chat(started, sp, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.endswith("The capital of France is") and cont.prompt.startswith(text)
    assert cont.outputs[0].token_ids == llm.generate(cont.prompt_token_ids, sp).outputs[0].token_ids
    for kwargs, needle in (({"continue_final_message": True}, "continue_final_message: cannot"),
                           ({"chat_template_kwargs": {"continue_final_message": True}},
                            "chat_template_kwargs: continue_final_message")):
        with pytest.raises(ValueError, match=needle):
            llm.chat(started, **kwargs)


def test_bad_words_never_appear_and_the_text_before_them_is_unchanged(llm):
    """vLLM's ``bad_words`` through the engine (the overlap scheduler: a word of several tokens
    makes its rows wait for their in-flight token): the greedy output holds none of them, and
    is the free output's up to the token where a word would have begun to be completed."""
    prompt = "The capital of France is"
    free = llm.generate([prompt], SamplingParams(max_tokens=24), use_tqdm=False)[0].outputs[0]
    tok = llm.tokenizer
    words = [w.strip(".,") for w in free.text.split()]
    long_word = next(w for w in words if len(w) > 3 and len(tok.encode(" " + w, add_special_tokens=False)) > 1)
    for bad in (["Paris"], [long_word]):
        assert bad[0] in free.text
        out = llm.generate([prompt], SamplingParams(max_tokens=24, bad_words=bad), use_tqdm=False)[0].outputs[0]
        assert bad[0] not in out.text, (bad, out.text)
        cut = free.text.index(bad[0])
        same = next(i for i, (a, b) in enumerate(zip(out.token_ids, free.token_ids, strict=False)) if a != b)
        assert tok.decode(free.token_ids[:same]) == free.text[:len(tok.decode(free.token_ids[:same]))]
        assert len(tok.decode(free.token_ids[:same + 1])) >= cut   # they part only at the bad word
    with pytest.raises(ValueError, match="^bad_words_token_ids"):
        llm.generate([prompt], SamplingParams(bad_words_token_ids=[[llm.vocab_size]]), use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    """vLLM's ``truncate_prompt_tokens``: a longer prompt keeps its last k tokens (its text is
    theirs) and generates what those tokens alone generate; a text longer than the context is
    taken when it is to be truncated; -1 keeps max_seq_len's worth; more than max_seq_len, or
    0, is refused by name. A chat is rendered whole, then truncated."""
    text = "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve"
    ids = llm.tokenizer.encode(text)
    sp = SamplingParams(max_tokens=6, truncate_prompt_tokens=8)
    [cut] = llm.generate([text], sp, use_tqdm=False)
    [tail] = llm.generate([ids[-8:]], SamplingParams(max_tokens=6), use_tqdm=False)
    assert len(ids) > 8 and cut.prompt_token_ids == ids[-8:] and cut.prompt == llm.tokenizer.decode(ids[-8:])
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    [short] = llm.generate([ids[:5]], SamplingParams(max_tokens=2, truncate_prompt_tokens=8), use_tqdm=False)
    assert short.prompt_token_ids == ids[:5]                       # shorter: as it is
    huge = "word " * (llm.max_seq_len * 2)
    [kept] = llm.generate([huge], SamplingParams(max_tokens=1, truncate_prompt_tokens=16), use_tqdm=False)
    assert len(kept.prompt_token_ids) == 16
    with pytest.raises(ValueError, match="leave room for output"):    # -1: the whole context, no room left
        llm.generate([huge], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)
    for bad in (0, llm.max_seq_len + 1):
        with pytest.raises(ValueError, match="^truncate_prompt_tokens"):
            llm.generate([text], SamplingParams(truncate_prompt_tokens=bad), use_tqdm=False)
    conv = [{"role": "user", "content": text}]
    [chat] = llm.chat(conv, SamplingParams(max_tokens=2, truncate_prompt_tokens=8), use_tqdm=False)
    assert chat.prompt_token_ids == llm.apply_chat_template(conv, tokenize=True)[-8:]


@pytest.mark.parametrize("call,needle", [
    (lambda llm: llm.generate(None), "inputs must be a prompt"),
    (lambda llm: llm.generate(5), "inputs must be a prompt"),
    (lambda llm: llm.generate("hi", {"max_tokens": 3}), "SamplingParams(**d)"),
    (lambda llm: llm.generate_async(["a", "b"]), "generate_async takes one prompt"),
    (lambda llm: llm.generate_async([[1, 2], [3]]), "generate_async takes one prompt"),
    (lambda llm: llm.generate_async([1, 2.5]), "prompt_token_ids"),          # one prompt, a bad id in it
])
def test_inputs_of_the_wrong_shape_are_named(llm, call, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        call(llm)
    assert llm.generate("Hi", SamplingParams(max_tokens=2)).outputs[0].token_ids   # the engine goes on
    outs = llm.generate((p for p in ("Hi", "Yo")), SamplingParams(max_tokens=2), use_tqdm=False)   # any iterable
    assert len(outs) == 2


def test_logprob_entries_carry_their_tokens_text_and_the_chosen_tokens_rank(llm):
    """vLLM's Logprob fields: ``decoded_token`` is each listed token's own text (None when the
    request does not detokenize), ``rank`` the chosen token's place in the whole vocabulary,
    also when it is outside the alternatives asked for; prompt logprobs the same."""
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=1, temperature=2.0, seed=11, ignore_eos=True)
    out = llm.generate("The capital of France is", sp, use_tqdm=False)
    o = out.outputs[0]
    for t, entry in zip(o.token_ids, o.logprobs, strict=True):
        assert all(lp.decoded_token == tok.decode([u], skip_special_tokens=False) for u, lp in entry.items())
        assert sorted(lp.rank for u, lp in entry.items() if u != t) == [1, 2] or entry[t].rank <= 2
        assert isinstance(entry[t].rank, int) and entry[t].rank >= 1
    assert any(entry[t].rank > 2 for t, entry in zip(o.token_ids, o.logprobs, strict=True))   # sampled hot
    for t, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert entry[t].decoded_token == tok.decode([t], skip_special_tokens=False) and entry[t].rank >= 1
    plain = llm.generate("The capital of France is", SamplingParams(max_tokens=2, logprobs=1, detokenize=False),
                         use_tqdm=False).outputs[0]
    assert all(lp.decoded_token is None for entry in plain.logprobs for lp in entry.values())


def test_ids_are_checked_before_truncate_prompt_tokens_cuts_them(llm):
    """A bad id the cut would drop is refused all the same, by name, in both entry points."""
    params = SamplingParams(max_tokens=2, truncate_prompt_tokens=2)
    for call in (lambda: llm.generate_async([1, "x", 2, 3], params), lambda: llm.generate([[1, "x", 2, 3]], params),
                 lambda: llm.generate_async({"prompt_token_ids": [1, 2.5, 2, 3]}, params)):
        with pytest.raises(ValueError, match="prompt_token_ids: token id"):
            call()
    assert llm.generate_async([1, 2, 3, 4], params).result().prompt_token_ids == [3, 4]
