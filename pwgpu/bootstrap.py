"""Paired bootstrap confidence intervals over token blocks.

Every quality figure is a ratio of sums over blocks of consecutive tokens (KL summed over a
block, divided by the tokens summed over the same blocks). A bootstrap replicate draws blocks
with replacement; *paired* means every method and every quantity in one replicate uses the
same drawn blocks, so that a ratio between two methods measured on the same text gets the
(much narrower) interval of their difference rather than of each one separately. Domains are
resampled independently, each with its own blocks.
"""

from __future__ import annotations

import numpy as np

CONFIDENCE = 0.95


class Resampler:
    """Fixed replicate indices per domain: ``idx[domain]`` is (replicates, blocks)."""

    def __init__(self, blocks_per_domain: dict[str, int], replicates: int = 2000, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.replicates = replicates
        self.idx = {d: rng.integers(0, n, size=(replicates, n)) for d, n in blocks_per_domain.items()}

    def sums(self, domain: str, values: np.ndarray) -> np.ndarray:
        """(replicates,) sums of ``values`` (one per block) over each replicate's blocks."""
        return np.asarray(values, dtype=np.float64)[self.idx[domain]].sum(axis=1)


def interval(replicates: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The percentile interval of bootstrap replicates (NaNs dropped)."""
    r = np.asarray(replicates, dtype=np.float64)
    r = r[np.isfinite(r)]
    if len(r) == 0:
        return float("nan"), float("nan")
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(r, [tail, 100 - tail])
    return float(lo), float(hi)


def ratio_of_sums(rs: Resampler, domain: str, num: np.ndarray, den: np.ndarray) -> tuple[float, float, float]:
    """``sum(num) / sum(den)`` and its interval, paired over blocks."""
    point = float(np.sum(num) / np.sum(den)) if np.sum(den) else float("nan")
    with np.errstate(divide="ignore", invalid="ignore"):
        reps = rs.sums(domain, num) / rs.sums(domain, den)
    return (point, *interval(reps))
