"""Routing sampler: top-k invariants on every draw, marginals against the exact expectations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.core.spec import load_model
from pwsim.routing import RoutingSampler, waterfill_top_k

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "tiny-moe")


def _sampler(name: str, kind: str, seed: int = 0, alpha: float = 1.0, freqs=None) -> RoutingSampler:
    return RoutingSampler(load_model(name), freqs, kind, alpha, np.random.default_rng(seed))


# Samplers are built once per (model, kind): each draws its noise pools at construction.
_SAMPLERS = {(m, k): _sampler(m, k) for m in MODELS for k in ("uniform", "zipf")}


@settings(max_examples=150, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    kind=st.sampled_from(["uniform", "zipf"]),
    num_tokens=st.one_of(st.integers(0, 40), st.integers(0, 20000)),
)
def test_every_draw_is_a_valid_top_k_routing(model, kind, num_tokens):
    s = _SAMPLERS[(model, kind)]
    spec = load_model(model)
    counts = s.sample(num_tokens)
    assert counts.shape == (spec.num_moe_layers, spec.num_experts)
    assert counts.dtype == np.int64
    assert (counts >= 0).all()
    assert (counts.sum(axis=1) == num_tokens * spec.top_k).all()  # k picks per token per layer
    assert (counts <= num_tokens).all()  # distinct experts: none chosen twice by one token


@settings(max_examples=60, deadline=None)
@given(
    alpha=st.floats(0.2, 4.0),
    num_tokens=st.integers(1, 3000),
    zero_experts=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
def test_skewed_importance_frequencies_keep_the_invariants(alpha, num_tokens, zero_experts, seed):
    """Steep Zipf rows (water-filling at work) and experts that are never routed to."""
    spec = load_model("mixtral-8x7b")
    rng = np.random.default_rng(seed)
    freqs = 1.0 / np.arange(1, spec.num_experts + 1) ** alpha * np.ones((spec.num_moe_layers, 1))
    freqs[:, spec.num_experts - zero_experts :] = 0.0
    s = RoutingSampler(spec, freqs, "importance", 1.0, rng)
    counts = s.sample(num_tokens)
    assert (counts.sum(axis=1) == num_tokens * spec.top_k).all()
    assert (counts <= num_tokens).all() and (counts >= 0).all()
    assert (counts[:, spec.num_experts - zero_experts :] == 0).all()


def test_one_token_picks_exactly_k_distinct_experts_per_layer():
    for model in MODELS:
        spec = load_model(model)
        s = _SAMPLERS[(model, "zipf")]
        for _ in range(50):
            counts = s.sample(1)
            assert ((counts == 1).sum(axis=1) == spec.top_k).all()


@pytest.mark.parametrize("model", ["mixtral-8x7b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("kind", ["uniform", "zipf"])
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 256])
def test_marginals_match_top_k_routing(model, kind, num_tokens):
    """Mean counts approach T * pi, and active experts per layer approach sum(1 - (1 - pi)^T),
    the expectation for tokens routed independently (what decode memory traffic depends on)."""
    s = _sampler(model, kind, seed=7)
    draws = np.stack([s.sample(num_tokens) for _ in range(300)])
    pi = s.inclusion
    assert np.abs(draws.mean(axis=0) / num_tokens - pi).max() < 0.1
    active = (draws > 0).mean(axis=0).sum(axis=1).mean()
    expected = (1 - (1 - pi) ** num_tokens).sum(axis=1).mean()
    assert active == pytest.approx(expected, rel=0.04)


def test_zipf_is_skewed_and_uniform_is_not():
    z = _sampler("qwen3-30b-a3b", "zipf", alpha=1.2)
    u = _sampler("qwen3-30b-a3b", "uniform")
    assert z.probs.max() / z.probs.min() > 100
    assert np.allclose(u.probs, 1 / 128)
    # Different expert order per layer: the hot expert is not always expert 0.
    assert len(set(np.argmax(z.probs, axis=1).tolist())) > 5


def test_same_seed_same_draws():
    a, b = _sampler("mixtral-8x7b", "zipf", seed=3), _sampler("mixtral-8x7b", "zipf", seed=3)
    for t in (1, 5, 100, 2000):
        assert np.array_equal(a.sample(t), b.sample(t))


def test_waterfill_caps_inclusion_at_one():
    p = waterfill_top_k(np.array([[100.0, 1, 1, 1], [1, 1, 1, 1]]), top_k=2)
    assert np.allclose(p.sum(axis=1), 1)
    assert p[0, 0] == pytest.approx(0.5)  # chosen by every token
    assert np.allclose(p[0, 1:], 0.5 / 3)
    assert np.allclose(p[1], 0.25)


def test_bad_frequencies_are_rejected():
    spec = load_model("mixtral-8x7b")
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="needs the importance table"):
        RoutingSampler(spec, None, "importance", 1.0, rng)
    with pytest.raises(ValueError, match=r"needs \(32, 8\)"):
        RoutingSampler(spec, np.ones((4, 8)), "importance", 1.0, rng)
    one_expert = np.zeros((32, 8))
    one_expert[:, 0] = 1.0
    with pytest.raises(ValueError, match="at least top_k"):
        RoutingSampler(spec, one_expert, "importance", 1.0, rng)
    with pytest.raises(ValueError, match="layer 0 are all 0"):
        RoutingSampler(spec, np.zeros((32, 8)), "importance", 1.0, rng)
    with pytest.raises(ValueError, match="unknown"):
        RoutingSampler(spec, None, "round-robin", 1.0, rng)


def test_per_batch_size_caches_do_not_change_a_draw():
    """Samplers with and without the per-T caches draw the same counts from the same seed."""
    cached, plain = _sampler("mixtral-8x7b", "zipf", seed=3), _sampler("mixtral-8x7b", "zipf", seed=3)
    plain._max_cached_token_counts = 0
    for t in [40, 39, 40, 700, 39, 5, 40, 8000, 700]:
        assert np.array_equal(cached.sample(t), plain.sample(t))
    assert 40 in cached._by_tokens and not plain._by_tokens


def test_uniform_stream_hands_out_the_rngs_own_sequence():
    """Drawn ahead in blocks, the values are those of drawing each in turn, scalars and arrays
    mixed, across block boundaries."""
    from pwsim.routing import UniformStream

    stream = UniformStream(np.random.default_rng(3), block=16)
    got: list[float] = []
    for n in (1, 5, 1, 30, 1, 1, 16, 3):
        got.extend([stream.scalar()] if n == 1 else stream.array((n, 1)).ravel().tolist())
    assert got == np.random.default_rng(3).random(len(got)).tolist()
