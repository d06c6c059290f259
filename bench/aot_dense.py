"""Offline sm_90 compile of the batch-invariant matmul in its configurations (no GPU needed).

Compiles `invariant._mm_kernel` as `_launch` launches it (16-byte aligned pointers, row strides
divisible by 16, unit stride along K) at the bench_dense shapes, with the configurations of
`invariant_configs` for decode / verify forwards and for prompt chunks (`backend.prefill_phase()`),
and reports per (phase, weight): shared memory, registers and spill bytes (ptxas -v), whether the
loads are pipelined (cp.async) and whether the dot is a wgmma. A kernel that spills or does not
pipeline will be slow on the GPU whatever its tiles.

    PYTHONPATH=. python3 bench/aot_dense.py [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from bench_dense import OPS, H, is_matmul
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ddserve.kernels import backend, invariant, invariant_configs

STRIDES = ["sxm", "sxh", "sxk", "swh", "swk", "swn", "sps", "sym", "syh", "syn"]
UNIT = {"sxk": 1, "swk": 1, "syn": 1}  # linear: x, w contiguous along K, y along N


def compile_one(cfg: invariant_configs.MMConfig, k: int, dtype: torch.dtype) -> dict:
    ty = "*bf16" if dtype == torch.bfloat16 else "*fp32"
    part, tick = (ty, ty) if cfg.split == 1 else ("*fp32", "*i32")  # as `_launch` passes them
    sig = {"x_ptr": ty, "w_ptr": ty, "y_ptr": ty, "r_ptr": ty, "part_ptr": part,
           "ticket_ptr": tick, "M": "i32"}  # fmt: skip
    sig.update({"N": "i32", "K": "constexpr"})
    sig.update({s: "constexpr" if s in UNIT else "i32" for s in STRIDES})
    consts = dict(UNIT, K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    k_per = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k
    consts.update(SPLIT=cfg.split, K_PER=k_per, FP32=dtype == torch.float32)
    # as `_launch` launches it on an sm_90 device: PDL, with the weight prefetch before the wait
    step = 128 // (2 if dtype != torch.float32 else 4)
    lines = min(triton.next_power_of_2(triton.cdiv(k_per, step)),
                invariant.PREFETCH_BYTES // (128 * cfg.block_n))  # fmt: skip
    consts.update(PRECISION=cfg.precision, INTERPRET=False, REDUCE=True, PF_LINES=lines)
    consts.update(PF_STEP=step, PDL=True, ADD=False)
    sig.update({c: "constexpr" for c in consts if c not in sig})
    names = list(sig)
    div16 = ["x_ptr", "w_ptr", "y_ptr", "r_ptr", "part_ptr", "ticket_ptr", "N"]
    div16 += [s for s in STRIDES if s not in UNIT]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div16}
    src = ASTSource(invariant._mm_kernel, sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": cfg.warps, "num_stages": cfg.stages, "launch_pdl": True}
    c = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts)
    ptx = c.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        cmd = [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull]
        log = subprocess.run(cmd, capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return {
        "shared_bytes": c.metadata.shared,
        "registers": int(regs[0]) if regs else None,
        "spill_store_bytes": int(spills[0]) if spills else None,
        "cp_async": ptx.count("cp.async"),
        "wgmma": "wgmma" in ptx,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out: dict = {}
    for s in ("decode", "prefill"):
        for name, (kind, n, k) in OPS.items():
            fp32 = kind == "router"
            if not is_matmul(kind) or (fp32 and s == "prefill"):
                continue
            dtype = torch.float32 if fp32 else torch.bfloat16
            phase = backend.prefill_phase() if s == "prefill" else contextlib.nullcontext()
            with phase:
                cfg = invariant_configs.mm_config(n, k, dtype, H if kind.startswith("bmm") else 1)
            try:
                rec = dict(cfg._asdict(), **compile_one(cfg, k, dtype))
            except Exception as e:  # noqa: BLE001 - report and go on
                rec = dict(cfg._asdict(), error=f"{type(e).__name__}: {str(e)[:300]}")
            out.setdefault(s, {})[name] = rec
            print(f"{s:7s} {name:26s} {json.dumps(rec)}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
