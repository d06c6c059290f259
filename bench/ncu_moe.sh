#!/usr/bin/env bash
# Nsight Compute on one fused_moe call (K2.6 per-rank shapes, T=192 or $T, bf16 scales, so the
# default variant v3): SpeedOfLight, MemoryWorkloadAnalysis, WarpStateStats, LaunchStats, Occupancy
# of the MoE kernels (v3: _w4_gemm_kernel, up then down; v2: _up_kernel, _silu_kernel, _down_kernel,
# _combine_kernel, the 2nd and 4th in moe_reduce.py), printed as a compact text report
# (<= 200 lines) to stdout and to $OUT/ncu_moe.txt (raw CSV in $OUT/ncu_moe.csv).
# MOE_CONFIG='{"variant": "v2"}' (JSON, fused_moe's config) profiles v2 instead.
# Exits 2 within ~30 s with a clear message when ncu is missing or cannot read the GPU counters
# (e.g. the gVisor runtime). Usage, from the repository root: bash bench/ncu_moe.sh   (< 90 s)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=${OUT:-/tmp}
REPORT="$OUTDIR/ncu_moe.txt"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
T=${T:-192}

say() { echo "$*" | tee -a "$REPORT"; }
: >"$REPORT"

NCU=$(command -v ncu || true)
for c in /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda-*/bin/ncu; do
  [ -z "$NCU" ] && [ -x "$c" ] && NCU=$c
done
if [ -z "$NCU" ]; then
  say "NCU UNAVAILABLE: no ncu binary (PATH, /usr/local/cuda*/bin, /opt/nvidia/nsight-compute)"
  exit 2
fi
say "ncu: $NCU ($("$NCU" --version 2>/dev/null | tail -1))"

# 1. Can ncu read counters here? One tiny kernel, one metric.
PROBE=$(timeout 40 "$NCU" --clock-control none --metrics sm__cycles_elapsed.avg \
  python3 -c "import torch; (torch.ones(8, device='cuda') + 1).sum().item()" 2>&1)
if ! echo "$PROBE" | grep -q "sm__cycles_elapsed.avg"; then
  say "NCU UNAVAILABLE: ncu cannot read GPU performance counters on this machine"
  say "(gVisor / containers without counter access give ERR_NVGPUCTRPERM or no metrics). Tail:"
  echo "$PROBE" | tail -8 | tee -a "$REPORT"
  exit 2
fi

# 2. The MoE call: compile and warm up outside the profiled range, then one call inside it.
DRIVER=$(cat <<'EOF'
import json, math, os, torch
from ddserve.kernels.moe_ref import ExpertWeights
from ddserve.kernels.moe_triton import fused_moe
t, e, h, i, k = int(os.environ.get("T", "192")), 384, 7168, 256, 8
g = torch.Generator(device="cuda").manual_seed(0)
def packed(rows, cols):
    words = torch.randint(-(2**31), 2**31 - 1, (e, rows, cols // 8), dtype=torch.int32,
                          device="cuda", generator=g)
    scale = (torch.rand(e, rows, cols // 32, device="cuda", generator=g) + 0.5) / (4.6 * math.sqrt(cols))
    return words, scale.to(torch.bfloat16)
w13, s13 = packed(2 * i, h)
w2, s2 = packed(h, i)
w = ExpertWeights(w13_packed=w13, w13_scale=s13, w2_packed=w2, w2_scale=s2)
x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=1).indices
tw = torch.rand(t, k, device="cuda", generator=g)
cfg = json.loads(os.environ.get("MOE_CONFIG") or "{}")
for _ in range(3):
    fused_moe(x, ids, tw, w, config=cfg, invariant=True)
torch.cuda.synchronize()
print("config", cfg or "default", "T", t, "distinct experts", int(torch.unique(ids).numel()))
torch.cuda.profiler.start()
fused_moe(x, ids, tw, w, config=cfg, invariant=True)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
EOF
)
CSV="$OUTDIR/ncu_moe.csv"
T=$T timeout 75 "$NCU" --clock-control none --profile-from-start off \
  -k 'regex:^_(up|silu|down|combine|w4_gemm)_kernel' \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section LaunchStats --section Occupancy --csv --page details \
  python3 -c "$DRIVER" >"$CSV" 2>"$OUTDIR/ncu_moe.stderr"
RC=$?
grep -m1 "^config" "$CSV" | tee -a "$REPORT"
if [ $RC -ne 0 ] || ! grep -q '"Metric Name"' "$CSV"; then
  say "ncu run failed (rc $RC; 124 = timeout). stderr tail:"
  tail -15 "$OUTDIR/ncu_moe.stderr" | tee -a "$REPORT"
  exit 1
fi

# 3. Compact report: one block per kernel, "section | metric = value unit".
python3 "$ROOT/bench/ncu_report.py" "$CSV" | head -190 | tee -a "$REPORT"
exit 0
