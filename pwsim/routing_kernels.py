"""The per-element passes of the routing sampler (``pwsim.routing``), compiled.

A normal-regime draw is ~15 whole-array numpy passes over the L x E counts: ~40 us a step on
Mixtral-8x7B (256 values) in a running simulation, where each call pays its dispatch, and ~200 us
on DeepSeek-V3 (14,848 values), where the running sum alone (``np.add.accumulate``, a dependent
add through memory per element) is ~50 us. Here they are two loops compiled with numba: one
builds the values (and the weights that restore each layer's total), one finds each layer's
correction and whether it is small enough, adds it, sums, rounds and differences. The
matrix-vector sums between them stay numpy's (BLAS orders its adds by the matrix's shape, which a
loop would not match bit for bit), and the
``(1 - pi)**T`` table stays ``np.exp``'s, so that every value is the one the numpy passes give.
A third loop draws the systematic regime (small batches): each point found by binary search in
its own layer's running sums and counted, where numpy searched the whole flat array for every
point and counted with ``bincount``; the same counts, ties included (side right).

Each loop performs the numpy passes' operations element by element in the same order (no
fast-math: no fused multiply-add, no reassociation), so the counts are identical bit for bit;
``tests/test_routing.py`` checks that against the numpy passes below, which are also what runs
where numba is not installed. numba is imported and the loops compiled on first use, so that
commands which simulate nothing do not import numba (~0.4 s); compiled code is cached on disk.
"""

from __future__ import annotations

import functools

import numpy as np

from pagedweight.compiled import available, numba_module  # noqa: F401 - re-exported


def values_numpy(p_i, p_j, scale, inclusion, num_tokens, lo, bounded, uniforms, start, unused_prob, x, weight):
    """``x = (p_i + p_j) * scale + T * pi``; when ``bounded``: clipped to [lo, T], zeroed where
    ``uniforms[start:] < unused_prob`` (if given), and ``weight = x * (T - x)``."""
    np.add(p_i, p_j, out=x)
    x *= scale
    x += num_tokens * inclusion
    if bounded:
        np.clip(x, lo, num_tokens, out=x)
        if unused_prob is not None:
            x *= uniforms[start : start + len(x)] >= unused_prob
        np.multiply(x, num_tokens - x, out=weight)


def counts_numpy(x, weight, sums, total, num_tokens, num_experts, ratio, out) -> bool:
    """``out``: differences of the rounded running sum of ``x + weight * ratio[layer]`` (of
    ``x`` when ``sums`` is None), where ``ratio = (total - sums[0]) / sums[1]`` (``sums``:
    each layer's sums of ``x`` and of ``weight``) moves each layer's total to ``total``. False
    (``out`` unset) when a ratio is beyond ``1 / num_tokens`` (moving that much mass could
    leave [0, T]) or NaN (a layer with no movable mass: every value at 0 or T)."""
    if sums is not None:
        with np.errstate(divide="ignore", invalid="ignore"):  # a NaN or inf is refused below
            np.divide(total - sums[0], sums[1], out=ratio)
        ratios = ratio.tolist()  # a list of L floats: min/max in Python beat two numpy reductions
        if not num_tokens * max(max(ratios), -min(ratios)) <= 1.0 or np.isnan(ratio).any():
            return False
        rows = x.reshape(-1, num_experts)
        rows += weight.reshape(rows.shape) * ratio[:, None]
    cum = np.add.accumulate(x)
    np.rint(cum, out=cum)
    out[0] = cum[0]
    np.subtract(cum[1:], cum[:-1], out=out[1:], casting="unsafe")
    return True


def _values_loop(p_i, p_j, scale, inclusion, tokens, lo, bounded, uniforms, start, unused_prob, masked, x, weight):
    for e in range(x.shape[0]):
        a = p_i[e] + p_j[e]
        a = a * scale
        a = a + tokens * inclusion[e]
        if bounded:
            # np.clip: the larger of (a, lo), then the smaller of (that, T)
            if not a > lo:
                a = lo
            if not a < tokens:
                a = tokens
            if masked:
                a = a * (1.0 if uniforms[start + e] >= unused_prob[e] else 0.0)
            weight[e] = a * (tokens - a)
        x[e] = a


def _counts_loop(x, weight, sum_x, sum_w, total, tokens, adjust, num_experts, ratio, out):
    num_layers = x.shape[0] // num_experts
    if adjust:
        widest = 0.0
        for layer in range(num_layers):
            r = (total - sum_x[layer]) / sum_w[layer]  # 0/0 is NaN, not an error
            if r != r:
                return False
            ratio[layer] = r
            if r > widest:
                widest = r
            if -r > widest:
                widest = -r
        if not tokens * widest <= 1.0:
            return False
    total_sum = 0.0
    prev = 0.0
    for layer in range(num_layers):
        r_layer = ratio[layer] if adjust else 0.0
        for e in range(layer * num_experts, (layer + 1) * num_experts):
            a = x[e]
            if adjust:
                a = a + weight[e] * r_layer
            total_sum = total_sum + a
            r = np.rint(total_sum)
            out[e] = np.int64(r - prev)
            prev = r
    return True


def systematic_numpy(uniforms, cum_flat, num_layers, num_tokens, top_k, out):
    """``out`` (flat, L x E): each expert's points of systematic sampling. Layer l's token t
    puts its ``top_k`` points at ``u[l, t] + l * k + j`` (j < k) on the layers' running
    inclusion sums laid end to end (``cum_flat``, row l shifted by l * k); a point counts for
    the expert whose interval holds it (``searchsorted``, side right; past the end: the last)."""
    offsets = (top_k * np.arange(num_layers))[:, None, None] + np.arange(top_k)[None, None, :]
    points = (uniforms.reshape(num_layers, num_tokens, 1) + offsets).ravel()
    flat = np.searchsorted(cum_flat, points, side="right")
    size = len(out)
    out[:] = np.bincount(np.minimum(flat, size - 1), minlength=size)


def _systematic_loop(uniforms, cum_flat, num_layers, num_tokens, top_k, out):
    size = cum_flat.shape[0]
    num_experts = size // num_layers
    for layer in range(num_layers):
        # Layer l's points lie in [l * k, (l + 1) * k): every sum of the rows before it is
        # <= l * k and every one after it >= (l + 1) * k, so the search for how many sums are
        # <= a point (searchsorted, side right) need only look in its own row.
        first, last = layer * num_experts, (layer + 1) * num_experts
        for t in range(num_tokens):
            u = uniforms[layer * num_tokens + t]
            lo = first
            for j in range(top_k):
                point = u + (layer * top_k + j)  # one add, as numpy adds the int offsets
                hi = last  # lo stays: a token's points rise with j
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if cum_flat[mid] <= point:
                        lo = mid + 1
                    else:
                        hi = mid
                out[lo if lo < size - 1 else size - 1] += 1


@functools.cache
def _loops() -> tuple:
    njit = numba_module().njit
    # The counts loop divides by a layer's weight sum, which may be 0: numpy's error model gives
    # inf or NaN there, as numpy's division does, where Python's would raise.
    counts_loop = njit(cache=True, error_model="numpy")(_counts_loop)
    return njit(cache=True)(_values_loop), counts_loop, njit(cache=True)(_systematic_loop)


_NO_FLOATS = np.zeros(1)


def values(p_i, p_j, scale, inclusion, num_tokens, lo, bounded, uniforms, start, unused_prob, x, weight):
    """``values_numpy``, compiled."""
    masked = unused_prob is not None
    _loops()[0](
        p_i, p_j, scale, inclusion, float(num_tokens), float(lo), bounded, uniforms, start,
        unused_prob if masked else _NO_FLOATS, masked, x, weight,
    )  # fmt: skip


def counts(x, weight, sums, total, num_tokens, num_experts, ratio, out) -> bool:
    """``counts_numpy``, compiled."""
    adjust = sums is not None
    sum_x, sum_w = sums if adjust else (_NO_FLOATS, _NO_FLOATS)
    return _loops()[1](x, weight, sum_x, sum_w, float(total), float(num_tokens), adjust, num_experts, ratio, out)


def systematic_loop():
    """The compiled loop of ``systematic`` (numba imported, and the loop loaded, here)."""
    return _loops()[2]


def systematic(uniforms, cum_flat, num_layers, num_tokens, top_k, out):
    """``systematic_numpy``, compiled (``out`` must be zeros)."""
    _loops()[2](uniforms, cum_flat, num_layers, num_tokens, top_k, out)
