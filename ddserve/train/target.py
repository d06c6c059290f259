"""Stage 3: train the target on the corpus's train split and export it as an INT4 HF checkpoint.

    python3 -m ddserve.train.target --corpus .train/corpus.tar.xz --tokenizer .train/tokenizer \\
        --tokens 100e6 --out $OUT

One process, one deadline (`--max-minutes`, counted from start): tokenize the corpus, train
(AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast on CUDA, the routing
bias update after every step, the last `--qat-frac` of the steps with INT4 fake-quantized
experts), evaluate on the held-out split, export. After `--replan-at` steps the run measures its
step time and, if `--tokens` would not fit before the deadline, shortens the schedule so the
cosine still ends (logged). Training also stops hard `--reserve-s` seconds before the deadline.

Writes into `--out`: `target/` (the HF checkpoint, routed experts INT4: config.json, index, two
< 15 MB shards, tokenizer.json, tokenizer_config.json) and `train_log.json` (arguments, schedule,
progress lines, validation history, final held-out loss with bf16 and with INT4 experts).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ddserve.train.data import Batches, load_token_splits, windows
from ddserve.train.export import export
from ddserve.train.shapes import target_config
from ddserve.train.target_model import TrainTarget

WARM_STEPS = 5  # steps whose time (allocation, kernel selection) is not a guide to the rest


@dataclass
class Schedule:
    """Warm-up then cosine from `lr` to `lr * min_lr_frac` over `total` steps; QAT for the last
    `qat_frac` of them."""

    total: int
    lr: float
    warmup: int
    min_lr_frac: float
    qat_frac: float

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        floor = self.lr * self.min_lr_frac
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    @property
    def qat_start(self) -> int:
        return self.total - round(self.qat_frac * self.total)


@dataclass
class RunLog:
    args: dict[str, Any]
    config: dict[str, Any]
    params: dict[str, int]
    tokens: dict[str, int] = field(default_factory=dict)
    schedule: list[str] = field(default_factory=list)
    progress: list[dict[str, float]] = field(default_factory=list)
    val: list[dict[str, float]] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    timings_s: dict[str, float] = field(default_factory=dict)

    def say(self, line: str) -> None:
        self.schedule.append(line)
        print(line, flush=True)


def count_params(model: TrainTarget) -> dict[str, int]:
    """Total parameters and those one token uses (top-k routed experts + everything else)."""
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = total - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts
    return {"total": total, "routed_experts": routed, "active_per_token": active}


def lm_loss(model: TrainTarget, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of batch [B, T + 1] (inputs [:, :-1], targets [:, 1:])."""
    ids = batch.long()
    logits, _ = model(ids[:, :-1])  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: TrainTarget, wins: torch.Tensor, batch: int, amp: bool) -> float:
    """Mean loss over every token of the windows [W, T + 1] (equal-length windows)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, wins.shape[0], batch):
        with torch.autocast(wins.device.type, torch.bfloat16, enabled=amp):
            total += lm_loss(model, wins[i : i + batch]).item() * wins[i : i + batch].shape[0]
    model.train(was_training)
    return total / wins.shape[0]


def evaluate_both(model: TrainTarget, wins: torch.Tensor, batch: int, amp: bool) -> dict:
    """Held-out loss with the experts as trained (bf16) and INT4-rounded (what export ships)."""
    qat = model.moe_layers()[0].qat if model.moe_layers() else False
    out = {}
    for name, on in (("bf16_experts", False), ("int4_experts", True)):
        model.set_qat(on)
        out[name] = round(evaluate(model, wins, batch, amp), 5)
    model.set_qat(qat)
    return out


def make_optimizer(model: TrainTarget, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (embeddings and lm_head included), not on norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2), eps=1e-8, fused=fused)


def imbalance(model: TrainTarget) -> float:
    """Mean over MoE layers of max(load) / mean(load) since the last bias update (1 = even)."""
    ratios = [float(g.load.max() / g.load.mean().clamp_min(1)) for g in model.gates()]
    return sum(ratios) / max(1, len(ratios))


def train_step(model, opt, batch, lr: float, args, amp: bool) -> torch.Tensor:
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.autocast(batch.device.type, torch.bfloat16, enabled=amp):
        loss = lm_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def replan(sched: Schedule, step: int, per_step_s: float, time_left_s: float) -> int | None:
    """A shorter total step count if the rest of the schedule would overrun, else None."""
    fits = step + int(0.97 * time_left_s / per_step_s)
    return fits if fits < sched.total * 0.98 else None


class Trainer:
    def __init__(self, args: argparse.Namespace, t_start: float) -> None:
        self.args, self.t_start = args, t_start
        self.deadline = t_start + 60 * args.max_minutes
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.amp = self.device.type == "cuda" and not args.fp32
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 for the few fp32 matmuls
        torch.manual_seed(args.seed)

    def load_data(self, log: RunLog) -> None:
        t = time.time()
        splits = load_token_splits(self.args.corpus, self.args.tokenizer, self.args.cache_dir)
        self.train_stream = torch.from_numpy(splits["train"]).to(self.device)
        wins = windows(torch.from_numpy(splits["eval"]).to(self.device), self.args.seq_len)
        self.eval_wins = wins[: self.args.eval_seqs or None]
        log.tokens = {"train": int(splits["train"].size), "eval": int(splits["eval"].size)}
        log.timings_s["tokenize"] = round(time.time() - t, 1)
        log.say(f"tokens: train {log.tokens['train']:,}, eval {log.tokens['eval']:,} "
                f"({log.timings_s['tokenize']} s)")  # fmt: skip

    def run(self) -> RunLog:
        args = self.args
        cfg = target_config(args.tokenizer, tiny=args.tiny)
        model = TrainTarget.from_config(cfg, seed=args.seed).to(self.device).train()
        log = RunLog(vars(args), cfg, count_params(model))
        where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        log.say(f"params: {log.params}; device {where}, bf16 autocast {self.amp}")
        self.load_data(log)
        per_step = args.batch * args.seq_len
        total = max(1, math.ceil(args.tokens / per_step))
        sched = Schedule(total, args.lr, min(args.warmup, total), args.min_lr_frac, args.qat_frac)
        log.say(f"plan: {total} steps x {per_step} tokens = {total * per_step:,} tokens")
        try:
            self.loop(model, sched, log)
        except Exception as e:  # export what was trained: a device call is not to be wasted
            log.final["error"] = repr(e)
            log.say(f"training failed ({e!r}); exporting the model as it is")
            self.finish(model, log)
            raise
        self.finish(model, log)
        return log

    def loop(self, model: TrainTarget, sched: Schedule, log: RunLog) -> None:
        args = self.args
        opt = make_optimizer(model, args)
        batches = Batches(self.train_stream, args.seq_len, args.batch, args.seed)
        val_wins = self.eval_wins[: args.val_seqs]
        stop_at = self.deadline - args.reserve_s
        t_train = t_log = t_warm = time.time()
        step = logged = 0
        qat = False
        while step < sched.total:
            if time.time() > stop_at:
                log.say(f"deadline: stopping at step {step} of {sched.total}")
                break
            if not qat and sched.qat_frac > 0 and step >= sched.qat_start:
                log.final["before_qat"] = evaluate_both(model, val_wins, args.batch, self.amp)
                log.say(f"step {step}: INT4 fake-quantized experts from here; held-out subset "
                        f"{log.final['before_qat']}")  # fmt: skip
                model.set_qat(True)
                qat = True
            loss = train_step(model, opt, batches.next(), sched.lr_at(step), args, self.amp)
            step += 1
            if step % args.log_every == 0 or step == sched.total:
                now = time.time()
                rec = {
                    "step": step, "of": sched.total, "loss": round(loss.item(), 4),
                    "lr": sched.lr_at(step - 1),
                    "tok_per_s": round((step - logged) * args.batch * args.seq_len / (now - t_log)),
                    "imbalance": round(imbalance(model), 3), "epoch": batches.epoch,
                    "elapsed_s": round(now - self.t_start, 1),
                }  # fmt: skip
                log.progress.append(rec)
                print(json.dumps(rec), flush=True)
                t_log, logged = now, step
            model.update_routing_bias(args.bias_gamma)
            if step % args.val_every == 0:
                val = evaluate(model, val_wins, args.batch, self.amp)
                log.val.append({"step": step, "loss": round(val, 5)})
                print(json.dumps({"step": step, "val_loss": round(val, 4)}), flush=True)
            if step == WARM_STEPS:
                t_warm = time.time()  # step times from here on exclude start-up costs
            if step >= max(args.replan_at, WARM_STEPS + 1) and (
                step == args.replan_at or step % args.val_every == 0
            ):
                per_step_s = (time.time() - t_warm) / (step - WARM_STEPS)
                shorter = replan(sched, step, per_step_s, stop_at - time.time())
                if shorter is not None:
                    log.say(f"step {step}: {per_step_s:.3f} s/step; {sched.total} steps would "
                            f"overrun --max-minutes, schedule shortened to {shorter}")  # fmt: skip
                    sched.total = shorter
        log.final["steps"] = step
        log.final["train_tokens_seen"] = step * args.batch * args.seq_len
        log.timings_s["train"] = round(time.time() - t_train, 1)

    def finish(self, model: TrainTarget, log: RunLog) -> None:
        args, out = self.args, Path(self.args.out)
        t = time.time()
        log.final["held_out"] = evaluate_both(model, self.eval_wins, args.batch, self.amp)
        log.final["held_out_windows"] = int(self.eval_wins.shape[0])
        log.say(f"held-out loss ({self.eval_wins.shape[0]} x {args.seq_len} tokens): "
                f"{log.final['held_out']}")  # fmt: skip
        log.timings_s["final_eval"] = round(time.time() - t, 1)
        ckpt = export(model, out / "target", args.tokenizer, int4=True)
        if args.export_bf16:
            export(model, Path(args.export_bf16), args.tokenizer, int4=False)
        log.final["routing_bias_range"] = [
            round(float(min(g.e_score_correction_bias.min() for g in model.gates())), 4),
            round(float(max(g.e_score_correction_bias.max() for g in model.gates())), 4),
        ]
        log.final["reloaded_int4_subset"] = self.check_export(ckpt)
        if self.device.type == "cuda":
            log.final["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        log.timings_s["total"] = round(time.time() - self.t_start, 1)
        (out / "train_log.json").write_text(json.dumps(asdict(log), indent=1) + "\n")
        log.say(f"wrote {ckpt} and {out / 'train_log.json'} ({log.timings_s['total']} s)")

    def check_export(self, ckpt: Path) -> float:
        """Held-out subset loss of the exported checkpoint read back (INT4 dequantized)."""
        reloaded = TrainTarget.from_checkpoint(ckpt, self.device, torch.float32)
        val_wins = self.eval_wins[: self.args.val_seqs]
        return round(evaluate(reloaded, val_wins, self.args.batch, self.amp), 5)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ddserve.train.target",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = p.add_argument
    a("--corpus", default=".train/corpus.tar.xz", help="from ddserve.train.corpus")
    a("--tokenizer", default=".train/tokenizer", help="from ddserve.train.tokenizer")
    a("--out", required=True, help="writes OUT/target/ (INT4 HF checkpoint), OUT/train_log.json")
    a("--tokens", type=float, default=100e6, help="training tokens (sets the schedule)")
    a("--seq-len", type=int, default=1024)
    a("--batch", type=int, default=64, help="sequences per step")
    a("--lr", type=float, default=2e-3, help="peak learning rate")
    a("--min-lr-frac", type=float, default=0.1, help="final lr = lr x this")
    a("--warmup", type=int, default=100, help="warm-up steps")
    a("--weight-decay", type=float, default=0.1)
    a("--beta2", type=float, default=0.95)
    a("--clip", type=float, default=1.0, help="gradient-norm clip")
    a("--bias-gamma", type=float, default=1e-3, help="routing-bias update speed")
    a("--qat-frac", type=float, default=0.1, help="final fraction of steps with INT4 experts")
    a("--max-minutes", type=float, default=9.0, help="wall-clock budget of the whole process")
    a("--reserve-s", type=float, default=60.0, help="kept for final evaluation + export")
    a("--replan-at", type=int, default=30, help="step at which the schedule is fitted to time")
    a("--log-every", type=int, default=20)
    a("--val-every", type=int, default=250)
    a("--val-seqs", type=int, default=64, help="held-out windows for periodic validation")
    a("--eval-seqs", type=int, default=0, help="held-out windows for the final loss (0: all)")
    a("--seed", type=int, default=0)
    a("--device", help="default: cuda if available, else cpu")
    a("--fp32", action="store_true", help="no bf16 autocast on CUDA")
    a("--tiny", action="store_true", help="test-sized shapes (shapes.TINY_OVERRIDES)")
    a("--cache-dir", help="cache the tokenized corpus here (.npz)")
    a("--export-bf16", metavar="DIR", help="also write a bf16-expert checkpoint to DIR")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    Trainer(parse_args(argv), t_start).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
