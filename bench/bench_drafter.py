"""What a DFlash drafter of a published Kimi K2.5 drafter's size costs a DDTree step on one GPU.

The K2.6 rank benchmark (`bench_engine.py`) drafts with an oracle, whose draft costs next to
nothing; a real DFlash drafter runs a forward over each stream's block every step and a context
forward over the tokens each step commits. ddserve shards the drafter across the target's ranks
(heads, MLP and `fc` split, one all-reduce after `fc`, o_proj and down_proj), so with `--tp N`
each rank reads 1/N of its weights; `--tp 1` is the drafter whole on one rank. This script builds
a drafter with random weights in the shape of z-lab/Kimi-K2.5-DFlash (hidden 7168, 6 layers, 64
query / 8 KV heads of 128, MLP 18432, block 16; the target's embedding, and its lm_head as one
rank's vocabulary slice at tp = 8) and times, per batch of B streams with a context of `--context`
tokens each:
- draft: `DFlashDrafter.draft_rows` (the block forward and the draft logits), CUDA-graph replay
  (the engine captures it inside the verify graph);
- commit: `commit_many` of `--commit` tokens per stream (the context forward and the ring write),
  eager; and `commit_block`, the engine's call after each step (the step's [B, block] hidden
  states, `--commit` rows kept per stream), a CUDA-graph replay on CUDA;
and the byte floor of each (weights read / copy bandwidth measured in the same run). At `--tp N`
it runs rank 0's shard on the one GPU with the collectives left out (as `bench_engine.py` runs
the target's rank slice) and reports how many all-reduces of how many bytes a rank would add.
Random weights say nothing about acceptance, only cost.

    python3 bench/bench_drafter.py --batches 1,5,10 --out drafter.json
    python3 bench/bench_drafter.py --batches 1,5,10 --tp 8 --out drafter_tp8.json
    python3 bench/bench_drafter.py --small --device cpu --out smoke.json   # tiny shapes, CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddserve.distributed import LocalComm  # noqa: E402
from ddserve.drafter.config import DrafterConfig, build_target_layer_ids  # noqa: E402
from ddserve.drafter.model import DFlashDrafter, DFlashModel  # noqa: E402
from ddserve.kernels import backend  # noqa: E402

# z-lab/Kimi-K2.5-DFlash as its published conversions describe it (hidden, layers, heads, MLP);
# its block size and RoPE follow the DFlash papers' K2 setting; no sliding window assumed
K25_DFLASH = dict(hidden=7168, layers=6, heads=64, kv_heads=8, head_dim=128, inter=18432,
                  block=16, vocab=163840, vocab_slice=163840 // 8, target_layers=61)  # fmt: skip
SMALL = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, inter=512, block=8,
             vocab=1024, vocab_slice=512, target_layers=61)  # fmt: skip


def drafter_config(s: dict, context: int) -> DrafterConfig:
    return DrafterConfig.from_hf({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": s["hidden"], "intermediate_size": s["inter"],
        "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "hidden_act": "silu",
        "attention_bias": False, "rms_norm_eps": 1e-6, "vocab_size": s["vocab"],
        "max_position_embeddings": 262144, "rope_theta": 50000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 64.0,
                         "original_max_position_embeddings": 4096},
        "block_size": s["block"], "num_target_layers": s["target_layers"],
        "dflash_config": {"mask_token_id": 0, "target_layer_ids": list(
            build_target_layer_ids(s["target_layers"], s["layers"]))},
        "layer_types": ["full_attention"] * s["layers"], "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    })  # fmt: skip


class RankSlice(LocalComm):
    """Rank 0 of `world_size` ranks for the shapes, with every collective left out."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size


class Hooks:
    """The target's embedding and lm_head (one rank's vocabulary slice), random."""

    def __init__(self, s: dict, device, dtype) -> None:
        gen = torch.Generator(device=device).manual_seed(1)
        self.emb = torch.randn(s["vocab"], s["hidden"], generator=gen, device=device).to(dtype)
        self.head = (
            torch.randn(s["vocab_slice"], s["hidden"], generator=gen, device=device)
            * s["hidden"] ** -0.5
        ).to(dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb.index_select(0, ids)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.head).float()


def random_model(cfg: DrafterConfig, device, dtype, tp: int = 1, stack: bool = True,
                 seed: int = 0) -> DFlashModel:  # fmt: skip
    """Rank 0's shard at tp (collectives left out) of a drafter with random weights: norms 1,
    matmul weights N(0, 1/fan_in), so activations and logits stay finite and O(1)."""
    with torch.device(device):
        model = DFlashModel(cfg, RankSlice(tp) if tp > 1 else None).to(dtype)
    if model.comm.world_size != tp:
        raise SystemExit(f"this drafter's shapes do not divide by --tp {tp}")
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    if stack:
        model.stack()  # as `load_dflash_model` leaves a loaded drafter
    return model


def build(s: dict, context: int, streams: int, device, dtype, stack: bool = True, tp: int = 1):
    cfg = drafter_config(s, context)
    model = random_model(cfg, device, dtype, tp, stack)
    gen = torch.Generator(device=device).manual_seed(0)
    hooks = Hooks(s, device, dtype)
    drafter = DFlashDrafter(model, hooks, max_streams=streams, max_context=context + 2048)
    width = len(drafter.capture_layers) * s["hidden"]  # the target hands over each layer once
    for sid in range(streams):
        hidden = torch.randn(context, width, generator=gen, device=device).to(dtype)
        drafter.add_stream(sid, [1] * context, hidden)
    return cfg, model, hooks, drafter, width


def copy_bandwidth(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    a = torch.empty(1 << 29, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * a.numel() / statistics.median(times)  # bytes read + written per second


def timed(fn, device, reps: int) -> float:
    """Median seconds of fn() (CUDA events on CUDA, wall clock elsewhere)."""
    cuda = torch.device(device).type == "cuda"
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def count_ops(fn) -> int:
    """Torch ops fn() dispatches from Python (top-level aten calls, CPU profiler): what an eager
    call costs the host, launch by launch, on any device."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.events()
    return sum(
        1 for e in events if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )  # fmt: skip


def draft_runner(drafter: DFlashDrafter, b: int, device):
    """A callable that drafts for streams 0..b-1: a CUDA-graph replay on CUDA, else eager."""
    rows = torch.tensor(drafter.state_rows(list(range(b))), device=device)
    bonus = torch.ones(b, dtype=torch.long, device=device)
    if torch.device(device).type != "cuda":
        return lambda: drafter.draft_rows(rows, bonus)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        drafter.draft_rows(rows, bonus)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drafter.draft_rows(rows, bonus)
    return graph.replay


def profile(drafter: DFlashDrafter, b: int, commit: int, width: int, device, dtype) -> None:
    """The torch profiler's top ops of one eager draft and one commit of b streams."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    rows = torch.tensor(drafter.state_rows(list(range(b))), device=device)
    bonus = torch.ones(b, dtype=torch.long, device=device)
    hidden = torch.randn(b * commit, width, device=device).to(dtype)
    items = [(sid, [1] * commit, hidden[sid * commit : (sid + 1) * commit]) for sid in range(b)]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for name, fn in (("draft (eager)", lambda: drafter.draft_rows(rows, bonus)),
                     ("commit", lambda: drafter.commit_many(items))):  # fmt: skip
        fn()
        with torch_profile(activities=acts) as prof:
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
        key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        print(f"--- {name}, B={b}")
        print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default=None, help="stream counts B (1,5,10; small: 1,2)")
    ap.add_argument("--context", type=int, default=None, help="context tokens per stream (1024)")
    ap.add_argument("--commit", type=int, default=5, help="tokens committed per stream per step")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions (median)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--layers", type=int, default=None, help="drafter layers (K2.5: 6; small: 2)")
    ap.add_argument("--no-stack", action="store_true",
                    help="no `DFlashModel.stack`: context k/v layer by layer, each MLP's gate "
                         "and up separate, for A/B")  # fmt: skip
    ap.add_argument("--tp", type=int, default=1,
                    help="time one rank's shard at this tensor-parallel size, collectives "
                         "left out (their count and bytes are reported); 1: the whole "
                         "drafter")  # fmt: skip
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine's default kernel mode (its norms run as one Triton launch "
                         "each on CUDA)")  # fmt: skip
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, print the torch profiler's top ops of one draft and "
                         "one commit at the smallest batch (CPU and CUDA time)")  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON output path (default: print)")
    args = ap.parse_args()
    backend.set_batch_invariant(args.batch_invariant)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    s = dict(SMALL if args.small else K25_DFLASH)
    if args.layers is not None:
        s["layers"] = args.layers
    batches = [int(x) for x in (args.batches or ("1,2" if args.small else "1,5,10")).split(",")]
    context = args.context or (64 if args.small else 1024)
    if min(batches) < 1 or args.commit < 1 or context < 1 or args.tp < 1:
        ap.error("--batches, --commit, --context and --tp must be >= 1")
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    print(f"building a drafter of {s['layers']} layers, hidden {s['hidden']} on {device}"
          + (f", rank 0 of {args.tp}" if args.tp > 1 else ""), flush=True)  # fmt: skip
    cfg, model, hooks, drafter, width = build(s, context, max(batches), device, dtype,
                                              stack=not args.no_stack, tp=args.tp)  # fmt: skip
    kv_heads = model.layers[0].self_attn.n_kv  # this rank's
    elem = torch.tensor([], dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elem
    head = hooks.head.numel() * elem
    fc_kv = (model.fc.weight.numel() + sum(
        p.numel() for n, p in model.layers.named_parameters() if ".k_proj." in n or ".v_proj." in n
    )) * elem  # fmt: skip
    bw = copy_bandwidth(device)
    print(f"drafter weights {weights / 1e9:.2f} GB, lm_head slice {head / 1e9:.2f} GB, "
          f"copy bandwidth {bw / 1e9 if bw else float('nan'):.0f} GB/s", flush=True)  # fmt: skip
    rows, commits = [], []
    gen = torch.Generator(device=device).manual_seed(2)
    for b in batches:
        draft = draft_runner(drafter, b, device)
        draft_s = timed(draft, device, args.reps)
        # the context's KV read by the block forward: every layer's k, v of the b streams
        kv = cfg.num_hidden_layers * 2 * b * context * kv_heads * cfg.head_dim
        draft_bytes = weights - fc_kv + head + kv * elem
        # what the collectives left out would add at tp > 1: all-reduces of [tokens, hidden]
        collectives = dict(
            draft_all_reduces=2 * cfg.num_hidden_layers if args.tp > 1 else 0,
            draft_all_reduce_bytes=b * cfg.block_size * s["hidden"] * elem,
            commit_all_reduces=1 if args.tp > 1 else 0,
            commit_all_reduce_bytes=b * args.commit * s["hidden"] * elem,
        )
        hidden = torch.randn(b * args.commit, width, generator=gen, device=device).to(dtype)

        def commit(b=b, hidden=hidden) -> None:
            items = [(sid, [1] * args.commit, hidden[sid * args.commit : (sid + 1) * args.commit])
                     for sid in range(b)]  # fmt: skip
            drafter.commit_many(items)

        commit_s = timed(commit, device, min(args.reps, 8))  # each call grows the context
        commits.append(commit)
        # the engine's call: the step's [B, block, width] hidden block, args.commit rows each
        # kept (on CUDA a graph replay; its first call captures the graph, untimed)
        block = torch.randn(b, s["block"], width, generator=gen, device=device).to(dtype)
        toks = [[1] * args.commit for _ in range(b)]
        sids = list(range(b))
        drafter.commit_block(sids, toks, block)
        block_s = timed(partial(drafter.commit_block, sids, toks, block), device,
                        min(args.reps, 8))  # fmt: skip
        row = dict(batch=b, draft_s=draft_s, commit_s=commit_s, commit_block_s=block_s,
                   draft_bytes=draft_bytes,
                   commit_bytes=fc_kv, draft_floor_s=draft_bytes / bw if bw else None,
                   commit_floor_s=fc_kv / bw if bw else None, **collectives)  # fmt: skip
        rows.append(row)
        floors = ""
        if bw:
            floors = f" (floors {draft_bytes / bw * 1e3:.2f} / {fc_kv / bw * 1e3:.2f})"
        print(f"B={b}: draft {draft_s * 1e3:.2f} ms, commit {commit_s * 1e3:.2f} ms (as a "
              f"block {block_s * 1e3:.2f}){floors}", flush=True)  # fmt: skip
    # torch ops per commit, counted after every timing (a profiler session can slow later
    # launches: bench/README.md, host_overhead.py)
    for row, commit in zip(rows, commits, strict=True):
        row["commit_ops"] = count_ops(commit)
        print(f"B={row['batch']}: {row['commit_ops']} torch ops per commit", flush=True)
    if args.profile:
        profile(drafter, min(batches), args.commit, width, device, dtype)
    report = dict(benchmark="bench_drafter", shape=s, context=context, commit=args.commit,
                  stacked=not args.no_stack, tp=args.tp, batch_invariant=args.batch_invariant,
                  device=torch.cuda.get_device_name() if device == "cuda" else device,
                  torch=torch.__version__, weights_bytes=weights, lm_head_slice_bytes=head,
                  copy_bandwidth_bytes_per_s=bw, rows=rows)  # fmt: skip
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
