"""An engine's kernel configuration: resolved once (`KernelConfig.resolve`) from explicit
arguments and the environment overrides declared here, logged by the engine, and active during
its forwards (`backend.kernel_mode`). Nothing else in `ddserve.kernels` reads the environment
to choose kernels."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

MOE_VARIANTS = ("v2", "v3")
# Every environment variable that changes which kernels run, with what it sets.
ENV_OVERRIDES = {
    "DDSERVE_MOE_VARIANT": "moe_variant: v2 or v3 for every MoE call (no v3 -> v2 fallback)",
    "DDSERVE_PDL": "pdl: 0 launches every kernel in plain stream order (no programmatic "
    "dependent launch)",
    "DDSERVE_SIDE_STREAM": "side_stream: 0 runs the shared expert on the main stream (no second "
    "CUDA stream)",
}
OFF = ("0", "off", "false", "no")


@dataclass(frozen=True)
class KernelConfig:
    # each token's row computed with one fixed arithmetic whatever else is in the forward
    # (DDTree verify rows == AR rows bit for bit); see backend.py
    batch_invariant: bool = False
    # the routed-experts kernel; None: v3 where it applies (CUDA, INT4, bf16 scales), else v2
    moe_variant: str | None = None
    # programmatic dependent launch on sm_90+ (pdl.py): a kernel starts while its predecessor
    # finishes; the arithmetic is the same either way
    pdl: bool = True
    # the MoE's shared expert (gate/up and SiLU) on a second CUDA stream beside the routed
    # experts, forked after the router (`backend.side_branch`); the same arithmetic either way
    side_stream: bool = True

    def __post_init__(self) -> None:
        if self.moe_variant is not None and self.moe_variant not in MOE_VARIANTS:
            raise ValueError(f"moe_variant={self.moe_variant!r}: expected one of {MOE_VARIANTS}")

    @classmethod
    def resolve(
        cls,
        batch_invariant: bool,
        moe_variant: str | None = None,
        env: Mapping[str, str] = os.environ,
    ) -> KernelConfig:
        """The configuration from explicit arguments; `env` (ENV_OVERRIDES) fills what they
        leave open."""
        variant = moe_variant or env.get("DDSERVE_MOE_VARIANT") or None
        pdl = env.get("DDSERVE_PDL", "1").strip().lower() not in OFF
        side = env.get("DDSERVE_SIDE_STREAM", "1").strip().lower() not in OFF
        return cls(
            batch_invariant=bool(batch_invariant), moe_variant=variant, pdl=pdl, side_stream=side
        )
