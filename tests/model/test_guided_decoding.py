"""Guided decoding on the bundled SmolLM2 (CPU): every greedy output under a JSON schema parses
and validates, regexes match whole, choices are one of the choices; the overlap loop gives the
sync loop's tokens; grammar and free requests batched together give what each gives alone;
preemption and abort keep the grammar state right."""

import json
import random
import re

import jsonschema
import pytest

from phalanx import LLM, GuidedDecodingParams, SamplingParams
from phalanx.llmapi.outputs import RequestError

QUESTION = "Describe something as JSON."


def schema(rng: random.Random, depth: int = 0) -> dict:
    """A random object schema: nested objects, arrays, enums, bounded numbers, required keys."""
    props = {}
    for i in range(rng.randint(1, 3 if depth else 4)):
        kind = rng.choice(["int", "num", "bool", "enum", "str", "array"] + (["object"] if depth < 1 else []))
        if kind == "int":
            lo = rng.randint(-50, 50)
            props[f"k{i}"] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 200)}
        elif kind == "num":
            props[f"k{i}"] = {"type": "number", "minimum": 0, "maximum": 100}
        elif kind == "bool":
            props[f"k{i}"] = {"type": "boolean"}
        elif kind == "enum":
            words = ["red", "green", "blue", "cat", "dog", "yes", "no"]
            props[f"k{i}"] = {"enum": rng.sample(words, rng.randint(2, 4))}
        elif kind == "str":
            props[f"k{i}"] = {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}
        elif kind == "array":
            items = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b", "c"]},
                                {"type": "boolean"}])
            props[f"k{i}"] = {"type": "array", "items": items, "minItems": 1, "maxItems": rng.randint(1, 3)}
        else:
            props[f"k{i}"] = schema(rng, depth + 1)
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


SCHEMAS = [schema(random.Random(i)) for i in range(50)]


@pytest.fixture(scope="module")
def llm():
    with LLM(orchestrator_type="inprocess") as llm:
        yield llm


def test_fifty_json_schemas_give_valid_json(llm):
    prompt = llm.apply_chat_template([{"role": "user", "content": QUESTION}])
    sps = [SamplingParams(max_tokens=256, guided_decoding=GuidedDecodingParams(json=s)) for s in SCHEMAS]
    outs = llm.generate([prompt] * len(sps), sps, use_tqdm=False)
    for s, out in zip(SCHEMAS, outs, strict=True):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (s, o.text)
        jsonschema.validate(json.loads(o.text), s)
    assert llm.stats()[0]["grammar_fill_us_per_step"] > 0      # the bitmask cost per step is reported


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z ]{5,20}\.",
                                     r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}", r"#[0-9a-f]{6}"])
def test_regex_outputs_match_whole(llm, pattern):
    out = llm.generate("Answer:", SamplingParams(max_tokens=40, guided_decoding=GuidedDecodingParams(regex=pattern)),
                       use_tqdm=False).outputs[0]
    assert re.fullmatch(pattern, out.text), out.text
    assert out.finish_reason == "stop"


def test_choice_and_json_object(llm):
    choices = ["Paris", "London", "Berlin, Germany"]
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate(prompt, SamplingParams(max_tokens=10, guided_decoding=GuidedDecodingParams(choice=choices)),
                       use_tqdm=False).outputs[0]
    assert out.text in choices
    obj = llm.generate(prompt, SamplingParams(max_tokens=120, guided_decoding=GuidedDecodingParams(json_object=True)),
                       use_tqdm=False).outputs[0]
    assert isinstance(json.loads(obj.text), dict)


def test_min_tokens_holds_the_end_back_until_a_grammar_allows_nothing_else(llm):
    """min_tokens with a grammar: EOS stays banned while the grammar allows another token (a
    regex that may go on is held to min_tokens), and a complete grammar still ends the output
    where min_tokens would ban its only token (a short choice: before, that row sampled id 0)."""
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    choices = ["Paris", "London"]
    sps = [SamplingParams(max_tokens=20, min_tokens=12, guided_decoding=GuidedDecodingParams(choice=choices)),
           SamplingParams(max_tokens=20, min_tokens=8, temperature=0.9, seed=2,
                          guided_decoding=GuidedDecodingParams(choice=choices)),
           SamplingParams(max_tokens=30, min_tokens=10, guided_decoding=GuidedDecodingParams(regex=r"[a-z ]{1,60}\.")),
           SamplingParams(max_tokens=6, min_tokens=3)]    # a free row batched with them keeps its own ban
    outs = llm.generate([prompt] * len(sps), sps, use_tqdm=False)
    for o in (outs[0].outputs[0], outs[1].outputs[0]):
        assert o.text in choices and o.finish_reason == "stop" and 0 not in o.token_ids, o
    held = outs[2].outputs[0]
    assert re.fullmatch(r"[a-z ]{1,60}\.", held.text) and len(held.token_ids) > 10, held
    assert len(outs[3].outputs[0].token_ids) >= 3


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 2}, "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains"),
    ({"type": "object", "properties": {"x": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}}, "allOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired"),
])
def test_schema_keywords_the_grammar_cannot_enforce_are_refused_by_name(llm, schema, keyword):
    """A keyword the grammar engine would ignore (its outputs broke it: repeated items, a missing
    contained value) is refused naming it, before anything runs; a property that happens to be
    called like one is a name, not a keyword."""
    sp = SamplingParams(max_tokens=20, guided_decoding=GuidedDecodingParams(json=schema))
    with pytest.raises(ValueError, match=f"guided_decoding.json: the keyword '{keyword}'"):
        llm.generate("Answer:", sp, use_tqdm=False)
    named = {"type": "object", "properties": {keyword: {"type": "integer"}}, "required": [keyword]}
    out = llm.generate("Answer:", SamplingParams(max_tokens=20, guided_decoding=GuidedDecodingParams(json=named)),
                       use_tqdm=False).outputs[0]
    assert keyword in json.loads(out.text)


def mixed_batch(llm):
    prompt = llm.apply_chat_template([{"role": "user", "content": QUESTION}])
    sps = [SamplingParams(max_tokens=120, guided_decoding=GuidedDecodingParams(json=SCHEMAS[i])) for i in range(4)]
    sps += [SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.8, seed=3)]
    sps += [SamplingParams(max_tokens=30, guided_decoding=GuidedDecodingParams(regex=r"[a-z]{4,9}( [a-z]{2,6}){2}"))]
    return [prompt] * len(sps), sps


def test_grammar_and_free_requests_batched_equal_each_alone(llm):
    prompts, sps = mixed_batch(llm)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    alone = [llm.generate(p, sp, use_tqdm=False).outputs[0].token_ids for p, sp in zip(prompts, sps, strict=True)]
    assert together == alone


def test_overlap_and_sync_loops_and_preemption_give_the_same_tokens(llm):
    prompts, sps = mixed_batch(llm)
    overlap = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    with LLM(orchestrator_type="inprocess", disable_overlap_scheduler=True) as sync:
        assert [o.outputs[0].token_ids for o in sync.generate(prompts, sps, use_tqdm=False)] == overlap
    # a pool this small preempts and recomputes requests mid-grammar (the seeded sampled row is
    # left out: a preempted request's in-flight token is dropped after its draw was taken)
    with LLM(orchestrator_type="inprocess",
             kv_cache_config={"max_tokens": 192, "tokens_per_block": 16, "enable_block_reuse": False},
             scheduler_config={"capacity_scheduler_policy": "MAX_UTILIZATION"}) as tight:
        outs = [o.outputs[0].token_ids for o in tight.generate(prompts, sps, use_tqdm=False)]
        deterministic = [i for i, sp in enumerate(sps) if sp.is_greedy]
        assert [outs[i] for i in deterministic] == [overlap[i] for i in deterministic]
        assert tight.stats()[0]["num_preemptions"] > 0, tight.stats()


def test_abort_mid_grammar_leaves_the_rest_right(llm):
    prompts, sps = mixed_batch(llm)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    futs = [llm.generate_async(p, sp, streaming=True) for p, sp in zip(prompts, sps, strict=True)]
    next(iter(futs[1]))
    futs[1].abort()
    for i, f in enumerate(futs):
        out = f.result(timeout=120)
        if i != 1:
            assert out.outputs[0].token_ids == want[i]
    stats = llm.stats()[0]
    assert stats["grammar_requests"] == 0 and stats["num_running"] == 0


def test_a_grammar_that_does_not_compile_names_the_field(llm):
    with pytest.raises(ValueError, match=r"guided_decoding\.regex does not compile"):
        llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(regex="[a-")), use_tqdm=False)
    with pytest.raises(ValueError, match=r"guided_decoding\.grammar does not compile"):
        llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(grammar="root ::= nowhere")),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a", choice=["a"])
    assert llm.generate("Say hi.", SamplingParams(max_tokens=3), use_tqdm=False).outputs[0].token_ids


def test_the_ranks_refuse_a_bad_grammar_that_skipped_the_check(llm):
    """A grammar that reaches a rank without the user-side check fails its request alone."""
    bad = SamplingParams(max_tokens=5, guided_decoding=GuidedDecodingParams(regex="[a-"))
    state = llm._executor.submit([1, 2, 3], bad, None)
    with pytest.raises(RequestError, match="does not compile"):
        from phalanx.llmapi.outputs import RequestOutput
        RequestOutput(state).result(timeout=60)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_padded_output_layer_never_yields_its_padding_ids(llm, temperature):
    """A model whose output layer is wider than its tokenizer: the grammar covers the tokenizer's
    ids and the sampler masks the rest, even where the padding ids have the largest logits."""
    import torch
    import xgrammar as xgr

    from helpers import make_request
    from phalanx.llmapi.grammar import GrammarCompiler
    from phalanx.pyexecutor.sampler import Sampler, TokenMask

    real = llm.vocab_size
    padded = real + 1000
    compiler = GrammarCompiler(llm.tokenizer.hf, padded, llm.tokenizer.eos_token_ids)
    assert compiler.vocab_size == real
    matcher = xgr.GrammarMatcher(compiler.compile(GuidedDecodingParams(choice=["yes", "no"])))
    bits = xgr.allocate_token_bitmask(2, compiler.vocab_size)
    matcher.fill_next_token_bitmask(bits, 1)
    allowed = {i for i in range(real) if bits[1, i // 32] >> (i % 32) & 1}
    logits = torch.randn(2, padded)
    logits[:, real:] = 100.0                      # the padding ids would win without the mask
    reqs = [make_request(4, temperature=temperature, seed=s) for s in (1, 2)]
    for _ in range(20):
        out = Sampler(padded, torch.device("cpu")).sample(logits.clone(), reqs, bitmask=TokenMask(bits, [1], real))
        assert out.token_ids[1].item() in allowed
        assert out.token_ids[0].item() >= real    # the free row is not masked


def test_a_structural_tag_runs_free_until_its_trigger_then_holds_its_tag(llm):
    """A structural tag: the output runs as the model writes it until the trigger ("Paris", the
    model's first word here), then the tag's begin, content (a JSON schema) and end are held; the
    ranks enforce it."""
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}])
    free = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False).outputs[0].text
    assert free.startswith("Paris,")     # the model's own first word: the trigger below
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["Paris"], "tags": [
        {"type": "tag", "begin": "Paris: ", "end": ".",
         "content": {"type": "json_schema", "max_whitespace_cnt": 1, "json_schema": {
             "type": "object", "properties": {"sky": {"enum": ["sunny", "cloudy"]}}, "required": ["sky"],
             "additionalProperties": False}}}]}}
    out = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0,
                                              guided_decoding=GuidedDecodingParams(structural_tag=tag)),
                       use_tqdm=False).outputs[0].text
    m = re.match(r"Paris: (\{[^}]*\})\.", out)
    assert m and json.loads(m.group(1))["sky"] in ("sunny", "cloudy"), out


def test_no_grammar_admits_a_special_token_but_a_stop_token(llm):
    """xgrammar would match a special token as its literal text, which decoding then skips: a
    JSON string holding "<filename>" came back shorter than its minLength, and a call after one
    slipped past a tools grammar. The special tokens but the stop tokens are unmatchable, at the
    start and inside a string, and the grammar's other tokens stay allowed."""
    import numpy as np
    import xgrammar as xgr

    from phalanx.llmapi.grammar import GrammarCompiler, special_ids
    tok = llm.tokenizer
    specials = sorted(special_ids(tok.hf) - set(tok.eos_token_ids))
    assert specials and tok.hf.convert_tokens_to_ids("<filename>") in specials
    compiler = GrammarCompiler(tok.hf, llm.vocab_size, tok.eos_token_ids)
    grammar = compiler.compile(GuidedDecodingParams(json={"type": "string", "minLength": 5}))
    for prefix in ("", '"ab'):
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(prefix)
        mask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        allowed = xgr.testing._get_masked_tokens_from_bitmask(mask, compiler.vocab_size)
        allowed = set(range(compiler.vocab_size)) - set(np.asarray(allowed).tolist())
        assert not allowed & set(specials), prefix
        assert tok.encode('"', add_special_tokens=False)[0] in allowed or prefix
        assert not xgr.GrammarMatcher(grammar).accept_token(specials[0])
    # a tool-call marker stays a token a grammar may take (the one the model opens a call with)
    import copy

    from phalanx.serve.tools import strict_tools_tag
    hf = copy.deepcopy(tok.hf)
    hf.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "<|eot_id|>"]})
    tag_id, eot_id = hf.convert_tokens_to_ids(["<|python_tag|>", "<|eot_id|>"])
    assert {tag_id, eot_id} <= special_ids(hf)
    compiler = GrammarCompiler(hf, len(hf), tok.eos_token_ids)
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object"}}}]
    grammar = compiler.compile(GuidedDecodingParams(structural_tag=strict_tools_tag(tools, "llama3_json")))
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_token(tag_id) and matcher.accept_string('{"name": "f", "parameters": {}}')
    assert not xgr.GrammarMatcher(grammar).accept_token(eot_id)


def test_a_hermes_call_marker_the_tokenizer_marks_special_is_decoded_for_the_parser(llm):
    """Some Hermes models' tokenizers mark ``<tool_call>`` special: decoding as usual drops it and
    the parser never sees the call. Free-running tools with such a tokenizer are decoded with
    their special tokens (as vLLM does), unless the request set skip_special_tokens itself."""
    import copy

    from phalanx.llmapi.tokenizer import Tokenizer
    from phalanx.serve.openai_server import ChatPlan, decodes_call_markers
    from phalanx.serve.tools import parse_tool_calls
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    plain = Tokenizer(llm.tokenizer.hf)
    hf = copy.deepcopy(llm.tokenizer.hf)
    hf.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    marked = Tokenizer(hf)
    auto = ChatPlan([], tools, None, "hermes", None, None)
    assert decodes_call_markers(auto, marked.special_strings(), set())
    assert not decodes_call_markers(auto, plain.special_strings(), set())            # spelled out: no need
    assert not decodes_call_markers(auto, marked.special_strings(), {"skip_special_tokens"})   # as asked
    assert not decodes_call_markers(ChatPlan([], tools, "required", None, None, None), marked.special_strings(),
                                    set())                                           # forced: read from the JSON
    ids = hf.encode('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', add_special_tokens=False)
    assert parse_tool_calls(marked.decode(ids, skip_special_tokens=False), "hermes", tools)[1][0].name == "add"
    assert parse_tool_calls(marked.decode(ids, skip_special_tokens=True), "hermes", tools)[1] == []


def test_strict_tools_tag_admits_the_calls_the_parser_reads_and_no_others(llm):
    """The structural tag of strict tools under tool_choice "auto", matched against the model's
    vocabulary: free text, then calls of the tools with arguments that follow their parameters,
    which the parser reads back; a call of another name, or with arguments that break the
    schema, is refused at the token that breaks it."""
    import xgrammar as xgr

    from phalanx.llmapi.grammar import GrammarCompiler
    from phalanx.serve.tools import parse_tool_calls, strict_tools_tag
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}}]
    compiler = GrammarCompiler(llm.tokenizer.hf, llm.vocab_size, llm.tokenizer.eos_token_ids)
    parser = "hermes"
    grammar = compiler.compile(GuidedDecodingParams(structural_tag=strict_tools_tag(tools, parser)))

    def call(name: str, args: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
    good = call("get_weather", '{"city": "Paris"}')
    text = "Let me look. " + good + "\n" + call("get_weather", '{"city":"Rome"}') + " Done."
    assert xgr.GrammarMatcher(grammar).accept_string(text)
    assert [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(text, parser, tools)[1]] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    for bad in (call("get_time", "{}"), call("get_weather", '{"city": 3}'),
                call("get_weather", '{"city": "Paris", "day": 1}'), call("get_weather", '{"city": "Llanfairpwll"}')):
        assert not xgr.GrammarMatcher(grammar).accept_string(bad), bad
    # Llama 3's JSON calls: the whole output is calls, or text that does not begin one
    grammar = compiler.compile(GuidedDecodingParams(structural_tag=strict_tools_tag(tools, "llama3_json")))
    calls = '{"name": "get_weather", "parameters": {"city": "Paris"}}; ' \
            '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(calls, "llama3_json", tools)[1]] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    eos = llm.tokenizer.eos_token_ids[0]
    for good in (calls, "<|python_tag|>" + calls, "It is sunny {mostly} in Paris.", "<b>Sunny</b>", ""):
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(good) and matcher.accept_token(eos), good   # whole, and may end there
    # a wrong call, also after the python tag or after a blank the parser strips (xgrammar's \s has
    # fewer than str.strip); an answer's JSON; a special token (its text) in front of a call; text after calls
    bad_call = '{"name": "get_weather", "parameters": {"city": 3}}'
    for bad in (bad_call, "<|python_tag|>" + bad_call, "\x85" + bad_call, "\u3000" + bad_call,
                '{"name": "get_time", "parameters": {}}', '{"answer": "Paris"}', ' {"name": "get_weather"',
                "<|im_start|>" + bad_call, calls + " Done."):
        assert not xgr.GrammarMatcher(grammar).accept_string(bad), bad
    # DeepSeek's marked calls (V3's json fence, V3.1's bare arguments): text, then calls the parser reads
    begin, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    forms = {"deepseek_v3": lambda a: f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{a}\n```"
                                      "<｜tool▁call▁end｜>",
             "deepseek_v31": lambda a: f"<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{a}<｜tool▁call▁end｜>"}
    for parser, form in forms.items():
        grammar = compiler.compile(GuidedDecodingParams(structural_tag=strict_tools_tag(tools, parser)))
        text = "Let me look. " + begin + form('{"city": "Paris"}') + form('{"city": "Rome"}') + end
        assert xgr.GrammarMatcher(grammar).accept_string(text), parser
        assert [json.loads(c.arguments) for c in parse_tool_calls(text, parser, tools)[1]] == \
            [{"city": "Paris"}, {"city": "Rome"}]
        assert not xgr.GrammarMatcher(grammar).accept_string(begin + form('{"city": 3}')), parser
    # Kimi K2's numbered calls inside its section markers: the index a decimal number, the arguments held
    sec, sec_end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"

    def kimi(name: str, i: str, args: str) -> str:
        return f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
    grammar = compiler.compile(GuidedDecodingParams(structural_tag=strict_tools_tag(tools, "kimi_k2")))
    text = "Let me look." + sec + kimi("get_weather", "0", '{"city": "Paris"}') + kimi("get_weather", "1",
                                                                                    '{"city":"Rome"}') + sec_end
    assert xgr.GrammarMatcher(grammar).accept_string(text)
    assert [(c.id, json.loads(c.arguments)) for c in parse_tool_calls(text, "kimi_k2", tools)[1]] == \
        [("functions.get_weather:0", {"city": "Paris"}), ("functions.get_weather:1", {"city": "Rome"})]
    for bad in (kimi("get_time", "0", "{}"), kimi("get_weather", "0", '{"city": 3}'),
                kimi("get_weather", "x", '{"city": "Paris"}'), kimi("get_weather", "01", '{"city": "Paris"}'),
                "<|tool_call_begin|>functions.get_weather:0" + '{"city": "Paris"}<|tool_call_end|>'):
        assert not xgr.GrammarMatcher(grammar).accept_string(sec + bad), bad
    # ... with its markers special tokens of the tokenizer: taken as tokens, and the output may end after
    import copy
    hf = copy.deepcopy(llm.tokenizer.hf)
    markers = [sec, "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", sec_end]
    hf.add_special_tokens({"additional_special_tokens": markers})
    ids = hf.convert_tokens_to_ids(markers)
    marked = GrammarCompiler(hf, len(hf), llm.tokenizer.eos_token_ids)
    matcher = xgr.GrammarMatcher(marked.compile(GuidedDecodingParams(structural_tag=strict_tools_tag(tools,
                                                                                                     "kimi_k2"))))
    assert matcher.accept_string("Sure.") and matcher.accept_token(ids[0]) and matcher.accept_token(ids[1])
    assert matcher.accept_string("functions.get_weather:0") and matcher.accept_token(ids[2])
    assert matcher.accept_string('{"city": "Oslo"}') and matcher.accept_token(ids[3]) and matcher.accept_token(ids[4])
    assert matcher.accept_token(llm.tokenizer.eos_token_ids[0])
