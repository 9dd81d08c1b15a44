"""LoRA adapters on the projections: y = x Wᵀ + s · (x Aᵀ) Bᵀ, each token with its request's
adapter (or none).

Every target projection holds ``max_loras`` adapter slots side by side, for each of its P parts
(q ‖ k ‖ v: 3, gate ‖ up: 2, o and down: 1): ``A`` [P·S·r, K] (K: this rank's input columns) and
``B`` [N, P·S·r] (N: this rank's output rows, laid out as the weight's; the scale s folded in; part
p's rows hold values only in part p's columns). A step computes

    ((x Aᵀ) ⊙ M) Bᵀ        M [T, P·S·r]: 1 where a column belongs to the slot of the token's adapter

so one pair of dense products serves a batch of mixed adapters and tokens without one, with the
same shapes at every step (CUDA graphs capture it; ``LoraState`` fills M before each step). On a
GPU a step of at most ``triton_lora.DECODE_ROWS`` tokens (decode) takes two Triton kernels instead, in
which each token multiplies by its own slot alone, and a step of at most ``GROUPED_ROWS`` two
grouped ones, the tokens sorted by slot into tiles that multiply by their slot once
(``kernels/triton_lora.py``; the dense form is their reference). The dense form's cost is
T·P·S·r·(K + N) multiply-adds a projection beside its T·K·N: at 4 slots of rank 16 on a
Llama-3.1-8B layer ~2 % of its weights' bytes and FLOPs. An adapter of a lower rank fills the
first of its slot's r columns (the rest stay zero).

Under tensor parallelism the placement follows the weight's: a column-parallel part's B takes
this rank's rows (``Projection._place``), its A is whole; a row-parallel projection's A takes this
rank's input columns and its B is whole, so each rank's partial (x_r A_rᵀ) Bᵀ sums, with the
weight's partial products, in the layer's one all-reduce.

Adapters are read from a PEFT directory (``adapter_config.json`` and
``adapter_model.safetensors``; pickled ``.bin`` files are never loaded): LoRA only, no DoRA, no
bias, no ``modules_to_save``, no per-module rank or alpha patterns — each refused by name.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from phalanx.config import LORA_TARGETS, LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
# PEFT initializations that rewrite the base weights (the adapter then holds only against them)
_BASE_CHANGING_INITS = ("olora", "corda", "loftq", "lora_ga")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")
# PEFT's LoRA settings that change what the weights mean: refused unless at these values
_UNSUPPORTED = {"use_dora": (False, None), "bias": ("none", None), "modules_to_save": (None, []),
                "fan_in_fan_out": (False, None), "layers_to_transform": (None, []), "rank_pattern": ({}, None),
                "alpha_pattern": ({}, None), "layer_replication": (None, []), "lora_bias": (False, None),
                "use_qalora": (False, None), "trainable_token_indices": (None, {}, []),
                "alora_invocation_tokens": (None, []), "target_parameters": (None, []), "arrow_config": (None,),
                "use_bdlora": (None, False), "velora_config": (None,), "monteclora_config": (None,),
                "kasa_config": (None,)}


@dataclass
class Adapter:
    """One adapter read from disk: (layer, module) -> (A [r, in], s·B [out, r]) on the host (float32
    as read; ``pyexecutor/lora.LoraManager`` keeps them in the model's dtype)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def module_shapes(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int,
                  intermediate: int) -> dict[str, tuple[int, int]]:
    """module -> (in features, out features) of a Llama-family layer's projections."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}


MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def config_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """``module_shapes`` of a model config (``models/config.ModelConfig``)."""
    return module_shapes(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size)


def read_adapter_for(name: str, path: str, model_cfg: Any, lora_cfg: LoraConfig) -> Adapter:
    """``read_adapter`` against a model config and the engine's LoRA settings: what the ranks
    read (``pyexecutor/lora.py``) and the server checks first (``serve/lora_routes.py``)."""
    return read_adapter(name, path, **_limits(model_cfg, lora_cfg))


def adapter_from_tensors_for(name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], model_cfg: Any,
                             lora_cfg: LoraConfig) -> Adapter:
    """``adapter_from_tensors`` against a model config and the engine's LoRA settings."""
    return adapter_from_tensors(name, config, tensors, **_limits(model_cfg, lora_cfg))


def _limits(model_cfg: Any, lora_cfg: LoraConfig) -> dict[str, Any]:
    return {"num_layers": model_cfg.num_layers, "shapes": config_shapes(model_cfg), "max_rank": lora_cfg.max_lora_rank,
            "targets": lora_cfg.targets, "sparse": sparse_layers(model_cfg)}


def sparse_layers(cfg: Any) -> Callable[[int], bool] | None:
    """Whether a layer's MLP is a mixture of experts (whose projections take no adapter), for a
    model config with experts; None for a dense model."""
    if not cfg.is_moe:
        return None
    from phalanx.models.moe import MoECausalLM
    return functools.partial(MoECausalLM.is_sparse, cfg)


def read_adapter(name: str, path: str, *, num_layers: int, shapes: dict[str, tuple[int, int]],
                 max_rank: int, targets: tuple[str, ...], sparse: Callable[[int], bool] | None = None) -> Adapter:
    """A PEFT LoRA directory -> ``Adapter``; a ValueError naming the file, the setting or the
    tensor (and the limit) where it cannot be served as it means. ``sparse``: the layers whose
    MLP is a mixture of experts (``sparse_layers``)."""
    try:
        where, cfg, tensors = _read_files(name, path, max_rank)
        return _build(name, where, cfg, tensors, num_layers, shapes, max_rank, targets, sparse, ADAPTER_CONFIG)
    except ValueError:
        raise
    except Exception as e:   # noqa: BLE001 - whatever a directory holds, the request is refused alone
        raise ValueError(f"lora_request {name!r}: the adapter could not be read ({type(e).__name__}: {e})") from None


def adapter_from_tensors(name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], *, num_layers: int,
                         shapes: dict[str, tuple[int, int]], max_rank: int, targets: tuple[str, ...],
                         sparse: Callable[[int], bool] | None = None) -> Adapter:
    """An adapter handed over in memory (a trainer's PEFT state dict and its ``LoraConfig`` as a
    dict, ``plain_peft_config``) -> ``Adapter``, checked as ``read_adapter`` checks a directory's;
    its path is empty. The tensors are copied (float32), so the caller's may change after."""
    try:
        if not isinstance(config, dict):
            raise ValueError(f"lora_request {name!r}: peft_config must be a mapping (a LoraConfig's to_dict())")
        return _build(name, "", config, tensors, num_layers, shapes, max_rank, targets, sparse, "peft_config")
    except ValueError:
        raise
    except Exception as e:   # noqa: BLE001 - whatever is handed over, the adapter alone is refused
        raise ValueError(f"lora_request {name!r}: the adapter could not be read ({type(e).__name__}: {e})") from None


def plain_peft_config(config: Any) -> dict[str, Any]:
    """A ``peft.LoraConfig`` (or its ``to_dict()``, or an ``adapter_config.json``'s dict) as plain
    values that travel to the ranks: sets as sorted lists, PEFT's string enums as strings."""
    if hasattr(config, "to_dict") and not isinstance(config, dict):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ValueError(f"peft_config must be a peft.LoraConfig or a dict, got {type(config).__name__}")

    def plain(v: Any) -> Any:
        if isinstance(v, str):      # (a str enum such as PeftType.LORA too)
            return str(v.value) if hasattr(v, "value") and isinstance(v.value, str) else str(v)
        if v is None or isinstance(v, (bool, int, float)):
            return v
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (set, frozenset)):
            return sorted(plain(x) for x in v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if hasattr(v, "value"):     # another enum
            return plain(v.value)
        return repr(v)              # refused by name if it is a setting that matters
    return {str(k): plain(v) for k, v in config.items()}


def _read_files(name: str, path: str, max_rank: int) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """A PEFT directory's real path, its ``adapter_config.json`` (checked first) and its tensors."""
    what = f"lora_request {name!r}"
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what}: lora_path must be a directory")
    where = os.path.realpath(path)
    cfg_file = os.path.join(where, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{what}: {ADAPTER_CONFIG} not found in lora_path")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: {ADAPTER_CONFIG} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{what}: {ADAPTER_CONFIG} must hold an object")
    _check_config(what, cfg, ADAPTER_CONFIG, max_rank)
    weights_file = os.path.join(where, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_file):
        pickled = os.path.isfile(os.path.join(where, "adapter_model.bin"))
        raise ValueError(f"{what}: {ADAPTER_WEIGHTS} not found in lora_path"
                         + (" (adapter_model.bin is a pickle and is not loaded)" if pickled else ""))
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(weights_file)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{what}: {ADAPTER_WEIGHTS} is not readable ({e})") from None
    return where, cfg, tensors


def _check_config(what: str, cfg: dict[str, Any], source: str, max_rank: int) -> tuple[int, float]:
    """An adapter's PEFT settings -> its rank and scale; a ValueError naming a setting it cannot
    be served with."""
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{what}: peft_type {kind!r} is not supported (LORA only)")
    for key, allowed in _UNSUPPORTED.items():
        if key in cfg and cfg[key] not in allowed:
            raise ValueError(f"{what}: {key}={cfg[key]!r} in {source} is not supported")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and (init.startswith("pissa") or init in _BASE_CHANGING_INITS):
        raise ValueError(f"{what}: init_lora_weights={init!r} in {source} is not supported (the adapter is "
                         "trained against a changed base model; PEFT converts it to a plain LoRA on saving with "
                         "path_initial_model_for_weight_conversion)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)   # (PEFT's default alpha)
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= max_rank:
        raise ValueError(f"{what}: rank r={r!r} must be an integer from 1 to max_lora_rank ({max_rank})")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{what}: lora_alpha={alpha!r} must be a finite number")
    return r, (alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r)


def _build(name: str, where: str, cfg: dict[str, Any], tensors: dict[str, torch.Tensor], num_layers: int,
           shapes: dict[str, tuple[int, int]], max_rank: int, targets: tuple[str, ...],
           sparse: Callable[[int], bool] | None, source: str) -> Adapter:
    """An adapter's settings and tensors (PEFT's names) checked against the model -> ``Adapter``."""
    what = f"lora_request {name!r}"
    r, scale = _check_config(what, cfg, source, max_rank)
    if not isinstance(tensors, dict):
        raise ValueError(f"{what}: the adapter's tensors must be a mapping of PEFT names to tensors")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key) if isinstance(key, str) else None
        if m is None:
            raise ValueError(f"{what}: tensor {key!r} is not a LoRA weight of a served projection "
                             f"({', '.join(LORA_TARGETS)})")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: tensor {key!r} is a {type(t).__name__}, not a tensor")
        layer, module, ab = int(m[1]), m[2], m[3]
        if module not in targets:
            raise ValueError(f"{what}: tensor {key!r}: {module} takes no adapter on this engine "
                             f"(lora_target_modules: {', '.join(targets)})")
        if layer >= num_layers:
            raise ValueError(f"{what}: tensor {key!r}: the model has {num_layers} layers")
        if sparse is not None and module in MLP_MODULES and sparse(layer):
            raise ValueError(f"{what}: tensor {key!r}: layer {layer}'s MLP is a mixture of experts, whose "
                             "projections take no adapter")
        if ab in pairs.get((layer, module), {}):
            raise ValueError(f"{what}: tensor {key!r}: layer {layer} {module} has lora_{ab} twice")
        pairs.setdefault((layer, module), {})[ab] = t
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{what}: layer {layer} {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        fan_in, fan_out = shapes[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
            raise ValueError(f"{what}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                             f"do not fit the model (expected ({r}, {fan_in}) and ({fan_out}, {r}))")
        a32 = a.detach().to("cpu", torch.float32, copy=True)
        b32 = b.detach().to("cpu", torch.float32) * scale
        if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
            raise ValueError(f"{what}: layer {layer} {module} holds a value that is not finite")
        weights[(layer, module)] = (a32, b32)
    if not weights:
        raise ValueError(f"{what}: {'the tensors hold' if not where else ADAPTER_WEIGHTS + ' holds'} no LoRA weights")
    return Adapter(name, where, r, weights)


class LoraState:
    """The step's token-to-slot mask M (module docstring), one buffer per part count P (M tiled
    P times), and each token's slot (``token_slots``, -1: none; the kernels' form), filled before
    each step by ``set_tokens``; the projections read their first T rows. ``kernels``: steps of
    up to ``kernel_rows`` tokens take ``kernels/triton_lora.py``'s decode kernels, and steps of up
    to ``grouped_rows`` its grouped kernels, whose step metadata (``groups``: the tokens sorted by
    slot, in tiles) ``set_tokens`` also writes (decided at build: on a GPU, unless
    ``PHALANX_LORA_KERNELS=0`` or ``PHALANX_KERNELS=ref``; ``=bgmv``: the decode kernels alone;
    with ``=1`` or ``=bgmv`` on the CPU too, through Triton's interpreter: ``TRITON_INTERPRET=1``)."""

    def __init__(self, slots: int, rank: int, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        self.slots, self.rank, self.device, self.dtype = slots, rank, device, dtype
        self.slot_of_col = torch.arange(slots * rank, device=device) // rank
        self.masks: dict[int, torch.Tensor] = {}
        self._grow(rows)   # (the masks and token_slots)
        self._rows_set = 0
        from phalanx.kernels import ops
        # "0": never; "1": also on the CPU (the interpreter); "bgmv": the decode kernels alone (also on the CPU)
        choice = os.environ.get("PHALANX_LORA_KERNELS", "")
        self.kernels = choice in ("1", "bgmv") or (choice != "0" and device.type == "cuda" and ops.triton_available())
        self.grouped = self.kernels and choice != "bgmv"
        self.partials: torch.Tensor | None = None   # the kernels' partial sums (``install`` sizes them)
        self.grouped_partials: torch.Tensor | None = None
        self.kernel_rows = 0                         # the most tokens a step sends through the decode kernels
        self.grouped_rows = 0                        # ... through the grouped kernels (more: the dense form)
        self.lora_add: Callable[..., torch.Tensor] | None = None   # ``triton_lora.lora_add`` (imported at build)
        self.lora_add_grouped: Callable[..., torch.Tensor] | None = None   # ``triton_lora.lora_add_grouped``
        self.step_groups: torch.Tensor | None = None   # the step's ``triton_lora.groups`` (``install`` sizes it)
        self.step_split: tuple[torch.Tensor, torch.Tensor] | None = None   # its tiles and order (views)
        self._tiles_empty = True                       # no tile of ``step_groups`` names a token
        self.token_slots: torch.Tensor
        self.served: tuple[str, ...] = ()                   # the modules that take adapters (``install``)
        self.layers: list[tuple[int, list[nn.Module]]] = []   # (layer, its adapted projections)

    def _grow(self, rows: int) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"LoRA mask: {rows} rows asked while a CUDA graph is captured")
        self.masks = {p: torch.zeros(rows, p * self.slots * self.rank, device=self.device, dtype=self.dtype)
                      for p in (1, 2, 3)}
        self.token_slots = torch.full((rows,), -1, device=self.device, dtype=torch.int32)

    def groups(self, token_slots: np.ndarray) -> np.ndarray | None:
        """The grouped kernels' step metadata for a step's tokens (``triton_lora.groups``), where
        they may run the step (None: they do not serve, or the step has too many tokens)."""
        if not 0 < len(token_slots) <= self.grouped_rows:
            return None
        from phalanx.kernels import triton_lora
        return triton_lora.groups(token_slots, self.slots)

    def set_tokens(self, token_slots: torch.Tensor, groups: torch.Tensor | None = None, clear: bool = False) -> None:
        """token_slots [T] (int, on the device): each token's adapter slot, -1 for none; ``groups``:
        their ``groups`` (on the device), where the grouped kernels may run the step; ``clear``:
        no token has an adapter. The grouped kernels' tiles are empty whenever the step set
        last is clear (a clear step after it is not set at all: ``ModelRunner._lora_slots``),
        and name tokens of the step set last alone."""
        if groups is not None:
            assert self.step_groups is not None
            self.step_groups[:groups.shape[0]] = groups
            self._tiles_empty = clear
        elif clear and not self._tiles_empty:
            self._empty_tiles()
        T = token_slots.shape[0]
        if self.masks[1].shape[0] < T:
            self._grow(T)
            self._rows_set = 0
        m = (token_slots[:, None] == self.slot_of_col[None, :]).to(self.dtype)
        for p, buf in self.masks.items():
            buf[:T] = m if p == 1 else m.repeat(1, p)
            if self._rows_set > T:   # rows of a larger step before (a graph's padding reads them)
                buf[T:self._rows_set].zero_()
        self.token_slots[:T] = token_slots
        if self._rows_set > T:
            self.token_slots[T:self._rows_set] = -1
        self._rows_set = T

    def _empty_tiles(self) -> None:
        if self.step_split is not None:
            self.step_split[0][0::3] = -1
        self._tiles_empty = True

    def reset_tokens(self) -> None:
        """No token has an adapter and no tile names one (before CUDA graphs are captured: their
        warm-up steps run whatever the buffers hold, over as many rows as the graph's)."""
        for buf in self.masks.values():
            buf.zero_()
        self.token_slots.fill_(-1)
        self._rows_set = 0
        self._empty_tiles()

    def slot_weights(self) -> list[LoraWeights]:
        """Every adapted projection's slots (``install``'s model)."""
        return [p.lora for _, projections in self.layers for p in projections]   # type: ignore[misc]

    def mask(self, parts: int, rows: int) -> torch.Tensor:
        if rows > self.masks[parts].shape[0]:
            self._grow(rows)
        return self.masks[parts][:rows]


class LoraWeights(nn.Module):
    """A projection's adapter slots (module docstring). ``parts``: (module, the shard id the
    weight's loader places it by) of each part; ``row_parallel``: A takes this rank's input
    columns (B whole), else B takes this rank's rows of its part (A whole); ``silu_in_front``:
    the projection's input is gate ‖ up and the adapter's is silu(gate) · up."""

    A: torch.Tensor
    B: torch.Tensor

    def __init__(self, proj: nn.Module, parts: list[tuple[str, object]], state: LoraState, row_parallel: bool,
                 silu_in_front: bool = False) -> None:
        super().__init__()
        self.parts, self.row_parallel, self.silu_in_front = parts, row_parallel, silu_in_front
        self.slots, self.rank = state.slots, state.rank
        self.state = [state]      # shared: a list keeps it out of this module's state
        self.proj = [proj]
        weight: torch.Tensor = proj.weight   # type: ignore[assignment]
        N, K = weight.shape[0], weight.shape[1]
        width = len(parts) * self.slots * self.rank
        self.register_buffer("A", torch.zeros(width, K, device=weight.device, dtype=state.dtype), persistent=False)
        self.register_buffer("B", torch.zeros(N, width, device=weight.device, dtype=state.dtype), persistent=False)
        ends = list(itertools.accumulate(sec[1] for sec in proj._out_sections()))  # type: ignore[operator]
        assert len(ends) == len(parts) and ends[-1] == N, (ends, N)
        self.bounds = (*ends, N, N)[:2]   # where parts 1 and 2 of the output start (N: no such part)
        self.plan: Any = None             # ``triton_lora.plan`` (``install``, where the kernels serve)

    @property
    def modules_served(self) -> tuple[str, ...]:
        return tuple(p[0] for p in self.parts)

    def _cols(self, part: int, slot: int) -> slice:
        c = (part * self.slots + slot) * self.rank
        return slice(c, c + self.rank)

    @torch.no_grad()
    def write(self, slot: int, adapter: Adapter, layer: int) -> None:
        """Slot ``slot`` takes ``adapter``'s weights of this projection in ``layer`` (zeros for a
        part it does not adapt)."""
        proj = self.proj[0]
        for p, (module, shard_id) in enumerate(self.parts):
            cols = self._cols(p, slot)
            self.A[cols] = 0
            self.B[:, cols] = 0
            pair = adapter.weights.get((layer, module))
            if pair is None:
                continue
            # whole tensors to the device (from pinned host memory: no wait), then this rank's part there
            a, b = (t.to(self.A.device, self.A.dtype, non_blocking=True) for t in pair)
            r = a.shape[0]
            c = slice(cols.start, cols.start + r)
            if self.row_parallel:
                a = proj._place(a, None)[1]     # type: ignore[operator]  # this rank's input columns
                self.B[:, c] = b
            else:
                rows, b = proj._place(b, shard_id)   # type: ignore[operator]  # this rank's rows of the part
                self.B[rows, c] = b
            self.A[c] = a

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The projection's output y [T, N] of x [T, K] plus each token's adapter."""
        state = self.state[0]
        T = x.shape[0]
        if 0 < T <= state.kernel_rows:
            return state.lora_add(y, x, self.A, self.B, state.token_slots, state.partials, self.plan)  # type: ignore[misc]
        if 0 < T <= state.grouped_rows:
            return state.lora_add_grouped(y, x, self.A, self.B, state.step_split,  # type: ignore[misc]
                                          state.grouped_partials, self.plan)
        return self.dense(y, x)

    def dense(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The dense form (module docstring): three kernels (x Aᵀ, the mask, and y + s Bᵀ in one
        GEMM), whatever the tokens; a new tensor."""
        s = torch.matmul(x, self.A.t())
        s.mul_(self.state[0].mask(len(self.parts), x.shape[0]))
        return torch.addmm(y, s, self.B.t())


def install(model: nn.Module, cfg: LoraConfig, rows: int) -> LoraState:
    """Give the target projections of a Llama-family model (``models/llama.py``) their adapter
    slots, and the model its ``LoraState`` (``model.lora``). A mixture of experts' layers take
    none (an adapter for their gate, up or down projections is refused when read). Where down
    has slots, its plan runs on silu(gate) · up made in front (the adapter needs it too)."""
    import dataclasses

    from phalanx.kernels.linear_plan import Neighbour
    from phalanx.models.llama import MLP, Attention, DecoderLayer
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    ref: torch.Tensor = model.lm_head.weight   # type: ignore[union-attr, assignment]
    state = LoraState(cfg.max_loras, cfg.max_lora_rank, rows, ref.device, ref.dtype)
    targets = cfg.targets
    served: set[str] = set()
    for layer in layers:
        attn = layer.self_attn
        assert isinstance(attn, Attention)   # (the engine refuses LoRA over DeepSeek's latent attention)
        qkv = attn.qkv_proj
        parts: list[tuple[str, object]] = [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]
        if any(p[0] in targets for p in parts):
            qkv.lora = LoraWeights(qkv, parts, state, row_parallel=False)
            served.update(p[0] for p in parts if p[0] in targets)
        if "o_proj" in targets:
            attn.o_proj.lora = LoraWeights(attn.o_proj, [("o_proj", None)], state, row_parallel=True)
            served.add("o_proj")
        mlp = layer.mlp
        if not isinstance(mlp, MLP):
            continue
        gu = mlp.gate_up_proj
        if "gate_proj" in targets or "up_proj" in targets:
            gu.lora = LoraWeights(gu, [("gate_proj", 0), ("up_proj", 1)], state, row_parallel=False)
            served.update(m for m in ("gate_proj", "up_proj") if m in targets)
        if "down_proj" in targets:
            down = mlp.down_proj
            down.plan = dataclasses.replace(down.plan, neighbour=Neighbour.PLAIN, launches=())
            down.lora = LoraWeights(down, [("down_proj", None)], state,
                                    row_parallel=True, silu_in_front=True)
            served.add("down_proj")
    model.lora = state   # type: ignore[assignment]
    state.served = tuple(m for m in LORA_TARGETS if m in served)
    state.layers = [(i, [p for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                     *((layer.mlp.gate_up_proj, layer.mlp.down_proj)
                                       if isinstance(layer.mlp, MLP) else ()))
                         if getattr(p, "lora", None) is not None]) for i, layer in enumerate(layers)]
    if state.kernels:   # each projection's launches decided here, once
        from phalanx.kernels import triton_lora
        state.lora_add = triton_lora.lora_add
        state.kernel_rows = triton_lora.DECODE_ROWS if state.grouped else triton_lora.MAX_ROWS
        for w in state.slot_weights():
            w.plan = triton_lora.plan(int(w.A.shape[1]), len(w.parts), w.slots, w.rank, w.bounds, state.dtype)
        widest = max((int(w.A.shape[1]) for w in state.slot_weights()), default=1)
        if state.grouped:
            state.lora_add_grouped, state.grouped_rows = triton_lora.lora_add_grouped, triton_lora.GROUPED_ROWS
            empty = triton_lora.groups(np.zeros(0, np.int64), state.slots)   # every tile empty
            state.step_groups = torch.from_numpy(np.concatenate([empty, np.zeros(state.grouped_rows, np.int32)])
                                                 ).to(state.device)
            state.step_split = triton_lora.split_groups(state.step_groups, state.slots)
            state.grouped_partials = triton_lora.grouped_partials(widest, state.rank, state.device)
        state.partials = triton_lora.partials(widest, state.rank, state.device)
    return state


def write_slot(state: LoraState, slot: int, adapter: Adapter) -> None:
    """Every adapted projection's slot ``slot`` takes ``adapter`` (``install``'s model)."""
    for i, projections in state.layers:
        for p in projections:
            p.lora.write(slot, adapter, i)   # type: ignore[union-attr, operator]
