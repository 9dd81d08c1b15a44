"""The user's process resolves the model once and hands it to the ranks with the engine's
arguments (``Init.model_source``), so that no rank imports transformers to read config.json
again. What arrives must be the very config the ranks would have resolved."""

import time

import pytest

from phalanx import LLM, SamplingParams
from phalanx.executor.messages import Init, pack, unpack
from phalanx.models.config import ModelConfig
from phalanx.models.loader import ModelSource, bundled_model_path, resolve_model


def _sources(tiny_models, tiny_moe_models):
    return [resolve_model(p) for p in (*tiny_models.values(), *tiny_moe_models.values(), bundled_model_path())]


def test_every_model_source_survives_the_wire(tiny_models, tiny_moe_models):
    """Dense, MoE (shared experts, sparse steps), sliding windows, llama3 rope scaling, GGUF:
    through msgpack and back, field for field and tuple for tuple."""
    for source in _sources(tiny_models, tiny_moe_models):
        init = unpack(pack(Init({"model": source.path}, source.to_wire())))
        back = ModelSource.from_wire(init.model_source)
        assert (back.kind, back.path, back.name) == (source.kind, source.path, source.name)
        assert back.config == source.config and hash(back.config) == hash(source.config)
        assert back.hf_config is None


def test_an_unknown_config_field_is_refused_by_name():
    cfg = ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16).to_wire()
    with pytest.raises(ValueError, match="no_such_field"):
        ModelConfig.from_wire({**cfg, "no_such_field": 1})


def test_ranks_take_the_resolved_model_and_start_faster(tiny_models, monkeypatch):
    """The same greedy tokens whether the rank resolves the model itself (nothing handed over)
    or takes it from the user's process; and taking it skips the rank's transformers import
    (~3 s on this machine: the start must be at least 1 s shorter)."""
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    starts: dict[bool, list[float]] = {True: [], False: []}
    tokens = {}
    for handed in (False, True, False, True):
        with monkeypatch.context() as m:
            if not handed:
                m.setattr(ModelSource, "to_wire", lambda self: None)
            t = time.monotonic()
            with LLM(tiny_models["llama"], skip_tokenizer_init=True) as llm:
                starts[handed].append(time.monotonic() - t)
                tokens[handed] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert tokens[True] == tokens[False]
    assert min(starts[False]) - min(starts[True]) > 1.0, starts
