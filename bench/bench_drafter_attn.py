"""The DFlash drafter's block attention at the K2.5 drafter's tp = 8 shapes (8 query heads on 1
KV head of 128, a block of 16 queries, rings of 2,048 and 4,096 entries): the ring kernel
(`kernels/drafter_attn.ring_attention`) over a sweep of its launch parameters (keys per split,
or "auto" = about one program per SM; warps; key tile) against the gathered path the CPU runs
(`ContextCache.layer`'s index_select, the concatenation, `grouped_attention`). Each config is
checked against the gathered path (bf16 tolerance) and timed as a CUDA graph of 6 calls (one
draft's layers), `triton.testing.do_bench_cudagraph`; us per call.

    python bench/bench_drafter_attn.py --batches 1,5,10 --out attn.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _util import environment, write_json  # noqa: E402

from ddserve.drafter.layers import grouped_attention  # noqa: E402
from ddserve.kernels.drafter_attn import ring_attention  # noqa: E402


def inputs(b: int, ring: int, live: float = 1.0, q_len=16, nh=8, kvh=1, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf, streams = torch.bfloat16, max(12, b)  # the ring's rows: more than the batch reads
    q = torch.randn(b, q_len, nh, d, generator=g, device="cuda").to(bf)
    ring_k, ring_v = (torch.randn(streams, ring, kvh, d, generator=g, device="cuda").to(bf)
                      for _ in "kv")  # fmt: skip
    rows = torch.randperm(streams, generator=g, device="cuda")[:b]
    k_blk, v_blk = (torch.randn(b, q_len, kvh, d, generator=g, device="cuda").to(bf) for _ in "kv")
    visible = torch.rand(b, q_len, ring + q_len, generator=g, device="cuda") > 0.1
    visible[..., ring:] = True
    visible[..., max(1, int(ring * live)) : ring] = False  # entries not written yet
    return q, ring_k, ring_v, rows, k_blk, v_blk, visible


def lengths(ring: int, live: float, streams: int) -> torch.Tensor:
    """Every ring row's committed tokens: `live` of the ring written (1: a full ring)."""
    return torch.full((streams,), max(1, int(ring * live)), dtype=torch.long, device="cuda")


def gathered(q, ring_k, ring_v, rows, k_blk, v_blk, visible):
    k = torch.cat((ring_k.index_select(0, rows), k_blk), 1).transpose(1, 2)
    v = torch.cat((ring_v.index_select(0, rows), v_blk), 1).transpose(1, 2)
    return grouped_attention(q, k, v, visible)


def timed_us(fn, calls: int = 6) -> float:
    from triton.testing import do_bench_cudagraph

    def six():
        for _ in range(calls):
            fn()

    return do_bench_cudagraph(six, rep=200) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,5,10")
    ap.add_argument("--rings", default="2048,4096")
    ap.add_argument("--splits", default="64,128,256,auto")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--block-n", default="32,64")
    ap.add_argument("--live", type=float, default=1.0,
                    help="the fraction of each ring the streams have written (the gathered path "
                         "reads every entry whatever it is)")  # fmt: skip
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for b, ring in itertools.product(map(int, args.batches.split(",")),
                                     map(int, args.rings.split(","))):  # fmt: skip
        x = inputs(b, ring, args.live)
        want = gathered(*x)
        base = timed_us(lambda x=x: gathered(*x))
        print(f"B={b} ring={ring}: gathered {base:.1f} us")
        rows.append(dict(batch=b, ring=ring, path="gathered", us=base))
        for split, warps, bn in itertools.product(args.splits.split(","),
                                                  map(int, args.warps.split(",")),
                                                  map(int, args.block_n.split(","))):  # fmt: skip
            kps = None if split == "auto" else int(split)
            kw = dict(keys_per_split=kps, num_warps=warps, block_n=bn,
                      lengths=lengths(ring, args.live, x[1].shape[0]))  # fmt: skip
            try:
                got = ring_attention(*x, **kw)
                err = (got.float() - want.float()).abs().max().item()
                ok = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
                us = timed_us(lambda x=x, kw=kw: ring_attention(*x, **kw))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                rows.append(dict(batch=b, ring=ring, path="ring", split=split, warps=warps,
                                 block_n=bn, error=repr(e)[:300]))  # fmt: skip
                print(f"  split={split} warps={warps} bn={bn}: {e!r}"[:200])
                continue
            rows.append(dict(batch=b, ring=ring, path="ring", split=split, warps=warps,
                             block_n=bn, us=us, max_err=err, close=ok))  # fmt: skip
            print(f"  split={split:>4} warps={warps} bn={bn}: {us:6.1f} us "
                  f"({base / us:.1f}x gathered){'' if ok else ' MISMATCH'}")  # fmt: skip
        write_json(args.out, dict(env=environment(), args=vars(args), rows=rows))  # so far


if __name__ == "__main__":
    main()
