#!/usr/bin/env bash
# Latency through `phalanx serve` on the Llama-3.1-8B shape with random weights and the bundled
# tokenizer: time to first token with one client (streamed completions: a cold 32-token prompt,
# then 2048 cached + 32 new tokens) and, with POISSON, inter-token latency under Poisson arrivals
# of 1000/1000 requests.
#   usage: tools/serve_latency.sh OUTDIR [CONFIG_YAML] [RATE PROMPTS] [SHAPE_OVERRIDES_JSON]
#   (CONFIG_YAML defaults to tools/gpu_serve.yaml; TTFT=0 skips the TTFT runs; PREFILL_CAP=N adds
#   scheduler_config.max_prefill_tokens_while_decoding: N to the config)
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1; config=${2:-tools/gpu_serve.yaml}; rate=${3:-}; n=${4:-400}; over=${5:-"{}"}
mkdir -p "$out"
if [ -n "${PREFILL_CAP:-}" ]; then
  capped=$(mktemp --suffix .yaml)
  { cat "$config"; printf 'scheduler_config:\n  max_prefill_tokens_while_decoding: %s\n' "$PREFILL_CAP"; } > "$capped"
  config=$capped
fi
d=$(python3 -c "import json, sys; from phalanx.bench.shapes import shape_dir; print(shape_dir('llama-3.1-8b', **json.loads(sys.argv[1])))" "$over")
cp .gpu_assets/smollm2-tokenizer/* "$d"/
port=8011
python3 -m phalanx.cli serve "$d" --port $port --config "$config" > "$out/server.txt" 2>&1 &
server=$!
up=0
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && { up=1; break; }; sleep 1
done
if [ $up = 0 ]; then echo "the server did not come up (see $out/server.txt)" >&2; kill $server; exit 1; fi
bench() { python3 -m phalanx.cli bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$d" --ignore-eos \
  --no-progress "$@"; }
if [ "${TTFT:-1}" = 1 ]; then
  bench --dataset random --input-len 32 --output-len 2 --num-prompts 16 --max-concurrency 1 --warmup 4 \
    --output "$out/serve_cold32.json" > "$out/serve_cold32.txt" 2>&1
  bench --dataset shared-prefix --groups 1 --prompts-per-group 16 --system-len 2048 --question-len 32 \
    --output-len 2 --max-concurrency 1 --warmup 4 --output "$out/serve_hit2048.json" > "$out/serve_hit2048.txt" 2>&1
fi
if [ -n "$rate" ]; then
  bench --dataset random --input-len 1000 --output-len 1000 --num-prompts "$n" --request-rate "$rate" --warmup 2 \
    --output "$out/serve_poisson.json" > "$out/serve_poisson.txt" 2>&1
fi
kill -INT $server; wait $server
