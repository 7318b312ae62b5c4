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
    # Arrays alone (a static policy's small batches): across boundaries, and beyond a block.
    stream = UniformStream(np.random.default_rng(4), block=16)
    got = []
    for n in (5, 7, 9, 3, 20, 6, 40, 2, 15, 16, 1):
        got.extend(stream.array((n,)).tolist())
    assert got == np.random.default_rng(4).random(len(got)).tolist()
    assert stream._pos > 0  # still drawing from its block


# sha256 (first 16 hex digits) of six rounds of draws at these batch sizes, from a seeded sampler
# per (model, kind): the counts as the numpy passes gave them before the compiled loops existed.
# Any change of a draw (a pass reordered, a fused multiply-add) changes a digest.
_DIGEST_TOKENS = (1, 2, 3, 5, 8, 13, 16, 40, 64, 100, 257, 700, 2048, 8000)
_DIGESTS = {
    ("mixtral-8x7b", "importance"): "7b4849ab824414f5",
    ("mixtral-8x7b", "zipf"): "35ed520c66cd9af4",
    ("qwen3-30b-a3b", "importance"): "7661ba655ff6c599",
    ("qwen3-30b-a3b", "uniform"): "53b80e96a858fb2b",
    ("deepseek-v3", "importance"): "3eccd800f741a3bb",
    ("deepseek-v3", "zipf"): "d362a8e99120b3b9",
    ("mixtral-8x7b", "skewed"): "7f59efcff8c48222",
}


def _digest_sampler(name: str, kind: str, compiled: bool) -> RoutingSampler:
    """``importance``: heavy-tailed frequencies, as measured ones are; ``skewed``: one expert of
    each layer picked by 98% of tokens (counts that may pass T without any going negative)."""
    model = load_model(name)
    freqs = None
    if kind == "importance":
        freqs = np.random.default_rng(7).pareto(1.5, (model.num_moe_layers, model.num_experts)) + 1e-3
    elif kind == "skewed":
        freqs = np.full((model.num_moe_layers, model.num_experts), 0.073)
        freqs[:, 0] = 0.49
    routing_kind = "importance" if freqs is not None else kind
    return RoutingSampler(model, freqs, routing_kind, 1.2, np.random.default_rng(11), compiled=compiled)


def _digest(name: str, kind: str, compiled: bool) -> str:
    import hashlib

    sampler = _digest_sampler(name, kind, compiled)
    h = hashlib.sha256()
    for _ in range(6):
        for t in _DIGEST_TOKENS:
            h.update(sampler.sample(t).astype(np.int64).tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize(("name", "kind"), list(_DIGESTS))
def test_compiled_and_numpy_passes_draw_the_counts_they_always_drew(name, kind):
    """The compiled loops (numba) and the numpy passes give the same counts, bit for bit, and
    those of the sampler before the loops were compiled: each run's results stay the same."""
    from pwsim import routing_kernels

    if not routing_kernels.available():
        pytest.skip("numba is not installed: only the numpy passes run")
    assert _digest(name, kind, compiled=True) == _DIGESTS[(name, kind)]
    assert _digest(name, kind, compiled=False) == _DIGESTS[(name, kind)]


def test_compiled_systematic_counts_are_numpys_on_ties_too():
    """The compiled systematic loop against ``np.searchsorted`` + ``np.bincount``, on points that
    fall exactly on a running sum (a tie counts for the next expert, as side right does) and on
    experts never picked (zero inclusion: equal sums), which random uniforms almost never hit."""
    from pwsim import routing_kernels

    if not routing_kernels.available():
        pytest.skip("numba is not installed: only the numpy passes run")
    rng = np.random.default_rng(5)
    for num_layers, num_experts, top_k in ((1, 4, 1), (3, 8, 2), (4, 16, 4)):
        incl = rng.choice([0.0, 0.125, 0.25, 0.5], (num_layers, num_experts))
        incl[:, 0] += 0.125  # no row without a used expert
        incl *= top_k / incl.sum(axis=1, keepdims=True)
        cum = np.cumsum(incl, axis=1)
        cum[:, -1] = top_k
        cum_flat = (cum + top_k * np.arange(num_layers)[:, None]).ravel()
        for num_tokens in (1, 3, 17):
            # uniforms on the layer's sums' fractional parts (ties), and random ones
            ties = np.concatenate([np.modf(cum_flat)[0], [0.0]])
            n = num_layers * num_tokens
            uniforms = np.where(rng.random(n) < 0.7, rng.choice(ties, n), rng.random(n))
            want = np.zeros(num_layers * num_experts, dtype=np.int64)
            got = np.zeros_like(want)
            routing_kernels.systematic_numpy(uniforms, cum_flat, num_layers, num_tokens, top_k, want)
            routing_kernels.systematic(uniforms, cum_flat, num_layers, num_tokens, top_k, got)
            assert got.tolist() == want.tolist()
            assert want.sum() == num_layers * num_tokens * top_k


def test_both_passes_cover_every_branch_of_the_normal_regime():
    """The draws of the digest test reach the fast path, the bounded one with and without the
    exact zero draw, and the fallback to systematic sampling, so the comparison covers them."""
    from pwsim import routing

    seen: set[str] = set()
    orig_normal, orig_systematic = RoutingSampler._normal, RoutingSampler._systematic

    class Spy(RoutingSampler):
        def _normal(self, num_tokens):
            self._in_normal = True
            out = orig_normal(self, num_tokens)
            self._in_normal = False
            return out

        def _systematic(self, num_tokens):
            if getattr(self, "_in_normal", False):
                seen.add("fallback")
            return orig_systematic(self, num_tokens)

    def values(p_i, p_j, scale, inclusion, num_tokens, lo, bounded, uniforms, start, unused_prob, x, weight):
        seen.add("masked" if unused_prob is not None else "bounded" if bounded else "fast")
        routing.routing_kernels.values_numpy(
            p_i, p_j, scale, inclusion, num_tokens, lo, bounded, uniforms, start, unused_prob, x, weight
        )

    for name, kind in _DIGESTS:
        sampler = _digest_sampler(name, kind, compiled=False)
        sampler.__class__ = Spy
        sampler._values = values
        for _ in range(6):
            for t in _DIGEST_TOKENS:
                sampler.sample(t)
    assert seen == {"fast", "bounded", "masked", "fallback"}, seen


@pytest.mark.parametrize("compiled", [False, True])
def test_counts_refuse_a_layer_with_no_movable_mass(compiled):
    """A layer whose values all sit at 0 or T has no weight to move (0 / 0: NaN) and one whose
    shortfall needs more than 1 / T of its weight would leave [0, T]: the counts' pass refuses
    both (the sampler falls back to systematic sampling), wherever the layer is, and counts
    the others' totals exactly."""
    from pwsim import routing_kernels

    if compiled and not routing_kernels.available():
        pytest.skip("numba is not installed: only the numpy passes run")
    counts = routing_kernels.counts if compiled else routing_kernels.counts_numpy
    num_tokens, num_experts, top_k = 4, 4, 2
    total = num_tokens * top_k
    ok_layer = np.array([3.5, 2.0, 1.5, 0.5])  # sums to 7.5: 0.5 short of 8
    stuck = np.array([4.0, 4.0, 0.0, 0.0])  # sums to 8 exactly, but nothing can move
    short = np.array([3.9, 3.0, 0.1, 0.0])  # 1 short, weight 3.78: ratio 0.265 > 1 / 4
    for layers in ([ok_layer, stuck], [stuck, ok_layer], [ok_layer, short]):
        x = np.concatenate(layers)
        weight = x * (num_tokens - x)
        rows = x.reshape(-1, num_experts)
        sums = (rows @ np.ones(num_experts), weight.reshape(rows.shape) @ np.ones(num_experts))
        out = np.zeros(len(x), dtype=np.int64)
        assert not counts(x.copy(), weight, sums, total, num_tokens, num_experts, np.empty(len(layers)), out)
    x = np.concatenate([ok_layer, ok_layer])
    weight = x * (num_tokens - x)
    rows = x.reshape(-1, num_experts)
    sums = (rows @ np.ones(num_experts), weight.reshape(rows.shape) @ np.ones(num_experts))
    out = np.zeros(len(x), dtype=np.int64)
    assert counts(x, weight, sums, total, num_tokens, num_experts, np.empty(2), out)
    assert out.reshape(2, -1).sum(axis=1).tolist() == [total, total]
    assert out.min() >= 0 and out.max() <= num_tokens
