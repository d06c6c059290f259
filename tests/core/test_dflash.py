"""DFlash drafter: incremental context ring == recompute; module == a plain re-statement of the
DFlash forward; checkpoint validation against the target (engine tests: test_dflash_engine.py)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ddserve.config import ModelConfig
from ddserve.drafter import DFlashDrafter, DFlashModel, DrafterConfig, DrafterMismatch
from ddserve.drafter.loader import load_drafter
from ddserve.drafter.rope import rope_inv_freq
from ddserve.drafter.tiny import random_weights, write_tiny_drafter
from ddserve.stacked import stacked_rows

H, V, TARGET_LAYERS, MASK = 64, 300, 5, 290


def target_cfg(**over) -> ModelConfig:
    raw = dict(
        model_type="deepseek_v3", hidden_size=H, num_hidden_layers=TARGET_LAYERS, vocab_size=V,
        num_attention_heads=4, n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
    )  # fmt: skip
    return ModelConfig.from_hf({**raw, **over})


def drafter_raw(layer_types=("sliding_attention", "sliding_attention"), window=16, **over) -> dict:
    """A published-layout DFlash config.json; target_layer_ids unsorted on purpose."""
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
        "intermediate_size": 96, "num_hidden_layers": len(layer_types), "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": V,
        "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        "block_size": 5, "num_target_layers": TARGET_LAYERS,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [3, 0]},
        "layer_types": list(layer_types), "use_sliding_window": window is not None,
        "sliding_window": window,
    }  # fmt: skip
    raw.update(over)
    return raw


class FakeTarget:
    """Random embedding + lm_head standing in for the target model's `embed` / `lm_logits`."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(V, H, generator=g)
        self.head = torch.randn(V, H, generator=g) / math.sqrt(H)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb[ids]

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        return h.float() @ self.head.T


def make_model(raw: dict, seed: int = 0) -> tuple[DFlashModel, dict[str, torch.Tensor]]:
    cfg = DrafterConfig.from_hf(raw)
    weights = random_weights(cfg, seed=seed, std=0.15)
    model = DFlashModel(cfg)
    model.load_state_dict(weights)
    return model, weights


def capture(states: dict[int, torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor:
    """What the target hands over: its captured layers (sorted, unique) concatenated."""
    return torch.cat([states[i] for i in layers], dim=-1)


# --------------------------------------------------------------------------------------------
# The DFlash forward, restated in one plain function (float64, no cache, no module).
# --------------------------------------------------------------------------------------------


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_dflash(w, raw, states, bonus, target):
    """Per-depth logits [D, V] of one stream whose committed context is `states` (target layer id
    -> [n, H] hidden states of positions 0..n-1); the block [bonus, MASK x D] sits at n..n+D."""
    w = {k: t.double() for k, t in w.items()}
    ids, nh, nkv, hd = raw["dflash_config"]["target_layer_ids"], 4, 2, raw["head_dim"]
    n, q_len = next(iter(states.values())).shape[0], raw["block_size"]
    hf = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    inv_freq, attn_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")

    def rope(x, pos):  # x [T, heads, hd]
        ang = pos.double()[:, None] * inv_freq.double()[None]
        cos = torch.cat([ang.cos()] * 2, -1)[:, None] * attn_factor
        sin = torch.cat([ang.sin()] * 2, -1)[:, None] * attn_factor
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    ctx = torch.cat([states[i].double() for i in ids], -1) @ w["fc.weight"].T
    ctx = rms(ctx, w["hidden_norm.weight"])  # [n, H]
    x = target.emb[[int(bonus)] + [MASK] * (q_len - 1)].double()  # [Q, H]
    q_pos, k_pos = torch.arange(n, n + q_len), torch.arange(n + q_len)
    for layer, kind in enumerate(raw["layer_types"]):
        p = f"layers.{layer}."
        hn = rms(x, w[p + "input_layernorm.weight"])
        q = rms(
            (hn @ w[p + "self_attn.q_proj.weight"].T).view(q_len, nh, hd),
            w[p + "self_attn.q_norm.weight"],
        )
        kv_in = torch.cat([ctx, hn])  # context first, then the block
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd)
        k = rope(rms(k, w[p + "self_attn.k_norm.weight"]), k_pos).repeat_interleave(nh // nkv, 1)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        v = v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", rope(q, q_pos), k) / math.sqrt(hd)
        if kind == "sliding_attention":
            dist = q_pos[:, None] - k_pos[None, :]
            scores = scores.masked_fill(
                (dist >= raw["sliding_window"]) | (-dist >= raw["sliding_window"]), -math.inf
            )
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q_len, nh * hd)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        hn = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = hn @ w[p + "mlp.gate_proj.weight"].T, hn @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["norm.weight"])
    return x[1:] @ target.head.double().T  # [D, V]


CASES = {
    "sliding": dict(layer_types=("sliding_attention", "sliding_attention"), window=16),
    "mixed": dict(layer_types=("sliding_attention", "full_attention"), window=16),
    "full": dict(layer_types=("full_attention", "full_attention"), window=None),
}


@pytest.mark.parametrize("stacked", [False, True], ids=["layer-by-layer", "stacked-kv"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_module_matches_plain_restatement(case, stacked):
    raw = drafter_raw(**CASES[case])
    model, w = make_model(raw)
    if stacked:  # context k/v of every layer in one matmul, as a loaded drafter runs
        model.stack_context_kv()
    target = FakeTarget()
    drafter = DFlashDrafter(model, target, max_streams=3, max_context=256)
    g = torch.Generator().manual_seed(1)
    lengths = {"short": 6, "wrapped": 41, "long": 90}  # window 16: two of these wrap the ring
    states = {
        s: {i: torch.randn(n, H, generator=g) for i in range(TARGET_LAYERS)}
        for s, n in lengths.items()
    }
    for sid, st in states.items():
        drafter.add_stream(sid, [0] * lengths[sid], capture(st, drafter.capture_layers))
    bonus = torch.tensor([7, 123, 260])
    got = drafter.draft(list(states), bonus)  # [3, D, V]
    assert got.shape == (3, raw["block_size"] - 1, V)
    for b, st in enumerate(states.values()):
        want = reference_dflash(w, raw, st, bonus[b], target)
        torch.testing.assert_close(got[b].double(), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("stacked", [False, True], ids=["layer-by-layer", "stacked-kv"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_incremental_context_equals_recompute(case, stacked):
    """Many steps with random acceptance (1..block_size tokens committed, per stream or batched
    by `commit_many`), streams joining and leaving, batches in shuffled order: the ring gives what
    a fresh drafter given the whole history gives, including long after the window wrapped."""
    raw = drafter_raw(**CASES[case])
    model, _ = make_model(raw, seed=3)
    if stacked:
        model.stack_context_kv()
    target = FakeTarget(seed=1)
    inc = DFlashDrafter(model, target, max_streams=4, max_context=512)
    rng, g = random.Random(0), torch.Generator().manual_seed(2)
    k = len(inc.capture_layers)
    history: dict[str, torch.Tensor] = {}
    next_sid = 0
    for step in range(28):
        if len(history) < 3 or (step % 9 == 4):
            if len(history) == 4:
                gone = rng.choice(sorted(history))
                inc.remove_stream(gone)
                del history[gone]
            sid, next_sid = f"s{next_sid}", next_sid + 1
            history[sid] = torch.randn(rng.randint(1, 20), k * H, generator=g)
            inc.add_stream(sid, [0] * history[sid].shape[0], history[sid])
        news = {
            sid: torch.randn(rng.randint(1, raw["block_size"]), k * H, generator=g)
            for sid in history
        }
        if step % 2:  # one stream at a time, or all in one batched commit
            for sid, new in news.items():
                inc.commit(sid, [0] * new.shape[0], new)
        else:
            inc.commit_many([(sid, [0] * new.shape[0], new) for sid, new in news.items()])
        for sid, new in news.items():
            history[sid] = torch.cat([history[sid], new])
        sids = rng.sample(sorted(history), len(history))
        bonus = torch.randint(0, V, (len(sids),), generator=g)
        got = inc.draft(sids, bonus)
        for b, sid in enumerate(sids):
            fresh = DFlashDrafter(model, target, max_streams=1, max_context=512)
            fresh.add_stream(sid, [0] * history[sid].shape[0], history[sid])
            want = fresh.draft([sid], bonus[b : b + 1])[0]
            torch.testing.assert_close(got[b], want, atol=1e-4, rtol=1e-4)
    assert max(h.shape[0] for h in history.values()) > 3 * 16  # the ring wrapped several times


def test_stacked_context_kv_is_the_layer_by_layer_result():
    """`stack_context_kv` rebinds the layers' k/v projections to views of one buffer (same
    values, the old tensors' memory released) and `context_kv` then computes every layer's in one
    matmul: the same k and v as layer by layer. A projection replaced afterwards (a reload)
    turns the stacked path off, and the result follows the new weight."""
    raw = drafter_raw(**CASES["mixed"])
    model, _ = make_model(raw, seed=4)
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(11, len(model.cfg.target_layer_ids) * H, generator=g)
    pos = torch.arange(30, 41)
    want_k, want_v = model.context_kv(hidden, pos)  # layer by layer
    batch = hidden.view(1, 11, -1).expand(2, 11, -1), pos.expand(2, 11)  # training's shapes
    want_bk, _ = model.context_kv(*batch)
    before = [m.weight.detach().clone() for m in model._kv_projections()]
    assert model._stacked_kv() is None
    model.stack_context_kv()
    stacked = model._stacked_kv()
    assert stacked is not None and stacked.shape == (sum(w.shape[0] for w in before), H)
    projections = zip(model._kv_projections(), before, strict=True)
    assert all(torch.equal(m.weight, w) for m, w in projections)
    k, v = model.context_kv(hidden, pos)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v, want_v, atol=1e-6, rtol=1e-6)
    bk, bv = model.context_kv(*batch)  # [L, B, T, KVH, Dh]
    torch.testing.assert_close(bk, want_bk, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(bv[:, 1], want_v, atol=1e-6, rtol=1e-6)
    model.requires_grad_(True)  # training: every weight must get its gradient, so layer by layer
    assert model._stacked_kv() is None
    with torch.no_grad():
        assert model._stacked_kv() is not None
    model.requires_grad_(False)
    attn = model.layers[1].self_attn
    attn.v_proj.weight = nn.Parameter(attn.v_proj.weight.detach() * 2, requires_grad=False)
    assert model._stacked_kv() is None
    k2, v2 = model.context_kv(hidden, pos)
    torch.testing.assert_close(k2, want_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v2[1], want_v[1] * 2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v2[0], want_v[0], atol=1e-6, rtol=1e-6)


def test_commit_many_of_a_stream_twice_or_of_none_is_sequential_commits():
    """A stream listed twice gets both commits in order; an empty batch changes nothing."""
    raw = drafter_raw(**CASES["sliding"])
    model, _ = make_model(raw, seed=3)
    target, g = FakeTarget(seed=1), torch.Generator().manual_seed(5)
    many = DFlashDrafter(model, target, max_streams=2, max_context=512)
    one = DFlashDrafter(model, target, max_streams=2, max_context=512)
    k = len(many.capture_layers)
    first, a, b = (torch.randn(n, k * H, generator=g) for n in (6, 3, 2))
    for d in (many, one):
        d.add_stream("s", [0] * 6, first)
    many.commit_many([])
    many.commit_many([("s", [0] * 3, a), ("s", [0] * 2, b)])
    one.commit("s", [0] * 3, a)
    one.commit("s", [0] * 2, b)
    assert many.cache.length("s") == one.cache.length("s") == 11
    bonus = torch.tensor([4])
    torch.testing.assert_close(many.draft(["s"], bonus), one.draft(["s"], bonus))


@pytest.mark.parametrize("stacked", [False, True], ids=["layer-by-layer", "stacked-kv"])
def test_block_commit_rows_equal_commit_many(stacked):
    """`commit_rows` (the pure tensor code a CUDA graph replays for `commit_block`): every row
    of a fixed [B, W] block through the context forward, the first count of each stream kept,
    the rest of its ring rewritten with its own values. Its ring and lengths equal
    `commit_many`'s step after step, as the ring wraps (window 16, 6 rows a block), with the
    capture layers reordered for `fc`; the eager `commit_block` (CPU) is `commit_many`."""
    raw = drafter_raw(**CASES["sliding"])
    model, _ = make_model(raw, seed=6)
    if stacked:
        model.stack_context_kv()
    target, g = FakeTarget(seed=2), torch.Generator().manual_seed(8)
    many, rows_ = (DFlashDrafter(model, target, max_streams=3, max_context=64) for _ in "ab")
    block = DFlashDrafter(model, target, max_streams=3, max_context=64)
    assert many._order is not None  # target_layer_ids [3, 0]: reordered for fc
    k, sids, w = len(many.capture_layers), ["x", "y", "z"], 6
    for sid, n in zip(sids, (5, 14, 1), strict=True):
        first = torch.randn(n, k * H, generator=g)
        for d in (many, rows_, block):
            d.add_stream(sid, [0] * n, first)
    rng = random.Random(3)
    for _ in range(7):
        # a view into a wider buffer, as the commit graphs' shared static input is
        hidden = torch.randn(4, w + 2, k * H, generator=g)[:3, :w]
        counts = [rng.randint(1, w) for _ in sids]
        toks = [[0] * c for c in counts]
        pairs = enumerate(zip(sids, toks, strict=True))
        many.commit_many([(s, t, hidden[i, : len(t)]) for i, (s, t) in pairs])
        block.commit_block(sids, toks, hidden)
        starts = [rows_.cache.length(s) for s in sids]
        with torch.inference_mode():
            rows_.commit_rows(hidden, rows_.cache.rows(sids), torch.tensor(starts),
                              torch.tensor(counts))  # fmt: skip
        for s, n, c in zip(sids, starts, counts, strict=True):
            rows_.cache.set_length(s, n + c)
        for d in (rows_, block):
            torch.testing.assert_close(d.cache.k, many.cache.k, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(d.cache.v, many.cache.v, atol=1e-6, rtol=1e-6)
            assert torch.equal(d.cache.lengths, many.cache.lengths)
            assert [d.cache.length(s) for s in sids] == [many.cache.length(s) for s in sids]
    assert many.cache.length("y") > 2 * many.cache.capacity  # the ring wrapped
    bonus = torch.tensor([3, 4, 5])
    torch.testing.assert_close(rows_.draft(sids, bonus), many.draft(sids, bonus))
    with pytest.raises(ValueError, match="below"):
        rows_.cache.set_length("x", 0)


def test_step_commit_state_then_advance_equals_commit_many():
    """`commit_state` (the commit a verify graph runs after its acceptance) at the streams'
    device lengths, padded as a graph pads its batch: a padding block at the spare `pad_row`
    and a block with count 0 (a sampled batch's flag) commit nothing. After the host's
    `advance`, ring and lengths equal `commit_many`'s, step after step as the ring wraps; the
    spare row stays empty. `rewind` undoes a commit the host never advanced."""
    raw = drafter_raw(**CASES["sliding"])
    model, _ = make_model(raw, seed=6)
    target, g = FakeTarget(seed=2), torch.Generator().manual_seed(9)
    many, step = (DFlashDrafter(model, target, max_streams=3, max_context=64) for _ in "ab")
    assert step.step_commits and step.pad_row == 3 and step.cache.k.shape[1] == 4
    k, sids, w = len(many.capture_layers), ["x", "y", "z"], 6
    for sid, n in zip(sids, (5, 14, 1), strict=True):
        first = torch.randn(n, k * H, generator=g)
        for d in (many, step):
            d.add_stream(sid, [0] * n, first)
    rows = torch.tensor([*step.cache.row_ids(sids), step.pad_row])  # [4]: 3 streams + padding
    rng = random.Random(4)
    for i in range(7):
        hidden = torch.randn(4, w, k * H, generator=g)
        counts = [rng.randint(1, w) for _ in sids]
        flags = [1, 1, 1, 0] if i % 3 else [1, 0, 1, 0]  # stream y sits out some steps
        toks = [[0] * c for c, f in zip(counts, flags, strict=False) if f]
        live = [s for s, f in zip(sids, flags, strict=False) if f]
        many.commit_many([
            (s, [0] * c, hidden[j, :c])
            for j, (s, c, f) in enumerate(zip(sids, counts, flags, strict=False)) if f
        ])  # fmt: skip
        step.commit_state(rows, hidden, torch.tensor([*counts, 5]) * torch.tensor(flags))
        step.advance(live, toks)
        torch.testing.assert_close(step.cache.k, many.cache.k, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(step.cache.v, many.cache.v, atol=1e-6, rtol=1e-6)
        assert torch.equal(step.cache.lengths, many.cache.lengths)
        assert [step.cache.length(s) for s in sids] == [many.cache.length(s) for s in sids]
    assert many.cache.length("y") > many.cache.capacity  # the ring wrapped
    assert step.cache.lengths[step.pad_row] == 0 and not step.cache.k[:, step.pad_row].any()
    before = step.cache.lengths.clone()
    step.commit_state(rows, torch.randn(4, w, k * H, generator=g), torch.tensor([2, 3, 1, 0]))
    assert not torch.equal(step.cache.lengths, before)
    step.rewind(sids)
    assert torch.equal(step.cache.lengths, before)


def test_grouped_attention_is_torch_sdpa_with_gqa():
    """The drafter's attention (explicit matmuls, a KV head's query heads as one block of rows)
    against torch's scaled_dot_product_attention with enable_gqa and the same boolean mask."""
    from ddserve.drafter.layers import grouped_attention

    g = torch.Generator().manual_seed(4)
    b, q_len, nh, kvh, d, keys = 3, 6, 8, 2, 16, 29
    q = torch.randn(b, q_len, nh, d, generator=g)
    k, v = (torch.randn(b, kvh, keys, d, generator=g) for _ in "kv")
    visible = torch.rand(b, q_len, keys, generator=g) > 0.4
    visible[..., -q_len:] = True  # every query sees the block
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None],
                                          enable_gqa=True)  # fmt: skip
    got = grouped_attention(q, k, v, visible)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(b, q_len, nh * d))


def test_sliding_drafter_keeps_only_its_window():
    raw = drafter_raw(**CASES["sliding"])
    model, _ = make_model(raw)
    drafter = DFlashDrafter(model, FakeTarget(), max_streams=2)
    assert drafter.cache.capacity == 16 and drafter.depth == raw["block_size"] - 1
    assert drafter.capture_layers == (0, 3)


def test_yarn_frequencies_match_transformers():
    raw = drafter_raw()
    raw["rope_scaling"] = dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=256,
        mscale=1.0, mscale_all_dim=0.7, beta_fast=16, beta_slow=2,
    )  # fmt: skip
    hf = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    inv, factor = rope_inv_freq(DrafterConfig.from_hf(raw).rope, raw["head_dim"])
    torch.testing.assert_close(inv, want_inv.float())
    assert factor == pytest.approx(want_factor)


# --------------------------------------------------------------------------------------------
# Loading and validation against the target
# --------------------------------------------------------------------------------------------


def test_tiny_drafter_round_trips_through_the_loader(tmp_path):
    tcfg = target_cfg(hidden_size=256, vocab_size=264)
    write_tiny_drafter(tmp_path, tcfg, seed=5, sliding_window=64)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["dflash_config"]["mask_token_id"] == 260 and raw["block_size"] == 8
    drafter = load_drafter(tmp_path, tcfg, FakeTarget(), max_streams=2, dtype=torch.float32)
    stored = load_file(str(tmp_path / "model.safetensors"))
    for name, t in drafter.model.state_dict().items():
        torch.testing.assert_close(t, stored[name].float())
    assert drafter.cache.capacity == 64
    assert all(0 <= i < tcfg.num_hidden_layers for i in drafter.capture_layers)
    assert drafter.model._stacked_kv() is not None  # the loader stacks the k/v projections
    mlps = [layer.mlp for layer in drafter.model.layers]  # and each MLP's gate and up
    assert all(stacked_rows(m.gate_proj.weight, m.up_proj.weight) is not None for m in mlps)


@pytest.mark.parametrize(
    "target_over, drafter_over, named",
    [
        (
            {},
            {"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [0, 5]}},
            "target_layer_ids",
        ),
        ({"num_hidden_layers": 3}, {"num_target_layers": None}, "target_layer_ids"),
        ({"hidden_size": 128}, {}, "hidden_size"),
        ({"vocab_size": 200}, {}, "mask_token_id"),
        ({"num_hidden_layers": 6}, {}, "num_target_layers"),
    ],
)
def test_mismatched_drafter_is_rejected_at_load(tmp_path, target_over, drafter_over, named):
    raw = drafter_raw(**drafter_over)
    model, w = make_model(drafter_raw())
    save_file(w, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterMismatch, match=named):
        load_drafter(tmp_path, target_cfg(**target_over), FakeTarget(), max_streams=1)


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    raw = drafter_raw()
    _, w = make_model(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(
        {k: v for k, v in w.items() if k != "layers.1.mlp.up_proj.weight"},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(DrafterMismatch, match="layers.1.mlp.up_proj.weight"):
        load_drafter(tmp_path, target_cfg(), FakeTarget(), max_streams=1)
    w["fc.weight"] = w["fc.weight"][:, :H].contiguous()
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterMismatch, match="fc.weight"):
        load_drafter(tmp_path, target_cfg(), FakeTarget(), max_streams=1)


def test_published_config_layout_parses():
    """transformers-5 `rope_parameters`, block_size inside dflash_config, default layer ids."""
    raw = drafter_raw()
    del raw["rope_scaling"], raw["rope_theta"], raw["block_size"]
    raw["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    raw["dflash_config"] = {"mask_token_id": MASK, "block_size": 16}
    raw["num_target_layers"] = 36
    cfg = DrafterConfig.from_hf(raw)
    assert cfg.block_size == 16 and cfg.rope.theta == 500000.0 and cfg.rope.kind == "default"
    assert cfg.target_layer_ids == (1, 33)  # round(1 + i*(36-4)/(2-1))


def test_stacked_mlp_is_the_two_projections_and_trains_both():
    """`DFlashModel.stack`'s MLP (one matmul over gate and up, `backend.silu_mul`) gives the
    separate projections' output; where gradients are wanted both weights get theirs (the
    stacked tensor views the gate weight alone, so training computes them separately)."""
    model, _ = make_model(drafter_raw(), seed=6)
    mlp = model.layers[0].mlp
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(1))
    want = mlp(x)
    model.stack()
    assert stacked_rows(mlp.gate_proj.weight, mlp.up_proj.weight) is not None
    torch.testing.assert_close(mlp(x), want, atol=1e-6, rtol=1e-6)
    model.requires_grad_(True)
    mlp(x).square().sum().backward()
    assert mlp.gate_proj.weight.grad is not None and mlp.up_proj.weight.grad is not None
    assert mlp.up_proj.weight.grad.abs().sum() > 0


def test_ring_context_without_triton_gathers_the_rows(monkeypatch):
    """A drafter asked to read its ring in place where the kernel does not import gathers the
    rows itself: the same draft logits as the gathered path."""
    from ddserve.kernels import backend

    asked = []
    ring_attention = backend.ring_attention
    monkeypatch.setattr(backend, "ring_attention",
                        lambda *a, **k: asked.append(1) or ring_attention(*a, **k))  # fmt: skip
    monkeypatch.setattr(backend, "_triton_module", lambda name: None)
    model, _ = make_model(drafter_raw(), seed=2)
    drafter = DFlashDrafter(model, FakeTarget(), max_streams=2)
    g = torch.Generator().manual_seed(0)
    width = len(drafter.capture_layers) * H
    for sid, n in (("a", 20), ("b", 3)):
        drafter.add_stream(sid, [1] * n, torch.randn(n, width, generator=g))
    rows, bonus = torch.tensor(drafter.state_rows(["a", "b"])), torch.tensor([4, 8])
    want = drafter.draft_rows(rows, bonus)
    assert not asked
    drafter.ring_attention = True
    assert torch.equal(drafter.draft_rows(rows, bonus), want)
    assert len(asked) == len(model.layers)  # asked for the ring kernel, got None, gathered
