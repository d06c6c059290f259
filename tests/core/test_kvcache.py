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


def test_slot_table_mirrors_appends_and_reuses_rows():
    """The device table gives each stream exactly its appended slots, in order, across growth."""
    from ddserve.kvcache import SlotTable

    rng = random.Random(0)
    table, lists = SlotTable(max_len=64, device="cpu", rows=2), {}
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
            k = rng.randint(0, min(3, 64 - len(slots)))
            new = [rng.randrange(10_000) for _ in range(k)]
            items.append((sid, len(slots), new))
            slots.extend(new)
        table.append(items)
        sids = list(lists)
        lens = [len(lists[s]) for s in sids]
        got = table.prefix(sids, lens)
        for i, s in enumerate(sids):
            assert got[i, : lens[i]].tolist() == lists[s]
