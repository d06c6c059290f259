"""Where does a DDTree verify row first differ from the AR row of the same token? (GPU diagnostic)

1. ops: each dense op at K2.6-like shapes (and torch's version of it, for contrast) on the first M
   rows of one 600-row input, M = 1..600; every row must equal the same row of the 600-row run.
2. model: the embedded tiny model (INT4 experts), one engine dtype, batch_invariant on (or off).
   Runner A decodes `depth + 1` AR steps for 8 streams, recording every module output and every
   backend op (attention, MoE, per-head matmuls) of each step; runner B (same weights, own cache)
   prefills the same prompts and runs one verify forward over a tree from an oracle drafter that
   contains the AR path. For each depth and stream it reports the first recorded tensor (in call
   order) where the verify row differs from the AR row, and the max abs difference there.

    python3 bench/exactness_probe.py --out $OUT/probe.json            # < 60 s on an H200
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from ddserve.ddtree import build_tree, verify_inputs
from ddserve.drafter.testing import OracleDrafter
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.kernels import backend
from ddserve.kernels.invariant_ref import bmm_heads_ref, linear_ref, rms_norm_ref
from ddserve.model.tiny import make_tiny
from ddserve.sampling import SamplingParams

PROMPTS = [list(range(5 + 7 * i, 5 + 7 * i + 3 + 5 * i)) for i in range(8)]
M_LIST = [*range(1, 18), 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300, 511, 512, 513]
MAX_M = 600


# ---- 1. op level ---------------------------------------------------------------------------------
def op_cases(dev: str) -> dict:
    """name -> (triton fn, torch fn, x [600, ...]) at K2.6-like shapes (tp = 1)."""
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    from ddserve.kernels import invariant as inv

    cases = {}
    shapes = [
        ("q_a_proj", 1536, 7168),
        ("kv_a_proj", 576, 7168),
        ("q_b_proj", 12288, 1536),
        ("o_proj", 7168, 8192),
        ("shared_down", 7168, 2048),
        ("lm_head", 163840, 7168),
    ]
    for name, n, k in shapes:  # fmt: skip
        w = r(n, k, scale=k**-0.5)
        cases[f"linear.{name}"] = (inv.linear, linear_ref, r(MAX_M, k), (w,))
    w = r(384, 7168, dtype=torch.float32, scale=7168**-0.5)
    cases["linear.router_fp32"] = (
        inv.linear,
        linear_ref,
        r(MAX_M, 7168, dtype=torch.float32),
        (w,),
    )
    kv_b = r(64, 256, 512, scale=512**-0.5)  # [H, nope + v, R]
    cases["bmm_heads.q_absorb"] = (
        inv.bmm_heads,
        bmm_heads_ref,
        r(MAX_M, 64, 128),
        (kv_b[:, :128],),
    )
    w_uv = kv_b[:, 128:].transpose(1, 2)  # [H, R, v]
    cases["bmm_heads.o_absorb"] = (inv.bmm_heads, bmm_heads_ref, r(MAX_M, 64, 512), (w_uv,))
    for d in (7168, 1536):
        cases[f"rms_norm.{d}"] = (inv.rms_norm, rms_norm_ref, r(MAX_M, d), (r(d), 1e-6))
    cases["rms_norm.kv_a_strided"] = (inv.rms_norm, rms_norm_ref, r(MAX_M, 576)[:, :512],
                                      (r(512), 1e-6))  # fmt: skip
    return cases


def row_invariance(fn, x: torch.Tensor, args: tuple) -> dict:
    full = fn(x, *args)  # [600, ...]
    bad, worst = [], 0.0
    for m in M_LIST:
        part = fn(x[:m], *args)
        if not torch.equal(part, full[:m]):
            bad.append(m)
            worst = max(worst, (part.float() - full[:m].float()).abs().max().item())
    return dict(bitwise_all_m=not bad, differing_m=bad, max_abs_diff=worst)


def time_us(fn, x: torch.Tensor, args: tuple, reps: int = 20) -> float:
    fn(x, *args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(x, *args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def op_checks(dev: str) -> dict:
    out = {}
    for name, (fast, ref, x, args) in op_cases(dev).items():
        out[name] = dict(triton=row_invariance(fast, x, args), torch=row_invariance(ref, x, args))
        out[name]["us_triton_vs_torch"] = {
            m: [round(time_us(fast, x[:m], args), 1), round(time_us(ref, x[:m], args), 1)]
            for m in (1, 8, 136, 520)  # AR and verify rows of 8 streams, budgets 16 and 64
        }
        ref_full = ref(x, *args).float()
        out[name]["triton_vs_torch_max_abs"] = (
            (fast(x, *args).float() - ref_full).abs().max().item()
        )
        print(name, json.dumps(out[name]), flush=True)
    return out


# ---- 2. model level ------------------------------------------------------------------------------
class Recorder:
    """Every module output and backend op result (the Router's gate linear and k-sum included),
    in call order, while `on`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.on, self.events, self.stack = False, [], []
        for name, mod in model.named_modules():
            if name:
                mod.register_forward_pre_hook(lambda *_, n=name: self.stack.append(n))
                mod.register_forward_hook(self._hook(name))
        for op in ("tree_attention", "moe"):
            chooser = getattr(backend, op)
            setattr(backend, op, lambda dt, c=chooser, op=op: self._wrap(op, c(dt)))
        for op in ("linear", "bmm_heads", "rms_norm", "row_sum"):  # called per forward
            setattr(backend, op, self._wrap(op, getattr(backend, op)))

    def _hook(self, name: str):
        def hook(_mod, _args, out):
            self.stack.pop()
            for i, t in enumerate(out if isinstance(out, tuple) else (out,)):
                self._add(name if i == 0 else f"{name}[{i}]", t)

        return hook

    def _wrap(self, label: str, fn):
        def call(*a, **kw):
            y = fn(*a, **kw)
            self._add(f"{self.stack[-1] if self.stack else ''}/{label}", y)
            return y

        return call

    def _add(self, label: str, t) -> None:
        if self.on and isinstance(t, torch.Tensor) and t.dim() >= 1:
            self.events.append((label, t.detach().clone()))

    def take(self) -> list:
        ev, self.events = self.events, []
        return ev


def path_rows(tree, ar_tokens: list[list[int]], depth: int) -> list[list[int | None]]:
    """Per stream, the verify rows of the AR path root -> ar[1] -> ... (None once it leaves)."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    rows = []
    for b, seq in enumerate(ar_tokens):
        cur, path = 0, [0]
        for d in range(1, depth + 1):
            nxt = [j + 1 for j in range(len(toks[b])) if pars[b][j] == cur and toks[b][j] == seq[d]]
            cur = nxt[0] if nxt and cur is not None else None
            path.append(cur)
        rows.append(path)
    return rows


def first_difference(ar_events: list, ver_events: list, ar_row: int, ver_row: int) -> dict:
    if [lbl for lbl, _ in ar_events] != [lbl for lbl, _ in ver_events]:
        return dict(error="AR and verify forwards recorded different op sequences")
    for i, ((label, a), (_, v)) in enumerate(zip(ar_events, ver_events, strict=True)):
        ra, rv = a[ar_row], v[ver_row]
        if ra.shape != rv.shape or not torch.equal(ra, rv):
            diff = (ra.float() - rv.float()).abs().max().item() if ra.shape == rv.shape else None
            return dict(identical=False, first_event=i, first_op=label, max_abs_diff=diff)
    return dict(identical=True, events=len(ar_events))


def model_probe(dev: str, dtype: str, invariant: bool, budget: int, depth: int) -> dict:
    path = make_tiny(Path(tempfile.mkdtemp()) / "tiny", int4=True, seed=0)
    cfg = EngineConfig(num_slots=4096, budget=budget, dtype=dtype, batch_invariant=invariant)
    params = SamplingParams(max_tokens=depth + 8, ignore_eos=True)
    a = ModelRunner(path, engine_cfg=cfg, device=dev)
    rec = Recorder(a.model)
    sids = list(range(len(PROMPTS)))
    for i, p in enumerate(PROMPTS):
        a.add_stream(i, p, params)
    ar = {sid: so.tokens[:] for sid, so in a.prefill().items()}
    ar_events = []
    for _ in range(depth + 1):
        rec.on = True
        res = a.ar_step(sids)
        rec.on = False
        ar_events.append(rec.take())
        for sid, so in res.items():
            ar[sid] += so.tokens
    conts = {tuple(p): ar[i] for i, p in enumerate(PROMPTS)}
    oracle = OracleDrafter(conts, a.model_cfg.vocab_size, depth=depth)
    b = ModelRunner.from_model(a.model, a.model_cfg, engine_cfg=cfg, drafter=oracle)
    for i, p in enumerate(PROMPTS):
        b.add_stream(i, p, params)
    first = {sid: so.tokens for sid, so in b.prefill().items()}
    prefill_kv = all(
        torch.equal(a.kv.pool[:, a.streams[s].slots[: len(p)]], b.kv.pool[:, b.streams[s].slots])
        for s, p in enumerate(PROMPTS)
    )
    sts = b._active(sids)
    bonus = torch.tensor([st.output[-1] for st in sts], device=b.device)  # [B]
    tree = build_tree(b.drafter.draft(sids, bonus), budget)
    blocks = b._alloc_scratch([budget + 1] * len(sts))
    prefix = torch.tensor([len(st.slots) for st in sts], device=b.device)  # [B]
    ids, pos = verify_inputs(tree, bonus, prefix)
    rec.on = True
    b._decode_forward(sts, budget + 1, blocks, tree.visible, ids, pos)
    rec.on = False
    ver_events = rec.take()
    rows = path_rows(tree, [ar[s] for s in sids], depth)
    per_depth = []
    for d in range(depth + 1):
        streams = []
        for s in sids:
            if rows[s][d] is None:
                streams.append(dict(stream=s, error="AR path not in the tree at this depth"))
                continue
            vrow = s * (budget + 1) + rows[s][d]
            streams.append(dict(stream=s, **first_difference(ar_events[d], ver_events, s, vrow)))
        per_depth.append(dict(depth=d, identical=sum(bool(x.get("identical")) for x in streams),
                              streams=streams))  # fmt: skip
    return dict(dtype=dtype, batch_invariant=invariant, budget=budget, depth=depth,
                prefill_first_tokens_equal=all(first[s] == ar[s][:1] for s in sids),
                prefill_kv_identical=prefill_kv, per_depth=per_depth)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--no-batch-invariant", action="store_true")
    ap.add_argument("--skip-ops", action="store_true", help="model probe only")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("ddserve.kernels.backend").setLevel(logging.INFO)  # the kernels chosen
    t0 = time.perf_counter()
    result = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else args.device)
    if not args.skip_ops and args.device == "cuda":
        result["ops"] = op_checks(args.device)
    result["model"] = model_probe(args.device, args.dtype, not args.no_batch_invariant,
                                  args.budget, args.depth)  # fmt: skip
    for row in result["model"]["per_depth"]:
        firsts = [
            (s["stream"], s.get("first_op")) for s in row["streams"] if not s.get("identical")
        ]
        print(
            f"depth {row['depth']}: {row['identical']}/{len(PROMPTS)} identical; first ops {firsts}"
        )
    result["seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
