#!/usr/bin/env bash
# Nsight Compute on the batch-invariant tree attention (`_tree_attn_inv_kernel` + its split
# merge) at K2.6 rank shapes (8 heads, latent 512 + rope 64, bf16): one stream decoding over a
# 1k prefix, then one stream verifying a 17-row tree (prefix-slot tables padded as the engine's
# graphs pad them). Sections: SpeedOfLight, MemoryWorkloadAnalysis, WarpStateStats,
# SourceCounters, LaunchStats, Occupancy (compact text: $OUT/ncu_tree_attn.txt), and the SASS
# instructions with the most warp-stall samples, with their stall reasons
# ($OUT/ncu_tree_attn_sass.txt; the whole per-instruction CSV in $OUT/ncu_tree_attn_sass.csv).
# PREFIX (default 1024) sets the prefix length. Exits 2 when ncu cannot read the counters.
# Usage, from the repository root: OUT=dir bash bench/ncu_tree_attn.sh   (< 3 min)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=${OUT:-/tmp}
REPORT="$OUTDIR/ncu_tree_attn.txt"
export PYTHONPATH="$ROOT:$ROOT/bench${PYTHONPATH:+:$PYTHONPATH}"
export PREFIX=${PREFIX:-1024}
say() { echo "$*" | tee -a "$REPORT"; }
: >"$REPORT"
NCU=$(command -v ncu || true)
for c in /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda-*/bin/ncu; do
  [ -z "$NCU" ] && [ -x "$c" ] && NCU=$c
done
[ -n "$NCU" ] || { say "NCU UNAVAILABLE: no ncu binary"; exit 2; }
say "ncu: $NCU ($("$NCU" --version 2>/dev/null | tail -1))"

DRIVER=$(cat <<'EOF'
import os, torch
from bench_tree_attn import SCALE, case_inputs
from ddserve.kernels.tree_attn_triton import tree_mla_attention
pl = int(os.environ["PREFIX"])
cases = [case_inputs(1, budget, pl, 8, 512, 64, "cuda", pad_pow2=True) for budget in (0, 16)]
for _, _, meta, ql, qp, kv in cases:
    for _ in range(3):
        tree_mla_attention(ql, qp, kv, meta, SCALE, invariant=True)
torch.cuda.synchronize()
print("cases: 1 stream, prefix", pl, "decode then 17 rows")
torch.cuda.profiler.start()
for _, _, meta, ql, qp, kv in cases:
    tree_mla_attention(ql, qp, kv, meta, SCALE, invariant=True)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
EOF
)
REP="$OUTDIR/ncu_tree_attn"
timeout 150 "$NCU" --clock-control none --profile-from-start off -f -o "$REP" \
  -k 'regex:_tree_attn_inv_kernel|_combine_kernel' --import-source no \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section SourceCounters --section LaunchStats --section Occupancy \
  python3 -c "$DRIVER" >"$OUTDIR/ncu_tree_attn.stdout" 2>"$OUTDIR/ncu_tree_attn.stderr"
RC=$?
if [ $RC -ne 0 ] || [ ! -f "$REP.ncu-rep" ]; then
  say "ncu run failed (rc $RC; 124 = timeout). tails:"
  tail -15 "$OUTDIR/ncu_tree_attn.stdout" "$OUTDIR/ncu_tree_attn.stderr" | tee -a "$REPORT"
  exit 1
fi
"$NCU" --import "$REP.ncu-rep" --csv --page details >"$OUTDIR/ncu_tree_attn_details.csv" 2>&1
python3 "$ROOT/bench/ncu_report.py" "$OUTDIR/ncu_tree_attn_details.csv" | head -400 | tee -a "$REPORT"
# Per-instruction SASS with stall samples, one file per profiled kernel launch (ids 0..3).
: >"$OUTDIR/ncu_tree_attn_sass.csv"
for id in 0 1 2 3; do
  echo "### launch $id" >>"$OUTDIR/ncu_tree_attn_sass.csv"
  "$NCU" --import "$REP.ncu-rep" --csv --page source --print-source sass \
    --launch-skip "$id" --launch-count 1 >>"$OUTDIR/ncu_tree_attn_sass.csv" 2>&1 || true
done
python3 - "$OUTDIR/ncu_tree_attn_sass.csv" <<'EOF' >"$OUTDIR/ncu_tree_attn_sass.txt" 2>&1
import csv, io, sys
text = open(sys.argv[1]).read().split("### launch ")
for part in text[1:]:
    head, _, body = part.partition("\n")
    lines = [l for l in body.splitlines() if l.startswith('"') and not l.startswith('"Kernel Name"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    if not rows:
        print(f"launch {head}: no rows; first lines:\n" + "\n".join(body.splitlines()[:5]))
        continue
    cols = [c for c in rows[0] if c]
    samp = next((c for c in cols if "Sampling" in c and "All" in c), None) or next(
        (c for c in cols if "Sampl" in c), None)
    print(f"launch {head}: {len(rows)} instructions; columns: {cols}")
    def num(v):
        try: return float(str(v).replace(",", ""))
        except ValueError: return 0.0
    total = sum(num(r.get(samp, 0)) for r in rows) if samp else 0
    print(f"  total samples ({samp}): {total:.0f}")
    stall_cols = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    totals = sorted(((sum(num(r[c]) for r in rows), c) for c in stall_cols), reverse=True)
    print("  by reason: " + ", ".join(f"{c} {v:.0f}" for v, c in totals[:8] if v > 0))
    executed = sum(num(r.get("Instructions Executed", 0)) for r in rows)
    print(f"  warp instructions executed: {executed:.0f}")
    top = sorted(range(len(rows)), key=lambda i: -num(rows[i].get(samp, 0)))[:45]
    for i in sorted(top):
        r = rows[i]
        reasons = sorted(((num(r[c]), c) for c in stall_cols if num(r[c]) > 0), reverse=True)[:3]
        print(f"  {i:5d} {num(r.get(samp, 0)):7.0f} {r.get('Source', '')[:70]:70s} "
              + " ".join(f"{c[:28]}={v:.0f}" for v, c in reasons))
EOF
head -c 20000 "$OUTDIR/ncu_tree_attn_sass.txt"
exit 0
