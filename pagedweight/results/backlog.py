"""Whether a run's queue kept growing: the offered load beyond what the policy served.

A queue that keeps up with its arrivals has a time to first token that does not trend once the
run has warmed up, however high it is. One fed faster than it serves builds a backlog that every
later arrival waits behind: in the fluid picture (arrivals at rate lambda, served at mu < lambda)
the backlog grows by lambda - mu requests a second and an arrival at time t waits ~(lambda / mu
- 1) t. So the slope of TTFT against arrival time, late in the run, reads the overload directly:
0 for a queue that keeps up, ~rho - 1 for offered load rho times what was served. Its TTFT then
measures the length of the run as much as the policy: a longer trace at the same rate gives a
larger one. ``pwsim run`` prints a note for such a policy; ``pwsim bench`` finds the largest load
a policy sustains.

The slope is taken between the third and the fourth quarter of the requests by arrival (medians
of each: a few slow requests do not make a trend, and the first half, where any queue fills from
empty, is left out). A burst late in a trace that a queue absorbs by its end also reads as
growth: the note says what the figures show, not why.
"""

from __future__ import annotations

import numpy as np

# A policy is reported as overloaded when TTFT grows by more than this many seconds per second
# of arrivals late in the run (offered load ~5% beyond what it served) and the last quarter's
# median TTFT is at least ``OVERLOAD_MIN_TTFT_S`` (a trend of milliseconds is no backlog a user
# waits on).
OVERLOAD_GROWTH_S_PER_S = 0.05
OVERLOAD_MIN_TTFT_S = 1.0
MIN_REQUESTS = 8  # fewer: no quarters to compare


def queue_growth(
    arrival_s: np.ndarray, first_token_s: np.ndarray, rejected: np.ndarray, end_s: float
) -> dict[str, float]:
    """``queue_growth_s_per_s``: the slope of TTFT against arrival time between the third and the
    fourth quarter of the requests that were not rejected, ordered by arrival (medians of each
    quarter; a request with no first token by ``end_s``, the run's end, counts as served then: a
    lower bound on its wait); ``late_median_ttft_ms``: the last quarter's median TTFT. Both 0
    with fewer than ``MIN_REQUESTS`` requests; the slope 0 when the two quarters' medians
    arrived at one instant."""
    keep = ~rejected
    arrival = arrival_s[keep]
    n = len(arrival)
    if n < MIN_REQUESTS:
        return {"queue_growth_s_per_s": 0.0, "late_median_ttft_ms": 0.0}
    order = np.argsort(arrival, kind="stable")
    arrival = arrival[order]
    first_s = first_token_s[keep][order]
    ttft_s = np.where(np.isnan(first_s), max(end_s, float(arrival[-1])), first_s) - arrival
    q3, q4 = slice(n // 2, 3 * n // 4), slice(3 * n // 4, n)
    late_s = float(np.median(ttft_s[q4]))
    span_s = float(np.median(arrival[q4]) - np.median(arrival[q3]))
    if span_s <= 0:
        return {"queue_growth_s_per_s": 0.0, "late_median_ttft_ms": late_s * 1e3}
    growth = (late_s - float(np.median(ttft_s[q3]))) / span_s
    return {"queue_growth_s_per_s": growth, "late_median_ttft_ms": late_s * 1e3}


def overload_note(policy: str, summary: dict) -> str | None:
    """A line for a policy whose queue kept growing (see the module docstring), else None."""
    growth = summary.get("queue_growth_s_per_s", 0.0)
    late_ms = summary.get("late_median_ttft_ms", 0.0)
    if not (growth > OVERLOAD_GROWTH_S_PER_S and late_ms >= OVERLOAD_MIN_TTFT_S * 1e3):
        return None
    return (
        f"{policy}: the queue kept growing: the last quarter of the requests to arrive waited "
        f"{late_ms / 1e3:,.1f} s (median) for a first token, {growth:.2f} s more per second of arrivals than the "
        f"quarter before. The offered load exceeds what this policy served (~{1 + growth:.2f}x), so its TTFT "
        "grows with the trace's length; lower workload.rate_scale, or find each policy's largest sustainable "
        "load with `pwsim bench` (a suite with this scenario as a cell)."
    )
