"""A small GRPO-style loop on the bundled SmolLM2: phalanx generates a group of answers per
prompt, a reward scores them, a transformers copy of the policy takes one policy-gradient step,
and the new weights go back into the engine from tensors in this process — the colocated
pattern of RL trainers (sleep while training, wake the weights, update, wake the KV cache).

    python examples/rl_loop.py --iterations 2 --group 4

Every output says which weight version produced it; the reward here prefers answers of about
eight words, so the mean length drifts towards that as the loop runs.
"""

from __future__ import annotations

import argparse
import os

import torch


def reward(text: str, target_words: int = 8) -> float:
    return -abs(len(text.split()) - target_words) / target_words


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--group", type=int, default=4, help="answers per prompt")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--policy", default=None, help="the trainer's copy of the model as a transformers checkpoint "
                    "directory (default: the bundled GGUF, read by transformers' GGUF loader: slow)")
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from phalanx import LLM, SamplingParams
    from phalanx.models.source import bundled_model_path

    if a.policy:
        policy = AutoModelForCausalLM.from_pretrained(a.policy, dtype=torch.float32)
    else:
        path = bundled_model_path()
        policy = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                      dtype=torch.float32)
    optimizer = torch.optim.SGD(policy.parameters(), lr=a.lr)
    questions = ["Describe the sea.", "What is a cat?"]

    with LLM(orchestrator_type="inprocess") as llm:
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        prompt_ids = [llm.tokenizer.encode(p) for p in prompts]
        sp = SamplingParams(n=a.group, temperature=1.0, max_tokens=a.max_tokens, seed=0, logprobs=0)
        for it in range(a.iterations):
            # 1. roll out: a group of answers per prompt, with the version of the weights behind them
            outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sp, use_tqdm=False)
            versions = sorted({v for o in outs for c in o.outputs for _, v in c.weight_versions})
            # 2. score, and the group-relative advantage of each answer
            batch = []
            for ids, out in zip(prompt_ids, outs, strict=True):
                rewards = torch.tensor([reward(c.text) for c in out.outputs])
                adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
                batch += [(ids, c.token_ids, float(adv[i])) for i, c in enumerate(out.outputs)]
            mean_words = sum(len(c.text.split()) for o in outs for c in o.outputs) / (len(outs) * a.group)
            print(f"iteration {it}: weights {versions}, mean reward "
                  f"{sum(reward(c.text) for o in outs for c in o.outputs) / (len(outs) * a.group):+.3f}, "
                  f"mean answer {mean_words:.1f} words", flush=True)
            # 3. train while the engine sleeps (its memory is the trainer's meanwhile)
            llm.sleep(level=1)
            optimizer.zero_grad()
            for ids, answer, adv in batch:
                seq = torch.tensor([ids + answer])
                logits = policy(seq).logits[0, len(ids) - 1:-1]
                logp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(answer)[:, None]).sum()
                (-adv * logp / len(batch)).backward()
            optimizer.step()
            # 4. new weights into the engine, straight from the trainer's tensors
            llm.wake_up(tags=["weights"])
            version = llm.update_weights_from_tensors(policy.state_dict().items(), weight_version=f"step-{it + 1}")
            llm.wake_up(tags=["kv_cache"])
            print(f"  updated to {version}", flush=True)
        final = llm.generate(prompts[0], SamplingParams(max_tokens=a.max_tokens, temperature=0), use_tqdm=False)
        print(f"final ({final.weight_version}): {final.outputs[0].text!r}")


if __name__ == "__main__":
    main()
