"""DrafterConfig: a DFlash checkpoint's config.json, read once, and checked against its target.

Published DFlash drafters ship a Qwen3-style config plus DFlash fields: `block_size`,
`num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}` (either may also sit at
the top level), optional `layer_types` / `sliding_window` / `use_sliding_window`, and RoPE as
`rope_theta` + `rope_scaling` (transformers 4.x) or `rope_parameters` (5.x). Sliding-window
semantics follow HF's `Qwen3Config`: the window applies only when `use_sliding_window` is true,
and only to layers whose type is `"sliding_attention"`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddserve.config import ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"


class DrafterMismatch(ValueError):
    """The drafter cannot serve this target (or its config is unusable); the message says why."""


def build_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """DFlash's default capture layers: `round(1 + i*(L-4)/(n-1))`, or `L // 2` when n == 1."""
    if n == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (n - 1))) for i in range(n))


@dataclass(frozen=True)
class RopeParams:
    """The drafter's rotary embedding (rotate-half, as Qwen3); `kind`: default|linear|yarn."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeParams:
        params = raw.get("rope_parameters")
        if params is None:
            params = dict(raw.get("rope_scaling") or {})
            params["rope_theta"] = raw.get("rope_theta", 10000.0)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "linear", "yarn"):
            raise DrafterMismatch(
                f"drafter rope type {kind!r} is not supported (default, linear, yarn)"
            )
        orig = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
        return cls(
            theta=float(params.get("rope_theta", 10000.0)),
            kind=kind,
            factor=float(params.get("factor", 1.0)),
            original_max_position_embeddings=orig,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )


@dataclass(frozen=True)
class DrafterConfig:
    """Everything the DFlash drafter's code reads; built by `from_hf`, never from raw JSON later."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope: RopeParams

    @property
    def depth(self) -> int:
        """Draft depths per step: the block is [bonus, MASK x depth]."""
        return self.block_size - 1

    @property
    def context_window(self) -> int | None:
        """Context entries any block query can see, when every layer slides; None if unbounded."""
        if self.sliding_window is not None and all(t == SLIDING for t in self.layer_types):
            return self.sliding_window
        return None

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any]) -> DrafterConfig:
        raw = _read(path_or_dict)
        if any("DFlash2" in a for a in raw.get("architectures") or []):
            raise DrafterMismatch("DFlash2 drafters (conv + candidate selector) are not supported")
        for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("is_causal", False)):
            if raw.get(key, want) != want:
                raise DrafterMismatch(
                    f"drafter {key}={raw[key]!r} is not supported (need {want!r})"
                )
        dfl = raw.get("dflash_config") or {}

        def pick(name: str, default: Any = None) -> Any:
            return dfl.get(name, raw.get(name, default))

        try:
            layers = int(raw["num_hidden_layers"])
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            inter = int(raw["intermediate_size"])
        except KeyError as e:
            raise DrafterMismatch(f"drafter config lacks {e.args[0]!r}") from None
        num_target = raw.get("num_target_layers")
        ids = pick("target_layer_ids")
        if ids is None:
            if num_target is None:
                raise DrafterMismatch(
                    "drafter config names neither target_layer_ids nor num_target_layers"
                )
            ids = build_target_layer_ids(int(num_target), layers)
        mask_id = pick("mask_token_id")
        if mask_id is None:
            raise DrafterMismatch("drafter config lacks dflash_config.mask_token_id")
        window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
        types = raw.get("layer_types") or [
            SLIDING if window is not None and i >= raw.get("max_window_layers", 28) else FULL
            for i in range(layers)
        ]
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            block_size=int(pick("block_size", 16)),
            mask_token_id=int(mask_id),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=None if num_target is None else int(num_target),
            layer_types=tuple(types),
            sliding_window=None if window is None else int(window),
            rope=RopeParams.from_hf(raw),
        )
        cfg._check_self()
        return cfg

    def _check_self(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise DrafterMismatch(
                f"drafter layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        if any(t not in (SLIDING, FULL) for t in self.layer_types):
            raise DrafterMismatch(f"drafter layer_types {self.layer_types} has an unknown type")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterMismatch(
                f"drafter heads {self.num_attention_heads} not a multiple of kv heads "
                f"{self.num_key_value_heads}"
            )
        if self.block_size < 2:
            raise DrafterMismatch(f"drafter block_size {self.block_size} must be >= 2")
        if not self.target_layer_ids:
            raise DrafterMismatch("drafter target_layer_ids is empty")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise DrafterMismatch(f"drafter sliding_window {self.sliding_window} must be >= 1")

    def validate(self, target: ModelConfig) -> None:
        """Raise DrafterMismatch naming the first field where this drafter cannot serve `target`."""
        n = target.num_hidden_layers
        bad = [i for i in self.target_layer_ids if not 0 <= i < n]
        if bad:
            raise DrafterMismatch(
                f"drafter target_layer_ids {list(self.target_layer_ids)} do not fit the target's "
                f"{n} layers (out of range: {bad}; valid ids 0..{n - 1})"
            )
        if self.num_target_layers is not None and self.num_target_layers != n:
            raise DrafterMismatch(
                f"drafter num_target_layers {self.num_target_layers} != target "
                f"num_hidden_layers {n}"
            )
        if self.hidden_size != target.hidden_size:
            raise DrafterMismatch(
                f"drafter hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise DrafterMismatch(
                f"drafter mask_token_id {self.mask_token_id} is outside the target vocab "
                f"(vocab_size {target.vocab_size})"
            )


def _read(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DrafterMismatch(f"drafter config not found: {path}") from None
    except json.JSONDecodeError as e:
        raise DrafterMismatch(f"drafter config {path} is not valid JSON: {e}") from None
