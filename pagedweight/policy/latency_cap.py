"""Speed in the objective: fewer weight bytes make a memory-bound step faster.

A step reads every active expert's weights, so its time grows with their bytes; under a TPOT
SLO the controller must not keep bytes that push a step past it when a cheaper precision map
would meet it. The runtime says how long a step would take with a given precision map
(``StepTimeModel``: the simulator asks its latency model, on the shape and routing of the last
step); this module turns that into a cap on the weight pages the controller may plan for.

Rules (``pagedweight`` only; ``paper-greedy`` stays verbatim):
- Downgrade for speed: when the current map's step is predicted past the SLO, the weights are
  shrunk to the largest budget whose plan meets it, if one does (even the floor missing it
  means precision cannot meet the SLO: then memory alone decides).
- Upgrade only under the cap: the upgrade budget is capped at the largest whose plan is
  predicted within ``1 - latency_margin`` of the SLO, so that a plan made just under it does
  not flip back at the next wobble of the batch (hysteresis on speed, beside the watermarks
  on memory and the dwell time on each expert).

``StepShapeFit`` learns the other half: how a step's time grows with its shape (prefill tokens,
decodes), from the steps that ran, for the batch limits of ``Controller.step_limits``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

# (flat precision ids per routed expert) -> predicted seconds of the runtime's next step
StepTimeModel = Callable[[np.ndarray], float]
# weight pages -> the precision ids of the plan for that budget, or None if it cannot fit
PlanIds = Callable[[int], "np.ndarray | None"]
BISECT_ROUNDS = 8


def largest_budget_within(
    limit_s: float, step_time_s: StepTimeModel, plan_ids: PlanIds, low_pages: int, high_pages: int
) -> int | None:
    """The largest weight budget in ``[low_pages, high_pages]`` (to within 1/2**8 of the span)
    whose plan's predicted step time is at most ``limit_s``; None if not even ``low_pages``
    meets it. Step time grows with the budget (more bytes to read), so bisection applies."""
    ids = plan_ids(high_pages)
    if ids is not None and step_time_s(ids) <= limit_s:
        return high_pages
    ids = plan_ids(low_pages)
    if ids is None or step_time_s(ids) > limit_s:
        return None
    lo, hi = low_pages, high_pages  # lo meets the limit, hi does not
    for _ in range(BISECT_ROUNDS):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        ids = plan_ids(mid)
        if ids is not None and step_time_s(ids) <= limit_s:
            lo = mid
        else:
            hi = mid
    return lo


class WeightReadStepTime:
    """A ``StepTimeModel`` for a runtime without a latency model of its own (the engine): a
    step reads each active expert's weights once, so a precision map changes the last step's
    time by the bytes of that step's active experts over the memory bandwidth. Only the
    difference between two maps matters to the controller (``Controller._tpot_model`` adds it
    to the measured mean step), and a memory-bound decode step is what the SLO is about; a
    compute-bound prefill chunk gains less than this says (the simulator's latency model takes
    the larger of compute and memory time per expert instead).

    ``observe`` takes each step's routing counts (layers, experts), as the core reports them."""

    def __init__(self, bytes_by_id: np.ndarray, bandwidth_bytes_per_s: float):
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s(={bandwidth_bytes_per_s}) must be > 0")
        self.bytes_by_id = np.asarray(bytes_by_id, dtype=np.float64)
        self.bandwidth_bytes_per_s = float(bandwidth_bytes_per_s)
        self._active: np.ndarray | None = None  # flat indices of the last step's active experts

    def observe(self, tokens_per_expert: np.ndarray) -> None:
        self._active = np.flatnonzero(tokens_per_expert)

    def __call__(self, precision_ids: np.ndarray) -> float:
        if self._active is None:
            return 0.0
        return float(self.bytes_by_id[precision_ids[self._active]].sum()) / self.bandwidth_bytes_per_s


class StepShapeFit:
    """A step's seconds against its shape, learnt from the steps that ran (both runtimes time
    every step, so both learn it alike): an exponentially weighted least-squares fit of

        duration = a + b * prefill_tokens + c * decodes

    over the last ~``1 / (1 - FORGET)`` steps, so that it follows precision changes and the
    batch's KV growing. It says how many prefill tokens and how many running requests a step
    may take within a time (``Controller.step_limits``). The runtime's step-time model cannot
    say it: it prices precision maps on the last step's shape only.

    The sums are kept in Python floats (nine multiply-adds a step); the 3 x 3 system is solved
    only when asked (every plan). Features are scaled (thousands of prefill tokens, hundreds of
    decodes) so that a small ridge keeps an unidentified coefficient near its last value
    instead of letting it run off."""

    FORGET = 0.99
    RIDGE = 1e-3
    MIN_STEPS = 16  # fewer steps seen: no fit

    def __init__(self) -> None:
        self._s = [0.0] * 6  # weighted sums of x x^T: 11 1p 1d pp pd dd
        self._r = [0.0] * 3  # weighted sums of x y: 1 p d
        self.num_steps = 0
        self._coef = (0.0, 0.0, 0.0)  # the last fit, per step, per 1k prefill tokens, per 100 decodes

    def observe(self, duration_s: float, prefill_tokens: int, decodes: int) -> None:
        f = self.FORGET
        p, d, y = prefill_tokens * 1e-3, decodes * 1e-2, duration_s
        s, r = self._s, self._r
        s[0] = f * s[0] + 1.0
        s[1] = f * s[1] + p
        s[2] = f * s[2] + d
        s[3] = f * s[3] + p * p
        s[4] = f * s[4] + p * d
        s[5] = f * s[5] + d * d
        r[0] = f * r[0] + y
        r[1] = f * r[1] + p * y
        r[2] = f * r[2] + d * y
        self.num_steps += 1

    def fit(self) -> tuple[float, float, float] | None:
        """(a seconds, b seconds per prefill token, c seconds per decode), or None before
        ``MIN_STEPS`` steps. Negative slopes (noise) count as 0."""
        if self.num_steps < self.MIN_STEPS:
            return None
        s, r, lam = self._s, self._r, self.RIDGE
        prior = self._coef
        coef = solve_symmetric3(
            (s[0], s[1], s[2], s[3] + lam, s[4], s[5] + lam), (r[0], r[1] + lam * prior[1], r[2] + lam * prior[2])
        )
        if coef is None:
            coef = prior
        self._coef = (coef[0], max(0.0, coef[1]), max(0.0, coef[2]))
        a0, b, c = self._coef
        return a0, b * 1e-3, c * 1e-2


def solve_symmetric3(
    m: tuple[float, float, float, float, float, float], rhs: tuple[float, float, float]
) -> tuple[float, float, float] | None:
    """x with ``A x = rhs`` for the symmetric 3 x 3 ``A`` given by its upper triangle
    ``(a00, a01, a02, a11, a12, a22)``, by its adjugate in Python floats (the fit solves one
    every plan: ~2 us, where ``np.linalg.solve`` costs ~15 us of call overhead). None when ``A``
    is singular or the result is not finite. The fit's ridge keeps ``A`` well conditioned."""
    a00, a01, a02, a11, a12, a22 = m
    c00 = a11 * a22 - a12 * a12
    c01 = a02 * a12 - a01 * a22
    c02 = a01 * a12 - a11 * a02
    c11 = a00 * a22 - a02 * a02
    c12 = a01 * a02 - a00 * a12
    c22 = a00 * a11 - a01 * a01
    det = a00 * c00 + a01 * c01 + a02 * c02
    if det == 0.0 or not math.isfinite(det):
        return None
    r0, r1, r2 = rhs
    x = (
        (c00 * r0 + c01 * r1 + c02 * r2) / det,
        (c01 * r0 + c11 * r1 + c12 * r2) / det,
        (c02 * r0 + c12 * r1 + c22 * r2) / det,
    )
    return x if all(math.isfinite(v) for v in x) else None
