#!/usr/bin/env bash
# LoRA on a GPU in one device call under 600 s: the LoRA GPU tests (graphs, grouped kernels, speculative
# verify steps, a trainer's CUDA tensors, the kernels at model sizes), a projection's cost by form, then decode
# at batch 1, 64 and 256 with LoRA rank 16 (4 adapters and none): the decode kernels alone (past 32 rows the
# dense form: PHALANX_LORA_KERNELS=bgmv) against the grouped kernels (the default). Results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD PHALANX_CACHE_DIR=/tmp/phalanx-cache PHALANX_STARTUP_TIMEOUT=200
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_lora.py tests/gpu/test_gpu_lora_grouped.py \
  tests/gpu/test_gpu_lora_tensors.py tests/kernels/test_lora_kernels.py tests/kernels/test_lora_grouped.py \
  > "$OUT/lora_tests.txt" 2>&1
timeout 100 python3 tools/bench_lora.py --rows 1 16 32 48 64 128 256 512 --output "$OUT/bench_lora.json" \
  > "$OUT/bench_lora.txt" 2>&1
for k in bgmv 1; do
  PHALANX_LORA_KERNELS=$k timeout 140 python3 -m phalanx.cli bench decode --model shape:llama-3.1-8b --batch 1 64 256 \
    --prompt-len 128 --steps 64 --overlap on --lora-rank 16 --loras 4 --output "$OUT/decode_lora_$k.json" \
    > "$OUT/decode_lora_$k.txt" 2>&1
  nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | xargs -r kill -9 2>/dev/null
done
