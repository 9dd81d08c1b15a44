import pytest

from phalanx.llmapi.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 99}, "logprobs"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {1: 500.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
    ({"bad_words_token_ids": [[1, -2]]}, "bad_words_token_ids"),
])
def test_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_defaults_are_greedy_and_sampling_knobs_imply_temperature_one():
    assert SamplingParams().is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_p=0.9).effective_temperature == 1.0
    assert not SamplingParams(top_k=5).is_greedy
    assert SamplingParams(top_k=1, temperature=0.8).is_greedy


def test_vocab_check_names_the_field():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[100]).check_vocab(50)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={60: 1.0}).check_vocab(50)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1, 50]).check_vocab(50)
    SamplingParams(allowed_token_ids=[1, 49]).check_vocab(50)
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[1, 50]]).check_vocab(50)
    wire = SamplingParams(allowed_token_ids=[7, 3]).to_dict()
    assert SamplingParams.from_dict(wire).allowed_token_ids == [7, 3]


def test_stop_string_forms():
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]


def test_stop_changed_after_construction_is_what_validate_checks_and_keeps():
    sp = SamplingParams()
    sp.stop = ["The"]
    sp.validate()                 # what LLM._prepare calls before it submits
    assert sp.stop_strings == ["The"]
    sp.stop = [""]
    with pytest.raises(ValueError, match="stop"):
        sp.validate()
    sp.stop = None
    sp.validate()
    assert sp.stop_strings == []


def test_lists_changed_after_construction_to_the_wrong_type_are_refused_by_name():
    for field, value in (("stop_token_ids", 5), ("logit_bias", [1, 2])):
        sp = SamplingParams()
        setattr(sp, field, value)
        with pytest.raises(ValueError, match=f"^{field} "):
            sp.validate()


def test_stop_strings_without_detokenizing_are_refused():
    """They are matched in the output's text: with detokenize=False there is none, so they would be ignored."""
    with pytest.raises(ValueError, match="^stop needs detokenize=True"):
        SamplingParams(stop=["."], detokenize=False)
    SamplingParams(stop_token_ids=[5], detokenize=False)   # ids need no text


def test_kv_cache_config_refuses_what_it_does_not_do():
    from pydantic import ValidationError

    from phalanx.config import KvCacheConfig
    with pytest.raises(ValidationError, match="copy_on_partial_reuse"):
        KvCacheConfig(copy_on_partial_reuse=False)
    assert KvCacheConfig(copy_on_partial_reuse=True).copy_on_partial_reuse


def test_check_prompt_refuses_each_kind_of_bad_token_id_and_names_it():
    import enum

    from phalanx.llmapi.sampling_params import check_prompt

    class Tok(enum.IntEnum):
        A = 5

    check_prompt([0, 99, 7], 100, 10)
    check_prompt([Tok.A, 3], 100, 10)            # an int subclass is an int
    for bad, shown in ((True, "True"), (-1, "-1"), (100, "100"), (2.0, "2.0"), ("3", "3")):
        with pytest.raises(ValueError, match=f"token id {shown} is outside the vocabulary"):
            check_prompt([1, bad, 2], 100, 10)
    with pytest.raises(ValueError, match="at least one token"):
        check_prompt([], 100, 10)
    with pytest.raises(ValueError, match="max_seq_len is 10"):
        check_prompt(list(range(10)), 100, 10)


def test_the_wire_form_carries_only_what_differs_from_the_defaults_and_round_trips():
    from phalanx.llmapi.sampling_params import GuidedDecodingParams
    cases = [SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0, detokenize=False),
             SamplingParams(), SamplingParams(max_tokens=None), SamplingParams(presence_penalty=0, logit_bias={}),
             SamplingParams(stop=["a"], stop_token_ids=[3], logit_bias={5: 1.0}, seed=3, top_p=0.5,
                            guided_decoding=GuidedDecodingParams(regex="a+"), logprobs=0),
             SamplingParams(min_tokens=2, stop_token_ids=[4])]
    for sp in cases:
        assert SamplingParams.from_dict(sp.to_dict()) == sp, sp
    assert cases[0].to_dict() == {"max_tokens": 128, "temperature": 0.0, "ignore_eos": True, "detokenize": False}
    assert SamplingParams().to_dict() == {} and cases[2].to_dict() == {"max_tokens": None}
    assert cases[3].to_dict() == {"presence_penalty": 0, "logit_bias": {}}   # an int 0 is not the float default
    assert cases[4].to_dict()["logit_bias"] == [[5, 1.0]] and cases[4].to_dict()["logprobs"] == 0
    with pytest.raises(TypeError, match="best_of"):     # a field phalanx does not have is refused on the rank
        SamplingParams.from_dict({"max_tokens": 4, "best_of": 2})


def test_bad_words_become_token_sequences_as_vllm_reads_them():
    """Each bad word as it stands and, where that gives another first token and as many tokens,
    after a space (a word inside a text); sequences already given are kept, none twice."""
    from phalanx.llmapi.sampling_params import bad_word_sequences
    from phalanx.llmapi.tokenizer import Tokenizer, _gguf_tokenizer
    from phalanx.models.source import bundled_model_path
    tok = Tokenizer(_gguf_tokenizer(bundled_model_path()))
    enc = lambda t: tok.encode(t, add_special_tokens=False)   # noqa: E731
    sp = SamplingParams(bad_words=["Paris", " Paris"], bad_words_token_ids=[[5]])
    sp.add_bad_word_ids(bad_word_sequences(sp.bad_words, enc))
    assert sp.bad_words_token_ids == [[5], enc("Paris"), enc(" Paris")] and enc("Paris") != enc(" Paris")
    assert SamplingParams.from_dict(sp.to_dict()).bad_words_token_ids == sp.bad_words_token_ids


def test_masks_that_leave_nothing_to_draw_are_refused():
    """allowed_token_ids that one-token bad words all ban (given, or added from bad_words), or
    beside a grammar (which may allow none of them), leave no token: refused by name."""
    from phalanx.llmapi.sampling_params import GuidedDecodingParams
    with pytest.raises(ValueError, match="^allowed_token_ids are all bad words"):
        SamplingParams(allowed_token_ids=[3, 4], bad_words_token_ids=[[3], [4], [1, 4]])
    SamplingParams(allowed_token_ids=[3, 4], bad_words_token_ids=[[3], [1, 4]])       # 4 is left
    sp = SamplingParams(allowed_token_ids=[3], bad_words=["x"])
    with pytest.raises(ValueError, match="^allowed_token_ids are all bad words"):
        sp.add_bad_word_ids([[3]])
    with pytest.raises(ValueError, match="^allowed_token_ids cannot be combined with guided_decoding"):
        SamplingParams(allowed_token_ids=[3], guided_decoding=GuidedDecodingParams(regex="a+"))
    for bad in ([[1]], 5):     # malformed allowed ids beside bad words: named, not a TypeError
        with pytest.raises(ValueError, match="^allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad, bad_words_token_ids=[[1]])
    assert SamplingParams(bad_words_token_ids=[[1]] * 256).bad_words_token_ids is not None   # two a word
    with pytest.raises(ValueError, match="^bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[1]] * 257)
