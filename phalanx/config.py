"""LlmArgs and its sub-configs: validated once, never mutated. Field names follow TensorRT-LLM.

Values known only at run time (the number of KV blocks, the model's own max length) are
constructor arguments of the objects that use them, not written back here.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class KvCacheConfig(StrictModel):
    free_gpu_memory_fraction: float = Field(
        0.9, gt=0.0, le=1.0,
        description="Fraction of the GPU memory left free after weights and a profiling run that the KV pool takes.")
    enable_block_reuse: bool = Field(True, description="Prefix caching through the radix tree.")
    enable_partial_reuse: bool = Field(True, description="Reuse part of a block by copy-on-write.")
    copy_on_partial_reuse: bool = Field(True, description="Partial hits are always copied (TensorRT-LLM's name; "
                                                          "false, sharing a partly matched block, is refused).")
    tokens_per_block: int = Field(32, ge=2, le=256, description="Tokens per KV block (a power of two).")
    max_tokens: int | None = Field(None, ge=1, description="Upper bound on the tokens the KV pool holds.")
    max_gpu_total_bytes: int = Field(0, ge=0, description="Upper bound on the KV pool's bytes (0: none). "
                                                          "On the CPU it sets the pool size (default 1 GiB).")
    host_cache_size: int | None = Field(
        None, ge=0, description="Bytes of host memory (each rank's, pinned on a GPU) for a second tier of KV blocks "
        "(TensorRT-LLM's name): full blocks the pool evicts are copied there and stay matchable, and a prefix found "
        "there is copied back instead of computed again. None or 0: no host tier. Needs enable_block_reuse.")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8"] = Field(
        "auto", description="The KV pool's dtype (auto: the model's, or fp8 where the checkpoint's KV cache is "
                            "calibrated for it); fp8: e4m3 with a scale a layer for K and one for V, the checkpoint's "
                            "or 1 (K and V divided by them and rounded when written, saturating at ±448), half the "
                            "bytes of bf16.")

    @field_validator("copy_on_partial_reuse")
    @classmethod
    def _copied(cls, v: bool) -> bool:
        if not v:
            raise ValueError("false is not supported: a partly matched block is always copied")
        return v

    @field_validator("tokens_per_block")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two, got {v}")
        return v

    @model_validator(mode="after")
    def _host_tier_needs_reuse(self) -> KvCacheConfig:
        if self.host_cache_size and not self.enable_block_reuse:
            raise ValueError("host_cache_size: the host tier keeps blocks for prefix reuse, which "
                             "enable_block_reuse: false turns off")
        return self


class SchedulerConfig(StrictModel):
    capacity_scheduler_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] = "GUARANTEED_NO_EVICT"
    max_prefill_tokens_while_decoding: int | None = Field(
        None, ge=1, description="Prompt positions (chunks of prompts, new prompts) one step may compute while requests "
        "are decoding in it, with chunked prefill on: a prompt arriving mid-stream stretches the decoders' step by at "
        "most this much work (inter-token latency), the rest of it follows in later steps. None: max_num_tokens.")


class CudaGraphConfig(StrictModel):
    batch_sizes: list[int] | None = Field(None, description="Decode batch sizes to capture.")
    max_batch_size: int = Field(128, ge=0, le=4096, description="Largest captured batch size.")
    enable_padding: bool = Field(True, description="Pad a batch up to the next captured size.")
    extend_num_tokens: list[int] = Field(
        [16, 32, 64, 128, 256, 512], description="Token counts of the graphs captured for steps that are not "
        "decode-only (prompts, chunks, new tokens after a cached prefix, mixed with decodes): such a step with at "
        "most extend_max_seqs sequences replays the smallest that holds its tokens. [] captures none.")
    extend_max_seqs: int = Field(8, ge=1, le=256, description="Sequences an extend graph holds.")
    piecewise_num_tokens: list[int] = Field(
        [*range(64, 1025, 64), *range(1152, 2049, 128)],
        description="Token counts of the piecewise graphs: a step that no decode or extend graph holds (a "
        "prompt's chunk among many decoding requests, or more tokens) with at most the largest of these tokens "
        "replays everything but attention from graphs, attention running eagerly between them. [] captures none.")

    @field_validator("extend_num_tokens", "piecewise_num_tokens")
    @classmethod
    def _positive_tokens(cls, v: list[int]) -> list[int]:
        if any(t < 2 for t in v):
            raise ValueError("every token count must be >= 2")
        return sorted(set(v))

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(b < 1 for b in v):
            raise ValueError("every batch size must be >= 1")
        return sorted(set(v)) if v is not None else None

    def capture_sizes(self, limit: int) -> list[int]:
        """The batch sizes to capture, capped at ``limit`` (the engine's max_batch_size)."""
        if self.batch_sizes is not None:
            return [b for b in self.batch_sizes if b <= limit]
        top = min(self.max_batch_size, limit)
        sizes = [1, 2, 4] + list(range(8, top + 1, 8))
        return sorted({b for b in sizes if b <= top})


class AttentionDpConfig(StrictModel):
    enable_balance: bool = False
    batching_wait_iters: int = Field(10, ge=0)
    timeout_iters: int = Field(50, ge=0)
    load_balance_weight: float = Field(1.0, ge=0.0, description="β in score = uncached tokens + β·normalised load.")
    routing: Literal["cache_aware", "load"] = "cache_aware"
    balance_threshold: int = Field(4, ge=1, description="Load gap (requests) at which the router balances "
                                                       "instead of following the cache.")


MAX_SPEC_LEN = 16    # the most drafts a step verifies, and the longest n-gram matched


class SpeculativeConfig(StrictModel):
    """Speculative decoding (TensorRT-LLM's shape): a proposer guesses up to ``max_draft_len``
    tokens per step for every decoding request and the target verifies them in one forward.

    NGram        drafts from the request's own history (prompt lookup): the tokens that followed
                 the latest earlier occurrence of its last ``max_matching_ngram_size`` ..
                 ``min_matching_ngram_size`` tokens; no extra weights.
    DraftTarget  drafts from a smaller model with the target's vocabulary
                 (``speculative_model_dir``), run greedily ``max_draft_len`` steps over its own
                 KV cache, which shares the target's block tables.
    Eagle3       drafts from an EAGLE-3 head (``speculative_model_dir``: a
                 ``LlamaForCausalLMEagle3`` checkpoint), one decoder layer fed the target's
                 hidden states of three of its layers and the next token's embedding
                 (models/eagle3.py); its own KV cache shares the target's block tables.

    vLLM's spelling is taken too (``_vllm_spelling``): ``method`` "ngram", "draft_model" (or a
    ``model`` alone) or "eagle3", ``num_speculative_tokens``, ``prompt_lookup_max``/``prompt_lookup_min``
    (each the other where one is given, both 5 where neither is, as vLLM sets them).
    """

    decoding_type: Literal["NGram", "DraftTarget", "Eagle3"]
    max_draft_len: int = Field(4, ge=1, le=MAX_SPEC_LEN, description="Draft tokens verified per step.")
    max_matching_ngram_size: int = Field(3, ge=1, le=MAX_SPEC_LEN, description="NGram: the longest suffix matched.")
    min_matching_ngram_size: int = Field(1, ge=1, le=MAX_SPEC_LEN, description="NGram: the shortest suffix matched.")
    speculative_model_dir: str | None = Field(
        None, validation_alias=AliasChoices("speculative_model_dir", "speculative_model"),
        description="DraftTarget: the draft model, Eagle3: the EAGLE-3 head (HF directory); also spelled "
                    "speculative_model (API.md).")
    max_concurrency: int | None = Field(
        None, ge=1, description="No drafts while more requests than this decode speculatively (steps then decode "
                                "one token a request, in CUDA graphs). Drafts also stop while too few are accepted "
                                "to pay at the batch size, unless adaptive is false.")
    adaptive: bool = Field(
        True, description="Verify drafts only while enough are accepted to pay at the batch size (SpecPolicy); "
                          "false: every step verifies max_draft_len drafts a request.")

    @model_validator(mode="before")
    @classmethod
    def _vllm_spelling(cls, data: Any) -> Any:
        """vLLM's keys as this config's; one setting named in both spellings is refused."""
        ours = {"method": "decoding_type", "model": "speculative_model_dir", "num_speculative_tokens": "max_draft_len",
                "prompt_lookup_max": "max_matching_ngram_size", "prompt_lookup_min": "min_matching_ngram_size"}
        if not isinstance(data, dict) or not any(k in data for k in ours):
            return data
        d = dict(data)
        for theirs, mine in ours.items():
            if theirs in d and (mine in d or mine == "speculative_model_dir" and "speculative_model" in d):
                raise ValueError(f"speculative_config: {theirs} (vLLM's spelling) and {mine} name one setting; "
                                 "give one")
        if "decoding_type" in d:
            theirs = next(k for k in ours if k in d)
            raise ValueError(f"speculative_config.{theirs} is vLLM's spelling; with decoding_type it is {ours[theirs]}")
        method = d.pop("method", None)
        if d.get("model") in ("ngram", "[ngram]") and method in (None, "ngram"):   # vLLM's older spelling
            d.pop("model")
            method = "ngram"
        if method is None and any(k in d for k in ("model", "speculative_model", "speculative_model_dir")):
            method = "draft_model"
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):   # named as given
            v = d.get(key)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SPEC_LEN):
                raise ValueError(f"speculative_config.{key} must be an integer from 1 to {MAX_SPEC_LEN}, got {v!r}")
        if (d.get("prompt_lookup_min") or 0) > (d.get("prompt_lookup_max") or MAX_SPEC_LEN):
            raise ValueError(f"speculative_config.prompt_lookup_min ({d['prompt_lookup_min']}) is above "
                             f"prompt_lookup_max ({d['prompt_lookup_max']})")
        kinds = {"ngram": "NGram", "draft_model": "DraftTarget", "eagle3": "Eagle3"}
        if method not in kinds:
            raise ValueError(f"speculative_config.method {method!r} is not supported; supported: "
                             f"{', '.join(map(repr, kinds))} (or decoding_type NGram / DraftTarget / Eagle3)")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is needed with method (vLLM's spelling; "
                             "decoding_type's is max_draft_len)")
        d["decoding_type"] = kinds[method]
        if method == "ngram":     # as vLLM sets them: each the other where one is given, both 5 where neither is
            lo = d.pop("prompt_lookup_min", d.get("min_matching_ngram_size"))    # (ours where vLLM's is not
            hi = d.pop("prompt_lookup_max", d.get("max_matching_ngram_size"))    # given: a YAML may add them)
            lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
            d["min_matching_ngram_size"], d["max_matching_ngram_size"] = lo, hi
        for theirs in ("model", "num_speculative_tokens"):
            if theirs in d:
                d[ours[theirs]] = d.pop(theirs)
        return d

    @model_validator(mode="after")
    def _proposer_fields(self) -> SpeculativeConfig:
        if self.min_matching_ngram_size > self.max_matching_ngram_size:
            raise ValueError(f"min_matching_ngram_size ({self.min_matching_ngram_size}) is above "
                             f"max_matching_ngram_size ({self.max_matching_ngram_size})")
        if self.decoding_type in ("DraftTarget", "Eagle3") and not self.speculative_model_dir:
            raise ValueError(f"decoding_type {self.decoding_type} needs speculative_model_dir (the "
                             f"{'draft model' if self.decoding_type == 'DraftTarget' else 'EAGLE-3 head'})")
        if self.decoding_type == "NGram" and self.speculative_model_dir:
            raise ValueError("speculative_model_dir is for decoding_type DraftTarget or Eagle3, not NGram")
        return self


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(StrictModel):
    """LoRA adapters served beside the base weights (TensorRT-LLM's ``lora_config``; vLLM's
    ``enable_lora`` with ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``). Every rank holds
    ``max_loras`` adapter slots of rank ``max_lora_rank`` for each target projection, in the
    activation dtype; a step runs requests of at most ``max_loras`` adapters (others wait), and
    the adapters read from disk stay in host memory while requests use them, up to
    ``max_cpu_loras`` more."""

    max_loras: int = Field(4, ge=1, le=64, description="Adapters a step may run (GPU slots).")
    max_lora_rank: int = Field(16, ge=1, le=512, description="The largest adapter rank served.")
    max_cpu_loras: int | None = Field(
        None, ge=1, le=1024, description="Adapters kept in host memory when no request uses them (default: max_loras).")
    lora_target_modules: list[Literal[LORA_TARGETS]] | None = Field(  # type: ignore[valid-type]
        None, description=f"The projections that hold adapter slots (default all: {', '.join(LORA_TARGETS)}); "
                          "an adapter for another is refused.")

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.lora_target_modules) if self.lora_target_modules else LORA_TARGETS


class LlmArgs(StrictModel):
    """Everything ``LLM(...)`` accepts."""

    model: str | None = Field(
        None, description="HF directory, .gguf file or HF id; None: the bundled SmolLM2-135M-Instruct.")
    tokenizer: str | None = None
    skip_tokenizer_init: bool = Field(
        False, description="No tokenizer: prompts must be token ids and outputs carry no text.")
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    pipeline_parallel_size: int = Field(1, ge=1, le=1)
    enable_attention_dp: bool = False
    attention_dp_config: AttentionDpConfig | None = None
    moe_expert_parallel_size: int | None = Field(None, ge=1, le=64)
    max_batch_size: int = Field(2048, ge=1, le=65536)
    max_num_tokens: int = Field(8192, ge=1, le=1 << 20)
    max_seq_len: int | None = Field(None, ge=2, le=1 << 21)
    enable_chunked_prefill: bool = True
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    scheduler_config: SchedulerConfig = Field(default_factory=SchedulerConfig)
    disable_overlap_scheduler: bool = False
    cuda_graph_config: CudaGraphConfig | None = Field(default_factory=CudaGraphConfig)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["fp8", "modelopt", "compressed-tensors"] | None = Field(
        None, description="fp8: the decoder layers' projections quantized to FP8 e4m3 at load, one scale per "
                          "output channel (W8A16 for decode batches, W8A8 with per-token scales for more rows), and "
                          "MoE experts per (expert, output row); embeddings, the output layer, norms and the "
                          "router stay in dtype. modelopt, compressed-tensors: the checkpoint's own method, served "
                          "as its quantization_config says (as vLLM takes them; refused where it says otherwise).")
    load_format: Literal["auto", "dummy"] = "auto"
    trust_remote_code: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    allreduce_strategy: Literal["AUTO", "NCCL"] = Field(
        "AUTO", description="Tensor-parallel all-reduce: AUTO takes the custom one-host all-reduce over CUDA IPC "
                            "(one-shot, two-shot, fused with the next RMSNorm) where it fits and NCCL above its "
                            "limit or across hosts; NCCL always uses NCCL.")
    engine_iteration_timeout: float = Field(
        120.0, ge=0.0,
        description="Seconds without a heartbeat from the ranks' loop (one comes at least every iteration) "
                    "after which the engine is declared stalled: pending requests fail naming the stuck rank, "
                    "health turns 503 and the job is stopped. 0 disables the watchdog.")
    backend: Literal["pytorch"] = "pytorch"
    orchestrator_type: Literal["mpi", "inprocess"] | None = Field(
        None, description="None/'mpi': ranks in an MPI job behind a proxy (the default); "
                          "'inprocess': one rank in a thread of this process (no MPI).")
    enable_sleep_mode: bool = Field(
        False, description="Reserve at start-up the pinned host memory that sleep(level=1) copies the weights "
                           "into (pinning ~15 GB takes seconds, which the first sleep would pay otherwise). "
                           "sleep works without it.")
    speculative_config: SpeculativeConfig | None = Field(
        None, description="Speculative decoding: {decoding_type: NGram | DraftTarget, max_draft_len, ...}.")
    lora_config: LoraConfig | None = Field(
        None, description="LoRA adapters, chosen per request (lora_request): {max_loras, max_lora_rank, ...}.")
    enable_lora: bool = Field(False, description="vLLM's switch: lora_config with its defaults where none is given.")
    kv_offloading_size: float | None = Field(
        None, gt=0.0, description="vLLM's: GiB of host memory for KV blocks the pool evicts, summed over the ranks "
                                  "(kv_cache_config.host_cache_size is one rank's bytes).")
    kv_offloading_backend: Literal["native"] | None = Field(
        None, description="vLLM's: native (phalanx's own host tier); needs kv_offloading_size.")
    mpi_private_network: bool = Field(
        True, description="Start the MPI job in a network namespace of its own (loopback only: nothing it opens "
                          "is reachable from outside). False: the host's network, which ranks need to join a "
                          "trainer's weight-update group (init_weights_update_group) over TCP.")

    @model_validator(mode="after")
    def _cross_checks(self) -> LlmArgs:
        if self.moe_expert_parallel_size is not None and self.tensor_parallel_size % self.moe_expert_parallel_size:
            raise ValueError(f"moe_expert_parallel_size ({self.moe_expert_parallel_size}) must divide "
                             f"tensor_parallel_size ({self.tensor_parallel_size})")
        if self.enable_attention_dp and self.tensor_parallel_size < 2:
            raise ValueError("enable_attention_dp needs tensor_parallel_size >= 2 (one rank per attention replica)")
        if self.speculative_config is not None and self.enable_attention_dp:
            raise ValueError("speculative_config: not supported with enable_attention_dp")
        if self.lora is not None and self.enable_attention_dp:
            raise ValueError("lora_config: not supported with enable_attention_dp")
        if self.kv_offloading_backend is not None and self.kv_offloading_size is None:
            raise ValueError("kv_offloading_backend: needs kv_offloading_size (GiB of host memory)")
        if self.kv_offloading_size is not None:
            if self.kv_cache_config.host_cache_size:
                raise ValueError("kv_offloading_size: kv_cache_config.host_cache_size sets the host tier too; give one")
            if not self.kv_cache_config.enable_block_reuse:
                raise ValueError("kv_offloading_size: the host tier keeps blocks for prefix reuse, which "
                                 "kv_cache_config.enable_block_reuse: false turns off")
        return self

    @property
    def host_cache_bytes(self) -> int:
        """Each rank's host tier in bytes: ``kv_cache_config.host_cache_size``, or vLLM's
        ``kv_offloading_size`` (GiB over all ranks) shared out."""
        if self.kv_offloading_size is not None:
            return offloading_bytes(self.kv_offloading_size, self.world_size)
        return self.kv_cache_config.host_cache_size or 0

    @property
    def lora(self) -> LoraConfig | None:
        """The LoRA settings in effect: ``lora_config``, or its defaults under ``enable_lora``."""
        return self.lora_config or (LoraConfig() if self.enable_lora else None)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def offloading_bytes(gib: float, ranks: int) -> int:
    """vLLM's kv_offloading_size (GiB summed over the ranks) as one rank's bytes."""
    return int(gib * 2**30) // max(1, ranks)


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(arguments)"


def make_llm_args(**kwargs: Any) -> LlmArgs:
    """Build LlmArgs; pydantic errors become one ValueError naming each field and its limit."""
    # None means "the default" except where None is itself a choice (no CUDA graphs)
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in ("model", "cuda_graph_config")}
    aliases = {"tp_size": "tensor_parallel_size", "ep_size": "moe_expert_parallel_size",
               "max_model_len": "max_seq_len", "max_num_seqs": "max_batch_size"}
    for alias, name in aliases.items():
        if alias in kwargs:
            kwargs[name] = kwargs.pop(alias)
    try:
        return LlmArgs(**kwargs)
    except ValidationError as e:
        raise ValueError(format_validation_error(e)) from None


def format_validation_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        parts.append(f"{_field_path(err['loc'])}: {msg}{shown}")
    return "; ".join(parts)


def merge_yaml(base: dict[str, Any], path: str) -> dict[str, Any]:
    """Overlay a YAML file of LlmArgs fields on ``base``; the YAML wins, nested dicts merge (but
    ``speculative_config``, one proposer in one spelling: the YAML's replaces a flag's whole)."""
    with open(path) as f:
        extra = yaml.safe_load(f) or {}
    if not isinstance(extra, dict):
        raise ValueError(f"{path}: expected a mapping of LLM arguments at the top level")
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "speculative_config":
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out
