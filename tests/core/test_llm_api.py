"""The offline API: `from ddserve import LLM, SamplingParams`, and `ddserve generate`."""

from __future__ import annotations

import pytest

from ddserve import LLM, SamplingParams
from ddserve.cli import main as cli_main
from ddserve.drafter.testing import OracleDrafter
from ddserve.kvcache import OutOfSlots
from tests.engine_helpers import PROMPTS, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, budget=8, device="cpu", num_slots=512, max_streams=2)


def test_string_and_token_prompts_give_tokens_text_and_stats(llm) -> None:
    sp = SamplingParams(max_tokens=6)
    text, ids = llm.generate(["hello"], sp, speculative=False)[0], llm.encode("hello")
    assert text.prompt_token_ids == ids and len(text.token_ids) <= 6
    assert text.text == llm.tokenizer.decode(text.token_ids)
    same = llm.generate(ids, sp, speculative=False)[0]  # a single token-id prompt
    assert same.token_ids == text.token_ids
    assert text.stats["steps"] == len(text.token_ids) - 1 and text.stats["target_forwards"] >= 6


def test_speculative_output_and_stats(llm) -> None:
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    ar = llm.generate(PROMPTS[:3], sp, speculative=False)
    llm.runner.drafter = OracleDrafter(
        {tuple(p): o.token_ids for p, o in zip(PROMPTS, ar, strict=False)}, 264, depth=4
    )
    try:
        dd = llm.generate(PROMPTS[:3], sp)  # 3 prompts, 2 streams at a time: one joins later
    finally:
        llm.runner.drafter = None
    assert [o.token_ids for o in dd] == [o.token_ids for o in ar]
    for o in dd:
        assert sum(o.stats["committed_per_step"]) == len(o.token_ids) - 1
        assert o.stats["mean_committed"] > 3.0 and o.finish_reason == "length"
    assert dd[0].stats["target_forwards"] < ar[0].stats["target_forwards"]


def test_pool_exhaustion_queues_and_impossible_requests_raise(tiny_model_dir) -> None:
    small = LLM(tiny_model_dir, budget=4, device="cpu", num_slots=60, max_streams=8)
    start = small.free_slots
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = small.generate(PROMPTS[:4], sp, speculative=False)  # at most two fit at a time
    assert all(len(o.token_ids) == 8 for o in outs)
    with pytest.raises(OutOfSlots):
        small.generate([list(range(60))], sp)
    assert small.free_slots == start and not small.runner.streams


def test_cancel_mid_run_frees_every_slot(llm) -> None:
    r = llm.runner
    start = r.free_slots
    r.add_stream("a", PROMPTS[2], SamplingParams(max_tokens=30))
    r.add_stream("b", PROMPTS[0], SamplingParams(max_tokens=30))
    r.prefill()
    r.ar_step(["a", "b"])
    assert r.free_slots < start
    assert r.cancel("a") and r.cancel("b") and not r.cancel("b")
    r.add_stream("c", PROMPTS[1], SamplingParams(max_tokens=30))
    assert r.cancel("c")  # cancelled before prefill
    assert r.free_slots == start


def test_cli_generate(tiny_model_dir, capsys) -> None:
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "4"]
    assert cli_main([*argv, "--device", "cpu", "--no-speculative"]) == 0
    captured = capsys.readouterr()
    assert "tokens/step" in captured.err and captured.out.strip() != ""


def test_default_model_and_dflash_drafter_path(tmp_path) -> None:
    from ddserve.drafter.tiny import write_tiny_drafter

    plain = LLM(device="cpu", num_slots=256)  # the embedded default checkpoint (trained)
    drafter_dir = write_tiny_drafter(tmp_path / "drafter", plain.runner.model_cfg)
    spec = LLM(drafter=drafter_dir, device="cpu", num_slots=256, budget=8)
    sp = SamplingParams(max_tokens=10)
    want = plain.generate(PROMPTS[:2], sp, speculative=False)
    got = spec.generate(PROMPTS[:2], sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].stats["steps"] >= 1
