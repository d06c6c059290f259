#!/usr/bin/env bash
# One device call of a development round: correctness first, then timing. Everything under $OUT
# (at most 8 files come back from the device: JSON per part plus one log).
#   OUT=results bash bench/device_round.sh check   # GPU tests, exactness probe, DDTree == AR
#   OUT=results bash bench/device_round.sh speed   # MoE and attention kernel benchmarks
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
LOG=$OUT/log
{ date -u; nvidia-smi -L; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } >>"$LOG" 2>&1
case "${1:-check}" in
  check)  # next session also: timeout 200 python3 bench/serve_exactness.py --out $OUT/sx.json
          # (needs Ray: the device bundle; on 2 GPUs it serves tp = 2 over NCCL)
    timeout 130 python3 bench/gpu_engine_check.py --batch-invariant --dtypes bfloat16 \
      --out "$OUT/engine_check_bf16_invariant.json" 2>&1 | tail -8 >>"$LOG"
    timeout 400 python3 -m pytest tests/gpu -q -s -p no:cacheprovider -rf >"$OUT/pytest.log" 2>&1
    tail -45 "$OUT/pytest.log" >>"$LOG"
    ;;
  v3)  # session 3: the Gluon MoE (correctness of every v3 path, then the variant sweep), alignment
    timeout 170 python3 -m pytest tests/gpu/test_moe_triton.py -q -p no:cacheprovider -rf -k "v3" \
      >"$OUT/pytest_v3.log" 2>&1; tail -25 "$OUT/pytest_v3.log" >>"$LOG"
    [ -f tests/gpu/test_moe_align_gpu.py ] && timeout 60 python3 -m pytest tests/gpu/test_moe_align_gpu.py \
      -q -p no:cacheprovider -rf 2>&1 | tail -5 >>"$LOG"
    (cd bench && timeout 230 python3 bench_moe.py --variants --budget 190 --no-torch \
      --out "$OUT/moe_v3.json") 2>&1 | tail -60 >>"$LOG"
    [ -f bench/bench_align.py ] && timeout 60 python3 bench/bench_align.py --out "$OUT/align.json" 2>&1 \
      | tail -12 >>"$LOG"
    ;;
  v3b)  # session 3 round 2: v3 as the default (BM/NT auto, SPLIT 4), every MoE GPU test, the
        # variant sweep with kernel breakdown, and the K2.6 rank step (CUDA graphs) on v3
    timeout 200 python3 -m pytest tests/gpu/test_moe_triton.py tests/gpu/test_moe_align_gpu.py -q \
      -p no:cacheprovider -rf >"$OUT/pytest_moe.log" 2>&1; tail -25 "$OUT/pytest_moe.log" >>"$LOG"
    grep -E "^T=.*(equal|BM|NT)" "$OUT/pytest_moe.log" | head -40 >>"$LOG"
    (cd bench && timeout 150 python3 bench_moe.py --variants --budget 110 --no-torch --breakdown \
      --out "$OUT/moe_v3b.json") 2>&1 | grep -v launch | tail -40 >>"$LOG"
    OUT=/tmp/eng timeout 130 bash bench/run_engine_gpu.sh --batches 1,5,10 --budgets 16 --corrupt 0 \
      --cuda-graphs --max-seconds 90 >/dev/null 2>&1; tail -14 /tmp/eng/engine.log >>"$LOG"
    cp /tmp/eng/engine.json "$OUT/engine_v3.json" 2>/dev/null
    ;;
  v3c)  # session 3 round 3: the rest of the GPU suite with v3 as the MoE default (+ the in-place
        # repack test), the K2.6 rank step on v3 (experts repacked in place), serving on 2 GPUs
    timeout 230 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "not (test_moe_triton or test_moe_align) or in_place or default_variant" \
      >"$OUT/pytest_rest.log" 2>&1; tail -12 "$OUT/pytest_rest.log" >>"$LOG"
    OUT=/tmp/eng timeout 150 bash bench/run_engine_gpu.sh --batches 1,5,10 --budgets 16 --corrupt 0 \
      --cuda-graphs --max-seconds 100 >/dev/null 2>&1; tail -14 /tmp/eng/engine.log >>"$LOG"
    cp /tmp/eng/engine.json "$OUT/engine_v3.json" 2>/dev/null
    mkdir -p /tmp/serve && SERVE_ARGS="--cuda-graphs" OUT=/tmp/serve timeout 120 \
      bash bench/gpu_serve_check.sh 2>&1 | tail -10 >>"$LOG"
    cp /tmp/serve/load_gpu.json "$OUT/serve_load_v3.json" 2>/dev/null
    ;;
  pair)  # the trained default pair on one H200: the GPU tests the CPU-path changes touch, then
          # bench/eval_pair.py (acceptance vs budget, DDTree vs AR tokens/s at 1/5/10 streams)
    timeout 170 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "test_invariant_gpu or test_engine_gpu or test_warmup_gpu or test_ddtree_nosync or test_prefill_phase_gpu" \
      >"$OUT/pytest_pair.log" 2>&1; tail -15 "$OUT/pytest_pair.log" >>"$LOG"
    timeout 360 python3 bench/eval_pair.py --max-minutes 5.5 --out "$OUT/eval_pair_h200.json" \
      --plot "$OUT/eval_pair_h200.png" >"$OUT/eval_pair.log" 2>&1; tail -30 "$OUT/eval_pair.log" >>"$LOG"
    ;;
  speed)
    (cd bench && timeout 200 python3 bench_moe.py --variants --out "$OUT/moe.json") 2>&1 | tail -40 >>"$LOG"
    (cd bench && timeout 150 python3 bench_tree_attn.py --out "$OUT/tree_attn.json") 2>&1 | tail -30 >>"$LOG"
    ;;
  speed2)  # round 2: MoE variants + ablations + ncu, attention presets, dense configs
    (cd bench && timeout 130 python3 bench_moe.py --variants --out "$OUT/moe_variants_r2.json") 2>&1 | tail -12 >>"$LOG"
    (cd bench && timeout 110 python3 bench_moe.py --ablate --budget 95 --out "$OUT/moe_ablate.json") 2>&1 | tail -30 >>"$LOG"
    mkdir -p /tmp/ncu && OUT=/tmp/ncu timeout 75 bash bench/ncu_moe.sh >>"$LOG" 2>&1; cp /tmp/ncu/ncu_moe.txt "$OUT/" 2>/dev/null
    (cd bench && timeout 125 python3 bench_tree_attn.py --presets --prefixes 1024,8192,32768 --budget-s 110 \
      --out "$OUT/tree_attn_presets.json") 2>&1 | tail -25 >>"$LOG"
    timeout 105 python3 bench/bench_dense.py --configs a,b --fp32-configs ieee,tf32x3 --budget 95 \
      --out "$OUT/dense_ab.json" 2>&1 | tail -25 >>"$LOG"
    ;;
  final)  # 2 GPUs, Ray bundle on PYTHONPATH: tests, DDTree == AR, serving (CUDA graphs, NCCL),
           # the engine (prefill + steps), short kernel benches
    timeout 190 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf -k "not every_preset" \
      >"$OUT/pytest.log" 2>&1; tail -25 "$OUT/pytest.log" >>"$LOG"
    timeout 50 python3 bench/gpu_engine_check.py --batch-invariant --dtypes bfloat16 \
      --out "$OUT/engine_check_bf16_invariant.json" 2>&1 | tail -6 >>"$LOG"
    mkdir -p /tmp/serve && SERVE_ARGS="--cuda-graphs" OUT=/tmp/serve timeout 110 \
      bash bench/gpu_serve_check.sh 2>&1 | tail -14 >>"$LOG"
    cp /tmp/serve/load_gpu.json "$OUT/serve_load_graphs.json" 2>/dev/null
    grep -iE "error|Traceback" /tmp/serve/serve.log | head -5 >>"$LOG"
    OUT=/tmp/eng timeout 80 bash bench/run_engine_gpu.sh --batches 1,5 --budgets 16 --corrupt 0.3 \
      --cuda-graphs --max-seconds 40 >/dev/null 2>&1; tail -8 /tmp/eng/engine.log >>"$LOG"
    cp /tmp/eng/engine.json "$OUT/engine_final.json" 2>/dev/null
    (cd bench && timeout 75 python3 bench_moe.py --variants --budget 60 --no-torch \
      --out "$OUT/moe_variants_r3.json") 2>&1 | tail -12 >>"$LOG"
    (cd bench && timeout 60 python3 bench_tree_attn.py --presets --prefixes 1024,8192,32768 \
      --budget-s 45 --out "$OUT/tree_attn_presets_r3.json") 2>&1 | tail -30 >>"$LOG"
    ;;
  engine)  # K2.6 rank slice, CUDA graphs, batch-invariant kernels on, then off
    ARGS="--batches 1,5,10 --budgets 8,16 --corrupt 0,0.3 --cuda-graphs --max-seconds 150"
    OUT=$OUT bash bench/run_engine_gpu.sh $ARGS >/dev/null 2>&1
    mv "$OUT/engine.json" "$OUT/engine_graphs_invariant.json"; tail -25 "$OUT/engine.log" >>"$LOG"
    OUT=$OUT bash bench/run_engine_gpu.sh $ARGS --no-batch-invariant >/dev/null 2>&1
    mv "$OUT/engine.json" "$OUT/engine_graphs_plain.json"; tail -25 "$OUT/engine.log" >>"$LOG"
    rm -f "$OUT/engine.log"
    ;;
esac
tail -c 11000 "$LOG"
