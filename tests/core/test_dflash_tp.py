"""The DFlash drafter under tensor parallelism over gloo, each rank in its own process: sharded
where its shapes divide by the ranks (heads, MLP and `fc` split, partial sums all-reduced), else
replicated. Every rank must produce the same draft logits bit for bit (each builds the tree on
its own), and those must be tp = 1's up to the reordered float32 sums."""

from __future__ import annotations

import pytest
import torch
from model_utils import rel_err
from ports import free_port
from ranks import spawn
from test_dflash import target_cfg

from ddserve.distributed import GlooComm
from ddserve.drafter.loader import load_drafter
from ddserve.drafter.tiny import write_tiny_drafter

HIDDEN, VOCAB = 256, 264


class FakeTarget:
    """The target's embedding and (all-gathered, so whole) lm_head: the same on every rank."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.emb = torch.randn(VOCAB, HIDDEN, generator=g)
        self.head = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb[ids]

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        return h.float() @ self.head.T


def drive(drafter) -> list[torch.Tensor]:
    """Streams joining, batched and single commits, drafts after each: the draft logits, and
    the context ring gathered to the full KV heads is the caller's to compare."""
    g = torch.Generator().manual_seed(7)
    width = len(drafter.capture_layers) * HIDDEN
    out = []
    for sid, n in (("a", 9), ("b", 30), ("c", 3)):
        drafter.add_stream(sid, [0] * n, torch.randn(n, width, generator=g))
    for step in range(3):
        news = [(sid, torch.randn(1 + (step + i) % 5, width, generator=g)) for i, sid in
                enumerate("abc")]  # fmt: skip
        if step == 1:
            for sid, h in news:
                drafter.commit(sid, [0] * h.shape[0], h)
        else:
            drafter.commit_many([(sid, [0] * h.shape[0], h) for sid, h in news])
        out.append(drafter.draft(["c", "a", "b"], torch.tensor([5, 17, 260])))
    return out


def load(path, comm=None):
    tcfg = target_cfg(hidden_size=HIDDEN, vocab_size=VOCAB)
    return load_drafter(path, tcfg, FakeTarget(), max_streams=3, max_context=128,
                        dtype=torch.float32, comm=comm)  # fmt: skip


def worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    comm = GlooComm(rank, world, f"tcp://127.0.0.1:{port}")
    try:
        drafter = load(path, comm)
        shards = drafter.model.comm.world_size
        torch.save((shards, drafter.cache.k.shape, drive(drafter)), f"{out}.{rank}")
        comm.barrier()
    finally:
        comm.close()


@pytest.mark.parametrize("world, sharded", [(2, True), (4, False)], ids=["tp2-sharded",
                         "tp4-replicated"])  # fmt: skip
def test_drafter_ranks_agree_and_match_tp1(world, sharded, tmp_path):
    """The tiny drafter has 2 KV heads: split across 2 ranks, whole on each of 4."""
    path = write_tiny_drafter(tmp_path / "drafter", target_cfg(hidden_size=HIDDEN,
                              vocab_size=VOCAB), seed=2, sliding_window=16)  # fmt: skip
    ref = load(path)
    want = drive(ref)
    out = str(tmp_path / "drafts")
    spawn(worker, (world, free_port(), str(path), out), world)
    got = [torch.load(f"{out}.{r}") for r in range(world)]
    for shards, k_shape, _ in got:
        assert shards == (world if sharded else 1)
        kv_heads = ref.cache.k.shape[-2] // (world if sharded else 1)
        assert k_shape[-2] == kv_heads, (k_shape, ref.cache.k.shape)
    for _, _, drafts in got[1:]:  # every rank drafts the same logits, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(drafts, got[0][2], strict=True))
    for d, w in zip(got[0][2], want, strict=True):
        err = rel_err(d, w)
        assert (err <= 1e-5) if sharded else err == 0, err
