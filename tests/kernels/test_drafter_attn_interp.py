"""`kernels/drafter_attn.ring_attention` (the DFlash drafter's block attention reading each
stream's context in its ring) in the Triton interpreter on the CPU: against `grouped_attention`
over the gathered rows (ragged masks, ring rows out of order, a query without any context, splits
that end inside the block's keys, streams shorter than the ring), and a drafter's draft logits
with the ring read in place equal to the gathered path's, with sliding layers over a ring that
wrapped and with a full-attention layer. Both kernels also compile for sm_90 at the K2.5
drafter's tp = 8 shapes; tests/gpu/test_drafter_attn_gpu.py checks bf16 on a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from ddserve.drafter.layers import grouped_attention
from tests.triton_interp import (
    interpreter_results,
    patch_interpreter,
    require_sm90_compiler,
    require_triton,
    run_cases,
)


def check_against_gathered(b, q_len, nh, kvh, d, c, per_split, lengths=None) -> None:
    """`lengths`: the streams' committed tokens (their ring entries past it never attended)."""
    from ddserve.kernels.drafter_attn import ring_attention

    gen = torch.Generator().manual_seed(b * 100 + c)
    q = torch.randn(b, q_len, nh, d, generator=gen)
    ring_k, ring_v = (torch.randn(4, c, kvh, d, generator=gen) for _ in "kv")
    rows = torch.tensor([3, 1][:b])
    k_blk, v_blk = (torch.randn(b, q_len, kvh, d, generator=gen) for _ in "kv")
    visible = torch.rand(b, q_len, c + q_len, generator=gen) > 0.4
    visible[..., c:] = True  # the block sees itself
    visible[0, 0, :c] = False  # a query with no context at all
    lens, want_vis = None, visible.clone()
    if lengths is not None:  # entries past a stream's length: visible here, never attended
        lens = torch.full((4,), 10**6, dtype=torch.long)
        lens[rows] = torch.tensor(lengths)
        written = torch.arange(c)[None, :] < torch.tensor(lengths)[:, None]  # [B, C]
        want_vis[..., :c] &= written[:, None, :]
        visible[..., :c] |= ~written[:, None, :]
    want = grouped_attention(
        q,
        torch.cat((ring_k[rows], k_blk), 1).transpose(1, 2),
        torch.cat((ring_v[rows], v_blk), 1).transpose(1, 2),
        want_vis,
    )
    got = ring_attention(q, ring_k, ring_v, rows, k_blk, v_blk, visible, block_n=16,
                         keys_per_split=per_split, lengths=lens)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def check_drafter_reads_the_ring_in_place(layer_types) -> None:
    """`DFlashDrafter.ring_attention` on and off (the CPU default): the same draft logits, and
    the kernel called once per layer."""
    from ddserve.drafter.model import DFlashDrafter
    from ddserve.kernels import drafter_attn
    from tests.core.test_dflash import FakeTarget, drafter_raw, make_model

    model, _ = make_model(drafter_raw(layer_types=layer_types, window=16), seed=3)
    drafter = DFlashDrafter(model, FakeTarget(seed=1), max_streams=3, max_context=24)
    gen = torch.Generator().manual_seed(2)
    width = len(drafter.capture_layers) * model.cfg.hidden_size
    for sid, n in (("a", 22), ("b", 7)):  # "a" wrapped its ring where every layer slides (16)
        drafter.add_stream(sid, [1] * n, torch.randn(n, width, generator=gen))
    assert not drafter.ring_attention  # off where the drafter lives on the CPU
    rows, bonus = torch.tensor(drafter.state_rows(["b", "a"])), torch.tensor([5, 9])
    want = drafter.draft_rows(rows, bonus)
    calls, kernel = [], drafter_attn.ring_attention
    drafter_attn.ring_attention = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    try:
        drafter.ring_attention = True
        got = drafter.draft_rows(rows, bonus)
    finally:
        drafter_attn.ring_attention = kernel
    assert len(calls) == len(layer_types)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


CASES = (
    ("two_streams_gqa2_splits_16", check_against_gathered, (2, 3, 4, 2, 16, 37, 16)),
    ("one_stream_gqa8_one_split", check_against_gathered, (1, 5, 8, 1, 16, 20, 64)),
    ("short_streams_skip_dead_tiles", check_against_gathered, (2, 3, 4, 2, 16, 37, 16, (10, 60))),
    ("a_length_one_past_a_tile", check_against_gathered, (2, 3, 4, 2, 16, 37, 16, (17, 1))),
    ("auto_splits", check_against_gathered, (2, 3, 4, 2, 16, 37, None, (3, 37))),
    ("drafter_sliding", check_drafter_reads_the_ring_in_place,
     (("sliding_attention", "sliding_attention"),)),
    ("drafter_mixed", check_drafter_reads_the_ring_in_place,
     (("sliding_attention", "full_attention"),)),
)  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_kernel_in_interpreter(name: str) -> None:
    require_triton()
    result = interpreter_results(__file__)[name]
    assert result == "ok", result


def test_kernels_compile_for_sm90() -> None:
    require_sm90_compiler()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddserve.kernels import drafter_attn as m

    target, opts = GPUTarget("cuda", 90, 64), {"num_warps": 8, "num_stages": 2}
    ptrs = ["q_ptr", "rk_ptr", "rv_ptr", "kb_ptr", "vb_ptr"]
    sig = {**dict.fromkeys(ptrs, "*bf16"), "rows_ptr": "*i64", "len_ptr": "*i64", "vis_ptr": "*i8",
           "po_ptr": "*fp32", "pl_ptr": "*fp32"}  # fmt: skip
    strides = ["sq_b", "sq_q", "sq_h", "sr_s", "sr_c", "sr_h", "sb_b", "sb_q", "sb_h", "sv_b",
               "sv_q"]  # fmt: skip
    sig.update(C="i32", KEYS="i32", **dict.fromkeys(strides, "i32"))
    consts = dict(Q=16, G=8, KVH=1, D=128, NSPLIT=9, CHUNK=256, BLOCK_M=128, BLOCK_N=64,
                  LENGTHS=True, PREC="tf32")  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(m._partial_kernel, sig, constexprs=consts)
    assert "mma" in triton.compile(src, target=target, options=opts).asm["ptx"]
    sig = {"po_ptr": "*fp32", "pl_ptr": "*fp32", "out_ptr": "*bf16", "so_b": "i32", "so_q": "i32"}
    consts = dict(Q=16, G=8, KVH=1, D=128, NSPLIT=9, BLOCK_M=128, BLOCK_S=16)
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(m._merge_kernel, sig, constexprs=consts)
    assert triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]


def test_shapes_the_kernel_does_not_take_are_gathered():
    """A head size that is not a power of two of at least 16 (or query heads not in whole
    groups) gets None from the backend, and the drafter gathers its rows instead."""
    require_triton()
    from ddserve.kernels import backend, drafter_attn

    for d, nh, kvh, ok in ((16, 4, 2, True), (128, 8, 1, True), (24, 4, 2, False),
                           (8, 4, 2, False), (16, 6, 4, False)):  # fmt: skip
        q, ring = torch.zeros(1, 2, nh, d), torch.zeros(3, 5, kvh, d)
        assert drafter_attn.supports(q, ring) is ok
    q, ring, blk = torch.zeros(1, 2, 4, 24), torch.zeros(3, 5, 2, 24), torch.zeros(1, 2, 2, 24)
    vis = torch.ones(1, 2, 7, dtype=torch.bool)
    assert backend.ring_attention(q, ring, ring, torch.tensor([1]), blk, blk, vis) is None


if __name__ == "__main__":  # the interpreter subprocess
    patch_interpreter()
    print(json.dumps(run_cases(CASES)))
