"""Rollout: what an RL trainer asks of the ranks — pause and continue, sleep and wake up, new
weights (from disk, from tensors shared in place, through a process group), and the version of
the weights each token comes from.

Every operation is a control op (``PyExecutor._control``): rank 0 broadcasts it in the iteration
stream, so all ranks apply it between the same two iterations and their schedulers stay equal.

Pause modes (``pause``): ``abort`` ends every unfinished request now (each returns the tokens
it has, finish reason "abort", so a caller can resend prompt + tokens); ``wait`` admits nothing
new but lets the running requests finish; ``keep`` runs no step at all, the running requests
keep their KV and go on after ``continue`` (if the weights changed meanwhile, their outputs span
two versions). Requests that arrive while paused wait.

Sleep (``sleep``, idle engine only): the KV cache's memory is released and the prefix cache
forgotten, the CUDA graphs are dropped, and the weights are copied to host memory (level 1) or
dropped (level 2, for a caller that loads new weights before generating); LoRA adapter slots are
given back too (their adapters stay in host memory and are written again when next needed).
Memory goes back by resizing each storage to zero, so every tensor object — parameters, their views in the layers'
plans, the KV pool — stays the same and takes its memory back on ``wake_up``; the graphs, which
hold raw addresses, are captured again once both weights and KV cache are awake.

Weight updates validate every name, shape and dtype against the model's checkpoint shapes
before anything is copied (a refused update changes no weight), load through the same loader
as start-up (each rank takes its shard, fused q/k/v and gate/up included), set the weight
version (the caller's string, else a counter), and start a new KV epoch: no prefix computed
with the old weights is served again (``KVCacheManager.invalidate``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from phalanx.llmapi.weight_transfer import DEFAULT_BUCKET_BYTES, DTYPES, EngineGroup, open_tensors
from phalanx.pyexecutor.speculative import NGramProposer

if TYPE_CHECKING:
    from phalanx.kernels.fp8 import Fp8BlockWeight, Fp8Weight
    from phalanx.pyexecutor.py_executor import PyExecutor

logger = logging.getLogger("phalanx")

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_TAGS = ("weights", "kv_cache")
# ModelConfig fields a checkpoint on disk may differ in and still be the same model
_FREE_CONFIG_FIELDS = {"torch_dtype", "bos_token_id", "eos_token_ids", "max_position_embeddings", "fp8_checkpoint",
                       "fp8_block", "fp8_unquantized", "fp8_kv_cache", "quant_method"}


def epoch_key(n: int) -> bytes:
    """The bytes epoch ``n`` appends to every prefix-cache key: they hold 0xfe, which no extra
    key has (a cache_salt is UTF-8; a LoRA key is 0xff, digits and a dot), so that no salt can
    spell a later epoch's keys under the weights before it."""
    return b"\xfeepoch%d" % n


class Rollout:
    OPS = ("pause", "continue", "sleep", "wake_up", "is_sleeping", "update_weights", "init_weights_update_group",
           "destroy_weights_update_group", "reset_prefix_cache", "weight_version")

    def __init__(self, executor: PyExecutor) -> None:
        self.ex = executor
        self.weight_version = "0"
        self.num_updates = 0
        self.num_epochs = 0
        self.pause_mode: str | None = None
        self.asleep: set[str] = set()
        self._host_copies: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        self._lora_slots: list[tuple[torch.UntypedStorage, int]] = []   # adapter slots given back while asleep
        self._kv_bytes = 0
        self._graphs_dropped = False
        self._group: EngineGroup | None = None
        self._host_buffer: torch.Tensor | None = None

    # -- what the loop asks ------------------------------------------------------------------------
    @property
    def holds(self) -> bool:
        """No step may run (paused with abort/keep, or asleep)."""
        return self.pause_mode in ("abort", "keep") or bool(self.asleep)

    @property
    def admits(self) -> bool:
        """Waiting requests may start."""
        return self.pause_mode is None and not self.asleep

    # -- dispatch ----------------------------------------------------------------------------------
    def run(self, op: str, args: dict[str, Any]) -> str:
        fn = getattr(self, "_" + op)
        return fn(**args)

    def _pause(self, mode: str = "abort") -> str:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.pause_mode = mode
        if mode == "abort":
            self.ex.abort_all()
        return "ok"

    def _continue(self) -> str:
        self.pause_mode = None
        return "ok"

    def _weight_version(self) -> str:
        return self.weight_version

    def _is_sleeping(self) -> str:
        return json.dumps(sorted(self.asleep))

    def _reset_prefix_cache(self) -> str:
        return json.dumps({"freed_blocks": self.new_epoch()})

    def new_epoch(self) -> int:
        self.num_epochs += 1
        return self.ex.scheduler.kv.invalidate(epoch_key(self.num_epochs))

    # -- memory ------------------------------------------------------------------------------------
    def _sleep(self, level: int = 1) -> str:
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"level must be 1 (weights to host memory) or 2 (weights dropped), got {level!r}")
        if self.asleep:
            raise ValueError(f"already asleep ({', '.join(sorted(self.asleep))})")
        unfinished = self.ex.num_unfinished()
        if unfinished:
            raise ValueError(f"sleep needs an idle engine: {unfinished} requests are unfinished "
                             "(pause_generation(mode='abort') ends them)")
        runner = self.ex.runner
        if runner.spec is not None and not isinstance(runner.spec.proposer, NGramProposer):
            raise ValueError("sleep is not supported with a draft model (speculative_config DraftTarget or "
                             "Eagle3): its weights and KV pool would stay in GPU memory")
        cuda = runner.device.type == "cuda"
        if level == 1:   # what can fail (pinning host memory) comes before anything is released
            self.reserve_host_buffer()
        before = _free_bytes(runner.device)
        _sync(runner.device)
        self.new_epoch()                      # the KV contents go: nothing cached may match again
        if runner.graphs is not None:
            runner.graphs.release()
            self._graphs_dropped = True
        kv = runner.kv_pool.tensor.untyped_storage()
        self._kv_bytes = kv.nbytes()
        kv.resize_(0)
        runner.kv_pool.release_staging()      # the host tier's device buffers (the new epoch emptied the tier)
        self._host_copies = []
        storages = _weight_storages(runner.model)
        offset = 0
        for storage in storages:
            host = None
            n = storage.nbytes()
            if level == 1:
                assert self._host_buffer is not None
                host = self._host_buffer[offset:offset + n]
                host.copy_(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage), non_blocking=True)
                offset += _aligned(n)
            self._host_copies.append((storage, n, host))
        _sync(runner.device)
        for storage in storages:
            storage.resize_(0)
        if runner.lora is not None:   # the adapters' slots: written again from host memory when next needed
            self._lora_slots = [(t.untyped_storage(), t.untyped_storage().nbytes())
                                for w in runner.lora.state.slot_weights() for t in (w.A, w.B)]
            for st, _ in self._lora_slots:
                st.resize_(0)
            runner.lora.forget_slots()
        if cuda:
            torch.cuda.empty_cache()
        self.asleep = set(SLEEP_TAGS)
        after = _free_bytes(runner.device)
        return json.dumps({"level": level, "freed_bytes": after - before if cuda else self._kv_bytes + sum(
            n for _, n, _ in self._host_copies) + sum(n for _, n in self._lora_slots)})

    def reserve_host_buffer(self) -> None:
        """One pinned host buffer that holds every weight (level-1 sleep copies them there),
        allocated once and kept: at start-up with ``enable_sleep_mode``, else at the first sleep."""
        storages = _weight_storages(self.ex.runner.model)
        total = sum(_aligned(s.nbytes()) for s in storages)
        if self._host_buffer is None or self._host_buffer.numel() < total:
            self._host_buffer = None
            self._host_buffer = torch.empty(total, dtype=torch.uint8,
                                            pin_memory=self.ex.runner.device.type == "cuda")

    def _wake_up(self, tags: list[str] | None = None) -> str:
        tags = list(SLEEP_TAGS) if tags is None else tags
        bad = [t for t in tags if t not in SLEEP_TAGS]
        if bad or not tags:
            raise ValueError(f"tags must be a non-empty list of {', '.join(SLEEP_TAGS)}, got {tags!r}")
        runner = self.ex.runner
        t0 = time.monotonic()
        if "weights" in tags and "weights" in self.asleep:
            for storage, nbytes, host in self._host_copies:
                storage.resize_(nbytes)
                if host is not None:
                    torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host,
                                                                                               non_blocking=True)
            for st, nbytes in self._lora_slots:   # empty slots hold zeros (models/lora.py)
                st.resize_(nbytes)
                torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).zero_()
            _sync(runner.device)
            self._host_copies, self._lora_slots = [], []
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            storage = runner.kv_pool.tensor.untyped_storage()
            storage.resize_(self._kv_bytes)
            runner.kv_pool.tensor.zero_()    # an FP8 pool must hold no NaN (attention_ref.values_key_minor)
            runner.kv_pool.restore_staging()
            self.asleep.discard("kv_cache")
        recaptured = False
        if not self.asleep and self._graphs_dropped and runner.graphs is not None:
            runner.graphs.release()     # whatever a failed earlier capture left
            runner.graphs.capture()     # if this fails, steps run eagerly and the next wake_up tries again
            self._graphs_dropped = False
            recaptured = True
        return json.dumps({"awake": [t for t in SLEEP_TAGS if t not in self.asleep], "graphs_recaptured": recaptured,
                           "seconds": time.monotonic() - t0})

    # -- weights -----------------------------------------------------------------------------------
    def _update_weights(self, source: str, path: str | None = None, specs: list[dict[str, Any]] | None = None,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES, weight_version: str | None = None,
                        names: Any = None, dtypes: Any = None, shapes: Any = None) -> str:
        if source not in ("disk", "tensors", "distributed"):
            raise ValueError(f"source must be disk, tensors or distributed, got {source!r}")
        t0 = time.monotonic()
        if source == "distributed":
            if self._group is None:
                raise ValueError("no weight-update group: call init_weights_update_group first")
            try:   # every refusal from here is posted: the trainer waits for this update's verdict
                _check_version(weight_version)
                self._check_awake()
                checked = self._check_specs(_distributed_specs(names, dtypes, shapes))
                if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
                    raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
            except ValueError as e:
                self._group.answer(str(e))
                raise
            self._group.answer(None)
            weights: Iterable[tuple[str, torch.Tensor | Fp8Weight | Fp8BlockWeight]] = self._group.receive(
                checked, bucket_bytes, self.ex.runner.device)
        elif source == "tensors":
            _check_version(weight_version)
            self._check_awake()
            weights = open_tensors(self._check_specs(specs))
        else:
            _check_version(weight_version)
            self._check_awake()
            weights = self._disk_weights(path)
        _sync(self.ex.runner.device)   # the step in flight reads the old weights: let it finish
        with torch.no_grad():
            count = self.ex.runner.model.load_weights(weights, partial=True)
        _sync(self.ex.runner.device)
        self.num_updates += 1
        self.weight_version = weight_version if weight_version is not None else str(self.num_updates)
        self.new_epoch()
        seconds = time.monotonic() - t0
        logger.info("weights updated from %s: %d tensors in %.2fs, version %s", source, count, seconds,
                    self.weight_version)
        return json.dumps({"weight_version": self.weight_version, "num_tensors": count, "seconds": seconds})

    def _check_awake(self) -> None:
        if "weights" in self.asleep:
            raise ValueError("the weights are asleep: wake_up(tags=['weights']) first")

    def _check_specs(self, specs: Any) -> list[dict[str, Any]]:
        """Every spec names a checkpoint tensor of this model with its full shape and a dtype
        that can travel; raises ValueError naming the first that does not."""
        if not isinstance(specs, list) or not specs:
            raise ValueError("named tensors: a non-empty list is needed")
        expected = self._expected()
        model = self.ex.runner.model
        fused = model.fused_shapes()      # (a trainer's in-memory form of the same weights)
        for i, spec in enumerate(specs):
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ValueError(f"tensor {i}: needs a name")
            name = spec["name"]
            if spec.get("dtype") not in DTYPES:
                raise ValueError(f"tensor {name!r}: dtype {spec.get('dtype')!r} is not one of {', '.join(DTYPES)}")
            shape = spec.get("shape")
            if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                    for d in shape)):
                raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
            ours = model.checkpoint_name(name)
            if ours is None:     # a tensor the model passes over (a vision tower's): it travels, then is dropped
                continue
            want = expected.get(ours) or fused.get(ours)
            if want is None:
                raise ValueError(f"tensor {name!r}: not a weight of this model")
            if list(shape) != list(want):
                raise ValueError(f"tensor {name!r}: shape {shape!r} does not match the model's {list(want)}")
        return specs

    def _expected(self) -> dict[str, tuple[int, ...]]:
        model = self.ex.runner.model
        shapes = dict(model.checkpoint_shapes())
        if model.config.tie_word_embeddings:   # a tied checkpoint may carry it; the loader skips it
            shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
        return shapes

    def _disk_weights(self, path: Any) -> Iterator[tuple[str, torch.Tensor | Fp8Weight | Fp8BlockWeight]]:
        """The checkpoint at ``path`` (a Hugging Face directory or a GGUF file), checked first:
        the same architecture and sizes, and (safetensors) every tensor's name and shape."""
        import dataclasses

        from phalanx.models.loader import (
            FP8_SCALE_SUFFIXES,
            check_fp8_checkpoint,
            checkpoint_weights,
            kv_scale_names,
            safetensors_specs,
        )
        from phalanx.models.source import resolve_model
        if not isinstance(path, str) or not path:
            raise ValueError("path: a checkpoint directory or .gguf file is needed")
        try:
            source = resolve_model(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"path {path!r}: {e}") from None
        mine, theirs = dataclasses.asdict(self.ex.runner.model.config), dataclasses.asdict(source.config)
        differ = sorted(k for k in mine if k not in _FREE_CONFIG_FIELDS and mine[k] != theirs.get(k))
        if differ:
            raise ValueError(f"path {path!r}: not the same architecture as the served model "
                             f"(differs in {', '.join(differ[:6])})")
        if source.kind == "hf":
            # names and shapes, all before any copy; an FP8 checkpoint's scales pair with its
            # weights (checked as the full-precision tensors they stand for: checkpoint_weights
            # keeps the bytes of per-tensor or per-row scaled ones, dequantizes the others)
            specs = [s for s in safetensors_specs(source.path) if "rotary_emb" not in s["name"]]
            if source.config.fp8_checkpoint:
                check_fp8_checkpoint(specs, source.config.fp8_block)
            weights = [{**s, "dtype": "float32"} if str(s["dtype"]).startswith("F8") else s
                       for s in specs if not s["name"].endswith(FP8_SCALE_SUFFIXES)]
            self._check_specs(weights)
            # a checkpoint is the whole model: one missing tensors (a half-written save) would
            # leave those of the old weights serving beside the new
            named = {self.ex.runner.model.checkpoint_name(s["name"]) for s in weights}
            missing = sorted(set(self._expected()) - named
                             - ({"lm_head.weight"} if self.ex.runner.model.config.tie_word_embeddings else set()))
            if missing:
                raise ValueError(f"path {path!r}: the checkpoint lacks {len(missing)} of the model's tensors, e.g. "
                                 f"{', '.join(missing[:3])}")
            if self.ex.runner.model.kv_scales_in_use() and not any(kv_scale_names(s["name"]) for s in specs):
                logger.warning("weights update from %s: it brings no KV cache scales; the FP8 pool keeps the ones it "
                               "was written with", path)
        return checkpoint_weights(source, self.ex.runner.model.activation_dtype, headers_checked=source.kind == "hf")

    def _init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                   backend: str | None = None, timeout: float = 600.0) -> str:
        if self._group is not None:
            raise ValueError("a weight-update group exists: destroy_weights_update_group first")
        ranks = self.ex.dist.size if self.ex.dist is not None else 1
        if not (isinstance(rank_offset, int) and isinstance(world_size, int) and rank_offset >= 1
                and rank_offset + ranks <= world_size):
            raise ValueError(f"rank_offset {rank_offset!r} + {ranks} engine ranks must fit in world_size "
                             f"{world_size!r} (the trainer is rank 0)")
        device = self.ex.runner.device
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, got {backend!r}")
        self._group = EngineGroup(master_address, int(master_port), rank_offset + self.ex.rank, world_size,
                                  backend, posts=self.ex.rank == 0, timeout=float(timeout))
        return json.dumps({"rank": rank_offset + self.ex.rank, "backend": backend})

    def _destroy_weights_update_group(self) -> str:
        self._group = None
        return "ok"


def _weight_storages(model: torch.nn.Module) -> list[torch.UntypedStorage]:
    """Each distinct storage behind the model's parameters (tied weights share one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for p in model.parameters():
        s = p.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen[s.data_ptr()] = s
    return list(seen.values())


def _aligned(n: int) -> int:
    return -(-n // 512) * 512


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.mem_get_info(device)[0])


def _check_version(weight_version: Any) -> None:
    if weight_version is not None and (not isinstance(weight_version, str) or not 1 <= len(weight_version) <= 256):
        raise ValueError("weight_version must be a non-empty string of at most 256 characters")


def _distributed_specs(names: Any, dtypes: Any, shapes: Any) -> list[dict[str, Any]]:
    """The specs of a broadcast update from its three lists (checked: lists of one length)."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtypes and shapes must be lists of the same length")
    return [{"name": n, "dtype": d, "shape": s} for n, d, s in zip(names, dtypes, shapes, strict=True)]
