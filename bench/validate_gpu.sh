#!/usr/bin/env bash
# Everything a GPU session should check, in one device call (~8 min on 2 x H200):
#   1. tests/gpu (kernels vs references, engine on CUDA incl. --cuda-graphs, NCCL with 2 GPUs)
#   2. DDTree == AR through the engine (fp32 exact mode, bf16)
#   3. ddserve serve over NCCL with a load test           (needs Ray on PYTHONPATH; 2+ GPUs)
#   4. the engine benchmark on a K2.6 rank slice, eager and with CUDA graphs
# Results (JSON, logs) under $OUT. Run from the repository root:
#   OUT=results bash bench/validate_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the device tool returns at most 8 files from $OUT: tests print, logs are removed at the end
nvidia-smi -L
timeout 240 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -15
timeout 150 python3 bench/gpu_engine_check.py --out "$OUT/gpu_engine_check.json" 2>&1 | tail -12
if python3 -c "import ray" 2>/dev/null && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  mkdir -p "$OUT/serve" && OUT=$OUT/serve timeout 170 bash bench/gpu_serve_check.sh 2>&1 | tail -8
fi
OUT=$OUT bash bench/run_engine_gpu.sh --max-seconds 60 --batches 1,5 --budgets 8,16 --corrupt 0.3
mv "$OUT/engine.json" "$OUT/engine_eager.json" 2>/dev/null
mv "$OUT/engine.log" "$OUT/engine_eager.log" 2>/dev/null
OUT=$OUT bash bench/run_engine_gpu.sh --max-seconds 60 --batches 1,5 --budgets 8,16 --corrupt 0.3 \
  --cuda-graphs
rm -f "$OUT"/engine*.log
