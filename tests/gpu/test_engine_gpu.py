"""The whole engine on a GPU: DDTree greedy == AR greedy in float32 (the exact mode), and the CuPy
NCCL communicator on two GPUs. Skipped without CUDA (and the NCCL test without 2 GPUs + CuPy)."""

from __future__ import annotations

import pytest
import torch
from _forwards import prefilled_runner
from engine_helpers import run_all

from ddserve.drafter.testing import OracleDrafter
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.model.tiny import make_tiny
from ddserve.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PROMPTS = [[5, 6, 7], list(range(20, 41)), [100, 101, 102, 103, 104, 105], [200]]


def _decode(runner: ModelRunner, speculative: bool, budget: int | None = None):
    return run_all(runner, PROMPTS, SamplingParams(max_tokens=24), speculative, budget)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "m", int4=True, seed=0)


@pytest.mark.parametrize("budget", [4, 32])
def test_ddtree_equals_ar_in_float32_on_the_gpu(model_dir, budget: int) -> None:
    cfg = EngineConfig(num_slots=4096, budget=32, dtype="float32")
    ref = _decode(ModelRunner(model_dir, engine_cfg=cfg, device="cuda"), False)
    table = {tuple(p): r for p, r in zip(PROMPTS, ref, strict=True)}
    for drafter in (model_dir / "drafter", OracleDrafter(table, 264, depth=7, corrupt=0.3, seed=1)):
        runner = ModelRunner(model_dir, engine_cfg=cfg, drafter=drafter, device="cuda")
        start = runner.free_slots
        assert _decode(runner, True, budget) == ref
        assert runner.free_slots == start


def _nccl_rank(rank: int, uid: bytes, q) -> None:
    torch.cuda.set_device(rank)
    from ddserve.distributed import NcclComm

    comm = NcclComm(rank, 2, uid)
    x = torch.full((1000,), float(rank + 1), device="cuda", dtype=torch.bfloat16)
    comm.all_reduce(x)
    g = comm.all_gather(torch.full((3,), float(rank), device="cuda"), dim=0)
    b = comm.broadcast(torch.full((2,), float(rank + 7), device="cuda"), src=1)
    torch.cuda.synchronize()
    q.put((rank, x[0].item(), g.tolist(), b.tolist()))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_comm_collectives_on_two_gpus() -> None:
    pytest.importorskip("cupy")
    import torch.multiprocessing as mp

    from ddserve.distributed import NcclComm

    ctx = mp.get_context("spawn")
    q, uid = ctx.Queue(), NcclComm.make_unique_id()
    procs = [ctx.Process(target=_nccl_rank, args=(r, uid, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    for _rank, reduced, gathered, bcast in got:
        assert reduced == 3.0
        assert gathered == [0.0] * 3 + [1.0] * 3
        assert bcast == [8.0, 8.0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_offline_llm_tp2_over_nccl_equals_tp1(model_dir) -> None:
    """float32: tp = 2 (the DFlash drafter sharded too: 2 KV heads, one a rank) gives tp = 1's
    tokens."""
    pytest.importorskip("cupy")
    from ddserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=16)
    kw = dict(drafter=model_dir / "drafter", budget=8, device="cuda", dtype="float32")
    with LLM(model_dir, tp=1, **kw) as one, LLM(model_dir, tp=2, **kw) as two:
        assert two.runner.drafter.model.comm.world_size == 2
        a = [o.token_ids for o in one.generate(PROMPTS, params)]
        b = [o.token_ids for o in two.generate(PROMPTS, params)]
    assert a == b


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_ddtree_with_a_sharded_drafter_in_graphs_equals_ar(model_dir) -> None:
    """bf16, CUDA graphs, batch-invariant kernels at tp = 2 over NCCL: the sharded DFlash
    drafter's all-reduces captured in the verify graph; DDTree gives plain AR's tokens."""
    pytest.importorskip("cupy")
    from ddserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=24)
    kw = dict(drafter=model_dir / "drafter", budget=8, device="cuda", dtype="bfloat16",
              cuda_graphs=True)  # fmt: skip
    with LLM(model_dir, tp=2, **kw) as two:
        assert two.runner.drafter.model.comm.world_size == 2
        ar = [o.token_ids for o in two.generate(PROMPTS, params, speculative=False)]
        assert [o.token_ids for o in two.generate(PROMPTS, params)] == ar


def test_graph_replay_matches_the_eager_forward(model_dir) -> None:
    """Same state, same decode inputs: the replayed forward's logits match the eager ones (bf16;
    the graph pads the batch to a bucket and the prefix to a power of two)."""
    eager, graphed = (
        prefilled_runner(model_dir, False, PROMPTS),
        prefilled_runner(model_dir, True, PROMPTS),
    )
    assert graphed._graphs is not None
    for q in (1, 9):  # an AR step, then a verify-sized block (budget 8 + root)
        outs = []
        for r in (eager, graphed):
            sts = [r.streams[i] for i in range(len(PROMPTS))]
            new = [r.allocator.alloc(q) for _ in sts]
            ids = torch.randint(0, 256, (len(sts) * q,), generator=torch.Generator().manual_seed(q))
            pos = torch.tensor([len(st.slots) + j for st in sts for j in range(q)])
            mask = torch.ones(len(sts), q, q, dtype=torch.bool).tril()
            out, _ = r._decode_forward(sts, q, new, mask, ids.cuda(), pos.cuda())
            outs.append(out.logits.float().clone())
            for block in new:
                r.allocator.free(block)
        a, b = outs
        assert (a - b).abs().max() <= 0.05 * a.abs().max()
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    graphed.close()


def test_ar_steps_replayed_from_graphs_give_the_eager_tokens(model_dir) -> None:
    """Plain decoding of several streams, every step a replay of the same captured forward
    (bf16, batch-invariant kernels), gives the eager engine's tokens, and the same tokens on a
    second run: a replay must not read anything freed or rewritten since its capture."""
    params = SamplingParams(max_tokens=16)
    outs = []
    for graphs in (False, True, True):
        cfg = EngineConfig(num_slots=4096, budget=8, dtype="bfloat16", cuda_graphs=graphs)
        runner = ModelRunner(
            model_dir, engine_cfg=cfg, drafter=model_dir / "drafter", device="cuda"
        )
        outs.append(run_all(runner, PROMPTS, params, speculative=False))
        assert bool(graphs) == bool(runner._graphs and runner._graphs._graphs)
        runner.close()
    assert outs[1] == outs[0] and outs[2] == outs[0]


def test_ddtree_with_graphs_finishes_and_frees_every_slot(model_dir) -> None:
    runner = prefilled_runner(model_dir, True, PROMPTS)
    start = runner.free_slots + sum(len(st.slots) for st in runner.streams.values())
    steps = 0
    while runner.streams and steps < 100:
        runner.ddtree_step(list(runner.streams))
        steps += 1
    assert not runner.streams and runner.free_slots == start
    assert runner._graphs is not None and runner._graphs._verify  # it did capture and replay
    runner.close()


@pytest.mark.parametrize("drafter_kind, temperature", [("dflash", 0.0), ("oracle", 0.8)])
def test_the_captured_verify_step_equals_the_eager_one(model_dir, drafter_kind, temperature):
    """The whole verify step replayed from one graph (bf16, batch-invariant kernels, 3 streams
    padded to the bucket of 4). DFlash drafts inside the graph: at temperature 0 both the graph
    and the eager engine give plain AR's tokens. The oracle's logits are copied in, so the trees
    are the eager ones and a sampled run (temperature 0.8) gives the eager tokens exactly."""
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=20, temperature=temperature, top_k=20, seed=7)
    cfg = EngineConfig(num_slots=4096, budget=8, dtype="bfloat16")
    ar = run_all(ModelRunner(model_dir, engine_cfg=cfg, device="cuda"), prompts, params, False)
    table = {tuple(p): r for p, r in zip(prompts, ar, strict=True)}
    outs = {}
    for graphs in (False, True):
        drafter = (
            model_dir / "drafter"
            if drafter_kind == "dflash"
            else OracleDrafter(table, 264, depth=7, corrupt=0.3, seed=1)
        )
        cfg = EngineConfig(num_slots=4096, budget=8, dtype="bfloat16", cuda_graphs=graphs)
        runner = ModelRunner(model_dir, engine_cfg=cfg, drafter=drafter, device="cuda")
        start = runner.free_slots
        outs[graphs] = run_all(runner, prompts, params, speculative=True)
        assert runner.free_slots == start
        assert bool(graphs) == bool(runner._graphs and runner._graphs._verify)
        if drafter_kind == "dflash":  # graphed only where the engine's are; greedy steps
            assert runner.drafter.graph_commits == graphs  # commit inside the verify graph
            assert not runner.drafter._graphs
        runner.close()
        if drafter_kind == "dflash":
            assert not runner.drafter._graphs
    if temperature == 0.0:
        assert outs[True] == ar and outs[False] == ar
    else:
        assert outs[True] == outs[False]


def _live_ring(drafter, sid) -> tuple[torch.Tensor, torch.Tensor]:
    """A stream's live context keys and values in its ring, oldest first."""
    n, cap = drafter.cache.length(sid), drafter.cache.capacity
    idx = torch.arange(max(0, n - cap), n, device="cuda") % cap
    row = drafter.cache.row_ids([sid])[0]
    return drafter.cache.k[:, row, idx].float(), drafter.cache.v[:, row, idx].float()


def test_the_verify_graph_commits_the_drafters_context_as_its_commit_graph_does(model_dir):
    """A greedy DDTree step with DFlash is one graph: the drafter commits each stream's accepted
    rows inside the verify graph (`step_commits`; 3 streams in the bucket of 4, the padding
    block at the drafter's spare row). In lockstep with an engine whose drafter commits after
    the step through its own commit graph: the same tokens, the same lengths on the host and
    the device, the live ring entries equal up to bf16 rounding (the two commits run at
    different batch shapes), the spare row never written."""
    prompts = PROMPTS[:3]
    runners = [prefilled_runner(model_dir, True, prompts) for _ in range(2)]
    in_step, after = (r.drafter for r in runners)
    after.step_commits = False
    assert in_step.step_commits
    outs: list[dict[int, list[int]]] = [{}, {}]
    steps = 0
    while runners[0].streams and steps < 40:
        for runner, out in zip(runners, outs, strict=True):
            for sid, so in runner.ddtree_step(list(runner.streams)).items():
                out.setdefault(sid, []).extend(so.tokens)
        steps += 1
        sids = list(runners[0].streams)
        assert sids == list(runners[1].streams)
        lens = [in_step.cache.length(s) for s in sids]
        assert lens == [after.cache.length(s) for s in sids]
        assert in_step.cache.lengths[in_step.cache.row_ids(sids)].tolist() == lens
        for sid in sids:
            for got, want in zip(_live_ring(in_step, sid), _live_ring(after, sid), strict=True):
                torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    assert not runners[0].streams and not runners[1].streams
    assert outs[0] == outs[1]
    pad = in_step.pad_row
    assert in_step.cache.lengths[pad] == 0 and not in_step.cache.k[:, pad].any()
    assert not in_step._graphs and after._graphs  # only the second used its commit graph
    for runner in runners:
        runner.close()


@pytest.mark.parametrize("speculative", [False, True])
def test_graphs_are_captured_again_when_the_slot_table_grows(model_dir, speculative) -> None:
    """The graphs gather each stream's prefix slots from the device slot table; streams beyond
    its rows (max_streams) reallocate it, after which the graphs must be captured again. Two
    streams decode (graphs captured), two more arrive (the table grows), and all four decode to
    plain AR's tokens, as the eager engine gives them."""
    params = SamplingParams(max_tokens=10)
    plain = EngineConfig(num_slots=4096, budget=8, dtype="bfloat16")
    ref = _decode(ModelRunner(model_dir, engine_cfg=plain, device="cuda"), False)
    # The oracle holds no per-stream state (the DFlash drafter's max_streams would refuse the
    # third stream), so the table is the only thing that has to grow.
    table = {tuple(p): r for p, r in zip(PROMPTS, ref, strict=True)}
    drafter = OracleDrafter(table, 264, depth=7, corrupt=0.3, seed=1) if speculative else None
    cfg = EngineConfig(num_slots=4096, budget=8, dtype="bfloat16", cuda_graphs=True, max_streams=2)
    runner = ModelRunner(model_dir, engine_cfg=cfg, drafter=drafter, device="cuda")
    out: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}

    def step() -> None:
        sids = list(runner.streams)
        res = runner.ddtree_step(sids) if speculative else runner.ar_step(sids)
        for sid, so in res.items():
            out[sid] += so.tokens

    for i in (0, 1):
        runner.add_stream(i, PROMPTS[i], params)
    for sid, so in runner.prefill().items():
        out[sid] += so.tokens
    step()
    table = runner.slot_table.table
    captured = len(runner._graphs._graphs) + len(runner._graphs._verify)
    assert captured >= 1
    for i in (2, 3):
        runner.add_stream(i, PROMPTS[i], params)
    assert runner.slot_table.table.data_ptr() != table.data_ptr()  # it grew
    for sid, so in runner.prefill().items():
        out[sid] += so.tokens
    while runner.streams:
        step()
    assert [out[i] for i in range(len(PROMPTS))] == [r[:10] for r in ref]
    runner.close()


@pytest.mark.parametrize("speculative", [False, True])
def test_a_step_padded_to_a_larger_bucket_gives_the_same_tokens_from_that_bucket(
    model_dir, speculative
) -> None:
    """`pad_to` (a Command planned for more streams than it runs): the step replays the larger
    bucket's graph, padding rows included, and gives each stream the tokens the unpadded step
    gives (batch-invariant kernels)."""
    outs, keys = [], []
    for pad in (0, 4):
        cfg = EngineConfig(num_slots=4096, budget=8, dtype="bfloat16", cuda_graphs=True,
                           graph_buckets=(1, 2, 4))  # fmt: skip
        runner = ModelRunner(
            model_dir, engine_cfg=cfg, drafter=model_dir / "drafter", device="cuda"
        )
        for i, p in enumerate(PROMPTS[:2]):
            runner.add_stream(i, p, SamplingParams(max_tokens=12))
        toks = {i: list(o.tokens) for i, o in runner.prefill().items()}
        while runner.streams:
            sids = list(runner.streams)
            step = runner.ddtree_step(sids, None, pad) if speculative else runner.ar_step(sids, pad)
            for i, o in step.items():
                toks[i] += o.tokens
        g = runner._graphs
        keys.append({k[0] for k in (g._verify if speculative else g._graphs)})
        outs.append(toks)
        runner.close()
    assert outs[1] == outs[0]
    assert keys[0] <= {1, 2} and keys[1] == {4}
