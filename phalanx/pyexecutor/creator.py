"""Building the rank-side engine from LlmArgs: device, model, KV pool, manager, scheduler, runner."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from phalanx.config import LlmArgs
from phalanx.kernels import fp8, ops
from phalanx.kernels.metadata import AttentionMetadata
from phalanx.kv_manager import KVCacheManager
from phalanx.llmapi.grammar import GrammarCompiler
from phalanx.llmapi.sampling_params import MAX_LOGPROBS
from phalanx.models.config import ModelConfig
from phalanx.models.eagle3 import Eagle3Head
from phalanx.models.llama import CausalLM
from phalanx.models.loader import build_model, cpu_plans, default_dtype, resolve_dtype
from phalanx.models.parallel import TPGroup, shard_heads
from phalanx.models.source import ModelSource
from phalanx.pyexecutor.guided_decoder import GuidedDecoder
from phalanx.pyexecutor.kv_pool import (
    CPU_DEFAULT_KV_BYTES,
    KVPool,
    bytes_per_block,
    num_blocks_for_budget,
    staging_bytes,
)
from phalanx.pyexecutor.model_runner import PROMPT_LOGPROB_ROWS, ModelRunner
from phalanx.pyexecutor.py_executor import BroadcastRequestQueue, PyExecutor, RequestQueue, Sender
from phalanx.pyexecutor.sampler import Sampler, costliest_rows
from phalanx.pyexecutor.scheduler import Scheduler, SchedulerLimits, SpecPolicy

logger = logging.getLogger("phalanx")


@dataclass
class EngineInfo:
    """Facts the user side needs about a started engine."""

    max_seq_len: int
    vocab_size: int
    num_kv_blocks: int
    tokens_per_block: int
    startup_seconds: float
    startup: dict = field(default_factory=dict)   # phases (weights, profiling, graphs) and kernel tuning


def resolve_device(args: LlmArgs, local_rank: int = 0) -> torch.device:
    """CPU, or the GPU of this rank on its host (local rank modulo the visible GPUs)."""
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but CUDA is not available")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def resolve_max_seq_len(args: LlmArgs, source: ModelSource) -> int:
    limit = source.config.max_position_embeddings
    if args.max_seq_len is None:
        return limit
    if args.max_seq_len > limit:
        raise ValueError(f"max_seq_len {args.max_seq_len} exceeds the model's max_position_embeddings {limit}")
    return args.max_seq_len


def create_py_executor(args: LlmArgs, source: ModelSource, sender: Sender | None,
                       queue: RequestQueue | BroadcastRequestQueue | None = None, tp: TPGroup | None = None,
                       dist=None, device: torch.device | None = None, ep=None) -> tuple[PyExecutor, EngineInfo]:
    """Build every rank-side piece. ``tp``/``dist`` are set under MPI (one rank otherwise)."""
    t0 = time.monotonic()
    tp = tp or TPGroup()
    device = device or resolve_device(args)
    dtype = resolve_dtype(args.dtype, source, device)
    cfg = source.config
    if cfg.is_gemma3 and dtype == torch.float16:
        logger.warning("Gemma 3 in float16: its activations can pass float16's range (its checkpoints are "
                       "bfloat16: dtype bfloat16 or auto)")
    max_seq_len = resolve_max_seq_len(args, source)
    adp = args.enable_attention_dp and dist is not None and dist.size > 1
    kv_fp8 = args.kv_cache_config.dtype == "fp8" or (args.kv_cache_config.dtype == "auto" and cfg.fp8_kv_cache
                                                       and fp8.supported(device))
    if kv_fp8 and cfg.is_mla:   # the pool holds DeepSeek's latents, which no FP8 path writes or reads yet
        if args.kv_cache_config.dtype == "fp8":
            raise ValueError("kv_cache_config.dtype: fp8 is not supported with DeepSeek's latent attention "
                             "(its pool holds one latent a token); use auto")
        logger.warning("the checkpoint's KV cache is calibrated for FP8, but DeepSeek's latent attention keeps its "
                       "pool in %s", dtype)
        kv_fp8 = False
    if kv_fp8:
        fp8.check_device(device, "kv_cache_config.dtype")
    if args.kv_cache_config.dtype == "auto" and cfg.fp8_kv_cache and not cfg.is_mla:
        logger.log(logging.INFO if kv_fp8 else logging.WARNING, "the checkpoint's KV cache is calibrated for FP8: "
                   "kv_cache_config.dtype auto stores it in %s", "FP8" if kv_fp8 else f"{dtype} (this GPU has no FP8)")
    if args.quantization in ("modelopt", "compressed-tensors") and cfg.quant_method != args.quantization:
        raise ValueError(f"quantization {args.quantization!r} names the checkpoint's own method, but its "
                         f"quantization_config.quant_method is {cfg.quant_method!r}")
    serves_fp8 = _serves_fp8(args, cfg, device)
    if serves_fp8:
        fp8.check_device(device, "quantization")
    elif cfg.fp8_checkpoint:
        logger.warning("an FP8 checkpoint on a GPU without FP8: served dequantized, in %s", dtype)
    model = build_model(source, dtype, device, tp, args.load_format, args.seed, fp8=serves_fp8,
                        **({"ep": ep} if cfg.is_moe and ep is not None else {}))
    if serves_fp8 and device.type == "cuda":
        torch.cuda.empty_cache()     # the loads' quantization temporaries go back before the KV pool is sized
    lora_state, lora_cfg = None, args.lora
    if lora_cfg is not None:    # adapter slots before the tuner and the profile (both see their paths)
        from phalanx.models import lora
        if cfg.is_gemma3 or cfg.is_mla:
            raise ValueError(f"lora_config: LoRA adapters on {'Gemma 3' if cfg.is_gemma3 else 'DeepSeek'} are not "
                             "supported")
        lora_state = lora.install(model, lora_cfg, max(args.max_num_tokens, args.max_batch_size))
        if not lora_state.served:
            raise ValueError(f"lora_config.lora_target_modules: {', '.join(lora_cfg.targets)} — no layer of this "
                             "model has them (a mixture of experts' gate, up and down take no adapter)")
    t_weights = time.monotonic() - t0
    kvc = args.kv_cache_config
    kv_dtype = (torch.float8_e4m3fn if kv_fp8 else dtype if kvc.dtype == "auto"
                else resolve_dtype(kvc.dtype, source, device))
    scaled = model.use_kv_scales(kv_fp8)
    if scaled:
        logger.info("FP8 KV pool: %d layers store K and V with the checkpoint's scales", scaled)
    if kv_fp8 and cfg.fp8_kv_cache and scaled < cfg.num_layers:
        logger.warning("the checkpoint's KV cache is calibrated for FP8 but brings scales for %d of its %d layers; "
                       "the others store K and V with scale 1", scaled, cfg.num_layers)
    heads = shard_heads(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.size)
    pool_shape = (cfg.num_layers, kvc.tokens_per_block, heads.num_kv_heads, cfg.head_dim, kv_dtype, device)
    block_bytes = bytes_per_block(cfg.num_layers, heads.num_kv_heads, cfg.head_dim, kvc.tokens_per_block, kv_dtype,
                                  cfg.kv_planes)
    pool_bytes = [block_bytes]   # a block of each pool (the target's, a draft model's)
    draft, profiled_draft = None, None
    if args.speculative_config is not None and args.speculative_config.decoding_type == "DraftTarget":
        draft = _build_draft(args, source, dtype, device, tp, max_seq_len)
        draft.use_kv_scales(kv_fp8)
        dcfg = draft.config
        dheads = shard_heads(dcfg.num_heads, dcfg.num_kv_heads, tp.rank, tp.size)
        profiled_draft = (draft, (dcfg.num_layers, kvc.tokens_per_block, dheads.num_kv_heads, dcfg.head_dim,
                                  kv_dtype, device))
        pool_bytes.append(bytes_per_block(dcfg.num_layers, dheads.num_kv_heads, dcfg.head_dim, kvc.tokens_per_block,
                                          kv_dtype))   # the draft's pool has the same blocks
        block_bytes = sum(pool_bytes)
    eagle = None
    if args.speculative_config is not None and args.speculative_config.decoding_type == "Eagle3":
        eagle = _build_eagle3(args, source, model, dtype, device, max_seq_len)
        head_cfg = eagle.config
        pool_bytes.append(bytes_per_block(1, head_cfg.num_kv_heads, head_cfg.head_dim, kvc.tokens_per_block,
                                          kv_dtype))   # the head's one-layer pool has the same blocks
        block_bytes = sum(pool_bytes)
    host_bytes = args.host_cache_bytes
    num_host_blocks = host_bytes // block_bytes   # (the draft's blocks beside the target's)
    extra: dict = {}
    if device.type == "cuda":
        extra["gemv_gb_per_s"] = _tune_kernels(model)
        if draft is not None:
            _tune_kernels(draft)
        if eagle is not None:
            _tune_kernels(eagle)
        staged = sum(staging_bytes(b, num_host_blocks) for b in pool_bytes)   # the host tier's staging buffers
        profiled_head = None if eagle is None else (eagle, (1, kvc.tokens_per_block, eagle.config.num_kv_heads,
                                                            eagle.config.head_dim, kv_dtype, device))
        num_blocks = _profile_num_blocks(args, model, pool_shape, block_bytes, max_seq_len, extra, profiled_draft,
                                         staged, profiled_head)
    else:
        num_blocks = _num_kv_blocks(args, device, block_bytes)
    if dist is not None and dist.size > 1:   # identical schedulers need identical pools and host tiers (ranks
        # with fewer KV heads fit more blocks in the same bytes): the smallest of each wins
        mine = b"%d,%d" % (num_blocks, num_host_blocks)
        counts = [tuple(map(int, b.split(b","))) for b in dist.allgather_bytes(mine)]
        num_blocks, num_host_blocks = min(c[0] for c in counts), min(c[1] for c in counts)
    if host_bytes and not num_host_blocks:   # (after the ranks agree: all of them refuse it)
        what = "kv_offloading_size" if args.kv_offloading_size is not None else "kv_cache_config.host_cache_size"
        raise ValueError(f"{what}: {host_bytes} bytes a rank hold no KV block ({block_bytes} bytes on a rank)")
    t_profile = time.monotonic() - t0 - t_weights
    # one extra block no request owns: CUDA-graph padding rows write there
    L, B, Hkv, D, kdt, dev = pool_shape
    pool = KVPool(L, num_blocks + 1, B, Hkv, D, kdt, dev, num_host_blocks, cfg.kv_planes)
    kv = KVCacheManager(num_blocks, kvc.tokens_per_block, kvc.enable_block_reuse, kvc.enable_partial_reuse,
                        num_host_blocks)
    limits = SchedulerLimits(args.max_batch_size, args.max_num_tokens, max_seq_len,
                             args.scheduler_config.capacity_scheduler_policy, args.enable_chunked_prefill,
                             args.scheduler_config.max_prefill_tokens_while_decoding,
                             args.lora.max_loras if args.lora is not None else 0)
    sc = args.speculative_config
    scheduler = Scheduler(limits, kv, SpecPolicy(sc.max_draft_len, sc.max_concurrency, sc.adaptive)
                          if sc is not None else None)
    runner = ModelRunner(model, pool, Sampler(cfg.vocab_size, device, args.seed), device, tp,
                         max_slots=min(args.max_batch_size, 4096))
    if lora_state is not None and lora_cfg is not None:
        from phalanx.pyexecutor.lora import LoraManager
        runner.lora = LoraManager(lora_state, lora_cfg, cfg)
    if args.speculative_config is not None:
        runner.spec = _build_spec(args, cfg, draft, num_blocks + 1, max_seq_len, kv_dtype, tp, device,
                                  num_host_blocks, eagle, model)
    # the most positions a request holds: speculative rows hold up to 2k past the length limit (Request.kv_limit)
    span = max_seq_len + 2 * (runner.spec.k if runner.spec is not None else 0)
    runner.guided = GuidedDecoder(functools.partial(_grammar_compiler, args, source),
                                  max_rows=min(args.max_batch_size, 4096), pin_memory=device.type == "cuda")
    ref_attention = device.type == "cuda" and not ops.triton_attention_everywhere(model, kvc.tokens_per_block)
    if ref_attention:
        logger.warning("attention takes the torch reference here (an uneven head split over %d ranks, "
                       "tokens_per_block %d under 16, or %d query heads of %d a KV head past the kernels' "
                       "16 x 1,024)%s", tp.size, kvc.tokens_per_block, heads.num_heads // heads.num_kv_heads,
                       cfg.head_dim, ": CUDA graphs off" if args.cuda_graph_config is not None else "")
    if device.type == "cuda":
        from phalanx.kernels import triton_attention
        from phalanx.pyexecutor.speculative import DraftModelProposer, Eagle3Proposer
        pools = [(pool, heads.num_heads, not ref_attention, cfg)]
        drafter = runner.spec.proposer if runner.spec is not None else None
        if isinstance(drafter, DraftModelProposer):
            # the draft's pool has head counts (and a head size) of its own: other kernel forms
            dcfg = drafter.model.config
            pools.append((drafter.pool, shard_heads(dcfg.num_heads, dcfg.num_kv_heads, tp.rank, tp.size).num_heads,
                          ops.triton_attention_everywhere(drafter.model, B), dcfg))
        if isinstance(drafter, Eagle3Proposer):   # the head is not sharded
            head = drafter.head
            pools.append((drafter.pool, head.config.num_heads, ops.triton_attention_everywhere(head, B), head.config))
        for p, num_heads, triton, pcfg in pools:
            if triton and pcfg.is_mla:   # the latent kernels (triton_mla), not the general ones
                from phalanx.kernels import triton_mla
                triton_mla.compile_latent_forms(p.tensor[0, 0], num_heads, pcfg.kv_lora_rank, dtype)
            elif triton:
                triton_attention.compile_decode_splits(p.tensor[0, 0], p.tensor[0, -1], num_heads, dtype)
                triton_attention.compile_extend_forms(p.tensor[0, 0], p.tensor[0, -1], num_heads, dtype)
            # the partial-reuse copy too, the block no one owns onto itself
            ops.copy_blocks(p.tensor, [p.num_blocks - 1], [p.num_blocks - 1], [0])
    if device.type == "cuda" and args.cuda_graph_config is not None and not ref_attention:
        sizes = args.cuda_graph_config.capture_sizes(args.max_batch_size)
        if sizes:
            from phalanx.pyexecutor.cuda_graph import CudaGraphRunner
            gcfg = args.cuda_graph_config
            extend = [] if adp or cfg.is_moe else [t for t in gcfg.extend_num_tokens if t <= args.max_num_tokens]
            dropped = sorted(set(gcfg.extend_num_tokens) - set(extend))
            if dropped and "extend_num_tokens" in gcfg.model_fields_set:
                logger.warning("cuda_graph_config.extend_num_tokens: no extend graphs for %s (%s): those steps run "
                               "eagerly", dropped, "attention DP" if adp else "a mixture-of-experts model"
                               if cfg.is_moe else f"above max_num_tokens {args.max_num_tokens}")
            piecewise = [] if adp or cfg.is_moe else _piecewise_sizes(gcfg.piecewise_num_tokens, args.max_num_tokens)
            runner.graphs = CudaGraphRunner(model, pool.tensor, sizes, -(-span // B), B, span,
                                            num_blocks, gcfg.enable_padding, device, extend_sizes=extend,
                                            extend_max_seqs=gcfg.extend_max_seqs,
                                            logits_per_seq=1 + (runner.spec.k if runner.spec is not None else 0),
                                            piecewise_sizes=piecewise)
            runner.graphs.capture()
            extra["graph_capture_s"] = runner.graphs.capture_seconds
            runner.pad_logits_to(runner.graphs.sizes)   # row counts whose output layer the capture ran
    if adp:   # each rank owns its requests; sync loop (see attention_dp/executor.py)
        from phalanx.attention_dp.executor import AdpExecutor
        executor: PyExecutor = AdpExecutor(scheduler, runner, queue or RequestQueue(), sender, cfg.vocab_size,
                                           max_seq_len, dist, disable_overlap=True,
                                           adp_config=args.attention_dp_config, capacity=args.max_batch_size)
    else:
        executor = PyExecutor(scheduler, runner, queue or RequestQueue(), sender, cfg.vocab_size, max_seq_len, dist,
                              disable_overlap=args.disable_overlap_scheduler)
    if args.enable_sleep_mode:
        t = time.monotonic()
        executor.rollout.reserve_host_buffer()
        extra["sleep_host_buffer_s"] = time.monotonic() - t
    info = EngineInfo(max_seq_len, cfg.vocab_size, num_blocks, kvc.tokens_per_block, time.monotonic() - t0,
                      {"weights_s": t_weights, "profile_s": t_profile, **extra})
    logger.info("engine ready on %s (%s) in %.1fs: %d KV blocks (%d tokens)", device, dtype, info.startup_seconds,
                num_blocks, num_blocks * kvc.tokens_per_block)
    if num_blocks * kvc.tokens_per_block < span:
        logger.warning("the KV pool holds %d tokens, fewer than the %d a request of max_seq_len (%d) may hold: "
                       "a request whose prompt and max_tokens need more is refused, and so is every request "
                       "without max_tokens; raise kv_cache_config.free_gpu_memory_fraction, "
                       "kv_cache_config.max_tokens or kv_cache_config.max_gpu_total_bytes, or lower max_seq_len",
                       num_blocks * kvc.tokens_per_block, span, max_seq_len)
    return executor, info


def _build_draft(args: LlmArgs, source: ModelSource, dtype: torch.dtype, device: torch.device,
                 tp: TPGroup, max_seq_len: int) -> CausalLM:
    """The DraftTarget proposer's model (``source.draft``, as the user's process resolved it):
    the target's vocabulary, sharded like the target, and positions up to ``max_seq_len``
    (checked before any forward of it, the memory profile's included)."""
    # resolved here only where the user's process did not (an engine built without its LLM)
    dsource = source.with_draft(args.speculative_config, args.trust_remote_code).draft
    assert dsource is not None
    if dsource.config.vocab_size != source.config.vocab_size:
        raise ValueError(f"speculative_config.speculative_model_dir: the draft's vocabulary "
                         f"({dsource.config.vocab_size}) differs from the target's ({source.config.vocab_size})")
    if dsource.config.is_moe:
        raise ValueError("speculative_config.speculative_model_dir: a mixture-of-experts draft is not supported")
    if dsource.config.max_position_embeddings < max_seq_len:
        raise ValueError(f"speculative_config.speculative_model_dir: the draft's max_position_embeddings "
                         f"({dsource.config.max_position_embeddings}) is below max_seq_len ({max_seq_len}); "
                         f"lower max_seq_len")
    return build_model(dsource, dtype, device, tp, args.load_format, args.seed,
                       fp8=_serves_fp8(args, dsource.config, device))


def _build_eagle3(args: LlmArgs, source: ModelSource, model: CausalLM, dtype: torch.dtype,
                  device: torch.device, max_seq_len: int) -> Eagle3Head:
    """The EAGLE-3 head (``source.draft``, as the user's process resolved it), its weights loaded,
    and the target set to capture the hidden states it reads (``DecoderModel.capture_hidden``)
    for the most tokens a forward runs."""
    from phalanx.models.eagle3 import aux_layers
    from phalanx.models.loader import iter_hf_weights, safetensors_specs
    dsource = source.with_draft(args.speculative_config, args.trust_remote_code).draft
    where = "speculative_config.speculative_model_dir"
    assert dsource is not None and args.speculative_config is not None
    if dsource.kind != "hf":
        raise ValueError(f"{where}: an EAGLE-3 head is a Hugging Face directory (config.json, safetensors)")
    hcfg, cfg = dsource.config, source.config
    if cfg.is_moe or cfg.is_gemma3:
        kind = "a mixture-of-experts" if cfg.is_moe else "a Gemma 3"
        raise ValueError(f"{where}: an EAGLE-3 head over {kind} target is not supported")
    if hcfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"{where}: the EAGLE-3 head's vocab_size ({hcfg.vocab_size}) differs from the target's "
                         f"({cfg.vocab_size})")
    layers = aux_layers(hcfg, cfg.num_layers)
    dummy = args.load_format == "dummy"    # random weights, as the target's (benchmarks)
    try:
        own_embedding = not dummy and any(s["name"].endswith("embed_tokens.weight")
                                          for s in safetensors_specs(dsource.path))
    except FileNotFoundError as e:
        raise ValueError(f"{where}: {e}") from None
    with torch.device(device), default_dtype(dtype):
        head = Eagle3Head(hcfg, cfg.hidden_size, len(layers), model.model.embed_tokens, own_embedding,
                          min(cfg.max_position_embeddings, max_seq_len + 2 * args.speculative_config.max_draft_len + 2))
    head.eval()
    try:
        with torch.no_grad():
            if dummy:
                head.random_weights(args.seed)
            else:
                head.load_weights(iter_hf_weights(dsource.path))
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"{where}: {e}") from None
    if device.type == "cpu":
        cpu_plans(head)
    model.model.capture_hidden(layers, max(args.max_num_tokens, args.max_batch_size))
    return head


def _build_spec(args: LlmArgs, cfg, draft: CausalLM | None, pool_blocks: int, max_seq_len: int,
                kv_dtype: torch.dtype, tp: TPGroup, device: torch.device, num_host_blocks: int = 0,
                eagle: Eagle3Head | None = None, model: CausalLM | None = None):
    from phalanx.pyexecutor.speculative import DraftModelProposer, Eagle3Proposer, NGramProposer, SpecDecoder
    sc = args.speculative_config
    assert sc is not None
    k = sc.max_draft_len
    max_position = cfg.max_position_embeddings
    proposer: NGramProposer | DraftModelProposer | Eagle3Proposer
    if eagle is not None:
        assert model is not None and model.model.aux_out is not None
        hc = eagle.config
        hpool = KVPool(1, pool_blocks, args.kv_cache_config.tokens_per_block, hc.num_kv_heads, hc.head_dim, kv_dtype,
                       device, num_host_blocks)   # the target's host blocks, its copies
        proposer = Eagle3Proposer(k, eagle, hpool, model.model.aux_out)
    elif draft is None:
        proposer = NGramProposer(k, sc.max_matching_ngram_size, sc.min_matching_ngram_size)
    else:
        dcfg = draft.config
        dheads = shard_heads(dcfg.num_heads, dcfg.num_kv_heads, tp.rank, tp.size)
        dpool = KVPool(dcfg.num_layers, pool_blocks, args.kv_cache_config.tokens_per_block, dheads.num_kv_heads,
                       dcfg.head_dim, kv_dtype, device, num_host_blocks)   # the target's host blocks, its copies
        proposer = DraftModelProposer(k, draft, dpool, cfg.vocab_size, dcfg.max_position_embeddings)
    return SpecDecoder(k, proposer, cfg.vocab_size, max_seq_len, max_position, args.kv_cache_config.tokens_per_block,
                       pool_blocks - 1, device, keep_history=isinstance(proposer, NGramProposer), tp=tp)


def _grammar_compiler(args: LlmArgs, source: ModelSource) -> GrammarCompiler:
    """The grammar compiler of this model's vocabulary (on a rank: built on the first grammar)."""
    try:
        from phalanx.llmapi.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(source, args.tokenizer, args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any loader failure means the same thing here
        raise ValueError(f"guided_decoding needs the model's tokenizer, which did not load: {e}") from None
    return GrammarCompiler(tokenizer.hf, source.config.vocab_size, tokenizer.eos_token_ids)


def _serves_fp8(args: LlmArgs, cfg: ModelConfig, device: torch.device) -> bool:
    """FP8 weights: asked for (``quantization: fp8``, refused by name on a GPU without FP8), or
    an FP8 checkpoint where the device runs FP8 (elsewhere it is served dequantized)."""
    return args.quantization == "fp8" or (cfg.fp8_checkpoint and fp8.supported(device))


def _tune_kernels(model: CausalLM | Eagle3Head) -> dict[str, float]:
    """Hand every projection its plan, and attention and MLP layers their one-token paths, by
    timing on this GPU (kernels/gemv_tuner.py). Returns GB/s per tuned shape, for the log."""
    if not ops.triton_available():
        return {}
    from phalanx.kernels import gemv_tuner
    from phalanx.kernels.linear_plan import Neighbour
    from phalanx.models.layers import Projection
    from phalanx.models.llama import MLP, Attention, DecoderLayer
    act_dtype = model.activation_dtype
    report: dict[str, float] = {}
    fused = model.lora is None   # LoRA adds to each projection: no paths that fuse one into its neighbours
    for m in model.modules():
        if isinstance(m, Projection) and m.weight.is_cuda:
            m.plan = gemv_tuner.tune_linear(m.weight, m.behind, report, fp8=m.weight_scale is not None,
                                            act_dtype=act_dtype, block=m.fp8_block)
        elif isinstance(m, DecoderLayer):
            m.prepare_fp8_rows(act_dtype, norms=fused)
    from phalanx.models.moe import SparseMoE
    for m in model.modules():
        if isinstance(m, SparseMoE) and m.w13.is_cuda:   # a rank under attention DP sees every rank's tokens
            from phalanx.kernels import triton_moe
            m.moe_plan = triton_moe.tune(m.w13, m.w2, m.top_k, m.cfg.num_experts, m.first, m.w13_scale, m.w2_scale,
                                         act_dtype, m.fp8_block)
            rows = m.moe_plan.rows
            report[f"moe {tuple(m.w13.shape)}: " + ", ".join(map(str, m.moe_plan.tiles))
                   + (f"; up to {rows.max_tokens} tokens one row a pair: {rows.gate_up}, {rows.down}" if rows else "")
                   ] = 0.0
        elif isinstance(m, Attention) and m.q_norm is None and fused:
            m.one_token_qkv = gemv_tuner.qkv_rope_plan(m.qkv_proj.plan, m.head_dim)
        elif (isinstance(m, MLP) and m.gate_up_proj.behind is Neighbour.NORM and m.gate_up_proj.weight.is_cuda
              and fused):
            m.one_token = gemv_tuner.gate_up_silu_plan(m.gate_up_proj.weight, m.gate_up_proj.plan,
                                                       m.down_proj.weight, m.down_proj.plan, report,
                                                       scales=(m.gate_up_proj.weight_scale, m.down_proj.weight_scale),
                                                       act_dtype=act_dtype)
    return report


def _piecewise_sizes(sizes: list[int], max_num_tokens: int) -> list[int]:
    """The piecewise graphs' token counts up to ``max_num_tokens``, and that count itself where
    a larger size was asked for (a step can never need more)."""
    kept = [t for t in sizes if t <= max_num_tokens]
    if len(kept) < len(sizes) and max_num_tokens not in kept and max_num_tokens >= 2:
        kept.append(max_num_tokens)
    return kept


def _profile_num_blocks(args: LlmArgs, model: CausalLM, pool_shape: tuple, block_bytes: int,
                        max_seq_len: int, extra: dict, draft: tuple[CausalLM, tuple] | None = None,
                        staged: int = 0, head: tuple[Eagle3Head, tuple] | None = None) -> int:
    """KV blocks from a profiling run: a forward over a max_num_tokens batch with a small
    temporary pool, a slice of prompt logprobs, the logits of the most rows a step samples
    (``SpecPolicy.most_sampled_rows`` with speculation) and their sampling with every setting
    on, then (memory free after weights − that run's activation peak) × fraction. With a large
    vocabulary the sampling is the peak: 2,048 rows of 128k float32 logits are 1 GB, and
    top-p's sort, the penalties, the seeded noise and logprobs hold up to ~6 copies of the rows
    they work on, which the sampler bounds by taking 256 rows at a time
    (``sampler.SAMPLE_CHUNK_ROWS``: ~0.8 GB at 128k). A draft model runs the same forward over a
    pool of its own shape (as it does in a step, while the target's logits are held) with its
    logits of one row a request: the higher of the two peaks counts, and its kernels are
    compiled here too. An EAGLE-3 head (``head``: it and its pool's shape) likewise runs over the
    prompt's rows while the target's logits are held."""
    dev = pool_shape[-1]
    n = max(1, min(args.max_num_tokens, max_seq_len - 1))
    sc = args.speculative_config
    rows = min(args.max_num_tokens, args.max_batch_size) if sc is None else \
        SpecPolicy(sc.max_draft_len, sc.max_concurrency).most_sampled_rows(args.max_batch_size, args.max_num_tokens)
    vocab = model.config.vocab_size
    activation_peak = _activation_peak(model, n, pool_shape, rows, sample=True,
                                       logprob_rows=min(PROMPT_LOGPROB_ROWS, args.max_num_tokens))
    if draft is not None:   # (the draft model, its pool's shape); the target's logits are held meanwhile
        held = rows * vocab * 4
        draft_rows = min(args.max_num_tokens, args.max_batch_size)
        activation_peak = max(activation_peak, held + _activation_peak(draft[0], n, draft[1], draft_rows))
    if head is not None:
        activation_peak = max(activation_peak, rows * vocab * 4 + _head_activation_peak(head[0], n, head[1]))
    free, total = torch.cuda.mem_get_info(dev)
    kvc = args.kv_cache_config
    budget = int(max(0, free - activation_peak - staged) * kvc.free_gpu_memory_fraction)   # staged: host tier
    if kvc.max_gpu_total_bytes:
        budget = min(budget, kvc.max_gpu_total_bytes)
    extra.update({"profile_tokens": n, "activation_peak_gib": activation_peak / 2**30,
                  "free_after_weights_gib": free / 2**30, "kv_budget_gib": budget / 2**30})
    return num_blocks_for_budget(budget, block_bytes, kvc.tokens_per_block, kvc.max_tokens)


@torch.inference_mode()
def _activation_peak(model: CausalLM, n: int, pool_shape: tuple, rows: int, sample: bool = False,
                     logprob_rows: int = 0) -> int:
    """The memory one forward over a prompt of n tokens and the logits of ``rows`` rows of its
    output (a step of short prompts samples more rows than one prompt has) allocate at their
    peak, over a temporary pool of ``pool_shape``. With ``sample``, those rows are also
    sampled as the costliest requests are (``sampler.costliest_rows``), after a slice of
    ``logprob_rows`` prompt logprobs (``ModelRunner._prompt_logprobs``'s, before a step's
    logits)."""
    dev = pool_shape[-1]

    def run(pool: torch.Tensor, meta: AttentionMetadata) -> None:
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        hidden = model(ids, torch.arange(n, device=dev), meta, pool)
        vocab = model.config.vocab_size
        if logprob_rows:
            lp = model.compute_logits(hidden[torch.arange(logprob_rows, device=dev) % n])[:, :vocab]
            lp.log_softmax(dim=-1).topk(MAX_LOGPROBS, dim=-1)
            del lp
        logits = model.compute_logits(hidden[torch.arange(rows, device=dev) % n])   # a gather, as a step's
        if sample:
            Sampler(vocab, dev).sample(logits, costliest_rows(rows, vocab))
    return _peak_over_prompt(n, pool_shape, run)


@torch.inference_mode()
def _head_activation_peak(head: Eagle3Head, n: int, pool_shape: tuple) -> int:
    """The memory an EAGLE-3 head's pass over a prompt of n tokens allocates at its peak (``fc``
    of the captured hidden states, then the entries' K/V), over a temporary pool of ``pool_shape``."""
    dev = pool_shape[-1]

    def run(pool: torch.Tensor, meta: AttentionMetadata) -> None:
        aux = torch.zeros(n, head.fc.weight.shape[1], dtype=head.norm.weight.dtype, device=dev)
        head.write_kv(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), head.fc(aux),
                      meta.slot_mapping, pool)
    return _peak_over_prompt(n, pool_shape, run)


def _peak_over_prompt(n: int, pool_shape: tuple, run: Callable[[torch.Tensor, AttentionMetadata], None]) -> int:
    """The memory ``run`` allocates at its peak (its own locals freed when it returns), given a
    temporary pool of ``pool_shape`` and the metadata of one prompt of n tokens, made before."""
    L, B, Hkv, D, kdt, dev = pool_shape
    tmp = KVPool(L, -(-n // B) + 1, B, Hkv, D, kdt, dev)
    meta = AttentionMetadata.one_prompt(n, B, dev)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    run(tmp.tensor, meta)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del tmp, meta
    torch.cuda.empty_cache()
    return peak


def _num_kv_blocks(args: LlmArgs, device: torch.device, block_bytes: int) -> int:
    kvc = args.kv_cache_config
    if device.type == "cpu":
        budget = kvc.max_gpu_total_bytes or CPU_DEFAULT_KV_BYTES
    else:
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * kvc.free_gpu_memory_fraction)
        if kvc.max_gpu_total_bytes:
            budget = min(budget, kvc.max_gpu_total_bytes)
    return num_blocks_for_budget(budget, block_bytes, kvc.tokens_per_block, kvc.max_tokens)
