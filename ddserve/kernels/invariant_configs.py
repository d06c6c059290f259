"""Launch configurations of the batch-invariant matmul (`invariant._mm_kernel`).

A configuration is a function of the weight's shape (N, K, heads) and dtype only -- never of the
row count M, or a row's arithmetic (tile sizes, K split) would depend on the batch. AR steps and
DDTree verify forwards run the same configuration; prompt chunks (inside
`backend.prefill_phase()`) run their own, since prompt rows are never compared with decode rows.

A K split of S gives S programs per output tile, each writing an fp32 partial that the tile's
last program sums in split order inside the same launch; its cost is those partials (M x N x S
x 4 bytes written and read back, mostly in L2), not a launch.

- 16-bit weights (bf16 / fp16, tensor-core MMA, fp32 accumulation), `_dense`: BLOCK_M 64 (one
  warpgroup MMA), BLOCK_N 128 for wide weights (N >= 4096, K >= 1024), 64 for N >= 1024, else
  32; BLOCK_K 64, 4 warps, 4 stages; K split (power of two, <= 16, K ranges >= DENSE_MIN_K =
  512) up to DENSE_PROGRAMS programs at M = 1 (two per H200 SM): at decode sizes the weight
  streams from HBM and one program per SM leaves bandwidth unused, while at a verify forward's
  hundreds of rows the partials of short K ranges cost more than they gain. At one K2.6 rank
  (tp = 8): q_a 7168->1536, kv_a 7168->576 and the shared expert's gate+up 7168->512 split 8,
  q_b 1536->1536 and o_proj 1024->7168 2, shared down 256->7168 and the absorbed matmuls 1.
  Timed at M = 1, 10, 17, 170 on an H200 (`bench/bench_dense.py --preset splitk`,
  bench/results/step/splitk_h200_2026-12-01.json), every split of these weights: the 512 floor
  is within 1 us of the fastest split at one row for each of them, and at 170 rows takes o_proj
  30 -> 23 us, the shared gate+up 21 -> 15 us and the absorbed 512->128 9.2 -> 8.0 us against
  the 256 floor.
- prompt chunks, 16-bit weights, `_prefill`: 128 x 128 (or 64 for N < 128) x 64 tiles, 8 warps,
  4 stages, no K split.
- fp32 weights (float32 models on CUDA; the Router's gate has its own kernel, `router.py`),
  `_tf32x3`: three tf32 tensor-core MMAs per tile (hi*hi + hi*lo + lo*hi, about fp32 accuracy,
  not bitwise equal to torch's fp32 but row-invariant);
  64 x 64 x 32 tiles, K split up to 32 ways. On an H200: 0.8-1.7x torch's fp32 gate, 1.4e-6 max
  abs error vs fp64 (bench/results/dense_round2_2026-11-30.json, with the split sum then a
  second launch).
Host-side only: this module imports no triton.
"""

from __future__ import annotations

import functools
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
    precision: str  # tl.dot input_precision for fp32 inputs ("tf32x3"); unused for 16-bit


DENSE_PROGRAMS = 264  # `_dense`'s program budget at M = 1: two per SM of an H200 (132 SMs)
DENSE_MIN_K = 512  # `_dense`'s shortest K range per split


def _split(programs: int, k: int, target: int, max_split: int, min_k: int) -> int:
    """Largest power-of-two split (<= max_split, K ranges >= min_k long) that keeps the program
    count at M = 1 within `target`: enough programs to stream the weight at small M, while the
    fp32 partials (M x N x split, written and read back) stay cheap at large M. A function of
    the weight only."""
    split = 1
    while split < max_split and programs * split * 2 <= target and k >= 2 * split * min_k:
        split *= 2
    return split


def _dense(n: int, k: int, heads: int) -> MMConfig:
    bn = 128 if n >= 4096 and k >= 1024 else 64 if n >= 1024 else 32
    split = _split(heads * _cdiv(n, bn), k, DENSE_PROGRAMS, 16, DENSE_MIN_K)
    return MMConfig(64, bn, 64, split, 4, 4, "")


def _tf32x3(n: int, k: int, heads: int) -> MMConfig:
    split = _split(heads * _cdiv(n, 64), k, 200, 32, 128)
    return MMConfig(64, 64, 32, split, 4, 3, "tf32x3")


def _prefill(n: int, k: int, heads: int) -> MMConfig:
    """Prompt chunks (inside `backend.prefill_phase()`; hundreds to thousands of rows):
    compute-bound, so large tensor-core tiles and no K split (the split's fp32 partials cost
    M x N x split bytes). Still a function of the weight only: a prompt's rows do not depend on
    which other prompts share its chunk."""
    return MMConfig(128, 128 if n >= 128 else 64, 64, 1, 8, 4, "")


def mm_config(n: int, k: int, dtype: torch.dtype, heads: int = 1) -> MMConfig:
    """The launch configuration for a [heads, K, N] weight of `dtype` (in the current phase)."""
    if dtype == torch.float32:
        return _cached(_tf32x3, n, k, heads)
    if backend.in_prefill_phase():
        return _cached(_prefill, n, k, heads)
    return _cached(_dense, n, k, heads)


@functools.lru_cache(maxsize=1024)
def _cached(fn, n: int, k: int, heads: int) -> MMConfig:
    return fn(n, k, heads)
