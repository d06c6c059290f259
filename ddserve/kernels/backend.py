"""The one place that chooses kernel backends. The choice is logged once per process.

Which kernel serves what (an engine's forwards run inside `kernel_mode(its KernelConfig)`,
batch-invariant by default; prompt chunks also inside `prefill_phase()`):

CPU, any dtype (and float32 activations on CUDA for attention and the MoE): the torch references.
- tree attention: `tree_attn.tree_mla_attention_ref`
- routed experts: `moe_ref.moe_ref` (INT4 experts dequantized once to float32 by the model)
- linear, bmm_heads, rms_norm: `invariant_ref` (torch); row_sum: `invariant_ref.fixed_order_sum`
  in batch-invariant mode, torch's sum otherwise
- add_rms_norm, mla_rope_cache, mla_latent, linear_rope, silu_mul: `fused_ref`'s torch sequences
  (the unfused model's ops)

CUDA, bf16 / fp16 activations, batch-invariant mode on:
- linear, bmm_heads (any float dtype): `invariant._mm_kernel` (a configuration that splits K
  sums its partials in split order inside the same launch), configurations from
  `invariant_configs.mm_config`: `_dense` for 16-bit weights, `_prefill` inside
  `prefill_phase()`, `_tf32x3` for float32 weights (float32 models)
- rms_norm: `invariant._rms_kernel`; row_sum of <= 8 float32 values: `invariant.row_sum8`
- add_rms_norm (residual add + RMSNorm): `fused._add_rms_kernel`
- mla_rope_cache (kv_a_layernorm, RoPE, cache write; 16-bit cache): `fused._mla_rope_cache_kernel`
- where `fuses_mla_latent` holds (MLA's q_b matmul configuration has one column tile per head's
  rope part: decode and verify forwards at K2.6 shapes), MLA runs instead mla_latent
  (q_a_layernorm, kv_a_layernorm, RoPE of k_pe, cache write): `fused._mla_latent_kernel`, and
  linear_rope (q_b_proj with the query's RoPE in the epilogue): `invariant._mm_kernel` (ROPE)
- silu_mul: `fused._silu_mul_kernel`
- route (the MoE router, any float activations): `router._gate_partials_kernel` + `_select_kernel`
- tree attention: `tree_attn_triton.tree_mla_attention(invariant=True)` ->
  `tree_attn_invariant._tree_attn_inv_kernel` with its device's configuration (SPLIT 256; BN 64
  in 3 stages on H100/H200, else 32; BM 32, or 16 for decode and small calls; one 256-key group
  per program, or one key tile per program for small decode calls), `_combine_kernel` merging the
  splits when there is more than one (a merge inside the first launch measured slower on an
  H200: BENCHMARKS.md)
- routed experts: `moe_triton.fused_moe`: INT4 experts with bf16 scales run v3 (`moe_v3`, Gluon
  kernel `moe_gluon`, experts repacked in place by `moe_w4_repack`, expert alignment
  `moe_align.align_by_expert_triton` (its torch version past 8192 pairs; none for one token),
  SiLU-and-mul in the up GEMM's launch (`moe_gluon._w4_up_silu_kernel`), fixed-order sums in
  `moe_reduce`); if v3 fails on its first call (compile or launch), v2 from
  then on. `moe_pairs`: v3 without its top-k combine, which the shared expert's down matmul
  then does in its epilogue (`linear(..., add_topk=k)`), up to `moe_triton.PAIRS_MAX_TOKENS`
  tokens.
  Dense experts or non-bf16 scales run v2 (`moe_triton_v2`, its fixed tile config, asm dequant
  from `moe_w4_tiles` when the scales are bf16, pure Triton dequant if that fails to compile).
CUDA, either mode: the MoE's shared expert (gate/up matmul and SiLU) runs on a second stream
beside the routed experts, forked after the router (`side_branch`; `KernelConfig.side_stream`,
DDSERVE_SIDE_STREAM=0 turns it off), joined before its down matmul.
CUDA sm_90+: every Triton / Gluon kernel of those paths launches with programmatic dependent
launch (`pdl.py`; `KernelConfig.pdl`, DDSERVE_PDL=0 turns it off), waiting on the device for its
predecessor; the matmul, the router's gate and verify-call tree attention prefetch their first
weight / key lines into L2 before that wait. A linear may take `add` (the MoE's routed output
added in the shared expert's down matmul), bitwise `linear(x, w) + add`.
CUDA, either mode: the DDTree builder's first stage (each depth's top-k draft tokens and
log-probs): `draft_topk._segment_kernel` + `_select_kernel` (k <= 256; torch's log_softmax +
topk beyond it and on CPU); its second stage (the tree from those top-k, best-first pops, the
torch beam's tensors bit for bit): `tree_beam._tree_beam_kernel` (budget <= 256; the torch beam
`ddtree.tree.tree_from_topk_torch` beyond it and on CPU).
CUDA, either mode: the DFlash drafter's block attention reads each stream's context in its ring
(`ring_attention`: `drafter_attn._partial_kernel` + `_merge_kernel`); on CPU the drafter
gathers the rows and runs torch matmuls (`drafter.layers.grouped_attention`).
CUDA, batch-invariant mode off: the same MoE; tree attention `tree_attn_triton._tree_attn_kernel`
(tiles tuned per call); linear / bmm_heads / rms_norm / row_sum in torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from ddserve.kernels.config import KernelConfig

if TYPE_CHECKING:
    from ddserve.kernels.router_ref import RoutingParams

log = logging.getLogger(__name__)


HALF = (torch.bfloat16, torch.float16)

# The configuration of the forwards running now (`config.KernelConfig`). In batch-invariant mode
# every kernel computes each token's row with the same arithmetic in the same order whatever else
# is in the batch (and, for attention, whether a key is a prefix key or a tree key), so a DDTree
# verify row equals the autoregressive row bit for bit in 16-bit dtypes. ModelRunner runs each of
# its forwards inside `kernel_mode(its config)`; outside an engine it is `set_batch_invariant`'s
# (default: batch invariance off, MoE variant chosen per call).
_current = KernelConfig()


def current() -> KernelConfig:
    return _current


@contextlib.contextmanager
def kernel_mode(cfg: KernelConfig) -> Iterator[None]:
    """`cfg` for the forwards inside (engines with different settings in one process do not leak
    into each other); restored on exit."""
    global _current
    before, _current = _current, cfg
    try:
        yield
    finally:
        _current = before


def invariant_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """The current configuration with batch invariance `on`, for the forwards inside."""
    return kernel_mode(dataclasses.replace(_current, batch_invariant=bool(on)))


def set_batch_invariant(on: bool) -> None:
    """Batch invariance outside any `kernel_mode` (tests, benchmarks)."""
    global _current
    if on != _current.batch_invariant:
        log.info("batch-invariant kernels: %s", "on" if on else "off")
    _current = dataclasses.replace(_current, batch_invariant=bool(on))


def batch_invariant() -> bool:
    return _current.batch_invariant


def _half_only(fast: Callable, ref: Callable) -> Callable:
    """The Triton attention / MoE kernels take 16-bit activations; float32 runs use their torch
    references (the dense ops have their own rule: `_invariant_for`).
    The fast kernel is told the batch-invariant mode at every call."""

    @functools.wraps(fast)
    def call(x: torch.Tensor, *args, **kwargs):
        if x.dtype in HALF:
            return fast(x, *args, invariant=_current.batch_invariant, **kwargs)
        return ref(x, *args, **kwargs)

    return call


@functools.cache
def tree_attention(device_type: str) -> Callable:
    """`tree_mla_attention_ref`'s signature; Triton on CUDA when it imports, else the reference."""
    from ddserve.kernels.tree_attn import tree_mla_attention_ref

    impl, name = tree_mla_attention_ref, "torch reference"
    if device_type == "cuda":
        try:
            from ddserve.kernels.tree_attn_triton import tree_mla_attention

            impl = _half_only(tree_mla_attention, tree_mla_attention_ref)
            name = "triton (bf16/fp16; float32 uses the reference)"
        except ImportError as e:  # pragma: no cover - depends on the machine
            log.warning("triton tree attention unavailable (%s); using the torch reference", e)
    log.info("tree attention backend on %s: %s", device_type, name)
    return impl


def moe_pairs(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights
) -> torch.Tensor | None:
    """The routed experts without their top-k combine: [T * k, D] (`moe_v3.CONFIG["PAIRS"]`),
    pair t * k + j the output of token t's slot-j expert times its weight, for a caller that
    folds the combine into a later launch (`linear(..., add_topk=k)`). Only where the Gluon MoE
    (v3) runs these experts and the fold pays (`moe_triton.fused_moe_pairs`: CUDA,
    batch-invariant mode, 16-bit x, no other MoE variant asked for, experts already repacked in
    place for v3 by an earlier call, at most `moe_triton.PAIRS_MAX_TOKENS` tokens); None
    elsewhere, and the caller uses `moe`."""
    if not (_current.batch_invariant and x.device.type == "cuda" and x.dtype in HALF):
        return None
    kernels = _triton_module("moe_triton")
    pairs = None if kernels is None else kernels.fused_moe_pairs(x, topk_ids, topk_weights, weights)
    _note("moe_pairs", "v3 pairs, combine in the shared down matmul" if pairs is not None else
          "v3 with its combine launch")  # fmt: skip
    return pairs


def draft_topk(
    draft_logits: torch.Tensor, k: int, floor: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each draft row's k most probable tokens (log-probs [B, D, k] float32 clamped at `floor`,
    descending; tokens int64) by the fused kernel (`draft_topk.draft_topk`: ties to the lower
    token, deterministic) where it serves these logits (CUDA, Triton imports, `supports`); None
    elsewhere, and the caller runs its torch log_softmax + topk (`ddtree.tree`). Not tied to
    batch-invariant mode: the draft tree only shapes which tokens are verified."""
    if draft_logits.device.type != "cuda":
        return None
    kernels = _triton_module("draft_topk")
    use = kernels is not None and kernels.supports(draft_logits, k)
    _note("draft_topk", "triton fused" if use else f"torch (k={k}, {draft_logits.dtype})")
    return kernels.draft_topk(draft_logits, k, floor) if use else None


def ring_attention(
    q: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, rows: torch.Tensor,
    k_blk: torch.Tensor, v_blk: torch.Tensor, visible: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """The DFlash drafter's block attention over each stream's context read in place in its ring
    (`drafter_attn.ring_attention`, shapes there) where Triton imports and the kernel takes the
    shapes (`drafter_attn.supports`); None otherwise, and the caller gathers the rows and runs
    `drafter.layers.grouped_attention`. The caller picks the device: the drafter asks for it
    where it lives on CUDA (`DFlashDrafter.ring_attention`; CPU tensors run only under Triton's
    interpreter). Not tied to batch-invariant mode: the draft only shapes which tokens are
    verified."""
    kernels = _triton_module("drafter_attn")
    use = kernels is not None and kernels.supports(q, ring_k)
    _note("drafter_attn", "triton, ring in place" if use else
          f"torch, rows gathered (head size {q.shape[-1]})")  # fmt: skip
    if not use:
        return None
    return kernels.ring_attention(q, ring_k, ring_v, rows, k_blk, v_blk, visible, lengths=lengths)


def tree_beam(
    top_lp: torch.Tensor, top_tok: torch.Tensor, budget: int
) -> tuple[torch.Tensor, ...] | None:
    """The DDTree builder's second stage (tokens, parents, depths, visible, scores of the
    `budget`-node tree from each depth's top-k) by the fused kernel (`tree_beam.tree_beam`: the
    torch beam's tensors bit for bit on `top_draft_tokens`' outputs) where it serves these inputs
    (CUDA, Triton imports, `supports`); None elsewhere, and the caller runs its torch beam
    (`ddtree.tree`). Not tied to batch-invariant mode, like `draft_topk`."""
    if top_lp.device.type != "cuda":
        return None
    kernels = _triton_module("tree_beam")
    use = kernels is not None and kernels.supports(top_lp, top_tok, budget)
    _note("tree_beam", "triton fused" if use else f"torch (budget={budget}, {top_lp.dtype})")
    return kernels.tree_beam(top_lp, top_tok, budget) if use else None


@functools.cache
def moe(device_type: str) -> Callable:
    """`ddserve.kernels.moe_ref.moe_ref`'s signature; Triton / Gluon on CUDA when it imports, else
    the reference."""
    from ddserve.kernels.moe_ref import moe_ref

    impl, name = moe_ref, "torch reference"
    if device_type == "cuda":
        try:
            from ddserve.kernels.moe_triton import fused_moe

            impl = _half_only(fused_moe, moe_ref)
            name = "triton (bf16/fp16; float32 uses the reference)"
        except ImportError as e:  # pragma: no cover - depends on the machine
            log.warning("triton moe unavailable (%s); using the torch reference", e)
    log.info("moe backend on %s: %s", device_type, name)
    return impl


# Prompt-chunk forwards run inside `prefill_phase()`: there the batch-invariant 16-bit matmuls
# take large-tile, no-split configurations (`invariant_configs.mm_config` reads the phase).
# Prefill rows are never compared with decode rows (they only write the prompt's KV), so the two
# phases may differ; each phase on its own is row-invariant.
_prefill = False


@contextlib.contextmanager
def prefill_phase() -> Iterator[None]:
    """The phase for the forwards inside (nesting keeps it); restored on exit."""
    global _prefill
    before, _prefill = _prefill, True
    try:
        yield
    finally:
        _prefill = before


def in_prefill_phase() -> bool:
    return _prefill


# True while `side_branch`'s body issues its kernels: launches that keep per-stream scratch
# (the split-K matmul's partials and tickets) take the side stream's own.
_on_side = False


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def on_side_stream() -> bool:
    return _on_side


@contextlib.contextmanager
def side_branch(x: torch.Tensor) -> Iterator[Callable[[], None]]:
    """The body's kernels on x's device's second stream, concurrent with what the caller queues
    next on its own: the side stream first waits for everything queued so far on the current
    stream (x is ready). Yields `join`, which makes the current stream wait for the body's
    work; call it before using any tensor the body made. Works under CUDA-graph capture (the
    fork and the join become graph edges). Where the configuration runs no side stream (CPU,
    `KernelConfig.side_stream` off) the body runs in place and `join` does nothing.

    Lifetimes (no `record_stream`): every tensor the body reads must stay referenced by the
    caller until `join` (else the current stream may reuse its memory while the side stream
    still reads it); the body's tensors come from the side stream's pool, and the caller uses
    them only after `join` and drops them before the next `side_branch`, whose fork then orders
    the side stream's reuse of their memory after those uses. Call `join` on every path, errors
    included (a CUDA-graph capture cannot end with the side stream unjoined). Kernels do not
    change: the results are bitwise those of running the body in place."""
    global _on_side
    if x.device.type != "cuda" or not _current.side_stream:
        yield lambda: None
        return
    assert not _on_side, "side branches do not nest"
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    side.wait_stream(main)
    _on_side = True
    try:
        with torch.cuda.stream(side):
            yield lambda: main.wait_stream(side)
    finally:
        _on_side = False


def device_type(t: torch.Tensor | torch.device) -> str:
    return (t.device if isinstance(t, torch.Tensor) else t).type


# ---- batch-invariant dense ops (Triton in invariant.py, torch in invariant_ref.py) -------------
# Chosen per call: the mode can change between engines, and a model also runs on the CPU.
# float32: every dense op of a float32 model on CUDA in batch-invariant mode (the Router's gate
# has its own kernel, `route` below); computed per `invariant_configs` ("tf32x3": three
# tensor-core products, about fp32 accuracy, row-invariant, not bitwise torch's fp32)
INVARIANT_DTYPES = (*HALF, torch.float32)


@functools.cache
def _note(op: str, choice: str) -> None:
    log.info("%s backend: %s", op, choice)


@functools.cache
def _triton_module(name: str):
    """ddserve.kernels.<name> (a Triton kernel module), or None when it does not import (logged
    once per module: the torch references run instead)."""
    import importlib

    try:
        return importlib.import_module(f"ddserve.kernels.{name}")
    except ImportError as e:  # pragma: no cover - depends on the machine
        log.warning("triton kernels %s unavailable (%s); using torch", name, e)
        return None


def _invariant_for(op: str, x: torch.Tensor):
    """The invariant kernels when the mode is on, x is on CUDA in a supported dtype; else None."""
    use = _current.batch_invariant and x.device.type == "cuda" and x.dtype in INVARIANT_DTYPES
    kernels = _triton_module("invariant") if use else None
    _note(op, f"triton batch-invariant ({x.dtype})" if kernels else f"torch ({x.device.type})")
    return kernels


def linear(
    x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None, *, add_topk: int = 0
) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] (F.linear's semantics), then + `add` when given (one
    launch on the batch-invariant path, the same bits as the torch ops it stands for).
    add_topk = k > 0: `add` is [M * k, N] fp32 or bf16, k rows per output row summed in slot
    order in fp32 and rounded (the MoE's top-k combine, `invariant_ref.combine_ref`) before the
    add."""
    from ddserve.kernels.invariant_ref import combine_ref, linear_ref

    kernels = _invariant_for("linear", x)
    if kernels:
        return kernels.linear(x, w, add, add_topk=add_topk)
    if add_topk and (add is None or add.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError("add_topk needs add: the [M * k, N] float32 or bfloat16 pair rows")
    y = linear_ref(x, w)
    if add is not None and add_topk:
        add = combine_ref(add, add_topk, y.dtype).view(y.shape)
    return y if add is None else y + add


def bmm_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head matmul x [T, H, K] @ w [H, K, N] -> [T, H, N] (MLA's absorbed einsums)."""
    from ddserve.kernels.invariant_ref import bmm_heads_ref

    kernels = _invariant_for("bmm_heads", x)
    return kernels.bmm_heads(x, w) if kernels else bmm_heads_ref(x, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (`invariant_ref.rms_norm_ref`'s order of operations)."""
    from ddserve.kernels.invariant_ref import rms_norm_ref

    kernels = _invariant_for("rms_norm", x)
    return kernels.rms_norm(x, weight, eps) if kernels else rms_norm_ref(x, weight, eps)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, keepdim: a fixed pairwise order in batch-invariant mode (any
    device; one Triton launch for <= 8 fp32 values on CUDA, else log2(n) elementwise adds),
    torch's sum otherwise."""
    from ddserve.kernels.invariant_ref import fixed_order_sum

    if not _current.batch_invariant:
        return x.sum(dim=-1, keepdim=True)
    if x.dtype == torch.float32 and x.shape[-1] <= 8:
        kernels = _invariant_for("row_sum", x)
        if kernels:
            return kernels.row_sum8(x)
    return fixed_order_sum(x)


# ---- fused elementwise ops of a decoder layer (Triton in fused.py, torch in fused_ref.py) -------
# One launch each where torch needs several; run on CUDA for 16-bit activations in batch-invariant
# mode (their RMSNorms are `invariant.rms_norm`'s arithmetic). Elsewhere the torch sequence they
# replace, with `rms_norm` above as its norm, so the CPU path is the unfused model bit for bit.


def _fused_for(op: str, x: torch.Tensor):
    """The fused kernels when the mode is on and x is 16-bit on CUDA; else None."""
    use = _current.batch_invariant and x.device.type == "cuda" and x.dtype in HALF
    kernels = _triton_module("fused") if use else None
    _note(op, f"triton fused ({x.dtype})" if kernels else f"torch sequence ({x.device.type})")
    return kernels


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, n): s = x + residual in x.dtype (the residual stream), n = `rms_norm(s)` bitwise;
    fused when residual and weight have x's dtype."""
    from ddserve.kernels.fused_ref import add_rms_norm_ref

    kernels = _fused_for("add_rms_norm", x)
    if kernels and residual.dtype == weight.dtype == x.dtype:
        return kernels.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps, rms_norm=rms_norm)


def mla_rope_cache(
    q: torch.Tensor,  # [T, H, nope + P]
    kv: torch.Tensor,  # [T, R + P]
    norm_weight: torch.Tensor,  # [R]
    eps: float,
    cos: torch.Tensor,  # [T, P]
    sin: torch.Tensor,  # [T, P]
    kv_cache: torch.Tensor,  # [S, R + P]
    slots: torch.Tensor,  # [T]
    interleave: bool,
) -> torch.Tensor:  # [T, H, P] contiguous
    """MLA's latent path (`fused_ref.mla_rope_cache_ref`): writes kv_cache[slots] =
    [rms_norm(c_kv) | rope(k_pe)] in the cache's dtype, returns the query's rotated rope part;
    fused when the cache, the norm's weight and q are 16-bit too."""
    from ddserve.kernels.fused_ref import mla_rope_cache_ref

    kernels = _fused_for("mla_rope_cache", kv)
    args = (q, kv, norm_weight, eps, cos, sin, kv_cache, slots, interleave)
    if kernels and kv_cache.dtype in HALF and norm_weight.dtype == q.dtype == kv.dtype:
        return kernels.mla_rope_cache(*args)
    return mla_rope_cache_ref(*args, rms_norm=rms_norm)


def fuses_mla_latent(
    q_a: torch.Tensor, kv_cache: torch.Tensor, q_b: torch.Tensor, nope: int, rope_dim: int
) -> bool:
    """Whether `mla_latent` and `linear_rope` each run as one launch for MLA's operands (q_a
    [T, q_lora], the latent cache [S, R + P], q_b_proj's weight [H * (nope + P), q_lora]):
    16-bit q_a and cache on CUDA in batch-invariant mode, both norms in one launch's warps
    (`fused.mla_latent_fits`), each head's rope part one column tile of q_b's matmul
    configuration in the current phase (`invariant.rope_tiles_fit`). Then they replace
    `rms_norm` + `linear` + `mla_rope_cache`, one launch fewer, the same bits."""
    fused = _fused_for("mla_latent", q_a)
    inv = _invariant_for("linear_rope", q_a)
    split = bool(fused and inv and kv_cache.dtype in HALF and q_b.dtype == q_a.dtype)
    if split:
        n, k = q_b.shape
        split = fused.mla_latent_fits(q_a.shape[-1], kv_cache.shape[-1] - rope_dim)
        split = split and inv.rope_tiles_fit(n, k, q_a.dtype, nope, rope_dim)
    phase = "prompt chunks" if _prefill else "decode / verify"
    _note(f"MLA latent path ({phase})", "mla_latent + linear_rope" if split else "mla_rope_cache")
    return split


def mla_latent(
    q_a: torch.Tensor,  # [T, q_lora]
    q_norm_weight: torch.Tensor,  # [q_lora]
    q_eps: float,
    kv: torch.Tensor,  # [T, R + P]
    norm_weight: torch.Tensor,  # [R]
    eps: float,
    cos: torch.Tensor,  # [T, P]
    sin: torch.Tensor,  # [T, P]
    kv_cache: torch.Tensor,  # [S, R + P]
    slots: torch.Tensor,  # [T]
    interleave: bool,
) -> torch.Tensor:  # [T, q_lora]
    """MLA's latent path with the query's norm (`fused_ref.mla_latent_ref`): writes
    kv_cache[slots] = [rms_norm(c_kv) | rope(k_pe)] in the cache's dtype, returns
    rms_norm(q_a); fused where `fuses_mla_latent`'s conditions on it hold."""
    from ddserve.kernels.fused_ref import mla_latent_ref

    kernels = _fused_for("mla_latent", kv)
    args = (q_a, q_norm_weight, q_eps, kv, norm_weight, eps, cos, sin, kv_cache, slots, interleave)
    one_dtype = q_a.dtype == q_norm_weight.dtype == norm_weight.dtype == kv.dtype
    if kernels and kv_cache.dtype in HALF and one_dtype:
        if kernels.mla_latent_fits(q_a.shape[-1], norm_weight.shape[0]):
            return kernels.mla_latent(*args)
    return mla_latent_ref(*args, rms_norm=rms_norm)


def linear_rope(
    x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nope: int,
    interleave: bool,
) -> torch.Tensor:  # fmt: skip
    """x [T, K] @ w [H * (nope + P), K]^T with each head's last P columns rotated
    (`fused_ref.linear_rope_ref`); one launch where `invariant.rope_tiles_fit`."""
    from ddserve.kernels.fused_ref import linear_rope_ref

    kernels = _invariant_for("linear_rope", x)
    n, k = w.shape
    if kernels and kernels.rope_tiles_fit(n, k, x.dtype, nope, cos.shape[-1]):
        return kernels.linear_rope(x, w, cos, sin, nope, interleave)
    return linear_rope_ref(x, w, cos, sin, nope, interleave, linear=linear)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2I] (gate first) -> F.silu(gate) * up [..., I], bitwise torch's."""
    from ddserve.kernels.fused_ref import silu_mul_ref

    kernels = _fused_for("silu_mul", gu)
    return kernels.silu_mul(gu) if kernels else silu_mul_ref(gu)


# ---- the MoE router (Triton in router.py, torch in router_ref.py) -----------------------------
def route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, params: RoutingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """`router_ref.route_ref`'s contract: x [T, D], gate [E, D] fp32 or bf16, bias [E] fp32,
    `RoutingParams` -> ids [T, k] int64, weights [T, k] fp32. Batch-invariant mode on CUDA: the
    fused router (two launches, fixed-order fp32); otherwise the torch math with this module's
    `linear` and `row_sum`."""
    from ddserve.kernels.router_ref import route_ref

    use = _current.batch_invariant and x.device.type == "cuda"
    kernels = _triton_module("router") if use else None
    _note("route", "triton batch-invariant router" if kernels else f"torch ({x.device.type})")
    if kernels:
        return kernels.route(x, weight, bias, params)
    return route_ref(x, weight, bias, params, linear=linear, row_sum=row_sum)
