"""Triton MoE (variant v2) on the CPU through the Triton interpreter, tiny shapes.

The kernels run in a subprocess with TRITON_INTERPRET=1 (the flag is read when a kernel is
decorated, so it must be set before ddserve's Triton modules are first imported in a process);
the subprocess prints one JSON record per check and the tests below assert on them.
Checks: equal to `moe_ref` within tolerance (INT4 and dense bf16, T = 0 / 1 / 5 / 33, experts with
no tokens, sizes off the tile grid, split-K 1 / 2 / 4); a token's row is bitwise the same alone as
inside bigger batches with different routing of the other tokens (also across the host-side
token chunking); unknown config keys are refused. The interpreter runs with
tests/triton_interp.py's patches (a `tl.dot` whose rows get the same arithmetic wherever they sit
in the tile), so the bitwise claims hold on any CPU.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.triton_interp import interpreter_run, patch_interpreter, require_triton

require_triton()
# The interpreter rounds fp32 -> bf16 by truncation (measured: 1-ulp differences in dequantized
# weights), so it sits a little above the GPU's 1e-2 tolerance.
TOL = 2.5e-2


def _random_int4(e: int, h: int, i: int, gen):
    import torch

    from ddserve.kernels.moe_ref import ExpertWeights

    def packed(rows: int, cols: int):
        words = torch.randint(
            -(2**31), 2**31 - 1, (e, rows, cols // 8), generator=gen, dtype=torch.int32
        )
        scale = (torch.rand(e, rows, cols // 32, generator=gen) + 0.5) / (4.6 * math.sqrt(cols))
        return words, scale.to(torch.bfloat16)

    w13p, s13 = packed(2 * i, h)
    w2p, s2 = packed(h, i)
    return ExpertWeights(w13_packed=w13p, w13_scale=s13, w2_packed=w2p, w2_scale=s2)


def _routing(t: int, e: int, k: int, gen, only: int | None = None):
    import torch

    ids = torch.rand(t, only or e, generator=gen).topk(k, dim=1).indices  # [T, k] distinct
    return ids, torch.rand(t, k, generator=gen) * 2.5


def _child() -> None:
    """Runs under TRITON_INTERPRET=1: print one JSON line per check."""
    import torch

    import ddserve.kernels.moe_triton_v2 as v2
    from ddserve.kernels.moe_ref import ExpertWeights, moe_ref
    from ddserve.kernels.moe_triton import fused_moe

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)

    def emit(**rec):
        print(json.dumps(rec), flush=True)

    def accuracy(name, w, t, k, cfg, inv, only=None):
        h = w.w13_packed.shape[-1] * 8 if w.is_int4 else w.w13.shape[-1]
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)  # [T, H]
        ids, tw = _routing(t, w.num_experts, k, gen, only)
        out = fused_moe(x, ids, tw, w, config=cfg, invariant=inv)
        ref = moe_ref(x, ids, tw, w)
        ok_shape = out.shape == x.shape and out.dtype == x.dtype
        if t == 0:
            err = 0.0
        else:
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            err = err if torch.isfinite(out).all() else float("inf")
        emit(kind="acc", name=name, t=t, inv=inv, cfg=cfg, err=err, shape_ok=ok_shape)

    w = _random_int4(8, 256, 64, gen)
    for t in (0, 1, 5, 33):
        accuracy("int4", w, t, 2, {}, True)
    accuracy("int4-one-expert", w, 12, 1, {}, True, only=1)  # 7 empty experts, 2 blocks
    accuracy("int4-split1", w, 5, 2, {"SPLIT": 1}, True)
    accuracy("int4-bm32", w, 17, 2, {"BM": 32, "SPLIT": 2}, True)
    accuracy("int4-split2", w, 5, 2, {"SPLIT": 2, "BN1": 64, "KW1": 8}, True)
    odd = _random_int4(7, 320, 96, gen)  # H, I off the 128-column steps and BN2
    accuracy("int4-odd", odd, 4, 3, {}, True)
    dense = ExpertWeights(
        w13=(torch.randn(6, 128, 192, generator=gen) / 14).to(torch.bfloat16),
        w2=(torch.randn(6, 192, 64, generator=gen) / 8).to(torch.bfloat16),
    )
    accuracy("dense", dense, 7, 2, {}, True)
    try:
        fused_moe(torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int64),
                  torch.ones(1, 2), w, config={"TMA": True})  # fmt: skip
        emit(kind="unknown_key", raised=False)
    except ValueError as exc:
        emit(kind="unknown_key", raised="TMA" in str(exc))

    # Invariance: token 0 alone, then first in batches whose other tokens route differently.
    x0 = torch.randn(1, 256, generator=gen).to(torch.bfloat16)
    ids0, tw0 = _routing(1, 8, 2, gen)
    alone = fused_moe(x0, ids0, tw0, w)
    for t, only in ((5, None), (17, None), (17, 3), (12, 2)):
        xo = torch.randn(t - 1, 256, generator=gen).to(torch.bfloat16)
        ido, two = _routing(t - 1, 8, 2, gen, only)
        pos = t // 2  # the token sits in the middle of the batch
        x = torch.cat([xo[:pos], x0, xo[pos:]])
        ids = torch.cat([ido[:pos], ids0, ido[pos:]])
        tw = torch.cat([two[:pos], tw0, two[pos:]])
        out = fused_moe(x, ids, tw, w)
        emit(kind="inv", name=f"T={t} only={only}", same=bool(torch.equal(out[pos], alone[0])))
    v2.CHUNK = 4  # host chunking: the token lands in the second of two chunks
    x = torch.cat([torch.randn(5, 256, generator=gen).to(torch.bfloat16), x0])
    ido, two = _routing(5, 8, 2, gen)
    out = fused_moe(x, torch.cat([ido, ids0]), torch.cat([two, tw0]), w)
    emit(kind="inv", name="chunked T=6 CHUNK=4", same=bool(torch.equal(out[5], alone[0])))


@pytest.fixture(scope="module")
def records() -> list[dict]:
    lines = interpreter_run(__file__).stdout.splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


@pytest.mark.interpreter
def test_matches_reference(records):
    acc = [r for r in records if r["kind"] == "acc"]
    assert len(acc) == 10
    bad = [r for r in acc if not (r["shape_ok"] and r["err"] < TOL)]
    assert not bad, bad


@pytest.mark.interpreter
def test_invariant_rows_are_bitwise_equal(records):
    inv = [r for r in records if r["kind"] == "inv"]
    assert len(inv) == 5
    assert all(r["same"] for r in inv), inv


@pytest.mark.interpreter
def test_unknown_config_keys_are_refused(records):
    assert [r["raised"] for r in records if r["kind"] == "unknown_key"] == [True]


if __name__ == "__main__":
    patch_interpreter()
    _child()
