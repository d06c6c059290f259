"""Stage 4, the DFlash drafter trainer: its many-block training forward is ddserve's serving
drafter; training lowers the loss; the written checkpoint serves in the engine with DDTree == AR
greedy; the acceptance walk counts what the engine would commit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ddserve.config import ModelConfig
from ddserve.drafter import DFlashDrafter, DFlashModel, DrafterConfig
from ddserve.drafter.loader import load_dflash_model
from ddserve.drafter.tiny import TINY_MASK_TOKEN_ID, random_weights
from ddserve.train.drafter import (
    DrafterShape,
    DraftObjective,
    TrainConfig,
    block_labels,
    block_loss,
    block_visibility,
    drafter_config,
    patch_target,
    sample_anchors,
    save_drafter,
    save_mask_embedding,
    train,
)
from ddserve.train.drafter_data import DraftData, GenPlan, acceptance, generate
from ddserve.train.shapes import target_config
from ddserve.train.target_model import TrainTarget

H, V, EOS = 64, 264, 257
CONTEXT_LAYERS = [1, 2]


def tiny_target() -> TrainTarget:
    cfg = target_config(tiny=True, vocab_size=V, bos_token_id=256, eos_token_id=EOS)
    return TrainTarget.from_config(cfg, seed=0).eval()


def shape(**over) -> DrafterShape:
    base = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                block_size=5, sliding_window=8)  # fmt: skip
    return DrafterShape(**{**base, **over})


def objective(target: TrainTarget, seed: int = 0, **over) -> tuple[DraftObjective, dict]:
    raw = drafter_config(target.cfg, shape(**over), TINY_MASK_TOKEN_ID, CONTEXT_LAYERS)
    torch.manual_seed(seed)
    model = DFlashModel(DrafterConfig.from_hf(raw))
    emb, head = target.model.embed_tokens.weight, target.lm_head.weight
    return DraftObjective(model, emb, head), raw


@pytest.fixture(scope="module")
def target() -> TrainTarget:
    return tiny_target()


@pytest.fixture(scope="module")
def data(target) -> DraftData:
    stream = np.random.default_rng(0).integers(0, 256, 4000).astype(np.int32)
    plan = GenPlan(24, prompt_lens=(6, 12), new_tokens=24, batch=12)
    return generate(target, stream, plan, CONTEXT_LAYERS, EOS, "cpu", log=lambda m: None)


def test_default_drafter_fits_the_default_target():
    """6-layer target: context layers 1, 3, 5; ~2M parameters (~4 MB in bf16); valid config."""
    from ddserve.train.drafter import context_layer_ids

    cfg = ModelConfig.from_hf(target_config(vocab_size=4096, bos_token_id=0, eos_token_id=1))
    ids = context_layer_ids(cfg.num_hidden_layers, DrafterShape.num_context_layers)
    assert ids == [1, 3, 5]
    dcfg = DrafterConfig.from_hf(drafter_config(cfg, DrafterShape(), 4, ids))
    dcfg.validate(cfg)
    with torch.device("meta"):
        params = sum(p.numel() for p in DFlashModel(dcfg).parameters())
    assert 1.5e6 < params < 2.1e6 and dcfg.block_size == 16 and dcfg.depth == 15


def test_cached_greedy_equals_recomputing_greedy(target):
    """The key/value-cached generator == re-running the whole prefix each step: the same
    tokens and the same captured hidden states (float32)."""
    from ddserve.train.drafter_data import cached_greedy_with_hidden, greedy_with_hidden

    prompts = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(0))
    ref_tokens, ref_hidden = greedy_with_hidden(target, prompts, 12, CONTEXT_LAYERS)
    tokens, hidden = cached_greedy_with_hidden(target, prompts, 12, CONTEXT_LAYERS)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-3, rtol=1e-2)  # bf16 storage
    assert not hidden[:, -1].any() and hidden[:, -2].any()  # only the last row is never context


# ---- (a) the training forward is the serving drafter ---------------------------------------


class TableTarget:
    """The target hooks the serving drafter borrows, from the objective's tables (mask row
    included), so both sides embed and project identically."""

    def __init__(self, obj: DraftObjective) -> None:
        self.obj = obj

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.obj.embed_ids(ids)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        return h.float() @ self.obj.lm_head.T


CASES = {
    "sliding": dict(sliding_window=8),
    "full": dict(sliding_window=None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_forward_equals_serving_drafter(target, case):
    """Many blocks per sequence in one block-sparse pass == ddserve's DFlashDrafter drafting each
    anchor as a stream whose committed context is the sequence before the anchor."""
    obj, raw = objective(target, **CASES[case])
    cfg = obj.cfg
    obj.model.load_state_dict(random_weights(cfg, seed=1, std=0.15))
    with torch.no_grad():
        obj.mask_row.copy_(torch.randn(H))  # a trained row, unlike the table's
    g = torch.Generator().manual_seed(2)
    b, s = 2, 40
    tokens = torch.randint(0, 256, (b, s), generator=g)
    hidden = torch.randn(b, s, len(CONTEXT_LAYERS) * H, generator=g)
    anchors = torch.tensor([[3, 17, 30, 35, 1], [0, 9, 10, 26, 34]])  # unsorted, adjacent, 0
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        got = obj(tokens, hidden, anchors, keep)  # [B, N, D, V]
    drafter = DFlashDrafter(obj.model, TableTarget(obj), max_streams=10, max_context=64)
    sids = [(i, j) for i in range(b) for j in range(anchors.shape[1])]
    for i, j in sids:
        a = int(anchors[i, j])
        drafter.add_stream((i, j), tokens[i, :a].tolist(), hidden[i, :a])
    bonus = torch.stack([tokens[i, anchors[i, j]] for i, j in sids])
    want = drafter.draft(sids, bonus)  # [B*N, D, V]
    assert got.shape == (b, anchors.shape[1], cfg.depth, V)
    torch.testing.assert_close(got.reshape(want.shape), want, atol=1e-5, rtol=1e-5)


def test_block_sees_its_context_and_itself_only():
    anchors, keep = torch.tensor([[2, 5]]), torch.tensor([[True, True]])
    vis = block_visibility(anchors, keep, seq_len=8, block=3, window=None)[0]  # [6, 8 + 6]
    ctx, blocks = vis[:, :8], vis[:, 8:]
    assert ctx[:3].sum(1).tolist() == [2, 2, 2] and ctx[3:].sum(1).tolist() == [5, 5, 5]
    assert torch.equal(blocks, torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool())
    slid = block_visibility(anchors, keep, seq_len=8, block=3, window=3)[0, 3:, :8]
    assert [r.nonzero().flatten().tolist() for r in slid] == [[3, 4], [4], []]  # p > 5+j-3


def test_anchors_are_distinct_and_have_a_target_label():
    prompt_lens, lengths = torch.tensor([4, 10]), torch.tensor([12, 13])
    gen = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchors(prompt_lens, lengths, 13, 6, gen)
    assert keep.sum(1).tolist() == [6, 3]  # row 1 has only anchors 9, 10, 11
    for a, k, p, n in zip(anchors, keep, prompt_lens, lengths, strict=True):
        chosen = a[k].tolist()
        assert len(set(chosen)) == len(chosen) and all(p - 1 <= x <= n - 2 for x in chosen)
    labels, valid = block_labels(torch.arange(13).expand(2, 13), lengths, anchors, keep, 4)
    assert torch.equal(labels[valid], (anchors[:, :, None] + torch.arange(1, 5))[valid])
    within = anchors[:, :, None] + torch.arange(1, 5) < lengths[:, None, None]  # [B, N, D]
    assert torch.equal(valid, keep[:, :, None] & within)


# ---- (b) training lowers the loss -----------------------------------------------------------


def _fixed_loss(obj: DraftObjective, data: DraftData) -> float:
    gen = torch.Generator().manual_seed(123)
    anchors, keep = sample_anchors(data.prompt_lens, data.lengths, data.tokens.shape[1], 8, gen)
    labels, valid = block_labels(data.tokens, data.lengths, anchors, keep, obj.cfg.depth)
    with torch.no_grad():
        return float(
            block_loss(obj(data.tokens, data.hidden, anchors, keep), labels, valid, 7.0)[0]
        )


def test_few_steps_reduce_the_loss(target, data):
    obj, _ = objective(target)
    before = _fixed_loss(obj, data)
    row = obj.mask_row.detach().clone()
    cfg = TrainConfig(batch=8, anchors=8, lr=3e-3, warmup_steps=5, log_every=10)
    records = train(obj, data, cfg, seconds=60, autocast=False, log=lambda m: None, max_steps=30)
    assert records[-1]["step"] == 30
    assert _fixed_loss(obj, data) < before - 0.3
    assert not torch.equal(obj.mask_row.detach(), row)  # the mask embedding is trained


# ---- (c) the written checkpoint serves ------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, target, data):
    """A drafter trained briefly, written, and the exported INT4 target patched with its row."""
    from ddserve.train.export import export

    tmp = tmp_path_factory.mktemp("served")
    obj, raw = objective(target, block_size=6)
    cfg = TrainConfig(batch=8, anchors=8, lr=3e-3, warmup_steps=5, log_every=10)
    train(obj, data, cfg, seconds=60, autocast=False, log=lambda m: None, max_steps=40)
    model_dir = export(target, tmp / "target", tokenizer_dir=None, int4=True)
    drafter_dir = save_drafter(obj, raw, tmp / "drafter")
    patch_target(model_dir, save_mask_embedding(obj, tmp / "mask_embedding.safetensors"))
    return obj, model_dir, drafter_dir


def test_trained_checkpoint_serves_with_ddtree_equal_to_greedy(served, data):
    from ddserve.sampling import SamplingParams
    from tests.engine_helpers import make_runner, run_all

    obj, model_dir, drafter_dir = served
    loaded = load_dflash_model(drafter_dir, ModelConfig.from_hf(model_dir), dtype=torch.float32)
    for name, t in obj.model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], t.to(torch.bfloat16).float())
    prompts = [data.tokens[i, :8].tolist() for i in range(3)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ar = run_all(make_runner(model_dir, 8), prompts, params, speculative=False)
    runner = make_runner(model_dir, 8, drafter=drafter_dir)
    row = runner.model.embed(torch.tensor([TINY_MASK_TOKEN_ID]))[0]
    trained = obj.mask_row.detach().to(torch.bfloat16)  # as the checkpoint stores it
    assert torch.equal(row, trained.to(row.dtype))  # the patched row is what the drafter reads
    assert run_all(runner, prompts, params, speculative=True) == ar


def test_heldout_walk_commits_what_the_engine_commits(served, data):
    """step_commits, run on the engine's own greedy output, predicts every DDTree step's
    committed count (the target as served: the INT4 checkpoint; the drafter's bf16 weights)."""
    from ddserve.sampling import SamplingParams
    from ddserve.train.drafter_data import step_commits
    from tests.engine_helpers import make_runner, run_all

    obj, model_dir, drafter_dir = served
    budget, p, new = 4, 8, 30
    runner = make_runner(model_dir, budget, drafter=drafter_dir)
    commits: dict[int, list[int]] = {}
    commit_many = runner.drafter.commit_many

    def spy(items):  # the engine commits every stream of a step in one call
        for sid, ids, _ in items:
            commits.setdefault(sid, []).append(len(ids))
        return commit_many(items)

    runner.drafter.commit_many = spy
    prompts = [data.tokens[i, :p].tolist() for i in range(4)]
    out = run_all(runner, prompts, SamplingParams(max_tokens=new, ignore_eos=True), True)
    served_target = TrainTarget.from_checkpoint(model_dir)
    seqs = torch.tensor([q + o for q, o in zip(prompts, out, strict=True)])  # [B, P+G]
    with torch.no_grad():
        hidden = torch.cat(served_target(seqs, CONTEXT_LAYERS)[1], dim=-1)  # [B, P+G, k*H]
    n = len(prompts)
    heldout = DraftData(seqs, hidden, torch.full((n,), p), torch.full((n,), p + new))
    as_served = load_dflash_model(drafter_dir, served_target.cfg, dtype=torch.float32)
    emb, head = served_target.model.embed_tokens.weight, served_target.lm_head.weight
    drafter = DraftObjective(as_served, emb, head)  # the patched row is the table's row
    walked, _ = step_commits(drafter, heldout, drafter.cfg.depth, [budget])
    for sid, steps in enumerate(walked[f"budget_{budget}"]):
        assert steps == commits[sid][: len(steps)]
    assert max(max(s) for s in walked[f"budget_{budget}"]) > 1  # some drafts were accepted


def test_patch_target_changes_only_the_mask_row(tmp_path, target):
    from ddserve.train.export import export, read_checkpoint

    obj, _ = objective(target)
    with torch.no_grad():
        obj.mask_row.fill_(0.5)
    model_dir = export(target, tmp_path / "target", tokenizer_dir=None, int4=True)
    _, before = read_checkpoint(model_dir)
    patch_target(model_dir, save_mask_embedding(obj, tmp_path / "m.safetensors"))
    _, after = read_checkpoint(model_dir)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed == ["model.embed_tokens.weight"]
    diff = (before[changed[0]] != after[changed[0]]).any(1).nonzero().flatten().tolist()
    assert diff == [TINY_MASK_TOKEN_ID] and after[changed[0]][TINY_MASK_TOKEN_ID].eq(0.5).all()


# ---- measuring ------------------------------------------------------------------------------


def _oracle(data: DraftData, depth: int, wrong_from: int | None = None):
    """Draft logits that put the target's own next tokens first (wrong from a depth on)."""

    def logits_fn(tokens, hidden, anchors, keep):
        at = anchors[:, :, None] + torch.arange(1, depth + 1)  # [B, N, D]
        labels = tokens.gather(1, at.clamp(max=tokens.shape[1] - 1).flatten(1)).view(at.shape)
        if wrong_from is not None:
            labels[:, :, wrong_from - 1 :] = (labels[:, :, wrong_from - 1 :] + 1) % V
        return torch.nn.functional.one_hot(labels, V).float() * 10  # [B, N, D, V]

    return logits_fn


def test_acceptance_of_a_perfect_drafter_is_a_full_block(data):
    depth = 4
    full = acceptance(_oracle(data, depth), data, depth, budgets=[1, 4])
    assert full["acc_per_depth"] == [1.0] * depth
    assert full["committed_per_step"] == {"chain": 5.0, "budget_1": 2.0, "budget_4": 5.0}
    two = acceptance(_oracle(data, depth, wrong_from=3), data, depth, budgets=[4])
    assert two["committed_per_step"]["chain"] == 3.0  # 2 accepted + the bonus


def test_cli_writes_a_loadable_drafter_and_a_report(tmp_path, target):
    """The whole command at toy scale: corpus tar, byte tokenizer, exported INT4 target."""
    import io
    import tarfile

    from ddserve.tokenizer import write_byte_tokenizer
    from ddserve.train.drafter import main
    from ddserve.train.export import export

    tok_dir = tmp_path / "tok"
    write_byte_tokenizer(tok_dir)
    corpus = tmp_path / "corpus.tar.xz"
    with tarfile.open(corpus, "w:xz") as tar:
        for split in ("train", "eval"):
            text = ("def f(x):\n    return x + 1\n" * 40).encode()
            info = tarfile.TarInfo(f"{split}/src/a.py")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    model_dir = export(target, tmp_path / "target", tokenizer_dir=tok_dir, int4=True)
    out = tmp_path / "run"
    main(["--target", str(model_dir), "--corpus", str(corpus), "--tokenizer", str(tok_dir),
          "--out", str(out), "--num-seqs", "8", "--eval-seqs", "4", "--prompt-lens", "8,16",
          "--new-tokens", "12", "--gen-batch", "4", "--layers", "1", "--intermediate", "64",
          "--block-size", "4", "--batch", "4", "--anchors", "4", "--max-steps", "3",
          "--budgets", "1,4", "--device", "cpu"])  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert report["train_log"][-1]["step"] == 3 and report["data"]["sequences"] == 8
    assert set(report["heldout_acceptance"]["committed_per_step"]) == {
        "chain", "budget_1", "budget_4"
    }  # fmt: skip
    loaded = load_dflash_model(out / "drafter", ModelConfig.from_hf(model_dir))
    assert loaded.cfg.mask_token_id == TINY_MASK_TOKEN_ID and loaded.cfg.block_size == 4
    assert (out / "mask_embedding.safetensors").exists() and (out / "log.txt").exists()
