#!/usr/bin/env bash
# Every GPU check in one call (run through the device tool from the repo root):
#   bash benchmarks/gpu_checks.sh
# Writes logs and the benchmark JSON under $OUT (or ./gpu_out when $OUT is unset).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
python -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/tests.log"
python -m ouro.cli make-model small /tmp/ouro_small > /dev/null
compare=none
python -c "import transformers" 2>/dev/null && compare=transformers
python -m ouro.cli bench offline --model /tmp/ouro_small --device cuda --num-prompts 64 --input-len 256 \
    --output-len 64 --max-concurrency 32 --compare "$compare" --output-json "$OUT/offline_cuda.json" 2>&1 \
    | grep -v "it/s" | tee "$OUT/bench.log"
# the compiled decode step with CUDA graphs (torch.compile mode="reduce-overhead", one graph per bucket)
timeout 420 python -m ouro.cli bench offline --model /tmp/ouro_small --device cuda --num-prompts 64 --input-len 256 \
    --output-len 64 --max-concurrency 32 --compile --output-json "$OUT/offline_cuda_compiled.json" 2>&1 \
    | grep -v "it/s" | tee "$OUT/bench_compiled.log"
# quantisation (issue 23): W8A8 (torch._int_mm) and FP8 (torch._scaled_mm) against the unquantised engine
for q in w8a8 fp8; do
  timeout 300 python -m ouro.cli bench offline --model /tmp/ouro_small --device cuda --dtype bfloat16 --num-prompts 64 \
      --input-len 256 --output-len 64 --max-concurrency 32 --quantization "$q" --output-json "$OUT/offline_cuda_$q.json" 2>&1 \
      | grep -v "it/s" | tee "$OUT/bench_$q.log"
done
