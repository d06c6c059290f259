"""Optional sgl-kernel Marlin MoE backend: deliberately not enabled yet.

`backend.moe` tries this module first and falls back to Triton on ImportError. sgl-kernel does not
import on the lent GPUs (its wheel pins torch 2.9.1 and is ~536 MB), so a Marlin wrapper could be
neither run nor tested here. Rather than ship an unverified path that would be chosen silently
wherever sgl-kernel happens to import, this module refuses to load, with the reason logged by
`backend.moe`. Enabling it needs, on a machine where sgl_kernel imports: a one-time repack of the
compressed-tensors words (`w13_packed [E, 2I, H/8]`, packed along K, q + 8 nibbles) into Marlin's
tile order (sgl_kernel's GPTQ Marlin MoE repack with an identity permutation; the scales permuted
to Marlin's group layout), `moe_wna16_marlin_gemm` for the two GEMMs with SiLU-and-mul between,
and `tests/gpu/test_moe_triton.py`'s comparisons run against `fused_moe_marlin`.
"""

from __future__ import annotations

try:
    import sgl_kernel  # noqa: F401
except ImportError as e:  # the lent GPUs and CI
    raise ImportError(f"sgl_kernel unavailable: {e}") from e

raise ImportError(
    "sgl_kernel imports, but ddserve's Marlin MoE wrapper is not implemented/verified"
)
