"""Dense MLP and the DeepSeek-V3 MoE layer (noaux_tc sigmoid routing, shared experts).

Routing: gate logits in fp32, sigmoid scores; experts are *chosen* on
score + e_score_correction_bias, restricted to the best `topk_group` groups (a group's score
is the sum of its top-2 biased scores), and *weighted* by the unbiased scores, normalised if
`norm_topk_prob`, times `routed_scaling_factor`. Routed experts run through `backend.moe`;
shared experts are added unscaled; one all-reduce sums the per-rank partials of both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ddserve.config import ModelConfig
from ddserve.engine.comm import Communicator
from ddserve.kernels import backend
from ddserve.kernels.moe_ref import ExpertWeights
from ddserve.model.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    empty_param,
    reduce_partials,
    shard_size,
)
from ddserve.model.quant import GROUP, PACK, check_int4_split


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); intermediate dim split across ranks."""

    def __init__(self, hidden: int, inter: int, comm: Communicator, dtype, device, reduce=True):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inter, comm, dtype, device)
        self.up_proj = ColumnParallelLinear(hidden, inter, comm, dtype, device)
        self.down_proj = RowParallelLinear(inter, hidden, comm, dtype, device, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Checkpoint names `mlp.gate.weight` [E, D] and `mlp.gate.e_score_correction_bias` [E]."""

    def __init__(self, cfg: ModelConfig, dtype, device) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        # kept in float32: routing runs in fp32 (as the reference does), so store it once rather
        # than casting [E, D] on every forward
        self.weight = empty_param((e, cfg.hidden_size), torch.float32, device)
        self.e_score_correction_bias = empty_param((e,), torch.float32, device)
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> topk_ids [T, k] int64, topk_weights [T, k] float32."""
        scores = backend.linear(x.float(), self.weight).sigmoid()  # [T, E] (fp32 gate)
        choice = scores + self.e_score_correction_bias.unsqueeze(0)  # [T, E]
        if self.topk_group < self.n_group:
            grouped = choice.view(x.shape[0], self.n_group, -1)  # [T, G, E/G]
            top2 = grouped.topk(2, dim=-1).values  # [T, G, 2]
            group_scores = top2[..., 0] + top2[..., 1]  # [T, G] (a + b: no reduction kernel)
            best = group_scores.topk(self.topk_group, dim=-1).indices  # [T, topk_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        ids = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, ids)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (backend.row_sum(weights) + 1e-20)  # fixed order if invariant
        return ids, weights * self.scaling


class RoutedExperts(nn.Module):
    """All routed experts of a layer, stacked (see `ExpertWeights`); I split across ranks."""

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

    def weights(self) -> ExpertWeights:
        if self.int4:
            return ExpertWeights(
                w13_packed=self.w13_packed,
                w13_scale=self.w13_scale,
                w2_packed=self.w2_packed,
                w2_scale=self.w2_scale,
                repack_in_place=True,  # the v3 MoE kernel may overwrite them with its stream
            )
        return ExpertWeights(w13=self.w13, w2=self.w2)


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
        ids, weights = self.gate(x)
        if self.route_hook is not None:
            self.route_hook(ids)
        moe = backend.moe(backend.device_type(x))
        y = moe(x, ids, weights, self.experts.weights())  # [T, D] this rank's partial
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return reduce_partials(self.comm, y)
