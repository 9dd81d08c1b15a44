"""``phalanx serve``'s LoRA flags in SGLang's and vLLM's spellings: ``--lora-paths`` (NAME=PATH,
PATH alone, SGLang's JSON; ``pinned: true`` refused by name), ``--max-loras-per-batch``,
``--max-loaded-loras`` / ``--max-cpu-loras``, ``--lora-target-modules`` (``all``): each lands in
``lora_config`` as the LLM class takes it."""

import argparse
import json

import pytest

from phalanx.config import LORA_TARGETS, make_llm_args
from phalanx.serve.cli import add_serve_args, llm_kwargs, lora_requests


def parser():
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p


def test_sglang_s_and_vllm_s_lora_flags_land_in_lora_config(tmp_path):
    for name in ("a", "b", "c", "x=y"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    a = parser().parse_args(["m", "--lora-paths", f"x={tmp_path / 'a'}", str(tmp_path / "b"),
                             json.dumps({"lora_name": "z", "lora_path": str(tmp_path / "c"), "pinned": False}),
                             "--max-loras-per-batch", "3", "--max-loaded-loras", "6",
                             "--lora-target-modules", "q_proj", "v_proj", "--lora_modules", f"w={tmp_path / 'a'}"])
    kw = llm_kwargs(a)
    assert kw["enable_lora"] is True
    assert kw["lora_config"] == {"max_loras": 3, "max_cpu_loras": 6, "lora_target_modules": ["q_proj", "v_proj"]}
    lora = make_llm_args(**kw).lora
    assert (lora.max_loras, lora.max_cpu_loras, lora.targets) == (3, 6, ("q_proj", "v_proj"))
    adapters = lora_requests(a.lora_modules + a.lora_paths)
    assert {n: (r.lora_int_id, r.lora_path) for n, r in adapters.items()} == {
        "w": (1, str(tmp_path / "a")), "x": (2, str(tmp_path / "a")), str(tmp_path / "b"): (3, str(tmp_path / "b")),
        "z": (4, str(tmp_path / "c"))}
    kw = llm_kwargs(parser().parse_args(["m", "--lora-target-modules", "all", "--max-cpu-loras", "2"]))
    assert kw["lora_config"] == {"max_cpu_loras": 2, "lora_target_modules": list(LORA_TARGETS)}
    assert make_llm_args(**kw).lora.targets == LORA_TARGETS
    a = parser().parse_args(["m", "--lora-paths", json.dumps({"lora_name": "x=y", "lora_path": str(tmp_path / "x=y")})])
    assert a.lora_paths == [("x=y", str(tmp_path / "x=y"))]     # (a name with "=" in JSON)


@pytest.mark.parametrize("args,why", [
    (["--lora-paths", '{"lora_name": "z", "lora_path": "PATH", "pinned": true}'], "pinned"),
    (["--lora-paths", '{"lora_name": "z", "lora_path": "PATH", "max_rank": 8}'], "max_rank is not supported"),
    (["--lora-paths", "z=/nowhere/at/all"], "is not a directory"),
    (["--lora-paths", "PATH"], "holds no adapter_config.json"),     # (a model named after the flag, say)
    (["--lora-target-modules", "embed_tokens"], "invalid choice"),
    (["--max-loras-per-batch", "0"], "--max_loras"),
])
def test_what_the_flags_cannot_mean_is_refused_by_name(tmp_path, capsys, args, why):
    with pytest.raises(SystemExit):
        parser().parse_args(["m", *(x.replace("PATH", str(tmp_path)) for x in args)])
    assert why in capsys.readouterr().err
