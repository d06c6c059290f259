"""The order in which `MoE.forward` queues its work: the router first, then the shared expert's
branch forks (on CUDA it runs on a second stream beside the routed experts), the routed experts,
the join, the shared down matmul that adds them. The order decides what overlaps on the GPU,
not the result (tests/gpu/test_side_stream_gpu.py compares the bits)."""

from __future__ import annotations

import contextlib

import torch

from ddserve.config import ModelConfig
from ddserve.distributed import LocalComm
from ddserve.kernels import backend
from ddserve.model.moe import MoE
from ddserve.model.tiny import TINY_CONFIG


def test_the_router_runs_before_the_shared_expert_branch_forks(monkeypatch):
    cfg = ModelConfig.from_hf(TINY_CONFIG)
    moe = MoE(cfg, LocalComm(), torch.float32, "cpu")
    x = torch.zeros(2, cfg.hidden_size)
    order: list[str] = []

    @contextlib.contextmanager
    def side_branch(t):
        order.append("fork")
        yield lambda: order.append("join")

    def route(t):
        order.append("route")
        return torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)

    def routed(t, ids, weights, pairs_ok):
        order.append("routed")
        return torch.ones_like(t), 0

    def activation(self, t):
        order.append("shared gate/up")
        return t

    def down(self, h, add=None, add_topk=0):
        order.append("shared down")
        return h + add

    monkeypatch.setattr(backend, "side_branch", side_branch)
    monkeypatch.setattr(moe, "_route", route)
    monkeypatch.setattr(moe, "_routed", routed)
    monkeypatch.setattr(type(moe.shared_experts), "activation", activation)
    monkeypatch.setattr(type(moe.shared_experts.down_proj), "forward", down)
    y = moe(x)
    assert order == ["route", "fork", "shared gate/up", "routed", "join", "shared down"]
    assert torch.equal(y, torch.ones_like(x))
