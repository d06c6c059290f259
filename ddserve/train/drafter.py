"""Stage 4: the DFlash block drafter, trained against the frozen (INT4) target.

    python -m ddserve.train.drafter --target DIR --corpus corpus.tar.xz --tokenizer DIR \\
        --out OUT --max-minutes 8
    python -m ddserve.train.drafter patch-target --target DIR \\
        --mask-embedding OUT/mask_embedding.safetensors

The model is ddserve's own `DFlashModel` (`ddserve/drafter/`), trained in place, so the weights it
writes load with `ddserve.drafter.loader` unchanged and serve the same function.

Objective (DFlash, arXiv 2602.06036, as SpecForge's `OnlineDFlashModel` trains it): per sequence,
`anchors` distinct random positions a; each anchor's block is [x_a, MASK x D] at positions
a..a+D, exactly ddserve's draft block when x_a is the bonus token and x_0..x_{a-1} are committed.
All blocks of a sequence run in one pass: block rows see the context (the target's hidden states at
`target_layer_ids`, projected by fc + hidden_norm) at positions < a, and within a sliding window
when the layers slide, plus every row of their own block, and nothing of other blocks. Row k
(1..D) predicts x_{a+k}; cross-entropy weighted by exp(-(k-1)/gamma) (DFlash's Eq. 4; gamma 7 for
block size 16), averaged over the weights. Labels are the target's greedy tokens
(`drafter_data.py`), so accuracy at depth k is the rate at which a chain draft matches the target.

The mask token's embedding: the drafter borrows the target's embedding table (frozen); the row of
`<|mask|>` never received a gradient while the target trained (the token never occurs in text),
so that one row is trained here with the drafter and written to `mask_embedding.safetensors`;
`patch-target` writes it into the target checkpoint's `model.embed_tokens.weight`, which is where
ddserve's drafter reads it at serving time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ddserve.config import ModelConfig
from ddserve.drafter.config import SLIDING, DrafterConfig
from ddserve.drafter.model import DFlashModel
from ddserve.train.drafter_data import DraftData, GenPlan, acceptance, generate, prompt_streams
from ddserve.train.shapes import special_ids
from ddserve.train.target_model import TrainTarget

MASK_TENSOR = "mask_embedding"  # [H] in mask_embedding.safetensors
Log = Callable[[str], None]


# ---- the drafter's shape and config.json ------------------------------------------------------


@dataclass(frozen=True)
class DrafterShape:
    """The drafter's size; hidden size is the target's. Defaults: ~2.0M parameters (~4 MB bf16)
    for a 256-wide target with 3 context layers."""

    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    block_size: int = 16
    sliding_window: int | None = 256
    num_context_layers: int = 3


def context_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """n capture layers evenly spaced from decoder layer 1 to the last one (6 layers, n=3:
    1, 3, 5). DFlash's rule `round(1 + i*(L-4)/(n-1))` stops at L-3, i.e. 1, 2, 3 at L=6; on a
    6-layer target the last layers carry most of what the target is about to say."""
    if n == 1 or num_target_layers < 3:
        return [num_target_layers - 1]
    span = num_target_layers - 2
    return sorted({int(round(1 + i * span / (n - 1))) for i in range(n)})


def drafter_config(
    target: ModelConfig, shape: DrafterShape, mask_token_id: int, layer_ids: Sequence[int]
) -> dict[str, Any]:
    """config.json in the published DFlash layout (Qwen3 fields + block_size + dflash_config)."""
    kind = "full_attention" if shape.sliding_window is None else SLIDING
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "vocab_size": target.vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_theta": 10000.0,
        "block_size": shape.block_size,
        "num_target_layers": target.num_hidden_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)},
        "layer_types": [kind] * shape.num_layers,
        "use_sliding_window": shape.sliding_window is not None,
        "sliding_window": shape.sliding_window,
        "torch_dtype": "bfloat16",
    }


# ---- the objective --------------------------------------------------------------------------


def sample_anchors(
    prompt_lens: Tensor, lengths: Tensor, seq_len: int, n: int, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """n distinct anchors per sequence, uniform over a in [P-1, length-2] (the label x_{a+1} is a
    target token). -> anchors [B, n] (0 where unused), keep [B, n] (fewer valid than n)."""
    pos = torch.arange(seq_len, device=lengths.device)[None, :]  # [1, S]
    valid = (pos >= prompt_lens[:, None] - 1) & (pos <= lengths[:, None] - 2)  # [B, S]
    score = torch.rand(valid.shape, generator=gen, device=gen.device).to(lengths.device)
    score = torch.where(valid, score, 2.0)  # [B, S] invalid positions sort last
    top, anchors = score.topk(min(n, seq_len), dim=1, largest=False)  # [B, n]
    keep = top < 1.5
    return torch.where(keep, anchors, 0), keep


def block_visibility(anchors: Tensor, keep: Tensor, seq_len: int, block: int,
                     window: int | None) -> Tensor:  # fmt: skip
    """[B, N*Q, S + N*Q] bool: block n's rows see context p < a_n (and, with a window, only
    p > a_n + j - window for row j, as ddserve's ring does), and all rows of block n."""
    b, n = anchors.shape
    dev = anchors.device
    p = torch.arange(seq_len, device=dev)  # [S]
    q_pos = anchors[:, :, None] + torch.arange(block, device=dev)  # [B, N, Q]
    ctx = (p < anchors[:, :, None, None]) & keep[:, :, None, None]  # [B, N, 1, S]
    if window is not None:
        ctx = ctx & (q_pos[..., None] - p < window)  # [B, N, Q, S]
    ctx = ctx.expand(b, n, block, seq_len).reshape(b, n * block, seq_len)
    same = torch.eye(n, dtype=torch.bool, device=dev)[:, None, :, None]  # [N, 1, N, 1]
    own = same.expand(n, block, n, block).reshape(1, n * block, n * block)
    return torch.cat([ctx, own.expand(b, -1, -1)], dim=-1)  # [B, N*Q, S + N*Q]


def block_labels(tokens: Tensor, lengths: Tensor, anchors: Tensor, keep: Tensor,
                 depth: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """labels [B, N, D] = x_{a+k} for k = 1..D, and where they exist (keep, a+k < length)."""
    at = anchors[:, :, None] + torch.arange(1, depth + 1, device=anchors.device)  # [B, N, D]
    valid = keep[:, :, None] & (at < lengths[:, None, None])  # [B, N, D]
    at = at.clamp(max=tokens.shape[1] - 1)
    return tokens.gather(1, at.flatten(1)).view(at.shape), valid


def depth_weights(depth: int, gamma: float | None, device: torch.device) -> Tensor:
    """[D] exp(-(k-1)/gamma) for k = 1..D (all ones without gamma)."""
    k = torch.arange(depth, device=device, dtype=torch.float32)
    return torch.ones_like(k) if gamma is None else torch.exp(-k / gamma)


class DraftObjective(nn.Module):
    """The drafter being trained, the target's frozen embedding and lm_head, and the trainable
    embedding row of the mask token."""

    def __init__(self, model: DFlashModel, embed: Tensor, lm_head: Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("embed", embed.detach().clone(), persistent=False)  # [V, H]
        self.register_buffer("lm_head", lm_head.detach().clone(), persistent=False)  # [V, H]
        self.mask_row = nn.Parameter(embed[self.cfg.mask_token_id].detach().float().clone())

    @property
    def cfg(self) -> DrafterConfig:
        return self.model.cfg

    def embed_ids(self, ids: Tensor) -> Tensor:
        """The drafter's view of the target's embedding: [...] -> [..., H] float32."""
        x = self.embed[ids].float()
        return torch.where((ids == self.cfg.mask_token_id)[..., None], self.mask_row, x)

    def hidden(self, tokens: Tensor, hidden: Tensor, anchors: Tensor, keep: Tensor) -> Tensor:
        """tokens [B, S], hidden [B, S, k*H], anchors/keep [B, N] -> block outputs after the
        final norm [B, N, Q, H]; the same layers and ops as `DFlashModel.block`."""
        b, s = tokens.shape
        q, n, dev = self.cfg.block_size, anchors.shape[1], tokens.device
        ctx_k, ctx_v = self.model.context_kv(hidden, torch.arange(s, device=dev).expand(b, s))
        ids = torch.full((b, n, q), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = tokens.gather(1, anchors)  # [B, N, Q]: [x_a, MASK x D]
        x = self.embed_ids(ids).flatten(1, 2)  # [B, N*Q, H]
        pos = (anchors[:, :, None] + torch.arange(q, device=dev)).flatten(1)  # [B, N*Q]
        cos, sin = self.model.rotary.cos_sin(pos, x.dtype)  # [B, N*Q, Dh]
        kinds = {layer.sliding for layer in self.model.layers}
        window = self.cfg.sliding_window
        vis = {k: block_visibility(anchors, keep, s, q, window if k else None) for k in kinds}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, ctx_k[i], ctx_v[i], vis[layer.sliding])
        return self.model.norm(x).view(b, n, q, -1)

    def forward(self, tokens: Tensor, hidden: Tensor, anchors: Tensor, keep: Tensor) -> Tensor:
        """-> draft logits [B, N, D, V] for depths 1..D (the target's lm_head, no final norm)."""
        h = self.hidden(tokens, hidden, anchors, keep)[:, :, 1:]  # [B, N, D, H]
        return h @ self.lm_head.to(h.dtype).T


def block_loss(logits: Tensor, labels: Tensor, valid: Tensor,
               gamma: float | None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """-> (weighted mean CE, per-depth correct top-1 counts [D], per-depth label counts [D])."""
    ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), reduction="none")
    w = valid.float() * depth_weights(labels.shape[-1], gamma, labels.device)  # [B, N, D]
    loss = (ce.view_as(w) * w).sum() / w.sum().clamp_min(1e-6)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & valid  # [B, N, D]
        correct, count = hit.sum((0, 1)), valid.sum((0, 1))  # [D] each
    return loss, correct, count


# ---- training -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    batch: int = 64  # sequences per step
    anchors: int = 64  # blocks per sequence (DFlash: up to 512 per 3k-token sequence)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    gamma: float | None = 7.0  # DFlash's decay for block size 16 (5 for 10, 4 for 8)
    grad_clip: float = 1.0
    log_every: int = 100
    seed: int = 0


def lr_at(step: int, frac: float, cfg: TrainConfig) -> float:
    """Linear warm-up over steps, then cosine to min_lr_ratio over the wall-clock budget."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def make_optimizer(obj: DraftObjective, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms or the mask row."""
    decay = [p for p in obj.parameters() if p.ndim >= 2]
    rest = [p for p in obj.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": rest, "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def train_step(obj: DraftObjective, batch: DraftData, cfg: TrainConfig, gen: torch.Generator,
               autocast: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Forward + backward of one batch (a DraftData); -> (loss, correct [D], count [D])."""
    s = batch.tokens.shape[1]
    anchors, keep = sample_anchors(batch.prompt_lens, batch.lengths, s, cfg.anchors, gen)
    labels, valid = block_labels(batch.tokens, batch.lengths, anchors, keep, obj.cfg.depth)
    dev = batch.tokens.device.type
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
        logits = obj(batch.tokens, batch.hidden, anchors, keep)  # [B, N, D, V]
    loss, correct, count = block_loss(logits, labels, valid, cfg.gamma)
    loss.backward()
    return loss.detach(), correct, count


class _Window:
    """Loss and per-depth top-1 hits summed over the steps since the last record (on device)."""

    def __init__(self, depth: int, device: torch.device) -> None:
        self.depth, self.device = depth, device
        self.reset()

    def reset(self) -> None:
        self.steps, self.loss = 0, torch.zeros((), device=self.device)
        self.correct = torch.zeros(self.depth, device=self.device)
        self.count = torch.zeros(self.depth, device=self.device)

    def add(self, loss: Tensor, correct: Tensor, count: Tensor) -> None:
        self.steps += 1
        self.loss, self.correct, self.count = (
            self.loss + loss,
            self.correct + correct,
            self.count + count,
        )

    def record(self, step: int, seconds: float, log: Log) -> dict[str, Any]:
        acc = (self.correct / self.count.clamp_min(1)).tolist()
        rec = {"step": step, "seconds": round(seconds, 1),
               "loss": float(self.loss) / max(self.steps, 1), "acc": acc}  # fmt: skip
        picked = " ".join(f"{acc[i - 1]:.2f}" for i in (1, 2, 4, 8, 15) if i <= len(acc))
        log(f"step {step} {seconds:.0f}s loss {rec['loss']:.3f} acc@1,2,4,8,15 {picked}")
        self.reset()
        return rec


def train(obj: DraftObjective, data: DraftData, cfg: TrainConfig, seconds: float, autocast: bool,
          log: Log = print, max_steps: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Train until `seconds` pass (or max_steps); -> the log records (loss, per-depth acc)."""
    opt, dev = make_optimizer(obj, cfg), data.tokens.device
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    t0, step, records, window = time.monotonic(), 0, [], _Window(obj.cfg.depth, dev)
    while time.monotonic() - t0 < seconds and (max_steps is None or step < max_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, (time.monotonic() - t0) / seconds, cfg)
        idx = torch.randint(len(data), (cfg.batch,), generator=gen, device=dev)
        window.add(*train_step(obj, data.take(idx), cfg, gen, autocast))
        nn.utils.clip_grad_norm_(obj.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % cfg.log_every == 0:
            records.append(window.record(step, time.monotonic() - t0, log))
    if window.steps:
        records.append(window.record(step, time.monotonic() - t0, log))
    return records


# ---- writing --------------------------------------------------------------------------------


def save_drafter(obj: DraftObjective, raw_cfg: dict[str, Any], out_dir: str | Path) -> Path:
    """config.json + model.safetensors (bf16), the layout `ddserve.drafter.loader` reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
             for k, v in obj.model.state_dict().items()}  # fmt: skip
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw_cfg, indent=2) + "\n")
    return out


def save_mask_embedding(obj: DraftObjective, path: str | Path) -> Path:
    """The trained `<|mask|>` embedding row [H] (bf16), for `patch_target`."""
    row = obj.mask_row.detach().to("cpu", torch.bfloat16).contiguous()
    meta = {"mask_token_id": str(obj.cfg.mask_token_id)}
    save_file({MASK_TENSOR: row}, str(path), metadata=meta)
    return Path(path)


def _embed_file(target_dir: Path, name: str) -> Path:
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        if name in weight_map:
            return target_dir / weight_map[name]
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            if name in sf.keys():
                return f
    raise FileNotFoundError(f"no safetensors file in {target_dir} holds {name}")


def patch_target(target_dir: str | Path, mask_file: str | Path) -> Path:
    """Write the trained mask row into the target checkpoint's embedding table, in place (only
    that row of that one tensor changes). -> the rewritten shard."""
    target_dir = Path(target_dir)
    cfg = ModelConfig.from_hf(target_dir)
    with safe_open(str(mask_file), framework="pt") as sf:
        row, mask_id = sf.get_tensor(MASK_TENSOR), int(sf.metadata()["mask_token_id"])
    name = f"{cfg.weight_prefix}model.embed_tokens.weight"
    shard = _embed_file(target_dir, name)
    with safe_open(str(shard), framework="pt") as sf:
        meta = sf.metadata()
    tensors = load_file(str(shard))
    table = tensors[name]  # [V, H]
    if row.shape != table.shape[1:]:
        raise ValueError(f"mask row {tuple(row.shape)} does not fit {name} {tuple(table.shape)}")
    table[mask_id] = row.to(table.dtype)
    save_file(tensors, str(shard), metadata=meta)
    return shard


# ---- the command ----------------------------------------------------------------------------


def _parse_train(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddserve.train.drafter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--target", required=True, help="exported target checkpoint (stage 3)")
    p.add_argument("--corpus", required=True, help="corpus.tar.xz (stage 1)")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (stage 2)")
    p.add_argument("--out", required=True, help="run folder: drafter/, mask_embedding, report")
    p.add_argument("--max-minutes", type=float, default=8.0, help="whole run, wall clock")
    p.add_argument("--gen-fraction", type=float, default=0.4,
                   help="train data generation ends at this fraction of the run")  # fmt: skip
    p.add_argument("--num-seqs", type=int, default=32768,
                   help="train sequences, at most (allocated up front: ~0.8 MB each)")  # fmt: skip
    p.add_argument("--eval-seqs", type=int, default=64, help="held-out sequences")
    p.add_argument("--prompt-text-mb", type=float, default=24.0,
                   help="train-split text tokenized for prompts")  # fmt: skip
    p.add_argument("--prompt-lens", default="32,64,128,256", help="cycled per generated batch")
    p.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per prompt")
    p.add_argument("--gen-batch", type=int, default=1024)
    p.add_argument("--no-kv-cache", action="store_true",
                   help="re-run the prefix every generation step (the reference loop)")  # fmt: skip
    p.add_argument("--layers", type=int, default=DrafterShape.num_layers)
    p.add_argument("--intermediate", type=int, default=DrafterShape.intermediate_size)
    p.add_argument("--block-size", type=int, default=DrafterShape.block_size)
    p.add_argument("--sliding-window", type=int, default=DrafterShape.sliding_window,
                   help="0: full attention over the context")  # fmt: skip
    p.add_argument("--context-layers", default="", help="target layer ids, e.g. 1,3,5")
    p.add_argument("--batch", type=int, default=TrainConfig.batch)
    p.add_argument("--anchors", type=int, default=TrainConfig.anchors)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--gamma", type=float, default=TrainConfig.gamma, help="0: no decay")
    p.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    p.add_argument("--budgets", default="1,4,8,16,32,64", help="DDTree budgets to measure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-steps", type=int, default=None, help="(tests) stop after N steps")
    return p.parse_args(argv)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _logger(path: Path) -> Log:
    path.parent.mkdir(parents=True, exist_ok=True)
    f = path.open("a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        f.write(msg + "\n")
        f.flush()

    return log


def _drafter_raw(args: argparse.Namespace, target: TrainTarget) -> dict[str, Any]:
    """config.json of the drafter this run trains."""
    ids = sorted(set(_ints(args.context_layers))) or context_layer_ids(
        target.cfg.num_hidden_layers, DrafterShape.num_context_layers
    )
    shape = DrafterShape(num_layers=args.layers, intermediate_size=args.intermediate,
                         block_size=args.block_size, sliding_window=args.sliding_window or None,
                         num_context_layers=len(ids))  # fmt: skip
    mask_id = special_ids(args.tokenizer)["<|mask|>"]
    return drafter_config(target.cfg, shape, mask_id, ids)


def _make_data(args: argparse.Namespace, target: TrainTarget, layer_ids: list[int],
               gen_end: float, log: Log) -> tuple[DraftData, DraftData]:  # fmt: skip
    """(train data from the train split until gen_end, held-out data from the eval split)."""
    streams = prompt_streams(args.corpus, args.tokenizer, args.prompt_text_mb, args.seed)
    sizes = {k: v.shape[0] for k, v in streams.items()}
    log(f"prompt streams (tokens): {sizes}")
    plens, eos, dev = _ints(args.prompt_lens), special_ids(args.tokenizer)["<|eos|>"], args.device
    cache = not args.no_kv_cache
    eval_plan = GenPlan(args.eval_seqs, plens[::2] or plens, args.new_tokens,
                        max(1, args.eval_seqs // 2), args.seed + 1, cache)  # fmt: skip
    heldout = generate(target, streams["eval"], eval_plan, layer_ids, eos, dev, None, log)
    plan = GenPlan(args.num_seqs, plens, args.new_tokens, args.gen_batch, args.seed, cache)
    return generate(target, streams["train"], plan, layer_ids, eos, dev, gen_end, log), heldout


EVAL_RESERVE_S = 60.0  # held-out acceptance + writing, kept out of the training time


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Generate data with the target, train until the deadline, write, measure. -> the report."""
    t0, out, dev = time.monotonic(), Path(args.out), torch.device(args.device)
    deadline, log = t0 + 60 * args.max_minutes, _logger(out / "log.txt")
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    target = TrainTarget.from_checkpoint(args.target, dev, dtype)
    raw = _drafter_raw(args, target)
    layer_ids = raw["dflash_config"]["target_layer_ids"]
    log(f"target {args.target}: capture layers {layer_ids}; drafter {raw}")
    gen_end = t0 + args.gen_fraction * 60 * args.max_minutes
    data, heldout = _make_data(args, target, layer_ids, gen_end, log)
    gen_s = time.monotonic() - t0
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    obj = DraftObjective(DFlashModel(DrafterConfig.from_hf(raw)), embed, head).to(dev)
    del target
    cfg = TrainConfig(batch=args.batch, anchors=args.anchors, lr=args.lr, gamma=args.gamma or None,
                      log_every=args.log_every, seed=args.seed)  # fmt: skip
    seconds = max(deadline - time.monotonic() - EVAL_RESERVE_S, 1.0)
    records = train(obj, data, cfg, seconds, cuda, log, args.max_steps)
    save_drafter(obj, raw, out / "drafter")
    save_mask_embedding(obj, out / "mask_embedding.safetensors")
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
        measured = acceptance(obj.eval(), heldout, obj.cfg.depth, _ints(args.budgets))
    report = {
        "drafter_config": raw, "train_config": asdict(cfg),
        "params": sum(p.numel() for p in obj.model.parameters()),
        "data": _data_stats(data), "heldout": _data_stats(heldout),
        "seconds": {"generate": round(gen_s, 1), "total": round(time.monotonic() - t0, 1)},
        "train_log": records, "heldout_acceptance": measured,
    }  # fmt: skip
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"held-out committed tokens per step: {measured['committed_per_step']}")
    log(f"held-out top-1 accuracy per depth: {[round(a, 3) for a in measured['acc_per_depth']]}")
    return report


def _data_stats(data: DraftData) -> dict[str, int]:
    generated = int((data.lengths - data.prompt_lens).sum())
    return {"sequences": len(data), "generated_tokens": generated,
            "tokens": int(data.lengths.sum())}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["patch-target"]:
        p = argparse.ArgumentParser(prog="python -m ddserve.train.drafter patch-target")
        p.add_argument("--target", required=True, help="target checkpoint to rewrite in place")
        p.add_argument("--mask-embedding", required=True, help="a run's mask_embedding file")
        args = p.parse_args(argv[1:])
        print(f"wrote the trained mask row into {patch_target(args.target, args.mask_embedding)}")
        return 0
    run(_parse_train(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
