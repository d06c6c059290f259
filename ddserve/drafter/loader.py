"""Load a DFlash checkpoint directory (config.json + *.safetensors) for a given target.

Accepts the layout published drafters use: unprefixed names (`fc.weight`, `layers.0.mlp...`) or
the same under `model.`, in one file or shards. The drafter never has its own embedding/lm_head;
if a checkpoint carries copies of the target's, they are skipped. Any other unknown, missing or
misshapen tensor is an error that names it. Under tensor parallelism each rank keeps its slice of
the sharded tensors (`DFlashModel.shard_dim`) and checks the checkpoint's full shape.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from ddserve.drafter.config import DrafterConfig, DrafterMismatch
from ddserve.drafter.model import DFlashDrafter, DFlashModel, TargetHooks

if TYPE_CHECKING:
    from ddserve.config import ModelConfig
    from ddserve.distributed import Communicator

log = logging.getLogger(__name__)
_SKIPPED = ("embed_tokens.weight", "lm_head.weight", "rotary_emb.inv_freq")


def load_dflash_model(
    path: str | Path,
    target_cfg: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    comm: Communicator | None = None,
) -> DFlashModel:
    """Read, validate against the target, and load the weights (this rank's shard of them with
    `comm` at tp > 1). Raises DrafterMismatch."""
    path = Path(path)
    cfg = DrafterConfig.from_hf(path)
    cfg.validate(target_cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterMismatch(f"no *.safetensors weights in drafter directory {path}")
    with torch.device("meta"):
        model = DFlashModel(cfg, comm)
    rank, world = model.comm.rank, model.comm.world_size
    local = {name: p.shape for name, p in model.state_dict().items()}
    expected = {name: _full_shape(model.shard_dim(name), s, world) for name, s in local.items()}
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for raw_name in f.keys():
                name = raw_name.removeprefix("model.")
                if name.endswith(_SKIPPED) and name not in expected:
                    continue
                if name not in expected:
                    raise DrafterMismatch(f"unexpected tensor {raw_name!r} in {file.name}")
                t = f.get_tensor(raw_name)
                if tuple(t.shape) != tuple(expected[name]):
                    raise DrafterMismatch(
                        f"drafter tensor {name} has shape {tuple(t.shape)}, config implies "
                        f"{tuple(expected[name])}"
                    )
                dim = model.shard_dim(name)
                if dim is not None:  # this rank's slice, copied so the full tensor is freed
                    n = local[name][dim]
                    t = t.narrow(dim, rank * n, n).contiguous()
                tensors[name] = t.to(dtype)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise DrafterMismatch(f"drafter checkpoint {path} lacks tensors: {missing[:8]}")
    model.load_state_dict(tensors, assign=True)
    log.info(
        "loaded DFlash drafter %s: %d layers, capture %s, %s",
        path,
        cfg.num_hidden_layers,
        cfg.target_layer_ids,
        f"sharded across {world} ranks" if world > 1 else "whole on this rank",
    )
    model = model.to(device).eval()
    model.stack()  # context k/v of every layer in one matmul, each MLP's gate + up in one
    return model


def _full_shape(dim: int | None, shape: torch.Size, world: int) -> tuple[int, ...]:
    """The checkpoint's shape of a tensor of which a rank holds `shape` (1/world at `dim`)."""
    full = list(shape)
    if dim is not None:
        full[dim] *= world
    return tuple(full)


def load_drafter(
    path: str | Path,
    target_cfg: ModelConfig,
    target: TargetHooks,
    max_streams: int,
    max_context: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    comm: Communicator | None = None,
) -> DFlashDrafter:
    """A ready DFlashDrafter for `target` (whose `embed` / `lm_logits` it borrows), sharded
    across `comm`'s ranks where its shapes allow (`shard_world`)."""
    model = load_dflash_model(path, target_cfg, dtype=dtype, device=device, comm=comm)
    return DFlashDrafter(model, target, max_streams=max_streams, max_context=max_context)
