"""Plumbing of the batch-invariant guarantees that does not need a GPU: the kernel mode is per
engine (not left behind by whichever engine was built last), a prompt's prefill chunks do not
depend on what else is pending, and the rank-order all-reduce used at tp > 2."""

from __future__ import annotations

import torch

from ddserve.distributed import Communicator
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.kernels import backend
from ddserve.sampling import SamplingParams


def _runner(model_dir, **cfg) -> ModelRunner:
    return ModelRunner(model_dir, engine_cfg=EngineConfig(num_slots=1024, **cfg), device="cpu")


def test_kernel_mode_is_per_engine(tiny_model_dir, monkeypatch) -> None:
    before = backend.batch_invariant()
    engines = {on: _runner(tiny_model_dir, batch_invariant=on) for on in (True, False)}
    assert backend.batch_invariant() == before  # building engines changes nothing
    for on, runner in engines.items():
        seen: list[bool] = []
        model_forward = runner.model.forward

        def spy(*args, _f=model_forward, _seen=seen, **kwargs):
            _seen.append(backend.batch_invariant())
            return _f(*args, **kwargs)

        monkeypatch.setattr(runner.model, "forward", spy)
        runner.add_stream(0, [5, 6, 7, 8], SamplingParams(max_tokens=3))
        runner.prefill()
        runner.ar_step([0])
        assert seen == [on, on]  # the prompt forward and the decode forward
        assert backend.batch_invariant() == before


def _chunks_of(runner: ModelRunner, sid, monkeypatch) -> list[tuple[int, int]]:
    """(prompt offset, length) of every prefill chunk of stream `sid`."""
    seen: list[tuple[int, int]] = []
    meta = runner._meta

    def spy(sts, q_lens, *args):
        seen.extend((len(st.slots), n) for st, n in zip(sts, q_lens, strict=True) if st.sid == sid)
        return meta(sts, q_lens, *args)

    monkeypatch.setattr(runner, "_meta", spy)
    runner.prefill()
    return seen


def test_prefill_chunks_do_not_depend_on_other_pending_prompts(tiny_model_dir, monkeypatch):
    prompt = list(range(3, 43))  # 40 tokens: chunks of 16 at offsets 0, 16, 32
    alone = _runner(tiny_model_dir, prefill_chunk=16)
    alone.add_stream("b", prompt, SamplingParams(max_tokens=2))
    expected = _chunks_of(alone, "b", monkeypatch)
    assert expected == [(0, 16), (16, 16), (32, 8)]
    for other in ([9] * 10, [9] * 16, [9] * 23):  # pending ahead of it: 10, 16, 23 tokens
        busy = _runner(tiny_model_dir, prefill_chunk=16)
        busy.add_stream("a", other, SamplingParams(max_tokens=2))
        busy.add_stream("b", prompt, SamplingParams(max_tokens=2))
        assert _chunks_of(busy, "b", monkeypatch) == expected
        assert not busy.pending_prefill


class _GatherOnly(Communicator):
    """Rank 0 of a fake group whose all_gather returns fixed per-rank tensors."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.rank, self.world_size, self.parts = 0, len(parts), parts
        self.plain_calls = 0

    def all_reduce(self, t):
        self.plain_calls += 1
        return t

    def all_gather(self, t, dim=-1):
        return torch.cat([p.unsqueeze(0) for p in self.parts], dim=dim)

    def broadcast(self, t, src=0):
        return t

    def barrier(self):
        pass


def test_all_reduce_ordered_sums_in_rank_order() -> None:
    g = torch.Generator().manual_seed(0)
    parts = [(torch.randn(64, 32, generator=g) * 10 ** (i % 3)).bfloat16() for i in range(4)]
    comm = _GatherOnly(parts)
    out = comm.all_reduce_ordered(parts[0].clone())
    assert torch.equal(out, ((parts[0] + parts[1]) + parts[2]) + parts[3])
    other_order = ((parts[3] + parts[2]) + parts[1]) + parts[0]
    assert not torch.equal(out, other_order)  # order matters in bf16: the test can fail
    assert comm.plain_calls == 0
    two = _GatherOnly(parts[:2])
    two.all_reduce_ordered(parts[0].clone())
    assert two.plain_calls == 1  # two ranks: a + b == b + a, the plain all-reduce is exact


def test_cuda_graphs_run_eagerly_when_padding_would_crowd_out_streams(tiny_model_dir, caplog):
    """max(buckets) x (budget + 1) padding slots must leave most of the pool to streams."""
    runner = _runner(tiny_model_dir)
    runner.cfg = EngineConfig(
        num_slots=256, budget=16, dtype="bfloat16", cuda_graphs=True, graph_buckets=(1, 8)
    )
    runner.device = torch.device("cuda")  # the check comes before anything touches the device
    free = runner.free_slots
    with caplog.at_level("WARNING"):
        assert runner._make_graphs() is None  # 8 x 17 = 136 padding slots > 256 / 2
    assert "padding KV slots" in caplog.text and runner.free_slots == free
