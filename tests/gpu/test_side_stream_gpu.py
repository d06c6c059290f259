"""The shared expert on a second CUDA stream (`backend.side_branch`) changes when its kernels run,
never what they compute: forwards eager and replayed from CUDA graphs give the same logits, bit
for bit, as with DDSERVE_SIDE_STREAM=0, and DDTree still equals plain decoding. A missing join
shows in the graph runs (a capture cannot end with the side stream unjoined; eagerly the side
kernels, queued first, usually win the race anyway). The tiny model's matmuls do not split K,
so the side stream's own split-K scratch is covered by `test_kernel_env` and the K2.6 engine
bench, not here. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.kernels import backend
from ddserve.model.tiny import make_tiny
from ddserve.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PROMPTS = [[5, 6, 7], list(range(20, 41)), [100, 101, 102, 103, 104, 105], [200],
           [(7 * i) % 250 for i in range(300)]]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "m", int4=True, seed=0)


def _runner(model_dir, graphs: bool, on: bool, monkeypatch) -> ModelRunner:
    monkeypatch.setenv("DDSERVE_SIDE_STREAM", "1" if on else "0")
    cfg = EngineConfig(num_slots=4096, budget=8, dtype="bfloat16", cuda_graphs=graphs)
    runner = ModelRunner(model_dir, engine_cfg=cfg, drafter=model_dir / "drafter", device="cuda")
    assert runner.kernels.side_stream == on
    for i, p in enumerate(PROMPTS):
        runner.add_stream(i, p, SamplingParams(max_tokens=24))
    runner.prefill()
    return runner


def _logits(runner: ModelRunner, q: int, seed: int) -> torch.Tensor:
    sts = [runner.streams[i] for i in range(len(PROMPTS))]
    new = [runner.allocator.alloc(q) for _ in sts]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (len(sts) * q,), generator=g)
    pos = torch.tensor([len(st.slots) + j for st in sts for j in range(q)])
    mask = torch.ones(len(sts), q, q, dtype=torch.bool).tril()
    out, _ = runner._decode_forward(sts, q, new, mask, ids.cuda(), pos.cuda())
    logits = out.logits.clone()
    for block in new:
        runner.allocator.free(block)
    return logits


@pytest.mark.parametrize("graphs", [False, True])
def test_forwards_with_the_side_stream_equal_forwards_without(model_dir, graphs, monkeypatch):
    backend._side_stream.cache_clear()
    off = _runner(model_dir, graphs, False, monkeypatch)
    assert backend._side_stream.cache_info().currsize == 0  # nothing forked with it off
    on = _runner(model_dir, graphs, True, monkeypatch)
    assert backend._side_stream.cache_info().currsize == 1  # the prefill forked
    for q, seed in [(1, 0), (9, 1), (1, 2), (9, 3), (9, 4)]:  # AR steps and verify-sized blocks
        assert torch.equal(_logits(on, q, seed), _logits(off, q, seed)), (q, seed)
    on.close()
    off.close()


def test_ddtree_with_the_side_stream_equals_plain_decoding(model_dir, monkeypatch):
    from engine_helpers import run_all

    monkeypatch.setenv("DDSERVE_SIDE_STREAM", "1")
    params = SamplingParams(max_tokens=20)
    cfg = EngineConfig(num_slots=4096, budget=8, dtype="bfloat16", cuda_graphs=True)
    runner = ModelRunner(model_dir, engine_cfg=cfg, drafter=model_dir / "drafter", device="cuda")
    assert runner.kernels.side_stream
    ddtree = run_all(runner, PROMPTS, params, speculative=True)
    assert ddtree == run_all(runner, PROMPTS, params, speculative=False)
    runner.close()
