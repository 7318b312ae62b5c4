"""Synthetic arrival processes: Poisson, Gamma with a given CV, piecewise rate schedules.

Every generator is vectorised (numpy draws in blocks, no per-request Python) and takes the run's
``numpy.random.Generator``, so one seed fixes the whole workload. Times are seconds from the
start of the process; the first request arrives at 0, like a replayed trace.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pagedweight.config.workload import ArrivalConfig, GammaArrival, PiecewiseArrival, PoissonArrival, RateSegment
from pagedweight.errors import ConfigError


def poisson_arrivals(
    rate_qps: float, rng: np.random.Generator, *, num_requests: int | None = None, duration_s: float | None = None
) -> np.ndarray:
    """Arrival times of a Poisson process (exponential gaps, IAT CV = 1)."""
    return gamma_arrivals(rate_qps, 1.0, rng, num_requests=num_requests, duration_s=duration_s)


def gamma_arrivals(
    rate_qps: float,
    cv: float,
    rng: np.random.Generator,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> np.ndarray:
    """Arrival times of a renewal process with Gamma gaps: mean 1/rate_qps, std/mean = cv.

    Shape k = 1/cv^2 and scale 1/(rate_qps k); cv = 1 is exactly the Poisson process."""
    if rate_qps <= 0:
        raise ConfigError(f"rate_qps(={rate_qps}) must be > 0")
    if cv <= 0:
        raise ConfigError(f"cv(={cv}) must be > 0")
    times = _unit_renewal(1.0 / cv**2, rng, num_requests, None if duration_s is None else duration_s * rate_qps)
    return times / rate_qps


def piecewise_arrivals(
    segments: Sequence[RateSegment],
    rng: np.random.Generator,
    *,
    cv: float = 1.0,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> np.ndarray:
    """Arrivals under a rate schedule, ending with its last segment (or at duration_s if sooner).

    A unit-rate Gamma renewal process in operational time Lambda(t) = integral of the rate is
    mapped back through Lambda^-1, so each segment gets its own mean rate and gaps keep their CV."""
    if cv <= 0:
        raise ConfigError(f"cv(={cv}) must be > 0")
    durations = np.array([s.duration_s for s in segments], dtype=np.float64)
    rates = np.array([s.rate_qps for s in segments], dtype=np.float64)
    if len(segments) == 0 or np.any(durations <= 0) or np.any(rates < 0) or not np.any(rates > 0):
        raise ConfigError("segments need duration_s > 0, rate_qps >= 0, and at least one rate_qps > 0")
    t_start = np.concatenate([[0.0], np.cumsum(durations)[:-1]])
    lam_start = np.concatenate([[0.0], np.cumsum(durations * rates)[:-1]])
    horizon_s = float(durations.sum()) if duration_s is None else min(duration_s, float(durations.sum()))
    # Lambda is piecewise linear through these knots (flat over idle segments).
    knots_t = np.concatenate([t_start, [durations.sum()]])
    knots_lam = np.concatenate([lam_start, [float((durations * rates).sum())]])
    lam_horizon = float(np.interp(horizon_s, knots_t, knots_lam))
    # Map back through busy segments only: an operational time never lands inside an idle one.
    busy = rates > 0
    t_start, lam_start, rates = t_start[busy], lam_start[busy], rates[busy]
    lam = _unit_renewal(1.0 / cv**2, rng, num_requests, lam_horizon)
    seg = np.searchsorted(lam_start, lam, side="right") - 1
    return t_start[seg] + (lam - lam_start[seg]) / rates[seg]


def generate_arrivals(
    cfg: ArrivalConfig, rng: np.random.Generator, *, num_requests: int | None = None, duration_s: float | None = None
) -> np.ndarray:
    """Arrival times for a validated ``arrival:`` config."""
    if isinstance(cfg, PoissonArrival):
        return poisson_arrivals(cfg.rate_qps, rng, num_requests=num_requests, duration_s=duration_s)
    if isinstance(cfg, GammaArrival):
        return gamma_arrivals(cfg.rate_qps, cfg.cv, rng, num_requests=num_requests, duration_s=duration_s)
    if isinstance(cfg, PiecewiseArrival):
        return piecewise_arrivals(cfg.segments, rng, cv=cfg.cv, num_requests=num_requests, duration_s=duration_s)
    raise TypeError(f"unknown arrival config {type(cfg).__name__}")


def _unit_renewal(shape: float, rng: np.random.Generator, num: int | None, horizon: float | None) -> np.ndarray:
    """Points of a mean-1 Gamma(shape) renewal process starting with a point at 0: the first
    ``num`` points, or all points < ``horizon``, whichever is fewer."""
    if num is None and horizon is None:
        raise ConfigError("give num_requests or duration_s")
    if num is not None and num <= 0:
        return np.zeros(0)
    if horizon is not None and horizon <= 0:
        return np.zeros(0)
    scale = 1.0 / shape
    if num is not None and horizon is None:
        gaps = rng.gamma(shape, scale, size=num - 1)
        return np.concatenate([[0.0], np.cumsum(gaps)])
    # Draw blocks sized to the expected count (plus a few standard deviations) until past the horizon.
    expected = horizon + 6.0 * math.sqrt(horizon / shape) + 16
    block = int(min(expected, num)) if num is not None else int(expected)
    chunks, last = [np.zeros(1)], 0.0
    while chunks[-1][-1] < horizon and (num is None or sum(len(c) for c in chunks) < num):
        times = last + np.cumsum(rng.gamma(shape, scale, size=max(block, 16)))
        chunks.append(times)
        last = float(times[-1])
    times = np.concatenate(chunks)
    times = times[times < horizon]
    return times[:num] if num is not None else times
