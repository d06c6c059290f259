"""TrainTarget (ddserve/train) is ddserve's model: an exported checkpoint serves the same logits."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from model_utils import make_meta, prefill, rel_err

from ddserve.model.loader import load_model
from ddserve.train.export import MAX_SHARD_BYTES, export
from ddserve.train.shapes import TARGET_CONFIG, target_config
from ddserve.train.target_model import TrainTarget, fake_int4

VOCAB = 264
PROMPTS = [[5, 100, 17, 250, 3, 3, 90, 91, 92, 7, 8, 200], [1, 2, 3, 4, 5, 6, 7], [42] * 9]


def _tiny_config() -> dict:
    return target_config(tiny=True, vocab_size=VOCAB, bos_token_id=256, eos_token_id=257)


def _trained(seed: int = 0, steps: int = 3) -> TrainTarget:
    """A tiny model after a few AdamW steps (routing bias moved too), in eval mode."""
    torch.manual_seed(seed)
    model = TrainTarget.from_config(_tiny_config(), seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 33))
        logits, _ = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        model.update_routing_bias(0.05)
    return model.eval()


def _round_to_bf16(model: TrainTarget) -> None:
    """What the export does to every parameter (the routing bias stays float32)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def _logits(model: TrainTarget, prompts=PROMPTS) -> torch.Tensor:  # [sum T, V]
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p]))[0][0] for p in prompts])


@pytest.fixture(scope="module")
def trained() -> TrainTarget:
    return _trained()


@pytest.fixture(scope="module", params=[False, True], ids=["bf16_experts", "int4_experts"])
def exported(request, trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("int4" if request.param else "bf16")
    export(trained, out, None, int4=request.param)
    return out, request.param


def test_shapes_are_the_issue_13_target():
    cfg = TrainTarget(TARGET_CONFIG).cfg
    model = TrainTarget(TARGET_CONFIG)
    total = sum(p.numel() for p in model.parameters())
    assert 19e6 < total < 23e6, total
    for tp in (1, 2, 4, 8):
        assert cfg.num_attention_heads % tp == 0 and cfg.vocab_size % tp == 0
        assert cfg.moe_intermediate_size % (32 * tp) == 0  # whole INT4 groups per rank


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_ddserve_logits_equal_traintarget_logits(exported, absorbed):
    path, _ = exported
    ref = _logits(TrainTarget.from_checkpoint(path))
    ours, _ = load_model(path, dtype=torch.float32, progress=False)
    logits, _ = prefill(ours, ours.new_kv_cache(3000), PROMPTS, absorbed=absorbed)
    assert rel_err(logits, ref) <= 1e-5


def test_bf16_export_is_the_bf16_rounding_of_the_trained_model(trained, tmp_path):
    export(trained, tmp_path, None, int4=False)
    rounded = _trained()
    _round_to_bf16(rounded)
    back = TrainTarget.from_checkpoint(tmp_path)
    for name, t in rounded.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    assert rel_err(_logits(back), _logits(rounded)) <= 1e-6


def test_qat_forward_equals_the_int4_checkpoint(tmp_path):
    model = _trained()
    _round_to_bf16(model)
    export(model, tmp_path, None, int4=True)
    model.set_qat(True)
    back = TrainTarget.from_checkpoint(tmp_path)
    assert rel_err(_logits(back), _logits(model)) <= 1e-6


def test_int4_export_changes_the_logits_only_a_little(trained, tmp_path):
    export(trained, tmp_path, None, int4=True)
    int4 = _logits(TrainTarget.from_checkpoint(tmp_path))
    assert 0 < rel_err(int4, _logits(trained)) < 0.1


def test_captured_hidden_states_are_what_ddserve_captures(exported):
    path, _ = exported
    layers = (2, 0)
    _, hidden = TrainTarget.from_checkpoint(path)(torch.tensor([PROMPTS[0]]), layers)
    ours, _ = load_model(path, dtype=torch.float32, progress=False)
    meta = make_meta([([], list(range(len(PROMPTS[0]))), None)])
    ids, pos = torch.tensor(PROMPTS[0]), torch.arange(len(PROMPTS[0]))
    out = ours(ids, pos, ours.new_kv_cache(64), meta, capture_layers=layers)
    assert rel_err(out.hidden, torch.cat([h[0] for h in hidden], dim=-1)) <= 1e-5


def test_export_shards_stay_under_the_limit(trained, tmp_path):
    export(trained, tmp_path, None, int4=False, max_shard_bytes=200_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and {p.name for p in shards} == set(index["weight_map"].values())
    assert all(p.stat().st_size <= 200_000 for p in shards)
    assert MAX_SHARD_BYTES < 16 * 2**20  # a device call returns files of at most 16 MiB
    load_model(tmp_path, dtype=torch.float32, progress=False)


def test_fake_int4_passes_gradients_straight_through():
    w = torch.randn(8, 64, requires_grad=True)
    q = fake_int4(w)
    q.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    groups = q.detach().unflatten(-1, (-1, 32)).flatten(0, 1)  # [R * C / 32, 32]
    assert (q - w).abs().max() > 0 and all(len(g.unique()) <= 16 for g in groups)


def _imbalance(gate) -> float:
    return float(gate.load.max() / gate.load.mean())


def test_bias_update_moves_expert_load_toward_balance():
    model = TrainTarget.from_config(_tiny_config(), seed=0).train()
    moe = model.moe_layers()[0]
    x = torch.randn(512, model.cfg.hidden_size) + 1.0
    with torch.no_grad():
        moe.gate.weight[0] = 0.05  # expert 0 scores high for every token
    ratios = []
    for _ in range(60):
        ids, weights = moe.gate(x)
        moe._routed(x, ids, weights)
        ratios.append(_imbalance(moe.gate))
        moe.gate.update_bias(0.01)
    assert ratios[0] > 3.0  # top-2 of 8: at most 4
    assert ratios[-1] < 0.5 * ratios[0], ratios[::10]
    assert moe.gate.e_score_correction_bias[0] < 0  # the overloaded expert was pushed down


def test_from_checkpoint_in_bf16_runs_close_to_float32(exported):
    path, _ = exported
    ids = torch.tensor([PROMPTS[0]])
    ref, _ = TrainTarget.from_checkpoint(path)(ids)
    model = TrainTarget.from_checkpoint(path, dtype=torch.bfloat16)
    logits, hidden = model(ids, capture_layers=(1,))
    assert logits.dtype == hidden[0].dtype == torch.bfloat16
    assert model.gates()[0].e_score_correction_bias.dtype == torch.float32
    assert rel_err(logits, ref) < 0.05
