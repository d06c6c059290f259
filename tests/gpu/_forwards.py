"""One target forward of a prefilled tiny-model engine, for GPU tests that compare launch
variants (PDL, the side stream) by their logits (not a test module)."""

from __future__ import annotations

import torch

from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.sampling import SamplingParams

# the last prompt's 300 tokens give its attention calls several key splits (256 keys each)
PROMPTS = [[5, 6, 7], list(range(20, 41)), [100, 101, 102, 103, 104, 105], [200],
           [(7 * i) % 250 for i in range(300)]]  # fmt: skip


def prefilled_runner(model_dir, graphs: bool, prompts: list[list[int]] = PROMPTS) -> ModelRunner:
    """A bf16 engine on CUDA (kernel configuration from the environment) with every prompt of
    `prompts` prefilled as streams 0, 1, ..."""
    cfg = EngineConfig(num_slots=4096, budget=8, dtype="bfloat16", cuda_graphs=graphs)
    runner = ModelRunner(model_dir, engine_cfg=cfg, drafter=model_dir / "drafter", device="cuda")
    for i, p in enumerate(prompts):
        runner.add_stream(i, p, SamplingParams(max_tokens=24))
    runner.prefill()
    return runner


def forward_logits(runner: ModelRunner, q: int, seed: int) -> torch.Tensor:
    """The logits of one forward of q random tokens per stream (causal within each stream's
    block) after its prefix; the block's slots are freed again."""
    sts = [runner.streams[i] for i in range(len(PROMPTS))]
    new = [runner.allocator.alloc(q) for _ in sts]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (len(sts) * q,), generator=g)
    pos = torch.tensor([len(st.slots) + j for st in sts for j in range(q)])
    mask = torch.ones(len(sts), q, q, dtype=torch.bool).tril()
    out, _ = runner._decode_forward(sts, q, new, mask, ids.cuda(), pos.cuda())
    logits = out.logits.clone()
    for block in new:
        runner.allocator.free(block)
    return logits
