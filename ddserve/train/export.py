"""HF checkpoints of a `TrainTarget`: write (bf16 or INT4 routed experts) and read back.

Written layout (what `ddserve.model.loader` and `transformers` read): `config.json`,
`model-0000k-of-0000n.safetensors` shards of < 15 MB each (a device call returns files of at most
16 MiB) with `model.safetensors.index.json`, and the tokenizer (`tokenizer.json`,
`tokenizer_config.json` with the chat template). Everything is bf16 except the routing bias
(float32) and, with `int4`, the routed experts: compressed-tensors `pack-quantized` as Kimi K2.6
ships it (`weight_packed` int32, `weight_scale` bf16, `weight_shape`; symmetric, group 32), made
by `ddserve.model.quant.checkpoint_int4`, with the `quantization_config` `make-tiny` writes.

    python -m ddserve.train.export --ckpt IN --out OUT [--int4] [--tokenizer DIR]

rewrites a checkpoint (e.g. bf16 -> INT4 experts, or re-sharded).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ddserve.model.quant import checkpoint_int4
from ddserve.model.tiny import INT4_QUANT_CONFIG

if TYPE_CHECKING:
    from ddserve.train.target_model import TrainTarget

MAX_SHARD_BYTES = 15_000_000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_INT4_FIELDS = ("weight_packed", "weight_scale", "weight_shape")
# A header entry is `"name":{"dtype":"BF16","shape":[a,b],"data_offsets":[x,y]},` (< 100 + name);
# plus up to 7 bytes of alignment padding and the `__metadata__` entry, spread over tensors.
_HEADER_BYTES_PER_TENSOR = 128


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def checkpoint_tensors(state: dict[str, torch.Tensor], int4: bool) -> dict[str, torch.Tensor]:
    """TrainTarget state_dict -> checkpoint tensors (CPU, contiguous)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        t = t.detach().cpu()
        if int4 and _is_expert(name):
            out.update(checkpoint_int4(name, t))
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.float()
        else:
            out[name] = t.to(torch.bfloat16)
    return {n: out[n].contiguous() for n in sorted(out)}


def _file_bytes(name: str, t: torch.Tensor) -> int:
    """Bytes a tensor adds to a safetensors file: its data and (at most) its header entry."""
    return t.numel() * t.element_size() + len(name) + _HEADER_BYTES_PER_TENSOR


def plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names in sorted order, cut into consecutive shards whose files stay under `max_bytes`."""
    shards: list[list[str]] = [[]]
    used = 8  # the header-length prefix
    for name in sorted(tensors):
        size = _file_bytes(name, tensors[name])
        if size > max_bytes:
            raise ValueError(f"{name}: {size} bytes does not fit a shard of {max_bytes}")
        if used + size > max_bytes and shards[-1]:
            shards.append([])
            used = 8
        shards[-1].append(name)
        used += size
    return shards


def save_sharded(tensors: dict[str, torch.Tensor], out: Path, max_bytes: int) -> list[Path]:
    """Shards plus `model.safetensors.index.json`; returns the shard paths."""
    shards = plan_shards(tensors, max_bytes)
    weight_map, paths = {}, []
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
        paths.append(out / fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return paths


def copy_tokenizer(tokenizer_dir: str | Path, out: Path) -> None:
    src = Path(tokenizer_dir)
    if src.resolve() == out.resolve():
        return
    for fname in TOKENIZER_FILES:
        if (src / fname).exists():
            shutil.copyfile(src / fname, out / fname)


def write_checkpoint(
    state: dict[str, torch.Tensor],
    hf_config: dict[str, Any],
    out_dir: str | Path,
    tokenizer_dir: str | Path | None,
    int4: bool,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """A complete HF checkpoint directory from a TrainTarget state_dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()  # a previous export's shards would shadow or confuse the index
    save_sharded(checkpoint_tensors(state, int4), out, max_shard_bytes)
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    if int4:
        config["quantization_config"] = INT4_QUANT_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    return out


def export(
    model: TrainTarget,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None,
    int4: bool = True,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """`model` as an HF checkpoint (routed experts INT4 unless `int4=False`)."""
    return write_checkpoint(
        model.state_dict(), model.hf_config, out_dir, tokenizer_dir, int4, max_shard_bytes
    )


def _tensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    return [path / "model.safetensors"]


def _read_raw(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in _tensor_files(path):
        with safe_open(f, framework="pt", device="cpu") as sf:
            for name in sf.keys():
                tensors[name] = sf.get_tensor(name)
    return tensors


def _dequantize(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """INT4 expert triples -> `<stem>.weight` float32 [out, in]; everything else as stored."""
    from ddserve.model.quant import dequantize_int4

    out = {n: t for n, t in raw.items() if not n.endswith(_INT4_FIELDS)}
    for name in raw:
        if name.endswith(".weight_packed"):
            stem = name.removesuffix(".weight_packed")
            w = dequantize_int4(raw[name], raw[f"{stem}.weight_scale"], torch.float32)
            shape = tuple(raw[f"{stem}.weight_shape"].tolist())
            if tuple(w.shape) != shape:
                raise ValueError(f"{stem}: unpacked shape {tuple(w.shape)} != weight_shape {shape}")
            out[f"{stem}.weight"] = w
    return out


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF config without quantization_config, tensors named as TrainTarget's state_dict: INT4
    experts dequantized to float32, the rest as stored)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    return config, _dequantize(_read_raw(path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ddserve.train.export",
        description="Rewrite an HF checkpoint of the trained target: bf16 or INT4 routed experts, "
        f"shards of < {MAX_SHARD_BYTES / 1e6:.0f} MB, tokenizer files copied.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint directory to read")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--int4", action="store_true", help="routed experts as INT4 (group 32)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the one in --ckpt)")
    p.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES)
    args = p.parse_args(argv)
    config, tensors = read_checkpoint(args.ckpt)
    out = write_checkpoint(
        tensors, config, args.out, args.tokenizer or args.ckpt, args.int4, args.max_shard_bytes
    )
    print(f"wrote {'INT4' if args.int4 else 'bf16'}-expert checkpoint to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
