"""The ``marginal`` allocator: multiple-choice knapsack by marginal loss per byte.

Each expert's allowed options are points (bytes, dloss). Only its *lower convex hull* matters
to the LP relaxation: start every expert at its cheapest option, then an upgrade along the hull
is a segment that buys ``-d dloss`` for ``d bytes``; hull segments of one expert have
decreasing ratio ``-d dloss / d bytes``. Sorting all segments by ratio (descending) and taking
the longest prefix that fits solves the LP relaxation exactly once the first segment that does
not fit is taken fractionally: that fractional objective is ``lp_bound``, a lower bound on any
plan's ``sum dloss`` (including the optimum).

The integral plan is that prefix, then a fill: the bytes left (fewer than the split segment
needs) go to the next segments in ratio order that fit, at most one per expert, each the
expert's next hull step. The plan is a pure function of the budget, so an incremental re-plan
gives exactly the plan a fresh planner would.

Incremental: ``MarginalPlanner`` keeps the sorted segments, their byte prefix sums and the
levels at the current prefix position. A new budget finds its position by binary search and
applies only the segments between the old and the new position.
"""

from __future__ import annotations

import numpy as np

from pagedweight.policy.problem import Plan, Problem, make_plan


def lower_hulls(bytes_: np.ndarray, dloss: np.ndarray, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lower convex hull of each row's allowed (bytes, dloss) points, as ladder levels.

    Returns ``hull`` (N, P) with the hull's levels in increasing bytes in its first ``size[i]``
    columns (-1 after) and ``size`` (N,). Dominated points (no fewer bytes for no less loss) are
    dropped; of equal-bytes points the lowest loss is kept. Vectorised across rows: a monotone
    chain with P pushes and at most P pops per push, each a numpy operation over all rows.
    """
    n, p = bytes_.shape
    rows = np.arange(n)
    big = np.float64(np.iinfo(np.int64).max)
    bkey = np.where(allowed, bytes_.astype(np.float64), big)
    by_loss = np.argsort(dloss, axis=1, kind="stable")
    order = np.take_along_axis(by_loss, np.argsort(np.take_along_axis(bkey, by_loss, 1), axis=1, kind="stable"), 1)
    sb = np.take_along_axis(bytes_.astype(np.float64), order, 1)
    sl = np.take_along_axis(dloss, order, 1)
    sa = np.take_along_axis(allowed, order, 1)

    stack = np.zeros((n, p), dtype=np.int64)  # sorted column positions on the hull
    size = np.zeros(n, dtype=np.int64)
    for c in range(p):
        valid = sa[:, c].copy()
        top = stack[rows, np.maximum(size - 1, 0)]
        has = size > 0
        valid &= ~has | ((sb[:, c] > sb[rows, top]) & (sl[:, c] < sl[rows, top]))
        for _ in range(p):
            a = stack[rows, np.maximum(size - 2, 0)]
            t = stack[rows, np.maximum(size - 1, 0)]
            # Pop t when it lies on or above the chord a -> c: not a hull vertex.
            above = (sl[rows, t] - sl[rows, a]) * (sb[:, c] - sb[rows, a]) >= (sl[:, c] - sl[rows, a]) * (
                sb[rows, t] - sb[rows, a]
            )
            pop = valid & (size >= 2) & above
            if not pop.any():
                break
            size -= pop
        stack[rows[valid], size[valid]] = c
        size += valid
    hull = np.where(np.arange(p) < size[:, None], np.take_along_axis(order, stack, 1), -1)
    return hull, size


class MarginalPlanner:
    """Incremental ``marginal`` plans for one problem and any sequence of budgets."""

    def __init__(self, problem: Problem):
        t = problem.table
        self.problem = problem
        hull, size = lower_hulls(t.bytes, t.dloss, problem.allowed)
        n, p = hull.shape
        self.base_levels = hull[:, 0].astype(np.int8)
        rows = np.arange(n)
        self.base_bytes = int(t.bytes[rows, self.base_levels].sum())
        self.base_loss = float(t.dloss[rows, self.base_levels].sum())

        # Segments s -> s+1 of every hull, as (N, P-1) grids first, then flattened and sorted.
        has = np.arange(p - 1) < (size[:, None] - 1)
        frm, to = np.maximum(hull[:, :-1], 0), np.maximum(hull[:, 1:], 0)
        dbytes = np.take_along_axis(t.bytes, to, 1) - np.take_along_axis(t.bytes, frm, 1)
        gain = np.take_along_axis(t.dloss, frm, 1) - np.take_along_axis(t.dloss, to, 1)
        ratio = np.where(has, gain / np.where(has, dbytes, 1), -np.inf)
        # Rounding can leave a nearly collinear vertex whose next ratio is a hair larger; the sort
        # must still keep each expert's segments in chain order, so make ratios non-increasing.
        ratio = np.minimum.accumulate(ratio, axis=1)
        expert, chain = np.nonzero(has)
        order = np.lexsort((chain, expert, -ratio[expert, chain]))
        self.seg_expert = expert[order]
        self.seg_from = frm[expert, chain][order].astype(np.int8)
        self.seg_to = to[expert, chain][order].astype(np.int8)
        self.seg_bytes = dbytes[expert, chain][order]
        self.seg_gain = gain[expert, chain][order]
        # Loss recovered per byte of each segment, non-increasing in this order (the sort key).
        self.seg_ratio = ratio[expert, chain][order]
        self.cum_bytes = np.concatenate([[0], np.cumsum(self.seg_bytes)])
        self.cum_gain = np.concatenate([[0.0], np.cumsum(self.seg_gain)])
        # Sorted position of each segment's predecessor in its expert's chain (-1: the first).
        position = np.empty(len(order), dtype=np.int64)
        position[order] = np.arange(len(order))
        grid_pos = np.full((n, max(p - 1, 1)), -1, dtype=np.int64)
        grid_pos[expert, chain] = position
        prev = np.full(len(order), -1, dtype=np.int64)
        later = chain > 0
        prev[later] = grid_pos[expert[later], chain[later] - 1]
        self.seg_prev = prev[order]

        self._position = 0  # segments [0, position) are applied to _levels
        self._levels = self.base_levels.copy()

    @property
    def num_segments(self) -> int:
        return len(self.seg_bytes)

    def bytes_worth(self, loss_per_byte: float) -> int:
        """Bytes of the plan that takes every segment recovering at least ``loss_per_byte`` loss
        per byte, and no other: weights worth more than memory valued at that rate."""
        k = int(np.searchsorted(-self.seg_ratio, -loss_per_byte, side="right"))
        return self.base_bytes + int(self.cum_bytes[k])

    @property
    def loss_span(self) -> float:
        """Loss of every expert at its cheapest option less that of every expert at its best."""
        return float(self.cum_gain[-1])

    def _walk(self, position: int) -> None:
        """Move the applied prefix to ``position``. Along a hull bytes rise, so levels fall: the
        new level of an expert is the min (forward) or max (backward) over the walked segments."""
        old = self._position
        if position > old:
            np.minimum.at(self._levels, self.seg_expert[old:position], self.seg_to[old:position])
        elif position < old:
            np.maximum.at(self._levels, self.seg_expert[position:old], self.seg_from[position:old])
        self._position = position

    def plan(self, budget_bytes: int) -> Plan:
        self.problem.check_budget(budget_bytes)
        slack = budget_bytes - self.base_bytes
        k = int(np.searchsorted(self.cum_bytes, slack, side="right")) - 1
        self._walk(k)
        leftover = slack - int(self.cum_bytes[k])
        lp_bound = self.base_loss - float(self.cum_gain[k])
        levels = self._levels.copy()
        if k < self.num_segments:
            lp_bound -= leftover / float(self.seg_bytes[k]) * float(self.seg_gain[k])
            taken = self._fill(k, leftover)
            levels[self.seg_expert[taken]] = self.seg_to[taken]
        return make_plan(self.problem, "marginal", levels, budget_bytes, lp_bound=lp_bound)

    def _fill(self, k: int, leftover: int) -> np.ndarray:
        """Segments after the split ``k`` that fit in ``leftover``, in ratio order, one per expert:
        each must be its expert's next step, i.e. its predecessor is in the prefix."""
        tail = slice(k + 1, self.num_segments)
        cand = k + 1 + np.flatnonzero((self.seg_bytes[tail] <= leftover) & (self.seg_prev[tail] < k))
        taken = []
        # Each round takes the longest run of candidates that fits, then drops those now too big:
        # the first survivor always fits, so rounds <= distinct segment sizes, not candidates.
        while cand.size:
            run = np.cumsum(self.seg_bytes[cand])
            m = int(np.searchsorted(run, leftover, side="right"))
            taken.append(cand[:m])
            leftover -= int(run[m - 1])
            cand = cand[m:]
            cand = cand[self.seg_bytes[cand] <= leftover]
        return np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
