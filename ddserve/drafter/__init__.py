"""DFlash block drafter: config, Qwen3-style layers, per-stream context ring, loader, tiny."""

from ddserve.drafter.config import DrafterConfig, DrafterMismatch
from ddserve.drafter.loader import load_dflash_model, load_drafter
from ddserve.drafter.model import DFlashDrafter, DFlashModel

__all__ = [
    "DFlashDrafter",
    "DFlashModel",
    "DrafterConfig",
    "DrafterMismatch",
    "load_dflash_model",
    "load_drafter",
]
