"""DDTree: tree build, verify inputs, target-token selection and acceptance, as pure tensor code.

Nothing here synchronises with the host or produces data-dependent shapes: every output has a
shape fixed by (batch, depth, budget, vocab), so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

from ddserve.ddtree.accept import Acceptance, accept
from ddserve.ddtree.sampling import select_tokens
from ddserve.ddtree.tree import DraftTree, build_tree
from ddserve.ddtree.verify import VerifyResult, block_meta, reselect, verify_inputs, verify_step

__all__ = [
    "Acceptance",
    "VerifyResult",
    "DraftTree",
    "accept",
    "block_meta",
    "build_tree",
    "reselect",
    "select_tokens",
    "verify_inputs",
    "verify_step",
]
