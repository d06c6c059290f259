"""`kernels/drafter_attn.ring_attention` on a GPU in bf16: at the K2.5 drafter's tp = 8 shapes
against `grouped_attention` over the gathered rows (full rings and streams shorter than their
ring), and a bf16 drafter's draft with the ring read in place (the CUDA default) against the
gathered path, eagerly and as a CUDA graph that reads the streams' lengths at replay. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

from ddserve.drafter.layers import grouped_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("streams", [1, 10])
@pytest.mark.parametrize("short", [False, True])
def test_ring_attention_equals_gathered_attention(streams, short):
    """8 query heads on 1 KV head, 16 queries, a ring of 2,048 + a block of 16 keys; `short`:
    the streams have written 1 to 2,047 entries (the rest never attended, whatever the mask)."""
    from ddserve.kernels.drafter_attn import ring_attention

    g = torch.Generator(device="cuda").manual_seed(streams)
    dev, bf, c = "cuda", torch.bfloat16, 2048
    q = torch.randn(streams, 16, 8, 128, generator=g, device=dev).to(bf)
    ring_k, ring_v = (torch.randn(12, c, 1, 128, generator=g, device=dev).to(bf) for _ in "kv")
    rows = torch.randperm(12, generator=g, device=dev)[:streams]
    k_blk, v_blk = (torch.randn(streams, 16, 1, 128, generator=g, device=dev).to(bf) for _ in "kv")
    visible = torch.rand(streams, 16, c + 16, generator=g, device=dev) > 0.3
    visible[..., c:] = True
    lengths, want_vis = None, visible
    if short:
        lengths = torch.randint(1, c, (12,), generator=g, device=dev)
        written = torch.arange(c, device=dev)[None, :] < lengths[rows][:, None]  # [B, C]
        want_vis = visible.clone()
        want_vis[..., :c] &= written[:, None, :]
    keys = torch.cat((ring_k[rows], k_blk), 1).transpose(1, 2)
    values = torch.cat((ring_v[rows], v_blk), 1).transpose(1, 2)
    want = grouped_attention(q, keys, values, want_vis)
    got = ring_attention(q, ring_k, ring_v, rows, k_blk, v_blk, visible, lengths=lengths)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_drafter_draft_reads_the_ring_in_place(monkeypatch):
    from ddserve.drafter.model import DFlashDrafter
    from ddserve.kernels import drafter_attn
    from tests.core.test_dflash import FakeTarget, drafter_raw, make_model

    class Target(FakeTarget):
        def __init__(self):
            super().__init__(seed=1)
            self.emb, self.head = self.emb.cuda(), self.head.cuda()

    calls, kernel = [], drafter_attn.ring_attention
    monkeypatch.setattr(drafter_attn, "ring_attention",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))  # fmt: skip
    model, _ = make_model(drafter_raw(), 3)  # two sliding layers: a ring of 16
    model = model.to("cuda", torch.bfloat16)
    model.stack()
    drafter = DFlashDrafter(model, Target(), max_streams=3, max_context=40)
    assert drafter.ring_attention and drafter.graph_commits  # the CUDA defaults
    gen = torch.Generator(device="cuda").manual_seed(2)
    width = len(drafter.capture_layers) * model.cfg.hidden_size
    for sid, n in (("a", 50), ("b", 7)):  # "a" wrapped its ring, "b" holds 7 of 16 entries
        drafter.add_stream(sid, [1] * n, torch.randn(n, width, generator=gen, device="cuda"))
    rows = torch.tensor(drafter.state_rows(["b", "a"]), device="cuda")
    bonus = torch.tensor([5, 9], device="cuda")
    got = drafter.draft_rows(rows, bonus)
    assert len(calls) == 2  # one call per layer: the ring read in place
    drafter.ring_attention = False
    want = drafter.draft_rows(rows, bonus)
    assert len(calls) == 2
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    drafter.ring_attention = True
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = drafter.draft_rows(rows, bonus)
    graph.replay()
    torch.testing.assert_close(out, got, atol=0, rtol=0)  # the same kernels, replayed
    drafter.commit("b", [1, 1, 1], torch.randn(3, width, generator=gen, device="cuda"))
    graph.replay()  # "b" now holds 10 entries: the replay reads the new length and ring
    fresh = drafter.draft_rows(rows, bonus)
    assert not torch.equal(fresh, got)
    torch.testing.assert_close(out, fresh, atol=0, rtol=0)
