"""Importance estimators and plan evaluation on small Mixtral models whose answers are known by
construction: a gate that can never pick an expert, an expert whose weights are all zero."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pwgpu.evaluate import MoeForward, ReferenceCache, evaluate_plan, uniform_plan  # noqa: E402
from pwgpu.importance import build_table, calibrate, oracle_kl  # noqa: E402

VOCAB, LAYERS, EXPERTS = 96, 2, 6
NEVER = (4, 5)  # experts of layer 0 with a zero gate row: see ``_checkpoint``
ZEROED = (1, 2)  # layer 1, expert 2 has all-zero weights


def _checkpoint(path):
    """A random 2-layer, 6-expert, top-2 Mixtral saved in bf16, with two built-in answers.

    Layer 0's gate rows are ``[a, -a, b, -b, 0, 0]``: for any input x one of ``+-a.x`` and one of
    ``+-b.x`` is positive, so the zero-logit experts 4 and 5 never make the top 2 (ties need x
    exactly orthogonal to a or b). Layer 1 expert 2 has all-zero weights: every precision stores
    it exactly, so it has no quantisation loss.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        sliding_window=None,
    )
    model = MixtralForCausalLM(cfg)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for k in sd:
        if "experts" in k or "embed" in k or "lm_head" in k:
            sd[k] = torch.randn_like(sd[k]) * (0.5 if "embed" in k else 0.08)
    a, b = torch.randn(64), torch.randn(64)
    gate = next(k for k in sd if k.startswith("model.layers.0.") and k.endswith("gate.weight"))
    sd[gate] = torch.stack([a, -a, b, -b, torch.zeros(64), torch.zeros(64)])
    experts = [k for k in sd if k.startswith("model.layers.1.") and "experts" in k]
    for k in experts:  # stacked [E, ...] tensors in transformers 5, per-expert modules in 4.x
        if sd[k].dim() == 3:
            sd[k][ZEROED[1]] = 0
        elif f"experts.{ZEROED[1]}." in k:
            sd[k].zero_()
    model.load_state_dict(sd)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return MoeForward(_checkpoint(tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return {"a": rng.integers(0, VOCAB, 512), "b": rng.integers(0, VOCAB // 2, 512)}


@pytest.fixture(scope="module")
def est(model, data):
    e = calibrate(model, data, tokens_per_domain=256, window=64, min_expert_tokens=4)
    oracle_kl(model, e, data, tokens_per_domain=128, window=128, experts=[(0, 0), (0, NEVER[0]), ZEROED, (1, 0)])
    return e


def test_forward_matches_transformers(model, tmp_path_factory):
    """The analysis forward pass is Mixtral's: same logits as MixtralForCausalLM in fp32."""
    from transformers import MixtralForCausalLM

    path = tmp_path_factory.mktemp("ckpt2")
    hf = MixtralForCausalLM.from_pretrained(_checkpoint(path), dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = MoeForward(path).logits(ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())


def test_routing_statistics_add_up(est):
    freq = est.counts / est.tokens
    np.testing.assert_allclose(freq.sum(axis=1), 2.0)  # top-2: two assignments per token
    np.testing.assert_allclose(est.weight_sum.sum(axis=1) / est.tokens, 1.0, rtol=1e-5)  # renormalised gates


def test_never_routed_expert_scores_zero(est):
    for e in NEVER:
        assert est.counts[0, e] == 0
        assert est.grad_var_sum[0, e] == 0 and est.weight_sum[0, e] == 0
        assert (est.fisher_token[0, e] == 0).all() and (est.fisher_seq[0, e] == 0).all()
        assert (est.output_error[0, e] == 0).all()
    assert (est.grad_var_sum[0, :4] > 0).all()
    assert est.oracle[0, NEVER[0]].max() == 0.0  # quantising it changes nothing


def test_zeroed_expert_has_no_quantisation_loss(est):
    layer, e = ZEROED
    assert est.counts[layer, e] > 0  # it is routed to, so a zero loss is not a zero count
    for name in ("fisher_token", "fisher_seq", "output_error"):
        assert (getattr(est, name)[layer, e] == 0).all(), name
    assert (est.oracle[layer, e] == 0).all()
    assert est.fisher_token[1, 0, -1] > 0 and est.oracle[1, 0, -1] > 0  # a normal expert does lose


def test_losses_grow_down_the_ladder(est):
    """Coarser integer formats lose more: int8 < int4 < int3 < int2 for every routed expert."""
    j = {p: est.ladder.index(p) for p in ("int8", "int4", "int3", "int2")}
    routed = est.counts > 0
    routed[ZEROED] = False
    for name in ("fisher_token", "output_error"):
        v = getattr(est, name)
        for lo, hi in (("int8", "int4"), ("int4", "int3"), ("int3", "int2")):
            assert (v[..., j[lo]][routed] < v[..., j[hi]][routed]).all(), (name, lo, hi)


def test_table_fallback_for_unrouted_experts(model, est):
    table, fallback = build_table(model, est, min_expert_tokens=4, model_name="t")
    assert {(layer, e) for layer, e, _ in fallback} >= {(0, NEVER[0]), (0, NEVER[1])}
    grid = table.grid(table.dloss)
    assert (grid[0, NEVER[0], 1:] > 0).all()  # a stand-in loss, not "free to drop to int2"
    assert table.grid(table.importance)[0, NEVER[0]] == 0  # the measured score stays what it is
    assert "fallback dloss for" in table.source and f"0:{NEVER[0]}(0)" in table.source
    assert table.bytes[0].tolist() == sorted(table.bytes[0].tolist(), reverse=True)


def test_eval_kl_zero_at_full_precision_and_grows(model, data):
    ref = ReferenceCache(model, {"a": data["a"][:256]}, 128)
    kl = {
        p: evaluate_plan(model, ref, uniform_plan(model, p))[0].kl_nats_per_token
        for p in ("bf16", "int8", "int4", "int2")
    }
    assert kl["bf16"] == 0.0
    assert 0 < kl["int8"] < kl["int4"] < kl["int2"]
    mixed = uniform_plan(model, "bf16")
    mixed[1, 0] = "int2"
    one = evaluate_plan(model, ref, mixed)[0].kl_nats_per_token
    assert 0 < one < kl["int2"]
