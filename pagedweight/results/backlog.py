"""Whether a run's queue kept growing: the offered load beyond what the policy served.

A policy that keeps up with its arrivals holds a number of requests in the system (arrived, not
finished) that does not trend once the run has warmed up, however long each of them takes. One
fed faster than it serves builds a backlog: arrivals at lambda a second, completions at mu <
lambda, and the requests in the system grow by lambda - mu a second. So that growth, late in the
run, reads the overload directly: offered load rho = lambda / mu times what was served. Its
latencies then measure the length of the trace as much as the policy (a longer trace at the same
rate gives larger ones). ``pwsim run`` and the report note such a policy; ``pwsim bench`` finds
the largest load a policy sustains.

The count is taken from arrivals and completions alone, whatever order the policy serves in: a
policy that serves late arrivals first (pagedweight's SLO-aware order under a backlog) keeps
their TTFT flat while the early ones wait, and a trend of TTFT would miss its backlog. The growth
is the difference between the mean count seen by the fourth and by the third quarter of the
arrivals, over the time between their mean arrival times (the first half, where any system fills
from empty, is left out). A burst late in a trace that a policy absorbs by its end also reads as
growth: the note says what the figures show, not why.
"""

from __future__ import annotations

import numpy as np

# A policy is noted as overloaded when the offered load is more than this many times what it
# served late in the run, and its backlog took at least ``OVERLOAD_MIN_DRAIN_S`` to clear after
# the last arrival (a backlog of milliseconds is none a user waits on).
OVERLOAD_LOAD_RATIO = 1.05
OVERLOAD_MIN_DRAIN_S = 1.0
MIN_REQUESTS = 8  # fewer: no quarters to compare
MAX_LOAD_RATIO = 100.0  # reported when (almost) nothing was served late in the run
NO_BACKLOG = {"backlog_growth_per_s": 0.0, "load_ratio": 0.0, "backlog_at_last_arrival": 0, "drain_s": 0.0}


def queue_growth(arrival_s: np.ndarray, finish_s: np.ndarray, rejected: np.ndarray) -> dict:
    """The backlog of the requests that were not rejected (``finish_s`` NaN: never finished):

    - ``backlog_growth_per_s``: requests in the system gained per second late in the run (the
      mean count at the fourth quarter's arrivals less that at the third's, over the time
      between the quarters' mean arrival times);
    - ``load_ratio``: lambda / (lambda - growth), lambda the arrivals per second over the last
      half; the offered load over what was served (1: kept up; at most ``MAX_LOAD_RATIO``, also
      when nothing was served); 0 when it cannot be told (under ``MIN_REQUESTS`` requests, or
      the last half arrived at one instant);
    - ``backlog_at_last_arrival``: requests arrived and not finished when the last one arrived;
    - ``drain_s``: from the last arrival to the last completion (0 if none came later)."""
    keep = ~rejected
    arrival = np.sort(arrival_s[keep])
    finish = np.sort(np.where(np.isnan(finish_s[keep]), np.inf, finish_s[keep]))
    n = len(arrival)
    if n < MIN_REQUESTS:
        return dict(NO_BACKLOG)
    last_arrival = float(arrival[-1])
    finite = finish[np.isfinite(finish)]
    drain_s = max(0.0, float(finite[-1]) - last_arrival) if len(finite) else 0.0
    in_system = np.arange(1, n + 1) - np.searchsorted(finish, arrival, side="right")  # at each arrival
    out = {"backlog_at_last_arrival": int(in_system[-1]), "drain_s": drain_s}
    q3, q4 = slice(n // 2, 3 * n // 4), slice(3 * n // 4, n)
    gap_s = float(arrival[q4].mean() - arrival[q3].mean())
    late_s = last_arrival - float(arrival[n // 2])
    if gap_s <= 0 or late_s <= 0:
        return {**out, "backlog_growth_per_s": 0.0, "load_ratio": 0.0}
    growth = float(in_system[q4].mean() - in_system[q3].mean()) / gap_s
    rate = (n - n // 2 - 1) / late_s  # arrivals per second over the last half
    served = rate - growth
    ratio = rate / served if served > rate / MAX_LOAD_RATIO else MAX_LOAD_RATIO
    return {**out, "backlog_growth_per_s": growth, "load_ratio": ratio}


def overload_notes(policies: dict[str, dict]) -> list[str]:
    """``overload_note`` of each policy (name -> its summary) that has one, in order: what
    ``pwsim run`` prints under its table and the report shows under its headline."""
    return [note for policy, summary in policies.items() if (note := overload_note(policy, summary)) is not None]


def overload_note(policy: str, summary: dict) -> str | None:
    """A line for a policy whose queue kept growing (see the module docstring), else None."""
    ratio = summary.get("load_ratio", 0.0)
    if not (ratio > OVERLOAD_LOAD_RATIO and summary.get("drain_s", 0.0) >= OVERLOAD_MIN_DRAIN_S):
        return None
    load = f"{MAX_LOAD_RATIO:g}x or more" if ratio >= MAX_LOAD_RATIO else f"~{ratio:.2f}x"
    return (
        f"{policy}: the queue kept growing: late in the run the requests in the system rose by "
        f"{summary['backlog_growth_per_s']:.2f} a second, {summary['backlog_at_last_arrival']:,} were unfinished "
        f"when the last one arrived and it took {summary['drain_s']:,.0f} s more to serve them. The offered load "
        f"exceeds what this policy served ({load}), so its latencies grow with the trace's length; lower "
        "workload.rate_scale, or find each policy's largest sustainable load with `pwsim bench` (a suite with this "
        "scenario as a cell)."
    )
