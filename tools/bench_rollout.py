"""The RL hand-off timed: sleep and wake up (levels 1 and 2), a colocated weight update from
this process's tensors (CUDA IPC), and an update through a weight-update group from a trainer in
another process (NCCL on a second GPU when there is one, else gloo on the CPU).

    python tools/bench_rollout.py --model shape:llama-3.1-8b --output rollout.json
    python tools/bench_rollout.py --tiny            # a small shape, to check the tool on a CPU

Memory is read with cudaMemGetInfo from this process, so what sleep returns is what another
process on the GPU (a trainer) could take. The trainer's tensors are random, seeded, in the
model's dtype; the colocated and the group update send the same values, so the tokens
generated after each must be equal (``same_tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch

GIB = 2**30


def trainer_tensors(model_dir: str, device: str, seed: int = 7) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's names and shapes, random values in bf16 (norms at one)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for name, shape in checkpoint_shapes(model_dir):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=g)
        out.append((name, t))
    return out


def checkpoint_shapes(model_dir: str) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the checkpoint (transformers' model on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return [(n, tuple(p.shape)) for n, p in meta.state_dict().items() if "rotary" not in n]


def nbytes(items: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


def free_bytes() -> int:
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info(0)[0])


def timed(fn: Any, *args: Any, **kw: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn(*args, **kw)
    return time.perf_counter() - t0, r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trainer_main(a: argparse.Namespace) -> None:
    """The other process: rank 0 of the weight-update group, sending ``--updates`` times."""
    from phalanx.llmapi.weight_transfer import TrainerGroup
    if a.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(a.device))
    items = trainer_tensors(a.model_dir, a.device)
    group = TrainerGroup("127.0.0.1", a.port, world_size=2, device=a.device, timeout=300)
    sends = []
    for _ in range(a.updates):
        t0 = time.perf_counter()
        group.send(items, a.bucket_bytes)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        sends.append(time.perf_counter() - t0)
    print(json.dumps({"trainer_send_s": sends, "bytes": nbytes(items)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shape:llama-3.1-8b")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer shape (checks the tool on a CPU)")
    ap.add_argument("--kv-fraction", type=float, default=0.5)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--bucket-bytes", type=int, default=1 << 30)
    ap.add_argument("--sleep-mode", action=argparse.BooleanOptionalAction, default=True,
                    help="enable_sleep_mode (the pinned host buffer reserved at start-up)")
    ap.add_argument("--output", default=None)
    ap.add_argument("--role", default="engine", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "trainer":
        return trainer_main(a)

    from phalanx import LLM, SamplingParams
    from phalanx.bench.shapes import TINY_OVERRIDES, resolve_model_arg
    cuda = torch.cuda.is_available()
    model_dir, dummy = resolve_model_arg(a.model, **(TINY_OVERRIDES if a.tiny else {}))
    assert model_dir is not None
    report: dict[str, Any] = {"settings": {**vars(a), "model_dir": model_dir},
                              "gpu": torch.cuda.get_device_name(0) if cuda else None}
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[(13 * i + 7 * j) % 1000 + 1 for j in range(64)] for i in range(8)]

    def generate() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    free0 = free_bytes()
    t_start, llm = timed(LLM, model_dir, load_format="dummy" if dummy else "auto", skip_tokenizer_init=True,
                         dtype="bfloat16", mpi_private_network=False, max_batch_size=64,
                         enable_sleep_mode=a.sleep_mode,
                         kv_cache_config={"free_gpu_memory_fraction": a.kv_fraction},
                         cuda_graph_config={"batch_sizes": [1, 2, 4, 8, 16, 32, 64]} if cuda else None)
    with llm:
        engine_bytes = free0 - free_bytes()
        report["startup_s"], report["engine_gib"] = t_start, engine_bytes / GIB
        report["engine_startup"] = llm.engine_info.startup
        generate()

        def sleep_wake(level: int, tags_sequence: list[list[str]]) -> dict[str, Any]:
            base = free_bytes()
            s, _ = timed(llm.sleep, level)
            returned = free_bytes() - base
            row: dict[str, Any] = {"level": level, "sleep_s": s, "returned_gib": returned / GIB,
                                   "returned_fraction": returned / engine_bytes if engine_bytes else None}
            for tags in tags_sequence:
                w, _ = timed(llm.wake_up, tags)
                row["wake_" + "+".join(tags) + "_s"] = w
            return row

        runs = [sleep_wake(1, [["weights", "kv_cache"]]),     # first: pinned host memory allocated
                sleep_wake(1, [["weights", "kv_cache"]])]     # again: the host buffers are cached
        tokens_start = generate()
        # level 2, then the colocated pattern: weights back, updated from this process's tensors
        runs.append(sleep_wake(2, [["weights"]]))
        report["sleep_wake"] = runs
        device = "cuda:0" if cuda else "cpu"
        items = trainer_tensors(model_dir, device)
        size = nbytes(items)
        report["weights_gib"] = size / GIB
        colocated = []
        for i in range(a.updates):
            s, version = timed(llm.update_weights_from_tensors, items, weight_version=f"colocated-{i}")
            colocated.append(s)
        w, _ = timed(llm.wake_up, ["kv_cache"])
        report["sleep_wake"][-1]["wake_kv_cache_s"] = w
        tokens_colocated = generate()
        del items
        if cuda:
            torch.cuda.empty_cache()
        report["colocated"] = {"seconds": colocated, "best_s": min(colocated), "gb_per_s": size / min(colocated) / 1e9,
                               "weight_version": version, "tokens_changed": tokens_colocated != tokens_start}

        # through a group: the trainer in another process (its own GPU when there is one)
        trainer_device = "cuda:1" if cuda and torch.cuda.device_count() > 1 else "cpu"
        port = free_port()
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "trainer", "--model-dir", model_dir, "--port",
               str(port), "--device", trainer_device, "--updates", str(a.updates), "--bucket-bytes",
               str(a.bucket_bytes)]
        trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        backend = "nccl" if trainer_device.startswith("cuda") else "gloo"
        joined: dict[str, Any] = {}
        join = threading.Thread(target=lambda: joined.update(
            r=llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend=backend,
                                            timeout=300)))
        join.start()
        join.join(600)
        shapes = dict(checkpoint_shapes(model_dir))
        names = list(shapes)
        group = []
        for i in range(a.updates):
            s, _ = timed(llm.update_weights_from_distributed, names, ["bfloat16"] * len(names),
                         [list(shapes[n]) for n in names], weight_version=f"group-{i}", bucket_bytes=a.bucket_bytes)
            group.append(s)
        out, _ = trainer.communicate(timeout=600)
        sent = json.loads(out.strip().splitlines()[-1])
        tokens_group = generate()
        llm.destroy_weights_update_group()
        report["group"] = {"backend": backend, "trainer_device": trainer_device, "seconds": group,
                           "best_s": min(group), "gb_per_s": size / min(group) / 1e9,
                           "trainer_send_s": sent["trainer_send_s"], "bucket_bytes": a.bucket_bytes,
                           "same_tokens_as_colocated": tokens_group == tokens_colocated}
    report["summary"] = {
        "sleep_level1_s": runs[1]["sleep_s"], "wake_level1_s": runs[1]["wake_weights+kv_cache_s"],
        "sleep_level1_first_s": runs[0]["sleep_s"], "returned_level1": runs[1]["returned_fraction"],
        "sleep_level2_s": runs[2]["sleep_s"], "returned_level2": runs[2]["returned_fraction"],
        "colocated_update_s": report["colocated"]["best_s"], "group_update_gb_s": report["group"]["gb_per_s"],
    }
    print(json.dumps(report, indent=1))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
