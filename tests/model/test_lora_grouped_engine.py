"""The engine with LoRA's grouped kernels (``PHALANX_LORA_KERNELS=1``: on the CPU they run in
Triton's interpreter; a GPU takes them by default): decode steps of more rows than the decode
kernels take (``triton_lora.MAX_ROWS``) mixing two adapters and none equal PEFT's greedy tokens,
and so do the same requests with the decode kernels alone (``=bgmv``), where those steps take the
dense form."""

import pytest
import torch

from hf_reference import LORA_TARGETS, assert_same_greedy, hf_greedy, save_lora_adapter
from phalanx import LLM, LoRARequest, SamplingParams

pytest.importorskip("triton")


@pytest.mark.parametrize("choice", ["1", "bgmv"])
def test_wide_decode_steps_through_the_grouped_kernels_equal_peft(choice, tiny_models, hf_models, tmp_path,
                                                                   monkeypatch):
    from phalanx.kernels import triton_lora
    monkeypatch.setenv("PHALANX_LORA_KERNELS", choice)
    hf = hf_models["llama"]
    refs = {None: hf, "all": save_lora_adapter(hf, tmp_path / "all", 8, LORA_TARGETS, 61),
            "some": save_lora_adapter(hf, tmp_path / "some", 4, ["q_proj", "o_proj", "up_proj", "down_proj"], 62)}
    ids = {"all": 1, "some": 2}
    g = torch.Generator().manual_seed(11)
    batch = [(torch.randint(0, 256, (int(n),), generator=g).tolist(), name)
             for n in torch.randint(2, 9, (14,), generator=g) for name in refs]   # 42 rows
    calls = {"grouped": [], "bgmv": []}
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess", max_num_tokens=256,
             kv_cache_config={"tokens_per_block": 8}, lora_config={"max_loras": 2, "max_lora_rank": 8}) as llm:
        state = llm._executor.engine.runner.model.lora
        assert state.kernels and state.kernel_rows == (triton_lora.DECODE_ROWS if choice == "1"
                                                        else triton_lora.MAX_ROWS) < len(batch)
        assert state.grouped_rows == (triton_lora.GROUPED_ROWS if choice == "1" else 0)
        for name, fn in (("grouped", state.lora_add_grouped), ("bgmv", state.lora_add)):
            if fn is not None:   # the state's own kernels, counted by the tokens they are given
                setattr(state, "lora_add_grouped" if name == "grouped" else "lora_add",
                        lambda y, x, *a, _fn=fn, _seen=calls[name]: (_seen.append(x.shape[0]), _fn(y, x, *a))[1])
        outs = llm.generate([p for p, _ in batch], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False,
                            lora_request=[LoRARequest(n, ids[n], str(tmp_path / n)) if n else None for _, n in batch])
    wide = state.kernel_rows
    if choice == "1":   # steps wider than the decode kernels take went through the grouped kernels
        assert any(t > wide for t in calls["grouped"]) and all(t <= triton_lora.GROUPED_ROWS for t in calls["grouped"])
    assert all(t <= wide for t in calls["bgmv"])   # (=bgmv: state.grouped_rows 0, the grouped kernels not built)
    for (p, name), out in zip(batch, outs, strict=True):
        ref, gaps = hf_greedy(refs[name], p, 4)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"adapter {name} prompt of {len(p)}")


def test_a_wide_step_without_adapters_leaves_no_tile_for_the_next_one(tiny_models, hf_models, tmp_path, monkeypatch):
    """A step with an adapter (grouped), then a step of more tokens than the grouped kernels take
    and no adapter (dense: its tiles not written), then a grouped step without adapters (not set
    at all, the mask being clear): the last one's tokens are the base model's, not the first
    step's adapter read from tiles left behind."""
    monkeypatch.setenv("PHALANX_LORA_KERNELS", "1")
    from phalanx.kernels import triton_lora
    hf = hf_models["llama"]
    save_lora_adapter(hf, tmp_path / "a", 8, LORA_TARGETS, 41)
    g = torch.Generator().manual_seed(5)

    def rnd(n):
        return torch.randint(0, 256, (n,), generator=g).tolist()
    wide = triton_lora.GROUPED_ROWS // 4 + 22
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess", max_num_tokens=1024,
             kv_cache_config={"tokens_per_block": 8, "enable_block_reuse": False},
             lora_config={"max_loras": 2, "max_lora_rank": 8}) as llm:
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        llm.generate([rnd(100)], one, use_tqdm=False, lora_request=[LoRARequest("a", 1, str(tmp_path / "a"))])
        llm.generate([rnd(wide) for _ in range(4)], one, use_tqdm=False)   # > GROUPED_ROWS tokens in one step
        prompt = rnd(100)
        out = llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    ref, gaps = hf_greedy(hf, prompt, 4)
    assert_same_greedy(out.outputs[0].token_ids, ref, gaps, "no adapter after a wide step")
