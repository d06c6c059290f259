"""The fused draft top-k (ddserve/kernels/draft_topk.py, the tree builder's first stage) in the
Triton interpreter on the CPU, against `draft_topk_ref` and torch's log_softmax + topk; plus the
host-side contracts (configurations, the CPU path of `top_draft_tokens`).

The kernel checks run in one subprocess with TRITON_INTERPRET=1, as in test_router_kernel.py:
the process runs this file as a script, calls every `check_*` and prints one JSON line. Small
vocabularies (48 to 5000) in segments of 64 to 4096 tokens and groups of 1 to 32 (rows cross
several segments; the last segment and group partly past V), k from 1 to 256 (above and below
the segment count, up to V); bf16, fp16 and fp32 logits; ties; -inf and very negative logits.
The host tests also compile both kernels offline for sm_90 at K2.6's shapes.
tests/gpu/test_draft_topk_gpu.py repeats the checks there on a GPU.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from ddserve.ddtree.tree import MIN_LOGPROB, build_tree, log_softmax_topk, top_draft_tokens
from tests.triton_interp import (
    interpreter_results,
    patch_interpreter,
    require_sm90_compiler,
    require_triton,
    run_cases,
)

# name -> (B, D, V, k, segment or None for the default, dtype)
SHAPES = {
    "bf16_6_segments_k16": (2, 2, 3000, 16, 512, torch.bfloat16),  # k > segments
    "fp32_odd_v_k64": (1, 2, 4999, 64, 1024, torch.float32),
    "fp16_k5": (2, 1, 1000, 5, 256, torch.float16),
    "k1_7_segments": (1, 3, 777, 1, 128, torch.float32),
    "k_is_v": (2, 1, 48, 48, None, torch.float32),  # k = V < k_pad: padding in the candidates
    "k100_past_pow2": (1, 1, 1500, 100, 256, torch.bfloat16),
    "default_config": (1, 2, 5000, 32, None, torch.bfloat16),
    "k_max": (1, 1, 3000, 256, 512, torch.float32),
}


def _logits(b, d, v, dtype, seed, scale=3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, d, v, generator=g) * scale).to(dtype)  # [B, D, V]


def _run(kernel, x, k, segment=None):
    cfg = kernel.topk_config(x.shape[-1], k, **({} if segment is None else dict(segment=segment)))
    return kernel.draft_topk(x, k, MIN_LOGPROB, cfg)


def _check_contract(kernel, x, k, lp, tok) -> None:
    """The reference's tokens exactly, its log-probs to 1e-5, torch's topk values to 1e-5 and
    its tokens wherever a value is not tied, sorted descending."""
    b, d, _ = x.shape
    assert lp.shape == tok.shape == (b, d, k) and lp.dtype == torch.float32
    assert tok.dtype == torch.int64
    ref_lp, ref_tok = kernel.draft_topk_ref(x, k, MIN_LOGPROB)
    assert torch.equal(tok, ref_tok), (tok, ref_tok)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    assert (lp[..., 1:] <= lp[..., :-1]).all()
    t_lp, t_tok = log_softmax_topk(x, min(k + 1, x.shape[-1]))  # one more: ties at the cut
    torch.testing.assert_close(lp, t_lp[..., :k], atol=1e-5, rtol=0)
    prev = torch.cat([torch.full_like(t_lp[..., :1], float("inf")), t_lp[..., :-1]], -1)
    nxt = torch.cat([t_lp[..., 1:], torch.full_like(t_lp[..., :1], float("-inf"))], -1)
    untied = ((t_lp != prev) & (t_lp != nxt))[..., :k]
    assert untied.any()
    assert torch.equal(tok[untied], t_tok[..., :k][untied])


def check_matches_reference(kernel, name: str) -> None:
    b, d, v, k, segment, dtype = SHAPES[name]
    x = _logits(b, d, v, dtype, seed=len(name))
    _check_contract(kernel, x, k, *_run(kernel, x, k, segment))


def check_ties_go_to_the_lower_token(kernel) -> None:
    """Logits from {0, 1, 2, 3}: hundreds of equal values per row, across segments and groups;
    a row of equal logits gives tokens 0..k-1; -0.0 ties with +0.0."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 4, (2, 2, 1200), generator=g).to(torch.bfloat16)
    x[1, 1] = 0.5
    x[1, 0] = -1.0
    x[1, 0, [900, 3]] = torch.tensor([0.0, -0.0], dtype=torch.bfloat16)  # equal logits
    lp, tok = _run(kernel, x, 24, segment=256)
    ref_lp, ref_tok = kernel.draft_topk_ref(x, 24, MIN_LOGPROB)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    assert tok[1, 1].tolist() == list(range(24))
    assert tok[1, 0, :3].tolist() == [3, 900, 0]
    same = lp[..., 1:] == lp[..., :-1]
    assert same.any() and (tok[..., 1:] > tok[..., :-1])[same].all()


def check_minus_inf_and_clamped_logits(kernel) -> None:
    """Rows with fewer finite logits than k (whole segments of -inf; the rest of the top-k are
    the lowest -inf tokens, at MIN_LOGPROB) and a row whose tail is clamped at MIN_LOGPROB."""
    v, k = 1000, 16
    x = torch.full((1, 3, v), float("-inf"))
    finite = [3, 400, 401, 777, 999]
    x[0, 0, finite] = torch.tensor([1.0, -2.0, 5.0, 0.5, -30.0])
    x[0, 1, 990:] = torch.randn(10)  # only the last segment has finite logits
    x[0, 2] = -3.0e4
    x[0, 2, [10, 600]] = torch.tensor([0.0, -1.0])
    lp, tok = _run(kernel, x, k, segment=128)
    ref_lp, ref_tok = kernel.draft_topk_ref(x, k, MIN_LOGPROB)
    assert torch.equal(tok, ref_tok), (tok, ref_tok)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    assert tok[0, 0, :5].tolist() == [401, 3, 777, 400, 999]
    assert tok[0, 0, 5:].tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]
    assert (lp[0, 0, 5:] == MIN_LOGPROB).all() and (lp[0, 2, 2:] == MIN_LOGPROB).all()
    assert tok[0, 1, 10:].tolist() == list(range(6))


def check_row_alone_equals_row_in_batch(kernel) -> None:
    """A row's outputs do not depend on the other rows, on the call, or on the logits' strides
    (bitwise): the same row alone, in a batch, in a strided view, and called twice."""
    x = _logits(3, 4, 2000, torch.bfloat16, seed=9)
    lp, tok = _run(kernel, x, 20, segment=256)
    again = _run(kernel, x, 20, segment=256)
    assert torch.equal(again[0], lp) and torch.equal(again[1], tok)
    alone = _run(kernel, x[1:2, 2:3], 20, segment=256)
    assert torch.equal(alone[0][0, 0], lp[1, 2]) and torch.equal(alone[1][0, 0], tok[1, 2])
    strided = _run(kernel, x.transpose(0, 1)[1::2], 20, segment=256)  # [2, 3, V] view
    assert torch.equal(strided[0], lp.transpose(0, 1)[1::2])
    assert torch.equal(strided[1], tok.transpose(0, 1)[1::2])


def check_build_tree_on_the_fused_first_stage(kernel) -> None:
    """The fused first stage gives the torch path's tree on random fp32 logits (no near-ties)."""
    from ddserve.ddtree.tree import tree_from_topk

    x = _logits(3, 4, 2000, torch.float32, seed=11)
    for budget in (8, 40):
        fused = tree_from_topk(*_run(kernel, x, budget, segment=512), budget)
        ref = build_tree(x, budget)
        for name in ("tokens", "parents", "depths", "visible"):
            assert torch.equal(getattr(fused, name), getattr(ref, name)), (budget, name)
        torch.testing.assert_close(fused.scores, ref.scores, atol=1e-4, rtol=0)


CASES = (
    [(f"matches_reference[{n}]", check_matches_reference, (n,)) for n in SHAPES]
    + [("ties_go_to_the_lower_token", check_ties_go_to_the_lower_token, ())]
    + [("minus_inf_and_clamped_logits", check_minus_inf_and_clamped_logits, ())]
    + [("row_alone_equals_row_in_batch", check_row_alone_equals_row_in_batch, ())]
    + [("build_tree_on_the_fused_first_stage", check_build_tree_on_the_fused_first_stage, ())]
)  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_kernel_in_interpreter(name: str) -> None:
    require_triton()
    result = interpreter_results(__file__)[name]
    assert result == "ok", result


def test_cpu_first_stage_is_torch_log_softmax_topk() -> None:
    """On the CPU `top_draft_tokens` (so `build_tree`) is the torch code, bit for bit."""
    x = _logits(2, 3, 300, torch.bfloat16, seed=1)
    got, want = top_draft_tokens(x, 17), log_softmax_topk(x, 17)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_reference_is_log_softmax_topk_with_ordered_ties() -> None:
    from ddserve.kernels.draft_topk import draft_topk_ref

    require_triton()
    x = _logits(2, 3, 700, torch.float32, seed=2)
    lp, tok = draft_topk_ref(x, 40, MIN_LOGPROB)
    t_lp, t_tok = log_softmax_topk(x, 40)
    torch.testing.assert_close(lp, t_lp, atol=1e-6, rtol=0)
    assert torch.equal(tok, t_tok)  # random fp32 logits: no ties


@pytest.mark.parametrize("v", [48, 1000, 4999, 32000, 163840, 262144])
@pytest.mark.parametrize("k", [1, 5, 16, 64, 100, 256])
def test_config_is_valid_for_every_supported_shape(v: int, k: int) -> None:
    """topk_config's launch shape passes the launcher's checks wherever `supports` holds."""
    import triton

    from ddserve.kernels import draft_topk

    require_triton()
    assert draft_topk.supports(torch.empty(1, 1, v), k) == (k <= v)
    if k > v:
        return
    cfg = draft_topk.topk_config(v, k)
    draft_topk._check_config(cfg, triton.next_power_of_2(k), draft_topk._sizes(v, cfg)[1])
    if v == 163840:  # K2.6: 40 segments of 4096 tokens; groups of 64 tokens for k 64
        assert cfg.segment == 4096 and cfg.width == {16: 128, 64: 64, 256: 32}.get(k, cfg.width)


def test_unsupported_shapes_fall_back() -> None:
    from ddserve.kernels import draft_topk

    require_triton()
    x = torch.empty(2, 3, 1000)
    assert draft_topk.supports(x, draft_topk.MAX_K)
    assert not draft_topk.supports(x, draft_topk.MAX_K + 1)
    assert not draft_topk.supports(x, 0)
    assert not draft_topk.supports(x.double(), 8)
    assert not draft_topk.supports(x[0], 8)


@pytest.mark.parametrize("k", [1, 16, 64, 256])
def test_kernels_compile_for_sm90_at_k26_shapes(k: int) -> None:
    """Both kernels compile offline for sm_90 (H100 / H200) at K2.6's draft shapes with PDL and
    the JIT's pointer divisibility, and wait before their first global memory access; a compile
    error fails the test (the interpreter does not compile)."""
    require_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddserve.kernels import draft_topk

    require_sm90_compiler()
    v = 163840
    cfg = draft_topk.topk_config(v, k)
    nseg, nh = draft_topk._sizes(v, cfg)
    seg_sig = dict(x_ptr="*bf16", heads_ptr="*fp32", stats_ptr="*fp32", sb="i32", sd="i32")
    seg_consts = dict(D=15, V=v, NSEG=nseg, SEG=cfg.segment, W=cfg.width, PDL=True)
    sel_sig = dict(x_ptr="*bf16", heads_ptr="*fp32", stats_ptr="*fp32", lp_ptr="*fp32",
                   tok_ptr="*i64", sb="i32", sd="i32", floor="fp32")  # fmt: skip
    sel_consts = dict(D=15, V=v, NSEG=nseg, NSEG_PAD=triton.next_power_of_2(nseg), NH=nh,
                      NH_PAD=triton.next_power_of_2(nh), W=cfg.width, K=k,
                      K_PAD=triton.next_power_of_2(k), PDL=True)  # fmt: skip
    for kernel, sig, consts, warps in (
        (draft_topk._segment_kernel, seg_sig, seg_consts, cfg.warps),
        (draft_topk._select_kernel, sel_sig, sel_consts, cfg.select_warps),
    ):
        pointers = [n for n, t in sig.items() if t.startswith("*")]
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
        src = ASTSource(kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts, attrs)
        opts = {"num_warps": warps, "launch_pdl": True}
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts).asm["ptx"]
        mem = re.search(r"\b(ld\.global|st\.global)", ptx)
        assert mem and 0 <= ptx.find("griddepcontrol.wait") < mem.start(), kernel


if __name__ == "__main__":  # the interpreter subprocess
    patch_interpreter()
    from ddserve.kernels import draft_topk

    print(json.dumps(run_cases(CASES, draft_topk)))
