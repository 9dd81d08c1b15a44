"""The user's process resolves the model once and hands it to the ranks with the engine's
arguments (``Init.model_source``), so that no rank imports transformers to read config.json
again. What arrives must be the very config the ranks would have resolved."""

import os

import pytest

from phalanx import LLM, SamplingParams
from phalanx.config import SpeculativeConfig
from phalanx.executor.messages import Init, pack, unpack
from phalanx.models.config import ModelConfig
from phalanx.models.source import ModelSource, bundled_model_path, resolve_model

DRAFT = {"decoding_type": "DraftTarget", "max_draft_len": 3, "adaptive": False}


def _sources(tiny_models, tiny_moe_models):
    return [resolve_model(p) for p in (*tiny_models.values(), *tiny_moe_models.values(), bundled_model_path())]


def test_every_model_source_survives_the_wire(tiny_models, tiny_moe_models):
    """Dense, MoE (shared experts, sparse steps), sliding windows, llama3 rope scaling, GGUF:
    through msgpack and back, field for field and tuple for tuple."""
    sources = _sources(tiny_models, tiny_moe_models)
    with_draft = sources[0].with_draft(SpeculativeConfig(**DRAFT, speculative_model_dir=tiny_models["qwen2"]))
    assert with_draft.draft is not None and with_draft.draft.path == tiny_models["qwen2"]
    for source in [*sources, with_draft]:
        init = unpack(pack(Init({"model": source.path}, source.to_wire())))
        back = ModelSource.from_wire(init.model_source)
        for b, s in ((back, source), (back.draft, source.draft)):
            if s is None:
                assert b is None
                continue
            assert b is not None and (b.kind, b.path, b.name) == (s.kind, s.path, s.name)
            assert b.config == s.config and hash(b.config) == hash(s.config)
            assert b.hf_config is None


def test_a_wire_dict_without_a_draft_reads_as_no_draft():
    wire = resolve_model(bundled_model_path()).to_wire()
    del wire["draft"]
    assert ModelSource.from_wire(wire).draft is None


def test_every_config_field_survives_the_wire():
    """Every field away from its default (the tiny checkpoints leave some at theirs)."""
    cfg = ModelConfig("qwen3_moe", 1000, 64, 128, 4, 4, 2, 32, rms_norm_eps=1e-5, rope_theta=5e5,
                      rope_scaling=(("factor", 8.0), ("rope_type", "llama3")), max_position_embeddings=2048,
                      tie_word_embeddings=True, qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=True,
                      sliding_windows=(None, 16, None, 16), bos_token_id=None, eos_token_ids=(2, 7),
                      torch_dtype="bfloat16", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=False, shared_expert_intermediate_size=40, decoder_sparse_step=2,
                      mlp_only_layers=(0, 3), fp8_checkpoint=True, fp8_block=(128, 128))
    back = ModelConfig.from_wire(unpack(pack(Init({}, {"config": cfg.to_wire()}))).model_source["config"])
    assert back == cfg and hash(back) == hash(cfg)
    assert all(type(getattr(back, f)) is type(getattr(cfg, f)) for f in cfg.__dataclass_fields__)


def test_an_unknown_config_field_is_refused_by_name():
    cfg = ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16).to_wire()
    with pytest.raises(ValueError, match="no_such_field"):
        ModelConfig.from_wire({**cfg, "no_such_field": 1})


def test_ranks_start_without_transformers_when_the_model_is_handed_over(tiny_models, tmp_path, monkeypatch):
    """The ranks see a ``transformers`` that cannot be imported (first on their PYTHONPATH; this
    process has the real one loaded already). Handed the resolved model and its DraftTarget
    draft, they start and give the same greedy tokens as in this process's own engine; left to
    resolve the model themselves, the start fails on that import."""
    fake = tmp_path / "no_transformers" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('transformers imported on a rank')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH")) if p))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    spec = {**DRAFT, "speculative_model_dir": tiny_models["qwen2"]}
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, speculative_config=spec) as llm:
        handed = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.stats()[0]["spec_verify_rows"] > 0     # the draft ran
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        assert handed == [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    monkeypatch.setattr(ModelSource, "to_wire", lambda self: None)
    with pytest.raises(Exception, match="transformers imported on a rank"):
        LLM(tiny_models["llama"], skip_tokenizer_init=True)


def test_an_activation_the_decoder_does_not_compute_is_refused_by_name():
    """The Llama and MoE decoders compute SiLU MLPs: a config naming another activation is refused,
    not run as SiLU."""
    import pytest
    from transformers import LlamaConfig, MixtralConfig

    from phalanx.models.config import ModelConfig
    for cfg in (LlamaConfig(hidden_act="gelu"), MixtralConfig(hidden_act="relu")):
        with pytest.raises(ValueError, match="hidden_act"):
            ModelConfig.from_hf(cfg)
    assert ModelConfig.from_hf(LlamaConfig(hidden_act="silu")).hidden_act == "silu"
