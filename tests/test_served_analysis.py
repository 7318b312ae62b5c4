"""The analysis behind the served-quality table, on numbers made up to test it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pwgpu.served_quality import _log_pearson, _spearman


def test_a_constant_proxy_in_rounding_noise_correlates_with_nothing():
    # A static map's proxy is one sum per step, added in varying order: equal up to the last bits.
    proxy = [1.812539758268408e-07, 1.8125397582684077e-07, 1.8125397582684082e-07, 1.812539758268408e-07]
    kl = [2e-7, 3e-7, 8e-6, 1e-7]
    assert math.isnan(_spearman(kl, proxy))
    assert _spearman(kl, [1e-7, 3e-7, 2e-7, 4e-8]) == pytest.approx(0.8)  # real differences still rank


def test_log_pearson_needs_three_positive_pairs():
    assert math.isnan(_log_pearson([1.0, 0.0, 2.0], [1.0, 1.0, 2.0]))
    assert _log_pearson([1e-9, 1e-6, 1e-3], [2e-9, 2e-6, 2e-3]) == pytest.approx(1.0)
    assert np.isfinite(_log_pearson([1e-9, 1e-6, 1e-3, 1e-4], [3e-9, 2e-6, 1e-3, 1e-2]))
