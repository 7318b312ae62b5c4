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
"""

from __future__ import annotations

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
