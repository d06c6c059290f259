"""Tensor parallelism over gloo in separate processes: logits equal tp = 1, on every rank."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_meta, rel_err
from ports import free_port
from ranks import spawn

from ddserve.distributed import GlooComm
from ddserve.kernels import backend
from ddserve.model.loader import load_model

PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [250, 3, 3, 40]]


def run_model(model) -> torch.Tensor:
    """Expanded prefill of two prompts, then one absorbed decode step for each: [T + 2, V]."""
    cache = model.new_kv_cache(64)
    slots = [list(range(len(PROMPTS[0]))), list(range(20, 20 + len(PROMPTS[1])))]
    meta = make_meta([([], s, None) for s in slots])
    ids = torch.tensor(PROMPTS[0] + PROMPTS[1])
    pos = torch.tensor([j for p in PROMPTS for j in range(len(p))])
    pre = model(ids, pos, cache, meta, absorbed=False).logits
    meta = make_meta([(slots[0], [40], None), (slots[1], [41], None)])
    nxt = pre[[len(PROMPTS[0]) - 1, -1]].argmax(-1)
    dec = model(nxt, torch.tensor([len(p) for p in PROMPTS]), cache, meta).logits
    return torch.cat([pre, dec])


def check_collectives(comm: GlooComm) -> None:
    r, w = comm.rank, comm.world_size
    t = torch.full((2, 3), float(r + 1), dtype=torch.bfloat16)
    assert torch.equal(
        comm.all_reduce(t), torch.full((2, 3), w * (w + 1) / 2, dtype=torch.bfloat16)
    )
    g = comm.all_gather(torch.full((2, 1), float(r)), dim=-1)  # [2, w]
    assert torch.equal(g, torch.arange(w, dtype=torch.float32).expand(2, w))
    assert comm.all_gather(torch.full((1, 2), float(r)), dim=0)[:, 0].tolist() == list(range(w))
    b = torch.tensor([r * 10])
    assert comm.broadcast(b, src=w - 1).item() == (w - 1) * 10

    def part(k: int) -> torch.Tensor:  # rank k's values; sums of these depend on the order
        return (torch.linspace(-3, 3, 16) * 10.0 ** (k % 3) * (1 + k / 7)).bfloat16()

    expected = part(0)
    for k in range(1, w):
        expected = expected + part(k)
    assert torch.equal(comm.all_reduce_ordered(part(r)), expected)


def worker(rank: int, world: int, port: int, paths: list[str], out: str) -> None:
    torch.set_num_threads(1)
    comm = GlooComm(rank, world, f"tcp://127.0.0.1:{port}")
    try:
        check_collectives(comm)
        results = []
        for path in paths:
            model, _ = load_model(path, comm, dtype=torch.float32, progress=False)
            results.append(run_model(model))
            with backend.invariant_mode(True):  # rank-order all-reduce at tp > 2, fallbacks
                assert rel_err(run_model(model), results[-1]) < 1e-5
        torch.save(results, f"{out}.{rank}")
        comm.barrier()
    finally:
        comm.close()


@pytest.mark.parametrize("world", [2, 4])
def test_tp_logits_equal_tp1(world, tiny_model_dir, tiny_int4_model_dir, tmp_path):
    paths = [str(tiny_model_dir), str(tiny_int4_model_dir)]
    refs = [run_model(load_model(p, dtype=torch.float32, progress=False)[0]) for p in paths]
    out = str(tmp_path / "logits")
    spawn(worker, (world, free_port(), paths, out), world)
    for rank in range(world):
        got = torch.load(f"{out}.{rank}")
        for g, ref in zip(got, refs, strict=True):
            assert rel_err(g, ref) <= 1e-5, (rank, rel_err(g, ref))
