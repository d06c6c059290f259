"""Safetensors checkpoint loading, sharded for tensor parallelism by a name -> split-dim table.

Reads `model.safetensors` or a sharded `model.safetensors.index.json`. Every model tensor must
come from exactly one checkpoint tensor of the expected full shape; anything missing, unexpected
or mis-shaped is an error naming it (checked before the long copy starts where possible).
Routed experts arrive one tensor per expert and projection and are stacked into
`mlp.experts.{w13,w2}` (dense) or `{w13,w2}_{packed,scale}` (INT4; `weight_shape` is checked).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ddserve.config import ModelConfig
from ddserve.distributed import Communicator
from ddserve.model.deepseek import DeepseekV3ForCausalLM

# Checkpoint name (suffix) -> tensor-parallel split dim; None = replicated. First match wins.
SPLIT_DIMS: tuple[tuple[str, int | None], ...] = (
    (r"embed_tokens\.weight", 0),  # vocab-parallel rows
    (r"lm_head\.weight", 0),
    (r"self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight", 0),  # heads
    (r"self_attn\.o_proj\.weight", 1),
    (r"mlp\.(shared_experts\.)?(gate|up)_proj\.weight", 0),  # dense MLP / shared experts
    (r"mlp\.(shared_experts\.)?down_proj\.weight", 1),
    (r"mlp\.experts\.\d+\.(gate|up)_proj\.(weight|weight_packed|weight_scale)", 0),
    (r"mlp\.experts\.\d+\.down_proj\.(weight|weight_packed|weight_scale)", 1),
    (r"mlp\.experts\.\d+\.\w+_proj\.weight_shape", None),  # [out, in] of the full matrix
    (r".*", None),  # norms, q_a / kv_a projections, router
)
_SPLIT_RES = tuple((re.compile(rf"(^|\.){p}$"), d) for p, d in SPLIT_DIMS)
_FIELD_SUFFIX = {"weight": "", "weight_packed": "_packed", "weight_scale": "_scale"}


class CheckpointError(ValueError):
    """The checkpoint does not match the model built from its config."""


def split_dim(name: str) -> int | None:
    return next(d for r, d in _SPLIT_RES if r.search(name))


@dataclass
class _Target:
    dest: torch.Tensor | None  # this rank's destination view (None: checked, not stored)
    full_shape: tuple[int, ...]  # expected shape in the checkpoint
    value: tuple[int, ...] | None = None  # expected contents (weight_shape tensors)


def _full_shape(local: torch.Size, dim: int | None, world: int) -> tuple[int, ...]:
    shape = list(local)
    if dim is not None:
        shape[dim] *= world
    return tuple(shape)


def _expert_targets(base: str, experts, cfg: ModelConfig, world: int) -> dict[str, _Target]:
    out: dict[str, _Target] = {}
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    fields = ("weight_packed", "weight_scale") if experts.int4 else ("weight",)
    for e in range(cfg.n_routed_experts):
        for proj in ("gate", "up", "down"):
            stem = f"{base}.{e}.{proj}_proj"
            for f in fields:
                param = getattr(experts, ("w2" if proj == "down" else "w13") + _FIELD_SUFFIX[f])
                dest = param[e]
                if proj != "down":
                    half = dest.shape[0] // 2
                    dest = dest[:half] if proj == "gate" else dest[half:]
                name = f"{stem}.{f}"
                out[name] = _Target(dest, _full_shape(dest.shape, split_dim(name), world))
            if experts.int4:
                value = (h, inter) if proj == "down" else (inter, h)
                out[f"{stem}.weight_shape"] = _Target(None, (2,), value)
    return out


def _targets(model: DeepseekV3ForCausalLM) -> dict[str, _Target]:
    world, cfg = model.comm.world_size, model.cfg
    out: dict[str, _Target] = {}
    for name, p in model.named_parameters():
        if ".mlp.experts." not in name:
            # the parameter itself (not p.data): a load bumps its version, which caches
            # derived from it (`moe.Router.gate_for`) check
            out[name] = _Target(p, _full_shape(p.shape, split_dim(name), world))
    for name, mod in model.named_modules():
        if name.endswith(".mlp.experts"):
            out.update(_expert_targets(name, mod, cfg, world))
    return out


def checkpoint_index(path: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for a single-file or sharded checkpoint directory."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _is_skipped(name: str, cfg: ModelConfig) -> bool:
    """Tensors the serving model does not use: the K2.6 vision tower and MTP layers."""
    if not name.startswith(cfg.weight_prefix):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name[len(cfg.weight_prefix) :])
    return (
        m is not None
        and int(m.group(1)) >= cfg.num_hidden_layers
        and (int(m.group(1)) < cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    )


def _names(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _shard(sl, target: _Target, dim: int | None, rank: int) -> torch.Tensor:
    if dim is None or target.dest is None:
        return sl[:]
    n = target.dest.shape[dim]
    index = [slice(None)] * len(target.full_shape)
    index[dim] = slice(rank * n, (rank + 1) * n)
    return sl[tuple(index)]


def load_checkpoint(model: DeepseekV3ForCausalLM, path: str | Path, progress: bool = True) -> None:
    """Fill every weight of `model` (this rank's shard) from the checkpoint at `path`."""
    cfg, rank = model.cfg, model.comm.rank
    targets = _targets(model)
    files = checkpoint_index(path)
    prefix = cfg.weight_prefix
    found = {n[len(prefix) :]: f for n, f in files.items() if not _is_skipped(n, cfg)}
    missing, unexpected = set(targets) - set(found), set(found) - set(targets)
    if missing or unexpected:
        parts = [f"missing tensors: {_names(missing)}"] * bool(missing)
        parts += [f"unexpected tensors: {_names(unexpected)}"] * bool(unexpected)
        raise CheckpointError(f"{path}: checkpoint does not match the config; " + "; ".join(parts))
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, f in found.items():
        by_file[f].append(name)
    bar = tqdm(
        total=len(found), desc="loading weights", unit="tensor", disable=not progress or rank
    )
    for fname, names in sorted(by_file.items()):
        with safe_open(fname, framework="pt", device="cpu") as f:
            for name in sorted(names):
                _load_one(f.get_slice(prefix + name), name, targets[name], rank)
                bar.update()
    bar.close()


def _load_one(sl, name: str, target: _Target, rank: int) -> None:
    shape = tuple(sl.get_shape())
    if shape != target.full_shape:
        raise CheckpointError(f"{name}: shape {list(shape)}, expected {list(target.full_shape)}")
    t = _shard(sl, target, split_dim(name), rank)
    if target.value is not None:
        if tuple(t.tolist()) != target.value:
            raise CheckpointError(f"{name}: value {t.tolist()}, expected {list(target.value)}")
        return
    with torch.no_grad():
        target.dest.copy_(t)


def load_model(
    path: str | Path,
    comm: Communicator | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> tuple[DeepseekV3ForCausalLM, ModelConfig]:
    """Config + model + weights from a checkpoint directory."""
    cfg = ModelConfig.from_hf(path)
    model = DeepseekV3ForCausalLM(cfg, comm, dtype=dtype, device=device)
    load_checkpoint(model, path, progress=progress)
    return model.eval(), cfg
