"""Dense MLP and the DeepSeek-V3 MoE layer (noaux_tc sigmoid routing, shared experts).

Routing (`kernels/router_ref.py`): gate logits in fp32, sigmoid scores; experts are *chosen* on
score + e_score_correction_bias, restricted to the best `topk_group` groups (a group's score
is the sum of its top-2 biased scores), and *weighted* by the unbiased scores, normalised if
`norm_topk_prob`, times `routed_scaling_factor`. Routed experts run through `backend.moe`, or,
for a few tokens on the GPU, `backend.moe_pairs`, whose per-expert outputs the shared expert's
down matmul sums in its epilogue; shared experts are added unscaled; one all-reduce sums the
per-rank partials of both. On CUDA (unless `KernelConfig.side_stream` is off) the shared expert's
gate/up and SiLU run on a second stream beside the routed experts (`backend.side_branch`, forked
after the router), joined before its down matmul.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ddserve.config import ModelConfig
from ddserve.distributed import Communicator
from ddserve.kernels import backend
from ddserve.kernels.moe_ref import ExpertWeights
from ddserve.kernels.router_ref import RoutingParams
from ddserve.model.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    empty_param,
    reduce_partials,
    shard_size,
)
from ddserve.model.quant import GROUP, PACK, check_int4_split, dequantize_int4
from ddserve.stacked import share_rows, stacked_rows

log = logging.getLogger(__name__)


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); intermediate dim split across ranks.

    `gate_proj.weight` and `up_proj.weight` [I_local, D] are views of one [2 * I_local, D]
    buffer, back to back (the loader copies into them in place), so on the CUDA batch-invariant
    path gate and up are one matmul followed by one fused silu-mul. Elsewhere they run as two
    matmuls and torch's silu and mul (the CPU reference).
    """

    def __init__(self, hidden: int, inter: int, comm: Communicator, dtype, device, reduce=True):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inter, comm, dtype, device)
        self.up_proj = ColumnParallelLinear(hidden, inter, comm, dtype, device)
        self.down_proj = RowParallelLinear(inter, hidden, comm, dtype, device, reduce=reduce)
        share_rows(self.gate_proj, self.up_proj)  # one [2 I_local, D] buffer

    def gate_up_weight(self) -> torch.Tensor | None:
        """[2 * I_local, D]: gate_proj.weight's rows then up_proj.weight's, one tensor, while
        the two still lie back to back in one buffer (as built); None if either was replaced."""
        g, u = self.gate_proj.weight, self.up_proj.weight
        return stacked_rows(g, u) if g.shape == u.shape else None

    def forward(
        self, x: torch.Tensor, add: torch.Tensor | None = None, *, add_topk: int = 0
    ) -> torch.Tensor:
        """[T, D] -> [T, D]; plus `add` in the down projection's launch (reduce=False only;
        `add_topk` as `backend.linear` takes it)."""
        return self.down_proj(self.activation(x), add=add, add_topk=add_topk)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x): [T, D] -> [T, I_local], the down projection's input."""
        merged = None
        if backend.batch_invariant() and x.device.type == "cuda":
            merged = self.gate_up_weight()
        if merged is None:
            return F.silu(self.gate_proj(x)) * self.up_proj(x)  # [T, I_local]
        # one matmul, then silu(gate) * up in one launch (bitwise the torch ops)
        return backend.silu_mul(backend.linear(x, merged))  # [T, 2 I_local] -> [T, I_local]


class Router(nn.Module):
    """Checkpoint names `mlp.gate.weight` [E, D] and `mlp.gate.e_score_correction_bias` [E];
    the math is `router_ref.route_ref` (`backend.route` picks the fused kernel or torch)."""

    def __init__(self, cfg: ModelConfig, dtype, device) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        # kept in float32: routing runs in fp32 (as the reference does), so store it once rather
        # than casting [E, D] on every forward
        self.weight = empty_param((e, cfg.hidden_size), torch.float32, device)
        self.e_score_correction_bias = empty_param((e,), torch.float32, device)
        self.params = RoutingParams.from_config(cfg)
        self._bf16: tuple[tuple[int, int], torch.Tensor | None] | None = None
        self._fp32_captured = False  # a capture read the fp32 gate: every forward keeps it
        self._retired: list[torch.Tensor] = []  # copies a captured graph may still read

    def gate_for(self, x: torch.Tensor) -> torch.Tensor:
        """The gate the router reads for `x`. For bf16 x on the fused router (CUDA, batch-
        invariant mode): a bf16 copy of `weight` when that copy holds its values exactly
        (checkpoints store the gate in bf16, so the fp32 parameter is a widening); the fused
        router then reads half the bytes and runs bf16 tensor-core products, which are exact
        (`kernels/router.py`). Otherwise `weight` itself. The copy costs half the fp32 gate's
        memory (5.5 MB per layer at K2.6's tp = 8 shapes).

        After `weight` is written (its version changes; the loader writes through the
        parameter) the copy is checked again and refreshed in place, so CUDA graphs captured
        on it read the new gate. A first use inside a capture (no exactness check can run
        there) makes this router read the fp32 gate from then on, eager or captured. If a write
        leaves values that bf16 cannot hold, eager forwards read the fp32 gate while graphs
        captured on the copy still read it: recapture them."""
        w = self.weight
        on_fused = x.dtype == torch.bfloat16 and w.device.type == "cuda"
        on_fused = on_fused and backend.batch_invariant() and not w.is_inference()
        if not on_fused or self._fp32_captured:  # (inference tensors have no version)
            return w  # the torch router (route_ref) reads the fp32 gate
        key = (w.data_ptr(), w._version)
        if self._bf16 is None or self._bf16[0] != key:
            if torch.cuda.is_current_stream_capturing():
                if self._bf16 is None or self._bf16[1] is None:
                    self._fp32_captured = True
                    return w
                raise RuntimeError(
                    "the router gate was written since its bf16 copy was made; run one eager "
                    "forward before capturing CUDA graphs"
                )
            self._bf16 = (key, self._bf16_copy(w))
        return w if self._bf16[1] is None else self._bf16[1]

    @torch.no_grad()
    def _bf16_copy(self, w: torch.Tensor) -> torch.Tensor | None:
        """The exact bf16 copy of w (written into the previous copy when there is one), or None."""
        w16 = w.to(torch.bfloat16)
        exact = torch.equal(w16.float(), w)
        old = None if self._bf16 is None else self._bf16[1]
        if exact and old is not None and old.shape == w16.shape and old.device == w16.device:
            return old.copy_(w16)
        if old is not None:
            self._retired.append(old)
        return w16 if exact else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> topk_ids [T, k] int64, topk_weights [T, k] float32."""
        return backend.route(x, self.gate_for(x), self.e_score_correction_bias, self.params)


class RoutedExperts(nn.Module):
    """All routed experts of a layer, stacked (see `ExpertWeights`); I split across ranks.

    On the CPU, INT4 experts are dequantized once to float32 (the torch reference's compute
    dtype) at first use and kept beside the INT4 tensors, which stay the source of truth: the
    copy is rebuilt if they change, and skipped when it would take more than a quarter of the
    memory available then (or with DDSERVE_EXPERT_CACHE=off); see `dequantized_cache_allowed`.
    """

    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype, device) -> None:
        super().__init__()
        e, h, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        il = shard_size(inter, comm.world_size, "moe_intermediate_size")
        self.int4 = cfg.quant is not None
        if self.int4:
            check_int4_split("moe_intermediate_size", inter, comm.world_size)
            check_int4_split("hidden_size", h, 1)
            self.w13_packed = empty_param((e, 2 * il, h // PACK), torch.int32, device)
            self.w13_scale = empty_param((e, 2 * il, h // GROUP), dtype, device)
            self.w2_packed = empty_param((e, h, il // PACK), torch.int32, device)
            self.w2_scale = empty_param((e, h, il // GROUP), dtype, device)
        else:
            self.w13 = empty_param((e, 2 * il, h), dtype, device)
            self.w2 = empty_param((e, h, il), dtype, device)
        # (version key of the INT4 tensors, w13 [E, 2I, H], w2 [E, H, I]) or (key, None, None)
        self._dequant: tuple[tuple, torch.Tensor | None, torch.Tensor | None] | None = None

    def weights(self) -> ExpertWeights:
        if self.int4:
            w13_dequant, w2_dequant = self._dequantized()
            return ExpertWeights(
                w13_packed=self.w13_packed,
                w13_scale=self.w13_scale,
                w2_packed=self.w2_packed,
                w2_scale=self.w2_scale,
                repack_in_place=True,  # the v3 MoE kernel may overwrite them with its stream
                w13_dequant=w13_dequant,
                w2_dequant=w2_dequant,
            )
        return ExpertWeights(w13=self.w13, w2=self.w2)

    def _dequantized(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The float32 copies on the CPU (built at first use), else (None, None)."""
        if self.w13_packed.device.type != "cpu":
            return None, None
        int4 = (self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale)
        key = tuple((t.data_ptr(), t._version) for t in int4)
        if self._dequant is None or self._dequant[0] != key:
            nbytes = 4 * PACK * (self.w13_packed.numel() + self.w2_packed.numel())
            if dequantized_cache_allowed(nbytes):
                # stored [E, in, out]-contiguous, handed out as [E, out, in] views: the reference's
                # x @ w.t() is then a plain row-major GEMM, which MKL streams ~1.5x faster for the
                # few rows per expert of a verify step than the transposed layout
                w13 = dequantize_int4(self.w13_packed, self.w13_scale, torch.float32)
                w2 = dequantize_int4(self.w2_packed, self.w2_scale, torch.float32)
                w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H]
                w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)  # [E, H, I]
                self._dequant = (key, w13, w2)
            else:
                self._dequant = (key, None, None)
        return self._dequant[1], self._dequant[2]


def build_dequantized_caches(model: nn.Module) -> None:
    """Dequantize every INT4 expert layer of a CPU model now (engine start) rather than in the
    first forward, so model loading pays for it and the first request does not."""
    for module in model.modules():
        if isinstance(module, RoutedExperts) and module.int4:
            module.weights()


def dequantized_cache_allowed(nbytes: int) -> bool:
    """Whether one layer's dequantized experts (`nbytes`) may be kept: DDSERVE_EXPERT_CACHE=off
    says never; otherwise when they fit in a quarter of the memory available now (so the layers
    of a model too big for it stop caching, each deciding as memory fills). Logged."""
    if os.environ.get("DDSERVE_EXPERT_CACHE", "auto").lower() in ("off", "0", "false", "no"):
        log.info("dequantized expert cache: off (DDSERVE_EXPERT_CACHE)")
        return False
    avail = available_memory()
    ok = avail is None or nbytes <= avail // 4
    log.log(
        logging.DEBUG if ok else logging.WARNING,
        "dequantized expert cache: %.1f MB for a layer, %s (available %s MB)",
        nbytes / 2**20, "kept" if ok else "not kept: dequantizing at every call",
        "unknown" if avail is None else f"{avail / 2**20:.0f}",
    )  # fmt: skip
    return ok


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype, device) -> None:
        super().__init__()
        self.comm = comm
        # Optional observer of each forward's topk_ids [T, k] (benchmarks count distinct experts).
        self.route_hook: Callable[[torch.Tensor], None] | None = None
        self.gate = Router(cfg, dtype, device)
        self.experts = RoutedExperts(cfg, comm, dtype, device)
        self.shared_experts = None
        if cfg.n_shared_experts:
            inter = cfg.moe_intermediate_size * cfg.n_shared_experts
            d = cfg.hidden_size
            self.shared_experts = DenseMLP(d, inter, comm, dtype, device, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D] (all-reduced)
        shared = self.shared_experts
        ids, weights = self._route(x)
        if shared is None:
            y, _ = self._routed(x, ids, weights, pairs_ok=False)
            return reduce_partials(self.comm, y)
        # The shared expert's gate/up beside the routed experts (CUDA). The fork comes after the
        # router: the router's kernels, on the critical path and latency-bound, then have the
        # GPU to themselves, and the side branch overlaps the routed experts' GEMMs only.
        with backend.side_branch(x) as join:
            h = shared.activation(x)  # [T, I_local]
        try:
            y, topk = self._routed(x, ids, weights, pairs_ok=True)
        finally:  # also on an error: a capture must not end with the side stream unjoined
            join()
        # routed + shared, added in the down matmul (topk > 0: y holds the [T * k, D] weighted
        # pairs, bf16 or fp32 (`moe_v3` PAIRS), whose top-k sum the down matmul's epilogue takes)
        y = shared.down_proj(h, add=y, add_topk=topk)
        return reduce_partials(self.comm, y)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk ids [T, k], their weights [T, k]) from the router; the route hook sees the ids."""
        ids, weights = self.gate(x)
        if self.route_hook is not None:
            self.route_hook(ids)
        return ids, weights

    def _routed(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, pairs_ok: bool
    ) -> tuple[torch.Tensor, int]:
        """The routed experts' output: ([T, D] partial, 0), or with `pairs_ok` where the backend
        serves it ([T * k, D] weighted pairs, bf16 or fp32 (`moe_v3` PAIRS), k) for the shared
        down matmul to sum."""
        experts = self.experts.weights()
        pairs = backend.moe_pairs(x, ids, weights, experts) if pairs_ok else None
        if pairs is not None:
            return pairs, ids.shape[1]
        return backend.moe(backend.device_type(x))(x, ids, weights, experts), 0
