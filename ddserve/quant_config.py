"""The `quantization_config` of a checkpoint's `config.json`: what ddserve accepts, parsed once.

Only the routed experts are INT4 (Kimi K2 Thinking / K2.6 layout): compressed-tensors
`pack-quantized`, symmetric int4 weights in groups of `GROUP` columns. `ModelConfig.from_hf`
calls `parse_quant_config`; the packing arithmetic lives in `ddserve.kernels.moe_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddserve.kernels.moe_ref import GROUP

# Keys of a compressed-tensors quantization_config / weights scheme that carry no meaning for us.
_IGNORED_TOP = {"kv_cache_scheme", "quantization_status", "global_compression_ratio", "version",
                "sparsity_config", "transform_config"}  # fmt: skip
_IGNORED_WEIGHTS = {"observer", "observer_kwargs", "dynamic", "block_structure"}


@dataclass(frozen=True)
class QuantConfig:
    """INT4 routed experts: symmetric int4, one scale per `group_size` input columns."""

    num_bits: int = 4
    group_size: int = GROUP
    fmt: str = "pack-quantized"
    ignore: tuple[str, ...] = ()  # module patterns the checkpoint left unquantized (informational)


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"unsupported quantization_config: {what}")


def parse_quant_config(q: dict[str, Any] | None) -> QuantConfig | None:
    """HF `quantization_config` -> QuantConfig (INT4 experts) or None (unquantized checkpoint).

    Accepts only what the model can run: compressed-tensors, format pack-quantized, one config
    group of symmetric int4 weights with group strategy and group size 32, no activation quant.
    """
    if q is None:
        return None
    method = q.get("quant_method")
    _require(method == "compressed-tensors", f"quant_method {method!r} (only compressed-tensors)")
    _require(q.get("format") == "pack-quantized", f"format {q.get('format')!r}")
    known = {"quant_method", "format", "config_groups", "ignore"} | _IGNORED_TOP
    unknown = sorted(set(q) - known)
    _require(not unknown, f"unknown field(s) {unknown}")
    groups = q.get("config_groups") or {}
    _require(len(groups) == 1, f"expected exactly one config group, got {sorted(groups)}")
    (name, group), = groups.items()  # fmt: skip
    for act in ("input_activations", "output_activations"):
        _require(group.get(act) is None, f"{name}.{act} must be null (weight-only INT4)")
    w = group.get("weights") or {}
    want = dict(num_bits=4, type="int", symmetric=True, group_size=GROUP, strategy="group")
    for key, val in want.items():
        _require(w.get(key) == val, f"{name}.weights.{key} = {w.get(key)!r}, need {val!r}")
    _require(w.get("actorder") in (None, False), f"{name}.weights.actorder = {w.get('actorder')!r}")
    unknown = sorted(set(w) - set(want) - _IGNORED_WEIGHTS - {"actorder"})
    _require(not unknown, f"unknown weight-scheme field(s) {unknown}")
    return QuantConfig(ignore=tuple(q.get("ignore") or ()))
