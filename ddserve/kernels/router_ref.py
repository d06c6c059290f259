"""The MoE router's math in plain torch: the reference of `router.py`'s fused kernel, and the
path the CPU and non-invariant CUDA forwards run.

DeepSeek-V3 noaux_tc routing for one token: gate logits in fp32, sigmoid scores; experts are
*chosen* on score + e_score_correction_bias, restricted to the best `topk_group` groups when
`topk_group < n_group` (a group's score is the sum of its two best biased scores), and
*weighted* by the unbiased scores, normalised by their sum (+ 1e-20) if `norm_topk_prob`, times
`routed_scaling_factor`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddserve.kernels.invariant_ref import fixed_order_sum


@dataclass(frozen=True)
class RoutingParams:
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scaling: float  # routed_scaling_factor

    @classmethod
    def from_config(cls, cfg) -> RoutingParams:
        """From a `ModelConfig` (the served model and the training model alike)."""
        return cls(
            top_k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            scaling=cfg.routed_scaling_factor,
        )

    @property
    def grouped(self) -> bool:
        return self.topk_group < self.n_group


def route_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    p: RoutingParams,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
    row_sum: Callable[[torch.Tensor], torch.Tensor] = fixed_order_sum,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (any float dtype), weight [E, D] fp32 (bf16 is widened exactly), bias [E] fp32
    -> ids [T, k] int64 (by descending choice score, as torch.topk orders them), weights [T, k]
    fp32. `linear` computes the gate logits and `row_sum` the normaliser (the model passes
    `backend`'s ops)."""
    scores = linear(x.float(), weight.float()).sigmoid()  # [T, E] (fp32 gate)
    choice = scores + bias.unsqueeze(0)  # [T, E]
    if p.grouped:
        grouped = choice.view(x.shape[0], p.n_group, -1)  # [T, G, E/G]
        top2 = grouped.topk(2, dim=-1).values  # [T, G, 2]
        group_scores = top2[..., 0] + top2[..., 1]  # [T, G] (a + b: no reduction kernel)
        best = group_scores.topk(p.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
    ids = choice.topk(p.top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if p.norm_topk_prob:
        weights = weights / (row_sum(weights) + 1e-20)
    return ids, weights * p.scaling
