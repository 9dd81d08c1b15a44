"""What a model directory can make phalanx run or read (RELIABILITY: "trust_remote_code defaults
to False and is honoured by every loader"; "weights load only from safetensors or GGUF").

A directory's ``auto_map`` names Python files of its own for the configuration and the tokenizer;
here those files append the process id to a marker file when they are imported, so a test sees
which processes ran them. A pickled ``pytorch_model.bin`` here does the same when unpickled."""

import json
import os
import pickle
import shutil

import psutil
import pytest

from phalanx import LLM, SamplingParams


def _map_to_marking_code(folder, json_name: str, auto: str, base: str, name: str, body: str, marker) -> None:
    """Map ``auto`` in ``folder/json_name`` to ``name``, a subclass of transformers' ``base`` in a
    module of the folder's own that appends the importing process's pid to ``marker``."""
    conf = json.loads((folder / json_name).read_text())
    conf["auto_map"] = {auto: f"marking.{name}" if auto == "AutoConfig" else [None, f"marking.{name}"]}
    (folder / json_name).write_text(json.dumps(conf))
    (folder / "marking.py").write_text(
        f"import os\nfrom transformers import {base}\n"
        f"with open({str(marker)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n\n"
        f"class {name}({base}):\n    {body}\n")


def _marked_model(src: str, dst, marker) -> str:
    """A copy of the tiny model whose config.json maps AutoConfig to code that leaves a mark."""
    shutil.copytree(src, dst)
    _map_to_marking_code(dst, "config.json", "AutoConfig", "LlamaConfig", "MarkedConfig", "model_type = 'llama'",
                         marker)
    return str(dst)


def _marked_tokenizer(dst, marker) -> str:
    """A word-level tokenizer whose tokenizer_config.json maps AutoTokenizer to code that leaves a mark."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(dst)
    _map_to_marking_code(dst, "tokenizer_config.json", "AutoTokenizer", "PreTrainedTokenizerFast",
                         "MarkedTokenizerFast", "pass", marker)
    return str(dst)


def _marks(marker) -> list[int]:
    return [int(p) for p in marker.read_text().split()] if marker.exists() else []


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """transformers copies a directory's code into its modules cache before importing it: a fresh
    cache per test, so a module imported by an earlier test is imported again."""
    import transformers.dynamic_module_utils as dmu
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    return tmp_path / "hf-modules"


def test_a_models_own_code_runs_only_with_trust_remote_code(tmp_path, tiny_models, modules_cache):
    """Configuration, draft model and tokenizer: by default the directory's code is never imported
    and the engine serves with transformers' own classes; with ``trust_remote_code=True`` each
    loader imports it in the user's process."""
    marker = tmp_path / "marks"
    model = _marked_model(tiny_models["llama"], tmp_path / "model", marker)
    tokenizer = _marked_tokenizer(tmp_path / "tokenizer", marker)
    draft = {"decoding_type": "DraftTarget", "max_draft_len": 2, "speculative_model_dir": model}
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(model, tokenizer=tokenizer, speculative_config=draft, orchestrator_type="inprocess") as llm:
        assert llm.args.trust_remote_code is False
        out = llm.generate("w1 w2 w3", sp, use_tqdm=False)
        assert type(llm.tokenizer.hf).__name__ != "MarkedTokenizerFast"
    assert out.outputs[0].length == 4 and _marks(marker) == []

    with LLM(model, tokenizer=tokenizer, speculative_config=draft, orchestrator_type="inprocess",
             trust_remote_code=True) as llm:
        trusted = llm.generate("w1 w2 w3", sp, use_tqdm=False)
        assert type(llm.tokenizer.hf).__name__ == "MarkedTokenizerFast"
        assert type(llm.source.hf_config).__name__ == type(llm.source.draft.hf_config).__name__ == "MarkedConfig"
    assert set(_marks(marker)) == {os.getpid()}
    assert trusted.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.mpi
def test_ranks_never_run_a_models_own_code(tmp_path, tiny_models, modules_cache):
    """Under MPI the ranks get the configuration as the user's process resolved it: with
    ``trust_remote_code=True`` the code runs in the user's process, in no rank."""
    marker = tmp_path / "marks"
    model = _marked_model(tiny_models["llama"], tmp_path / "model", marker)
    with LLM(model, tensor_parallel_size=2, skip_tokenizer_init=True, trust_remote_code=True) as llm:
        out = llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        ranks = {p.pid for p in psutil.Process(llm._executor.proc.pid).children(recursive=True)}
    assert out.outputs[0].length == 4
    assert _marks(marker) == [os.getpid()] and len(ranks) >= 2


class _Payload:
    """Unpickling this writes the marker: what a malicious .bin checkpoint can do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


def _touch(path):
    with open(path, "a") as f:
        f.write("unpickled\n")


def test_a_pickled_checkpoint_is_refused_and_never_unpickled(tmp_path, tiny_models):
    marker = tmp_path / "marks"
    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], model)
    os.remove(model / "model.safetensors")
    with open(model / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Payload(marker)}, f)
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors weights .*pickled \.bin checkpoints are refused"):
        LLM(str(model), skip_tokenizer_init=True, orchestrator_type="inprocess")
    assert not marker.exists()
    with open(model / "pytorch_model.bin", "rb") as f:      # what loading it would have done
        pickle.load(f)
    assert marker.read_text() == "unpickled\n"


def test_no_loader_unpickles():
    """No module of phalanx unpickles: no call of torch.load (or torch.serialization's or
    torch.jit's), pickle/dill/joblib load(s), pickle.Unpickler or pandas.read_pickle, none of
    them imported by name, and numpy.load never given allow_pickle."""
    import ast
    import pathlib

    import phalanx
    loaders = {"torch": {"load"}, "serialization": {"load"}, "jit": {"load"}, "pickle": {"load", "loads", "Unpickler"},
               "dill": {"load", "loads"}, "joblib": {"load"}, "pd": {"read_pickle"}, "pandas": {"read_pickle"}}
    modules = {"torch", "torch.serialization", "torch.jit", "pickle", "dill", "joblib", "pandas"}
    found = []
    for path in pathlib.Path(phalanx.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                found += [f"{where} from {node.module} import {a.name}" for a in node.names
                          if a.name in {"load", "loads", "Unpickler", "read_pickle"}]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                name = (owner.id if isinstance(owner, ast.Name)
                        else owner.attr if isinstance(owner, ast.Attribute) else "")
                if node.func.attr in loaders.get(name, ()):
                    found.append(f"{where} {name}.{node.func.attr}")
                if name in ("np", "numpy") and node.func.attr == "load" and any(
                        k.arg == "allow_pickle" for k in node.keywords):
                    found.append(f"{where} {name}.load(allow_pickle=...)")
    assert found == []
