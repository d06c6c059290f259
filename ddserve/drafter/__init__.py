"""Drafters: the `Drafter` seam (base.py), the DFlash block drafter (config, Qwen3-style layers,
per-stream context ring, loader, tiny) and test drafters (testing.py)."""

from ddserve.drafter.base import Drafter
from ddserve.drafter.config import DrafterConfig, DrafterMismatch
from ddserve.drafter.loader import load_dflash_model, load_drafter
from ddserve.drafter.model import DFlashDrafter, DFlashModel

__all__ = [
    "DFlashDrafter",
    "DFlashModel",
    "Drafter",
    "DrafterConfig",
    "DrafterMismatch",
    "load_dflash_model",
    "load_drafter",
]
