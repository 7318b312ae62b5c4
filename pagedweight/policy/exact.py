"""The ``exact`` allocator: the optimal ``sum dloss`` plan, as a MILP solved by HiGHS.

One binary ``x[i, j]`` per expert i and kept option j; ``sum_j x[i, j] = 1`` for every expert;
``sum bytes[i, j] * x[i, j] <= budget``; minimise ``sum dloss[i, j] * x[i, j]``. Options that
another allowed option of the same expert dominates (no more bytes, no more loss) are dropped
first: no optimum needs them, and they only slow branch and bound.

The marginal plan seeds HiGHS as an incumbent, so a time-limited solve still returns a plan at
least as good as ``marginal``; ``proven_optimal`` says whether the solver closed the gap.
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

from pagedweight.policy.hull import MarginalPlanner
from pagedweight.policy.problem import Plan, Problem, make_plan

_banner_shown = False


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS prints a copyright banner from C++ on the first ``Highs()`` of a process, before any
    option can turn it off; it would corrupt a CLI's output, so hide file descriptor 1 once."""
    global _banner_shown
    if _banner_shown:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        _banner_shown = True


def kept_options(problem: Problem) -> np.ndarray:
    """(N, P) bool: allowed options that no other allowed option of the expert dominates."""
    b, loss, ok = problem.table.bytes, problem.table.dloss, problem.allowed
    p = b.shape[1]
    # better[i, j, k]: option k is at least as good as j in both bytes and loss.
    no_worse = (b[:, None, :] <= b[:, :, None]) & (loss[:, None, :] <= loss[:, :, None]) & ok[:, None, :]
    strictly = (b[:, None, :] < b[:, :, None]) | (loss[:, None, :] < loss[:, :, None])
    earlier_twin = np.arange(p)[None, :] < np.arange(p)[:, None]  # equal options: keep the first
    dominated = (no_worse & (strictly | earlier_twin[None])).any(axis=2)
    return ok & ~dominated


def solve_exact(problem: Problem, budget_bytes: int, time_limit_s: float | None = None) -> Plan:
    import highspy

    problem.check_budget(budget_bytes)
    seed = MarginalPlanner(problem).plan(budget_bytes)
    t = problem.table
    keep = kept_options(problem)
    expert, level = np.nonzero(keep)
    n, num_cols = t.num_rows, len(expert)
    col_bytes = t.bytes[expert, level]
    col_loss = t.dloss[expert, level]
    byte_scale = max(budget_bytes, 1) / 1000.0
    loss_scale = float(col_loss.max()) or 1.0  # losses are ~1e-6 nats: bring them to O(1) for tolerances

    def solve(limit_bytes: int) -> tuple[np.ndarray, bool]:
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = num_cols, n + 1
        lp.col_cost_ = col_loss / loss_scale
        lp.col_lower_ = np.zeros(num_cols)
        lp.col_upper_ = np.ones(num_cols)
        lp.row_lower_ = np.concatenate([np.ones(n), [-highspy.kHighsInf]])
        # Bytes scaled so the budget row is ~1e3: coefficients far from 1 (bytes, or MiB of tiny
        # test instances, ~1e-6) fall foul of HiGHS's tolerances and gave wrong "optimal" plans.
        # The plan's exact bytes are rechecked below.
        lp.row_upper_ = np.concatenate([np.ones(n), [limit_bytes / byte_scale]])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.arange(0, 2 * num_cols + 1, 2, dtype=np.int32)
        lp.a_matrix_.index_ = np.column_stack([expert, np.full(num_cols, n)]).reshape(-1).astype(np.int32)
        lp.a_matrix_.value_ = np.column_stack([np.ones(num_cols), col_bytes / byte_scale]).reshape(-1)
        lp.integrality_ = [highspy.HighsVarType.kInteger] * num_cols
        with _quiet_stdout():
            h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 1e-9)
        h.setOptionValue("mip_abs_gap", 1e-12)
        h.setOptionValue("mip_feasibility_tolerance", 1e-9)
        h.setOptionValue("threads", 1)
        if time_limit_s is not None:
            h.setOptionValue("time_limit", float(time_limit_s))
        h.passModel(lp)
        start = np.zeros(num_cols)
        start[np.flatnonzero(level == seed.levels[expert])] = 1.0
        # No warm start from ``start``: HiGHS 1.16 took a solution given by setSolution at an
        # objective of 0 and declared it optimal (a 3-expert instance came back at loss 7 with
        # 2 possible). The marginal seed still guards the answer below.
        h.run()
        optimal = h.getModelStatus() == highspy.HighsModelStatus.kOptimal
        x = np.asarray(h.getSolution().col_value)
        if x.size != num_cols:  # no solution object (time ran out before HiGHS read the seed)
            x = start
        choice = np.full(n, -1, dtype=np.int64)
        picked = np.flatnonzero(x > 0.5)
        choice[expert[picked]] = level[picked]
        if (choice < 0).any():
            return seed.levels.astype(np.int64), False
        return choice, optimal

    limit = budget_bytes
    for _ in range(4):
        levels, optimal = solve(limit)
        used = int(t.bytes[np.arange(n), levels].sum())
        if used <= budget_bytes:
            break
        limit -= used - budget_bytes  # tolerance rounding let a few bytes through: tighten and retry
    else:
        levels, optimal = seed.levels.astype(np.int64), False
    plan = make_plan(problem, "exact", levels, budget_bytes, lp_bound=seed.lp_bound, proven_optimal=optimal)
    if plan.sum_dloss > seed.sum_dloss:
        # Only within HiGHS's gap tolerance, or a time limit hit before it improved on its seed:
        # the seed is then at least as good, and optimal whenever the solver's answer was.
        return make_plan(problem, "exact", seed.levels, budget_bytes, lp_bound=seed.lp_bound, proven_optimal=optimal)
    return plan
