"""Slot allocator and latent pool."""

from __future__ import annotations

import random

import pytest
import torch

from ddserve.kvcache import LatentCache, OutOfSlots, SlotAllocator


def test_alloc_gives_distinct_slots_and_free_returns_them() -> None:
    a = SlotAllocator(10)
    x, y = a.alloc(4), a.alloc(6)
    assert len(set(x + y)) == 10 and set(x + y) == set(range(10))
    assert a.num_free == 0 and a.num_used == 10
    a.free(x)
    assert a.num_free == 4
    assert sorted(a.alloc(4)) == sorted(x)


def test_out_of_slots_allocates_nothing() -> None:
    a = SlotAllocator(8)
    held = a.alloc(5)
    with pytest.raises(OutOfSlots):
        a.alloc(4)
    assert a.num_free == 3
    assert len(set(a.alloc(3)) | set(held)) == 8


def test_double_free_and_foreign_slots_are_rejected_without_side_effects() -> None:
    a = SlotAllocator(6)
    s = a.alloc(3)
    a.free(s[:1])
    with pytest.raises(ValueError):
        a.free([s[1], s[0]])  # s[0] is already free
    assert a.num_free == 4  # s[1] was not freed by the failed call
    with pytest.raises(ValueError):
        a.free([99])
    with pytest.raises(ValueError):
        a.free([s[1], s[1]])


def test_random_alloc_free_never_hands_out_a_held_slot() -> None:
    rng, a = random.Random(0), SlotAllocator(64)
    held: list[list[int]] = []
    for _ in range(500):
        if held and rng.random() < 0.5:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            try:
                held.append(a.alloc(rng.randint(0, 9)))
            except OutOfSlots:
                pass
        flat = [s for h in held for s in h]
        assert len(flat) == len(set(flat)) == a.num_used
    for h in held:
        a.free(h)
    assert a.num_free == 64


def test_latent_pool_shape() -> None:
    c = LatentCache(3, 17, 576, dtype=torch.bfloat16)
    assert c.pool.shape == (3, 17, 576) and c.pool.dtype == torch.bfloat16
    assert c.num_slots == 17 and c.nbytes() == 3 * 17 * 576 * 2


def test_a_step_that_raises_returns_its_new_slots(tiny_model_dir, monkeypatch):
    """A forward that fails (e.g. out of device memory) must not leak the step's fresh slots."""
    from ddserve.drafter.testing import RandomDrafter
    from ddserve.engine.config import EngineConfig
    from ddserve.engine.runner import ModelRunner
    from ddserve.sampling import SamplingParams

    runner = ModelRunner(tiny_model_dir, engine_cfg=EngineConfig(num_slots=512, budget=8),
                         drafter=RandomDrafter(264, depth=4, seed=0), device="cpu")  # fmt: skip
    runner.add_stream(0, [5, 6, 7, 8], SamplingParams(max_tokens=8))
    runner.prefill()
    before = runner.free_slots

    def boom(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(runner, "_forward", boom)
    for step in (runner.ar_step, runner.ddtree_step):
        with pytest.raises(RuntimeError, match="simulated"):
            step([0])
        assert runner.free_slots == before


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="the pinned-staging path needs CUDA")),
]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_slot_table_mirrors_appends_and_reuses_rows(device):
    """The device table gives each stream exactly its appended slots, in order, across growth
    (of the table's rows and, on CUDA, of the staging buffers)."""
    from ddserve.kvcache import SlotTable

    rng = random.Random(0)
    table, lists = SlotTable(max_len=512, device=device, rows=2), {}
    for step in range(200):
        if rng.random() < 0.2 or not lists:
            sid = step
            table.add(sid)
            lists[sid] = []
        elif rng.random() < 0.1:
            sid = rng.choice(list(lists))
            table.remove(sid)
            del lists[sid]
            continue
        items = []
        for sid, slots in lists.items():
            k = rng.randint(0, min(3 if step % 50 else 300, 512 - len(slots)))
            new = [rng.randrange(10_000) for _ in range(k)]
            items.append((sid, len(slots), new))
            slots.extend(new)
        table.append(items)
        sids = list(lists)
        lens = [len(lists[s]) for s in sids]
        got = table.prefix(sids, lens)
        for i, s in enumerate(sids):
            assert got[i, : lens[i]].tolist() == lists[s]


def _table_rows(table, lists: dict) -> dict:
    sids = list(lists)
    got = table.prefix(sids, [len(lists[s]) for s in sids])
    return {s: got[i, : len(lists[s])].tolist() for i, s in enumerate(sids)}


@pytest.mark.parametrize("device", DEVICES)
def test_slot_table_long_append_then_a_short_one(device):
    """A long append (1,500 slots at once, as a long prompt's chunks add) and a short one after
    it both land where they belong."""
    from ddserve.kvcache import SlotTable

    table = SlotTable(max_len=2048, device=device, rows=2)
    table.add("a")
    big = list(range(5000, 6500))
    table.append([("a", 0, big)])
    table.append([("a", 1500, [7, 8])])
    assert _table_rows(table, {"a": big + [7, 8]}) == {"a": big + [7, 8]}


def test_slot_table_append_writes_several_streams_in_one_call():
    from ddserve.kvcache import SlotTable

    table, lists = SlotTable(max_len=32, device="cpu", rows=4), {}
    for sid, first in (("x", [1, 2, 3]), ("y", [4]), ("z", [])):
        table.add(sid)
        lists[sid] = list(first)
    table.append([(sid, 0, list(slots)) for sid, slots in lists.items()])
    new = {"x": [9], "y": [10, 11, 12], "z": [13, 14]}
    table.append([(sid, len(lists[sid]), new[sid]) for sid in ("z", "x", "y")])
    for sid in lists:
        lists[sid] += new[sid]
    assert _table_rows(table, lists) == lists


def test_slot_table_append_past_the_end_of_a_row_raises_and_writes_nothing():
    from ddserve.kvcache import SlotTable

    table = SlotTable(max_len=4, device="cpu", rows=2)
    table.add(0)
    table.add(1)
    table.append([(0, 0, [5, 6])])
    with pytest.raises(IndexError):
        table.append([(1, 0, [7]), (0, 2, [8, 9, 10])])
    assert _table_rows(table, {0: [5, 6], 1: []}) == {0: [5, 6], 1: []}
    assert table.table[1].tolist() == [0, 0, 0, 0]


def test_a_step_takes_the_slots_one_alloc_per_block_would(tiny_model_dir):
    """A step allocates all its blocks at once; each block gets what allocating the blocks one
    by one would have given it."""
    import copy

    from ddserve.engine.config import EngineConfig
    from ddserve.engine.runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, engine_cfg=EngineConfig(num_slots=64, budget=4),
                         device="cpu")  # fmt: skip
    runner.allocator.free(runner.allocator.alloc(40)[::3])  # a scrambled free list
    sizes = [3, 1, 5, 2]
    one_by_one = copy.deepcopy(runner.allocator)
    assert runner._alloc_scratch(sizes) == [one_by_one.alloc(n) for n in sizes]
    assert runner.allocator.alloc(10) == one_by_one.alloc(10)


def test_slot_table_equals_the_streams_slot_lists_across_ar_and_ddtree_steps(tiny_model_dir):
    """After every step of a mix of AR and DDTree steps (streams joining and finishing), the
    device table holds each stream's committed slots in order, and the pool holds the rest."""
    from ddserve.drafter.testing import RandomDrafter
    from ddserve.engine.config import EngineConfig
    from ddserve.engine.runner import ModelRunner
    from ddserve.sampling import SamplingParams

    cfg = EngineConfig(num_slots=1024, budget=6, max_streams=4)
    runner = ModelRunner(tiny_model_dir, engine_cfg=cfg, device="cpu",
                         drafter=RandomDrafter(264, depth=4, seed=3))  # fmt: skip
    prompts = [[5, 6, 7], [100, 101], list(range(30, 45)), [200], [9, 8, 7, 6, 5]]
    rng = random.Random(0)

    def check() -> None:
        lists = {sid: st.slots for sid, st in runner.streams.items() if st.slots}
        assert _table_rows(runner.slot_table, lists) == lists
        held = [s for st in runner.streams.values() for s in st.slots]
        assert len(held) == len(set(held)) == runner.allocator.num_used

    steps = 0
    for i, p in enumerate(prompts):
        runner.add_stream(i, p, SamplingParams(max_tokens=rng.randint(4, 14)))
        runner.prefill()
        check()
        for _ in range(rng.randint(1, 3)):
            sids = list(runner.streams)
            if not sids:
                break
            if rng.random() < 0.5:
                runner.ar_step(sids)
            else:
                runner.ddtree_step(sids, rng.choice([1, 3, 6]))
            steps += 1
            check()
    while runner.streams:
        runner.ddtree_step(list(runner.streams))
        check()
    assert steps > 5 and runner.allocator.num_used == 0


def test_a_step_that_runs_out_of_slots_takes_none(tiny_model_dir):
    """When the pool holds enough for the first blocks of a step but not all of them, the step's
    allocation raises and leaves the pool as it was."""
    from ddserve.engine.config import EngineConfig
    from ddserve.engine.runner import ModelRunner
    from ddserve.kvcache import OutOfSlots

    runner = ModelRunner(tiny_model_dir, engine_cfg=EngineConfig(num_slots=64, budget=4),
                         device="cpu")  # fmt: skip
    runner.allocator.alloc(54)  # 10 left: a first block of 4 fits, three do not
    free = runner.allocator.num_free
    with pytest.raises(OutOfSlots):
        runner._alloc_scratch([4, 4, 4])
    assert runner.allocator.num_free == free == 10


def test_a_ddtree_step_leaves_the_free_list_as_one_free_per_stream_would(tiny_model_dir):
    """The dropped tree slots of a DDTree step go back in one free; the pool's free list then
    equals the one that allocating each block alone and freeing each stream's dropped slots in
    batch order gives, so later steps place their KV in the same slots."""
    import copy

    from ddserve.drafter.testing import RandomDrafter
    from ddserve.engine.config import EngineConfig
    from ddserve.engine.runner import ModelRunner
    from ddserve.sampling import SamplingParams

    budget = 6
    runner = ModelRunner(tiny_model_dir, device="cpu",
                         engine_cfg=EngineConfig(num_slots=1024, budget=budget, max_streams=4),
                         drafter=RandomDrafter(264, depth=4, seed=5))  # fmt: skip
    for sid, prompt in enumerate([[5, 6, 7], list(range(30, 41)), [200, 3]]):
        runner.add_stream(sid, prompt, SamplingParams(max_tokens=200))
    runner.prefill()
    sids = list(runner.streams)
    for _ in range(3):
        ref = copy.deepcopy(runner.allocator)
        before = {sid: len(runner.streams[sid].slots) for sid in sids}
        blocks = [ref.alloc(budget + 1) for _ in sids]
        runner.ddtree_step(sids)
        for sid, block in zip(sids, blocks, strict=True):
            kept = set(runner.streams[sid].slots[before[sid] :])
            assert kept <= set(block)  # the step took the slots one alloc per block gives
            ref.free([s for s in block if s not in kept])
        assert runner.allocator._free == ref._free


def test_a_multi_row_block_needs_its_mask(tiny_model_dir):
    """Only one-row blocks may leave the visibility mask out (a row sees itself)."""
    from ddserve.engine.config import EngineConfig
    from ddserve.engine.runner import ModelRunner
    from ddserve.sampling import SamplingParams

    runner = ModelRunner(tiny_model_dir, engine_cfg=EngineConfig(num_slots=64, budget=4),
                         device="cpu")  # fmt: skip
    runner.add_stream("a", [5, 6, 7], SamplingParams(max_tokens=8))
    runner.prefill()
    st = runner.streams["a"]
    with pytest.raises(ValueError, match="mask"):
        runner._decode_forward([st], 2, [[60, 61]], None, [1, 2], [3, 4])


@pytest.mark.parametrize("device", DEVICES)
def test_staging_puts_what_torch_tensor_makes_and_reuses_its_buffers(device):
    """`Staging.put` == torch.tensor(values) on the device, for ints and float32, through
    buffer growth and reuse (each result read before the next put, as its callers use it)."""
    from ddserve.kvcache import Staging

    rng = random.Random(1)
    for dtype in (torch.long, torch.float32):
        st = Staging(torch.device(device), dtype)
        for n in (3, 1, 700, 5, 2500, 8):
            vals = [rng.randrange(-(2**40), 2**40) for _ in range(n)] if dtype == torch.long else [
                rng.uniform(-3, 3) for _ in range(n)]  # fmt: skip
            got = st.put(vals)
            assert got.device.type == device and got.dtype == dtype
            assert torch.equal(got.cpu(), torch.tensor(vals, dtype=dtype)), (dtype, n)
