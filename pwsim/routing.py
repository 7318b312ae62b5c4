"""Per-step routing: how many of a step's tokens each expert of each MoE layer receives.

Shape legend: L = MoE layers, E = experts per layer, T = tokens in the step, k = top_k.

Every token picks k *distinct* experts per layer, so a layer's counts sum to T * k and no
expert receives more than T. Drawing T * k picks token by token costs O(T * L * E) and the
simulator draws once per engine step, so the sampler works from inclusion probabilities:

1. Frequencies (L, E) are normalised per layer and water-filled so that each expert's
   inclusion probability ``pi = k * p`` is at most 1 (an expert cannot be chosen by more than
   every token; mass above that moves to the others). Each layer's ``pi`` sums to k.
2. Small steps are exact per token: systematic sampling lays the experts' ``pi`` end to end on
   [0, k) and takes the points ``u + j``, ``j = 0..k-1``, for one uniform ``u`` per token and
   layer. Because every ``pi <= 1`` the k points land in k distinct experts, and expert e is
   chosen with probability exactly ``pi_e``. Used while ``T * L * k <= SYSTEMATIC_LIMIT_POINTS``
   or the mean count per expert ``T * k / E`` is below 1/4 (where the normal regime's active
   expert count drifts by more than 3%).
3. Larger steps use a normal approximation of the per-expert counts ``Binomial(T, pi_e)``,
   projected so each layer sums to ``T * k`` (the deviation is taken from each expert in
   proportion to its variance) and rounded along the running sum, which keeps every count >= 0
   and the total exact. When some expected count is low, whether an expert is used at all is
   drawn exactly (unused with probability ``(1 - pi)**T``, else at least 1 token) before the
   layer is rescaled to its total. Measured over 400 draws: active experts per layer within 3%
   of ``sum(1 - (1 - pi)**T)`` for T >= 3 (Mixtral-8x7B and Qwen3-30B-A3B, uniform and Zipf 1.0)
   and mean counts within 0.09 T of ``T * pi``.
4. Where a normal draw may pass T (experts with ``pi`` near 1 at small T), values are capped at
   T and the removed mass goes to the used experts in proportion to their room below T;
   rounding along the running sum then keeps every count within [0, T].

The projected unit deviations are drawn once per sampler as a pool of K patterns (K * L * E
about 2**20 values, K >= 64) and each step adds two patterns at random, scaled by
``sqrt(T / 2)``: K**2 / 2 combinations, and each pattern's worst ratios to ``pi`` and ``1 - pi``
are known, so most steps skip the exact zero draw of step 3 and the bounds of step 4
with one scalar comparison. Measured on one
core (numpy 2.4): a numpy call on a 32 x 8 array costs 1-8 us (``cumsum`` 8.5, ``add.accumulate``
3.3, ``diff(prepend=)`` 24), ``standard_normal`` 9 ns per value, ``Generator.multinomial`` 17-35 us
for 32 x 8 and 150-570 us for 48 x 128, ``binomial`` / ``poisson`` 40-120 ns per value; hence a
pool, and no per-step multinomial.
``benchmarks/latency_model.py`` prints the per-call times of this sampler.
"""

from __future__ import annotations

import math

import numpy as np

from pagedweight.core.spec import ModelSpec
from pagedweight.errors import ConfigError
from pwsim import routing_kernels

# Exact systematic sampling up to this many points (T * L * k) per call: 6 us for Mixtral at
# T = 1 (64 points), 17 us at T = 8 (512), 13 us for Qwen3-30B-A3B at T = 1 (384) on one core.
SYSTEMATIC_LIMIT_POINTS = 512
SYSTEMATIC_MAX_MEAN_COUNT = 0.25
NOISE_POOL_VALUES = 1 << 20
# Memory for the per-batch-size arrays (1 - pi)**T (2 KiB each for Mixtral, 116 KiB at
# DeepSeek-V3 scale): every batch size of a Mixtral run, ~280 of a DeepSeek-V3 one.
TOKEN_CACHE_BYTES = 32 << 20
MIN_NOISE_PATTERNS = 64
UNIFORM_BLOCK = 4096


class UniformStream:
    """An RNG's uniforms, drawn ahead in blocks and handed out in order: the same values, in the
    same order, as calling ``rng.random()`` for each (a scalar call costs ~0.5 us, a value taken
    by ``item`` ~0.07). The RNG must be this stream's alone from then on. The block stays an
    array: most values go out as arrays (systematic draws, ~1,000 a step), a few as scalars."""

    def __init__(self, rng: np.random.Generator, block: int = UNIFORM_BLOCK):
        self.rng = rng  # this stream's alone: values are drawn ahead, a block at a time
        self.block = block
        self._array = np.zeros(0)
        self._pos = 0

    def _refill(self) -> None:
        self._array = self.rng.random(self.block)
        self._pos = 0

    def scalar(self) -> float:
        if self._pos == len(self._array):
            self._refill()
        self._pos += 1
        return self._array.item(self._pos - 1)

    def array(self, shape: tuple[int, ...]) -> np.ndarray:
        """The next ``prod(shape)`` uniforms, in that shape."""
        return self.take(math.prod(shape)).reshape(shape)

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` uniforms (1-D)."""
        left = len(self._array) - self._pos
        if n <= left:
            pos = self._pos
            self._pos = pos + n
            return self._array[pos : pos + n]
        head, rest = self._array[self._pos :], n - left
        if rest > self.block:
            self._pos = len(self._array)
            return np.concatenate([head, self.rng.random(rest)])
        # The next block now: left exhausted, a stream of array draws alone (a static policy's
        # small batches) would otherwise draw every later call afresh and join it to nothing.
        self._refill()
        self._pos = rest
        return np.concatenate([head, self._array[:rest]])


def waterfill_top_k(freqs: np.ndarray, top_k: int) -> np.ndarray:
    """Per-layer pick probabilities ``p`` (rows sum to 1) with ``top_k * p <= 1``.

    Experts whose share would exceed 1 / top_k are set to exactly that, and the rest of the
    row is rescaled to take the remainder (repeated until no expert exceeds the cap).
    """
    p = np.asarray(freqs, dtype=np.float64)
    if p.ndim != 2:
        raise ConfigError(f"frequencies must be 2-D (layers, experts), got shape {p.shape}")
    if (p < 0).any() or not np.isfinite(p).all():
        raise ConfigError("frequencies must be finite and >= 0")
    sums = p.sum(axis=1, keepdims=True)
    if (sums <= 0).any():
        raise ConfigError(f"frequencies of layer {int(np.argmin(sums[:, 0]))} are all 0")
    if (np.count_nonzero(p, axis=1) < top_k).any():
        raise ConfigError(f"every layer needs at least top_k(={top_k}) experts with frequency > 0")
    p = p / sums
    cap = 1.0 / top_k
    capped = np.zeros(p.shape, dtype=bool)
    for _ in range(p.shape[1]):
        over = (p > cap * (1 + 1e-12)) & ~capped
        if not over.any():
            break
        capped |= over
        free_mass = 1.0 - cap * capped.sum(axis=1, keepdims=True)
        rest = np.where(capped, 0.0, p)
        rest_sum = rest.sum(axis=1, keepdims=True)
        p = np.where(capped, cap, rest * free_mass / np.where(rest_sum > 0, rest_sum, 1.0))
    return p


def zipf_frequencies(num_layers: int, num_experts: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Frequencies ``1 / rank**alpha`` with a random expert order per layer (shape L, E)."""
    base = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** alpha
    order = np.argsort(rng.random((num_layers, num_experts)), axis=1)
    return base[order]


class RoutingSampler:
    """Draws tokens per expert per MoE layer for a step of ``num_tokens`` tokens."""

    def __init__(
        self,
        model: ModelSpec,
        frequencies: np.ndarray | None,
        kind: str,
        alpha: float,
        rng: np.random.Generator,
        systematic_limit_points: int = SYSTEMATIC_LIMIT_POINTS,
        compiled: bool | None = None,
    ):
        """``compiled``: the normal regime's passes compiled (numba; the default where it is
        installed) or as numpy passes; the counts are the same either way."""
        num_layers, num_experts = model.num_moe_layers, model.num_experts
        if kind == "importance":
            if frequencies is None:
                raise ConfigError("routing kind 'importance' needs the importance table's frequencies")
            freqs = np.asarray(frequencies, dtype=np.float64)
            if freqs.shape != (num_layers, num_experts):
                raise ConfigError(
                    f"frequencies have shape {freqs.shape}; {model.name} needs ({num_layers}, {num_experts})"
                )
        elif kind == "uniform":
            freqs = np.ones((num_layers, num_experts))
        elif kind == "zipf":
            freqs = zipf_frequencies(num_layers, num_experts, alpha, rng)
        else:
            raise ConfigError(f"routing kind {kind!r} unknown; allowed: importance, uniform, zipf")
        self.kind = kind
        self.top_k = k = model.top_k
        self.rng = rng  # the sampler's own: it draws ahead from it (UniformStream)
        self.systematic_limit_points = systematic_limit_points
        if routing_kernels.available() if compiled is None else compiled:
            self._values, self._counts = routing_kernels.values, routing_kernels.counts
            # The loop itself, not its wrapper: most steps of a small batch are this call alone.
            self._systematic_counts = routing_kernels.systematic_loop()
        else:
            self._values, self._counts = routing_kernels.values_numpy, routing_kernels.counts_numpy
            self._systematic_counts = routing_kernels.systematic_numpy
        self._systematic_max_picks = SYSTEMATIC_MAX_MEAN_COUNT * num_experts
        self.probs = waterfill_top_k(freqs, k)  # (L, E), rows sum to 1
        # (L, E), rows sum to k; clipped because rounding in the water-fill can leave 1 + 1e-16.
        self.inclusion = np.minimum(k * self.probs, 1.0)
        self._num_layers, self._num_experts = num_layers, num_experts
        self._layer_ids = np.arange(num_layers)
        # Systematic sampling: row l's running inclusion sum shifted by l * k, so that one
        # search serves all layers (a point u + j + l * k lands in row l).
        cum = np.cumsum(self.inclusion, axis=1)
        cum[:, -1] = k  # rounding must not leave a point past the row's end
        self._inclusion_cum_flat = (cum + k * self._layer_ids[:, None]).ravel()
        self._init_noise_pool()

    def _init_noise_pool(self) -> None:
        """Patterns ``D`` (K, L * E): unit deviations ``sd * z`` with each layer's sum removed in
        proportion to the experts' variances, so ``T * pi + sqrt(T) * D`` sums to ``T * k``."""
        size = self._num_layers * self._num_experts
        num_patterns = max(MIN_NOISE_PATTERNS, NOISE_POOL_VALUES // size)
        incl = self.inclusion
        var_unit = incl * (1 - incl)
        var_sum = var_unit.sum(axis=1, keepdims=True)
        share = var_unit / np.where(var_sum > 0, var_sum, 1.0)
        dev = np.sqrt(var_unit) * self.rng.standard_normal((num_patterns, self._num_layers, self._num_experts))
        dev -= share * dev.sum(axis=2, keepdims=True)
        self._patterns = dev.reshape(num_patterns, size)
        # Worst ratios per pattern: x = T pi + s D >= 0 while s * neg_ratio <= T, and x <= T while
        # s * over_ratio <= T (experts with pi = 1 have no variance, hence no deviation).
        with np.errstate(divide="ignore", invalid="ignore"):
            neg = np.where(incl > 0, -dev / incl, 0.0)
            over = np.where(incl < 1, dev / (1 - incl), 0.0)
        self._neg_ratio = np.maximum(neg.reshape(num_patterns, size).max(axis=1), 0.0).tolist()
        self._over_ratio = np.maximum(over.reshape(num_patterns, size).max(axis=1), 0.0).tolist()
        self._inclusion_flat = incl.ravel()
        with np.errstate(divide="ignore"):
            self._log1m_inclusion = np.log1p(-self._inclusion_flat)  # -inf where pi = 1: always used
        self._uniforms = self.rng.random(max(NOISE_POOL_VALUES, 2 * size))
        # Every later draw in order from one stream (per-step scalars are the costly kind).
        self._stream = UniformStream(self.rng)
        # ``_normal``'s work arrays: values, their weights (and both as (L, E) views), each
        # layer's sums of them and its ratio.
        self._x, self._weight, self._ratio = np.empty(size), np.empty(size), np.empty(self._num_layers)
        shape = (self._num_layers, self._num_experts)
        self._x_rows, self._weight_rows = self._x.reshape(shape), self._weight.reshape(shape)
        self._sum_x, self._sum_weight = np.empty(self._num_layers), np.empty(self._num_layers)
        self._ones_experts = np.ones(self._num_experts)
        self._by_tokens: dict[int, np.ndarray] = {}
        self._max_cached_token_counts = TOKEN_CACHE_BYTES // (8 * size)

    def _systematic(self, num_tokens: int) -> np.ndarray:
        """Counts (L, E) by systematic sampling (``routing_kernels.systematic_numpy``): exact,
        distinct experts per token; the regime of small batches."""
        u = self._stream.take(self._num_layers * num_tokens)
        out = np.zeros(self._num_layers * self._num_experts, dtype=np.int64)
        self._systematic_counts(u, self._inclusion_cum_flat, self._num_layers, num_tokens, self.top_k, out)
        return out.reshape(self._num_layers, self._num_experts)

    def _normal(self, num_tokens: int) -> np.ndarray:
        """Counts (L, E) summing to T * k per layer, none above T (see the module docstring).
        The per-element passes are ``pwsim.routing_kernels``' (compiled where numba is)."""
        rand = self._stream.scalar
        num_patterns = len(self._patterns)
        i, j = int(rand() * num_patterns), int(rand() * num_patterns)
        scale = math.sqrt(num_tokens / 2)
        total = num_tokens * self.top_k
        may_exceed = scale * (self._over_ratio[i] + self._over_ratio[j]) > num_tokens
        may_be_negative = scale * (self._neg_ratio[i] + self._neg_ratio[j]) > num_tokens
        bounded = may_be_negative or may_exceed
        x, weight = self._x, self._weight
        start, unused_prob, sums = 0, None, None
        if may_be_negative:
            # Some expected count is low enough for the normal to misjudge whether the expert is
            # used at all (rounding it up overstated Qwen3-30B-A3B's active experts by up to 19%
            # at T = 2..16). Draw that exactly: unused with probability (1 - pi)**T, else at
            # least one token (values are clipped to >= 1 first).
            start = int(rand() * (len(self._uniforms) - len(x)))
            unused_prob = self._unused_prob(num_tokens)
        self._values(
            self._patterns[i], self._patterns[j], scale, self._inclusion_flat, num_tokens,
            1.0 if may_be_negative else 0.0, bounded, self._uniforms, start, unused_prob, x, weight,
        )  # fmt: skip
        if bounded:
            # Values bounded to [0, T]; each layer's total restored by moving mass in proportion
            # to x (T - x): nothing moves for unused experts or those at T (pi = 1), and no value
            # can leave [0, T] while |shortfall| * T <= sum(x (T - x)). Re-drawing the excess as
            # picks instead cost 25 us per round and ran on 85% of Mixtral steps at T = 8 with
            # importance-like frequencies.
            # The counts' pass finds each layer's ratio, (T k - sum x) / sum x (T - x), and
            # refuses (False) when one is too large (or NaN: no movable mass).
            # ndarray.dot into the work arrays: BLAS's matrix-vector product, as ``rows @ ones``
            # is (the same floats), with less of numpy's dispatch (~0.5 us a call against 0.9).
            ones = self._ones_experts
            sums = (self._x_rows.dot(ones, self._sum_x), self._weight_rows.dot(ones, self._sum_weight))
        # Rounding the running sum keeps every count in [0, T] (each x is) and each layer's
        # total exact (every layer's total is an integer, so layer boundaries round exactly).
        out = np.empty(len(x), dtype=np.int64)
        if not self._counts(x, weight, sums, total, num_tokens, self._num_experts, self._ratio, out):
            return self._systematic(num_tokens)
        return out.reshape(self._num_layers, self._num_experts)

    def _unused_prob(self, num_tokens: int) -> np.ndarray:
        """``(1 - pi)**T`` (flat), cached per T: most steps of a run repeat a few hundred batch
        sizes, and each array costs a pass of ``np.exp``."""
        hit = self._by_tokens.get(num_tokens)
        if hit is None:
            hit = np.exp(num_tokens * self._log1m_inclusion)
            if len(self._by_tokens) < self._max_cached_token_counts:
                self._by_tokens[num_tokens] = hit
        return hit

    def sample(self, num_tokens: int) -> np.ndarray:
        """Tokens per expert per layer, (L, E) int64; each row sums to num_tokens * top_k."""
        if num_tokens <= 0:
            return np.zeros((self._num_layers, self._num_experts), dtype=np.int64)
        picks = num_tokens * self.top_k
        if picks * self._num_layers <= self.systematic_limit_points or picks < self._systematic_max_picks:
            return self._systematic(num_tokens)  # exact: distinct experts per token by construction
        return self._normal(num_tokens)
