"""DFlash drafter in the engine: DDTree greedy == autoregressive greedy, on one rank and on two
(gloo) ranks each holding a replica; the tiny drafter's mask token is the tokenizer's."""

from __future__ import annotations

import pytest

from ddserve.config import ModelConfig
from ddserve.drafter import DFlashDrafter
from ddserve.drafter.tiny import write_tiny_drafter
from ddserve.sampling import SamplingParams
from tests.engine_helpers import greedy_reference, make_runner, run_all

ENGINE_PROMPTS = [list(range(30, 60)), [5, 6, 7, 8, 9, 10], list(range(120, 140)), [200]]
ENGINE_MAX = 16  # every stream's context passes the drafter's 16-entry window


@pytest.fixture(scope="module")
def dflash_setup(tmp_path_factory, tiny_model_dir):
    tcfg = ModelConfig.from_hf(tiny_model_dir)
    path = write_tiny_drafter(tmp_path_factory.mktemp("dflash"), tcfg, seed=1, sliding_window=16)
    ref = greedy_reference(tiny_model_dir, ENGINE_PROMPTS, ENGINE_MAX, ignore_eos=True)
    return tiny_model_dir, path, ref


@pytest.mark.parametrize("budget, batch", [(1, 2), (5, 4), (32, 3)])
def test_ddtree_greedy_with_dflash_equals_autoregressive(dflash_setup, budget, batch):
    model_dir, drafter_dir, ref = dflash_setup
    runner = make_runner(model_dir, budget, drafter=drafter_dir)
    drafter = runner.drafter
    assert isinstance(drafter, DFlashDrafter) and drafter.cache.capacity == 16
    commits, commit_many = [], drafter.commit_many

    def spy(items):  # the engine commits every stream of a step in one call
        commits.extend(len(ids) for _, ids, _ in items)
        return commit_many(items)

    drafter.commit_many = spy
    start = runner.free_slots
    params = SamplingParams(max_tokens=ENGINE_MAX, ignore_eos=True)
    assert run_all(runner, ENGINE_PROMPTS[:batch], params, True) == ref[:batch]
    assert runner.free_slots == start and drafter.cache.num_streams == 0
    if budget >= 32:  # the multi-token commit path ran (seeded, so this is deterministic)
        assert max(commits) > 1


def test_tiny_mask_token_is_the_tokenizers_mask(tmp_path):
    from tokenizers import Tokenizer

    from ddserve.drafter.tiny import TINY_MASK_TOKEN_ID
    from ddserve.tokenizer import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.token_to_id("<|mask|>") == TINY_MASK_TOKEN_ID


def test_tensor_parallel_replicas_agree(dflash_setup):
    """tp=2 over gloo (on the CPU even where a GPU is visible): every rank holds its shard of
    the drafter (the tiny one's 2 KV heads split) and drafts the same tree; a rank whose tree
    differed would verify other tokens and corrupt the all-reduced forward."""
    from ddserve.engine.llm import LLM

    model_dir, drafter_dir, _ = dflash_setup
    prompts, params = ENGINE_PROMPTS[:3], SamplingParams(max_tokens=ENGINE_MAX, ignore_eos=True)
    with LLM(model_dir, drafter=drafter_dir, tp=2, budget=8, device="cpu", seed=0) as llm:
        assert llm.runner.drafter.model.comm.world_size == 2  # sharded, not replicated
        ar = [o.token_ids for o in llm.generate(prompts, params, speculative=False)]
        assert [o.token_ids for o in llm.generate(prompts, params)] == ar


def test_runner_close_closes_its_drafter(dflash_setup):
    """`ModelRunner.close` frees the drafter's graphs too (`Drafter.close`: DFlash's commit
    graphs captured all-reduces, which must go before the communicator)."""
    model_dir, drafter_dir, _ = dflash_setup
    runner = make_runner(model_dir, 4, drafter=drafter_dir)
    closed, close = [], runner.drafter.close
    runner.drafter.close = lambda: closed.append(1) or close()
    runner.close()
    assert closed == [1]
