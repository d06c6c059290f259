"""bench/drafter_attn_triton.py (an experiment for the "triton-ring" drafter variant) on the CPU:
its checks in the Triton interpreter (against `grouped_attention` and the drafter's own draft),
and both kernels compiled for sm_90 at the K2.5 drafter's tp = 8 shapes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
triton = pytest.importorskip("triton", reason="needs triton (pip install -e '.[test]')")


def test_ring_attention_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{HERE.parent}:{HERE}",
               OMP_NUM_THREADS="1")  # fmt: skip
    code = "import drafter_attn_triton as m; m.self_check(); m.variant_check()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_kernels_compile_for_sm90():
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this triton cannot compile for sm_90: {e}")
    from triton.compiler import ASTSource

    sys.path.insert(0, str(HERE))
    import drafter_attn_triton as m

    target, opts = GPUTarget("cuda", 90, 64), {"num_warps": 8, "num_stages": 2}
    ptrs = ["q_ptr", "rk_ptr", "rv_ptr", "kb_ptr", "vb_ptr"]
    sig = {**dict.fromkeys(ptrs, "*bf16"), "rows_ptr": "*i64", "vis_ptr": "*i8",
           "po_ptr": "*fp32", "pl_ptr": "*fp32"}  # fmt: skip
    strides = ["sq_b", "sq_q", "sq_h", "sr_s", "sr_c", "sr_h", "sb_b", "sb_q", "sb_h", "sv_b",
               "sv_q"]  # fmt: skip
    sig.update(C="i32", KEYS="i32", **dict.fromkeys(strides, "i32"))
    consts = dict(Q=16, G=8, KVH=1, D=128, NSPLIT=9, CHUNK=256, BLOCK_M=128, BLOCK_N=64)
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(m._partial_kernel, sig, constexprs=consts)
    assert "mma" in triton.compile(src, target=target, options=opts).asm["ptx"]
    sig = {"po_ptr": "*fp32", "pl_ptr": "*fp32", "out_ptr": "*bf16", "so_b": "i32", "so_q": "i32"}
    consts = dict(Q=16, G=8, KVH=1, D=128, NSPLIT=9, BLOCK_M=128, BLOCK_S=16)
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(m._merge_kernel, sig, constexprs=consts)
    assert triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("streams", [1, 10])
def test_ring_attention_on_the_gpu(streams):
    """bf16 at the K2.5 drafter's tp = 8 shapes (8 query heads on 1 KV head, 16 queries, a ring
    of 2,048 + a block of 16 keys) against `grouped_attention` over the gathered keys."""
    import torch

    sys.path.insert(0, str(HERE))
    from drafter_attn_triton import ring_attention

    from ddserve.drafter.layers import grouped_attention

    g = torch.Generator(device="cuda").manual_seed(streams)
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(streams, 16, 8, 128, generator=g, device=dev).to(bf)
    ring_k, ring_v = (torch.randn(12, 2048, 1, 128, generator=g, device=dev).to(bf) for _ in "kv")
    rows = torch.randperm(12, device=dev)[:streams]
    k_blk, v_blk = (torch.randn(streams, 16, 1, 128, generator=g, device=dev).to(bf) for _ in "kv")
    visible = torch.rand(streams, 16, 2048 + 16, generator=g, device=dev) > 0.3
    visible[..., 2048:] = True
    keys = torch.cat((ring_k[rows], k_blk), 1).transpose(1, 2)
    values = torch.cat((ring_v[rows], v_blk), 1).transpose(1, 2)
    want = grouped_attention(q, keys, values, visible)
    got = ring_attention(q, ring_k, ring_v, rows, k_blk, v_blk, visible)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
