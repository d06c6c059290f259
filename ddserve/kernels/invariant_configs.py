"""Launch configurations of the batch-invariant matmul (`invariant._mm_kernel`).

A configuration is a function of the weight's shape (N, K, heads) and dtype only -- never of the
row count M, or a row's arithmetic (tile sizes, K split) would depend on the batch. Everything
here must therefore stay fixed while a model serves: AR steps and DDTree verify forwards must
run the same configuration.

Candidate sets (chosen by `set_configs` or the environment variables DDSERVE_INVARIANT_CONFIGS
and DDSERVE_INVARIANT_FP32; bench/bench_dense.py times them against each other on the GPU):

16-bit weights (bf16 / fp16, tensor-core MMA, fp32 accumulation):
- "r1": round 1 (narrow BLOCK_N for bandwidth at small M, BLOCK_K 128, 4 warps, 3 stages).
- "a": BLOCK_M 64 (one warpgroup MMA), BLOCK_N 128 for wide weights (N >= 4096, K >= 1024),
  64 for N >= 1024, else 32; BLOCK_K 64, 4 warps, 4 stages; K split to at most 160 programs at
  M = 1 (the default).
- "b": BLOCK_M 128 / 8 warps for large weights (N*K >= 8M: lm_head, q_a, dense MLP), BLOCK_N
  128, BLOCK_K 64, 4 stages: best tensor-core use at M >= 128, twice the padded MMA work at
  M = 1.
- "c": BLOCK_M 64, BLOCK_N 256 / 8 warps for very wide weights (N >= 8192), 128 for N >= 2048,
  3 stages; K split to at most 264 programs (two per SM) at M = 1.
fp32 weights (the Router's gate):
- "ieee_r1": round 1 (32 x 16 x 32 tiles for the Router, fp32 FMA, K split 8 ways).
- "ieee": exact fp32 FMA, 32 x 32 x 32 tiles, K split up to 16 ways.
- "ieee64": exact fp32 FMA, 64 x 64 x 16 tiles, K split up to 32 ways.
- "tf32x3": three tf32 tensor-core MMAs per tile (hi*hi + hi*lo + lo*hi, about fp32 accuracy,
  not bitwise equal to torch's fp32 but row-invariant like every configuration here; the default).
An unknown value of either environment variable logs a warning naming the sets and the default
is used instead. Host-side only: this module imports no triton.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

import torch

from ddserve.kernels import backend


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MMConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split: int  # K ranges whose fp32 partials are summed in range order (1: no split)
    warps: int
    stages: int
    precision: str  # tl.dot input_precision for fp32 inputs ("ieee" / "tf32x3"); unused for 16-bit


def _split(programs: int, k: int, target: int, max_split: int, min_k: int) -> int:
    """Largest power-of-two split (<= max_split, K ranges >= min_k long) that keeps the program
    count at M = 1 within `target`: enough programs to stream the weight at small M, while the
    fp32 partials (M x N x split, written and read back) stay cheap at large M. A function of
    the weight only."""
    split = 1
    while split < max_split and programs * split * 2 <= target and k >= 2 * split * min_k:
        split *= 2
    return split


def _r1(n: int, k: int, heads: int) -> MMConfig:
    bn = 16 if n <= 1024 else 32 if n <= 8192 else 64
    bk = 128 if k >= 128 else 64
    programs, split = heads * _cdiv(n, bn), 1  # round 1's rule: split up to >= 128
    while split < 8 and programs * split < 128 and k >= 2 * split * 512:
        split *= 2
    return MMConfig(64, bn, bk, split, 4, 3, "")


def _a(n: int, k: int, heads: int) -> MMConfig:
    bn = 128 if n >= 4096 and k >= 1024 else 64 if n >= 1024 else 32
    return MMConfig(64, bn, 64, _split(heads * _cdiv(n, bn), k, 160, 8, 256), 4, 4, "")


def _b(n: int, k: int, heads: int) -> MMConfig:
    big = n * k >= 8 * 2**20
    bm, bn = (128, 128) if big else (64, 128 if n >= 4096 else 64 if n >= 1024 else 32)
    split = _split(heads * _cdiv(n, bn), k, 160, 8, 512)
    return MMConfig(bm, bn, 64, split, 8 if big else 4, 4, "")


def _c(n: int, k: int, heads: int) -> MMConfig:
    bn = 256 if n >= 8192 else 128 if n >= 2048 else 64
    split = _split(heads * _cdiv(n, bn), k, 264, 8, 256)
    return MMConfig(64, bn, 64, split, 8 if bn == 256 else 4, 3, "")


def _ieee_r1(n: int, k: int, heads: int) -> MMConfig:
    bn = 32 if n > 1024 else 16
    programs, split = heads * _cdiv(n, bn), 1
    while split < 8 and programs * split < 128 and k >= 2 * split * 512:
        split *= 2
    return MMConfig(32, bn, 32, split, 4, 3, "ieee")


def _ieee(n: int, k: int, heads: int) -> MMConfig:
    split = _split(heads * _cdiv(n, 32), k, 200, 16, 256)
    return MMConfig(32, 32, 32, split, 4, 3, "ieee")


def _ieee64(n: int, k: int, heads: int) -> MMConfig:
    split = _split(heads * _cdiv(n, 64), k, 200, 32, 128)
    return MMConfig(64, 64, 16, split, 4, 3, "ieee")


def _tf32x3(n: int, k: int, heads: int) -> MMConfig:
    split = _split(heads * _cdiv(n, 64), k, 200, 32, 128)
    return MMConfig(64, 64, 32, split, 4, 3, "tf32x3")


DENSE_SETS = {"r1": _r1, "a": _a, "b": _b, "c": _c}
FP32_SETS = {"ieee_r1": _ieee_r1, "ieee": _ieee, "ieee64": _ieee64, "tf32x3": _tf32x3}
log = logging.getLogger(__name__)


def _env_set(var: str, sets: dict, default: str) -> str:
    """The set named by environment variable `var`, or `default` (with a warning) if unknown."""
    name = os.environ.get(var, default)
    if name not in sets:
        log.warning("%s=%r is not one of %s: using %r", var, name, ", ".join(sorted(sets)), default)
        return default
    return name


_current = {
    "dense": _env_set("DDSERVE_INVARIANT_CONFIGS", DENSE_SETS, "a"),
    # tf32x3 on an H200: 0.8-1.7x torch's fp32 gate, row-invariant, 1.4e-6 max abs error vs fp64
    # (ieee: 3.5-5x torch); bench/results/dense_round2_2026-11-30.json
    "fp32": _env_set("DDSERVE_INVARIANT_FP32", FP32_SETS, "tf32x3"),
}


def _prefill(n: int, k: int, heads: int) -> MMConfig:
    """Prompt chunks (inside `backend.prefill_phase()`; hundreds to thousands of rows):
    compute-bound, so large tensor-core tiles and no K split (the split's fp32 partials cost
    M x N x split bytes). Still a function of the weight only: a prompt's rows do not depend on
    which other prompts share its chunk."""
    return MMConfig(128, 128 if n >= 128 else 64, 64, 1, 8, 4, "")


def set_configs(dense: str | None = None, fp32: str | None = None) -> None:
    """Select the candidate set for 16-bit and / or fp32 weights (benchmarks only: a serving
    process must not switch between its AR and verify forwards)."""
    if dense is not None and dense not in DENSE_SETS:
        raise ValueError(f"unknown dense config set {dense!r}; have {sorted(DENSE_SETS)}")
    if fp32 is not None and fp32 not in FP32_SETS:
        raise ValueError(f"unknown fp32 config set {fp32!r}; have {sorted(FP32_SETS)}")
    _current.update({k: v for k, v in (("dense", dense), ("fp32", fp32)) if v is not None})


def current_configs() -> dict[str, str]:
    return dict(_current)


def mm_config(n: int, k: int, dtype: torch.dtype, heads: int = 1) -> MMConfig:
    """The launch configuration for a [heads, K, N] weight of `dtype` in the current sets."""
    if dtype == torch.float32:
        return _cached(FP32_SETS[_current["fp32"]], n, k, heads)
    if backend.in_prefill_phase():
        return _cached(_prefill, n, k, heads)
    return _cached(DENSE_SETS[_current["dense"]], n, k, heads)


@functools.lru_cache(maxsize=1024)
def _cached(fn, n: int, k: int, heads: int) -> MMConfig:
    return fn(n, k, heads)
