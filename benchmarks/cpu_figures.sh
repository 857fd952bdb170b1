#!/usr/bin/env bash
# Every CPU figure in docs/results.md, one command after another (about 25 minutes on an idle
# 2-core machine; other processes on it slow everything down: each timing prints the load average).
#   bash benchmarks/cpu_figures.sh [OUT_DIR]
# The exactness table has its own command: python benchmarks/exactness_matrix.py
set -uo pipefail
OUT=${1:-${TMPDIR:-/tmp}/ouro_figures}
mkdir -p "$OUT"
export PYTHONPATH=$PWD TOKENIZERS_PARALLELISM=false
run() {  # name, command...
    local name=$1; shift
    echo "== $name: $* (load average $(cut -d' ' -f1 /proc/loadavg))" | tee "$OUT/$name.log"
    "$@" 2>&1 | grep -v -e "it/s" -e "s/it" -e "tensor/s" | tee -a "$OUT/$name.log"
}
run offline python -m ouro.cli bench offline --model small --num-prompts 64 --input-len 256 --output-len 64 \
    --max-concurrency 32 --compare transformers --output-json "$OUT/offline.json"
run floor python benchmarks/step_floor.py --model small --offline-json "$OUT/offline.json"
run floor_previous_rates python benchmarks/step_floor.py --model small --batch 32 --context 290 \
    --flops-per-s 327e9 --bytes-per-s 26.5e9
run prefill python -m ouro.cli bench prefill --model small --input-len 1024 --repeats 3 --compare transformers \
    --output-json "$OUT/prefill.json"
run breakdown_small python benchmarks/decode_breakdown.py --model small --batch 32 --input-len 256 --steps 8
run breakdown_tiny python benchmarks/decode_breakdown.py --model tiny --batch 32 --input-len 256 --steps 8
run near_tie_prefill python benchmarks/router_near_tie.py --model small --input-len 1024 --seed 0
run near_tie_offline python benchmarks/router_near_tie.py --model small --offline-json "$OUT/offline.json"
run preemption_tiny python benchmarks/preemption_agreement.py --model tiny
run preemption_small python benchmarks/preemption_agreement.py --model small --num-prompts 8 --max-prompt-len 700 \
    --pages 52 --slots 2
run plan_small python -m ouro.cli plan --model small --kv-cache-dtype float32 --context 131072,1048576
run plan_flash python -m ouro.cli plan --model flash --kv-cache-dtype bfloat16 --context 131072,1048576
run sizes python -c "from ouro.models.presets import PRESETS, parameter_count; [print(n, parameter_count(c)) for n, c in PRESETS.items()]"
