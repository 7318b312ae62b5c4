"""The allocation problem every allocator solves, and the plan it returns.

``Problem``: an ``ImportanceTable`` with its pins, as arrays (bytes and loss per expert per ladder
level, which levels each expert may take). ``Plan``: one ladder level per expert, its bytes and
its loss. Kept apart from the solvers so that each solver module imports this one and none
imports another's dispatcher.

``Q(p) = weight_bits(p) / 16``: the paper's quality of a precision, 1 for BF16/FP16, 0.5 for
FP8/INT8, 0.25 for INT4 (scales not counted, as in the paper).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pagedweight.core.spec import PRECISION_ID, PRECISION_NAMES, PRECISIONS
from pagedweight.errors import AllocationError
from pagedweight.policy.importance import ImportanceTable


def quality(name: str) -> float:
    """The paper's ``Q_p``."""
    return PRECISIONS[name].weight_bits / 16


@dataclass(frozen=True, eq=False)
class Problem:
    """A table plus pins, in the arrays the solvers use. N = experts (layer-major), P = ladder."""

    table: ImportanceTable
    allowed: np.ndarray  # (N, P) bool: options an expert may take (one column if pinned)
    min_bytes: np.ndarray  # (N,) int64: bytes of the expert's cheapest allowed option

    @cached_property
    def greedy_order(self) -> tuple[np.ndarray, tuple]:
        """paper-greedy's order (descending importance, ties by row) and its sweep rows: fixed for
        the problem, while the controller re-plans it at every budget change."""
        order = np.argsort(-self.table.importance, kind="stable")
        return order, _sweep_rows(self, order)

    @classmethod
    def build(cls, table: ImportanceTable, pinned: np.ndarray | None = None) -> Problem:
        """``pinned``: (N,) or (L, E) of ``PRECISION_ID`` codes, -1 where the expert is free."""
        n, p = table.dloss.shape
        rising = np.flatnonzero((np.diff(table.bytes, axis=1) > 0).any(axis=1))
        if rising.size:
            # The solvers walk each expert's options in ladder order as bytes fall; tables read
            # from files are checked already, this catches tables built in code.
            raise AllocationError(
                f"expert {rising[0]}: bytes {table.bytes[rising[0]].tolist()} increase down the ladder "
                f"{list(table.ladder)}; run importance.validate(table) for details"
            )
        allowed = np.ones((n, p), dtype=bool)
        if pinned is not None:
            pins = np.asarray(pinned).reshape(-1)
            if pins.shape != (n,):
                raise AllocationError(f"pinned has {pins.size} entries; the table has {n} experts")
            id_to_level = np.full(len(PRECISION_NAMES), -1, dtype=np.int64)
            for j, name in enumerate(table.ladder):
                id_to_level[PRECISION_ID[name]] = j
            rows = np.flatnonzero(pins >= 0)
            codes = pins[rows].astype(np.int64)
            pin_level = np.full(codes.shape, -1, dtype=np.int64)
            known = codes < len(PRECISION_NAMES)
            pin_level[known] = id_to_level[codes[known]]
            bad = rows[pin_level < 0]
            if bad.size:
                code = int(pins[bad[0]])
                name = PRECISION_NAMES[code] if code < len(PRECISION_NAMES) else f"code {code}"
                raise AllocationError(
                    f"expert {bad[0]} is pinned at {name}, which is not in the table's ladder {list(table.ladder)}"
                )
            allowed[rows] = False
            allowed[rows, pin_level] = True
        min_bytes = np.where(allowed, table.bytes, np.iinfo(np.int64).max).min(axis=1)
        return cls(table=table, allowed=allowed, min_bytes=min_bytes)

    @property
    def num_pinned(self) -> int:
        return int((self.allowed.sum(axis=1) == 1).sum()) if self.allowed.shape[1] > 1 else 0

    def check_budget(self, budget_bytes: int) -> None:
        need = int(self.min_bytes.sum())
        if budget_bytes < need:
            lowest = self.table.ladder[-1]
            pins = f" ({self.num_pinned} pinned experts at their pinned precision)" if self.num_pinned else ""
            raise AllocationError(
                f"budget_bytes={budget_bytes} ({budget_bytes / 2**30:.3f} GiB) is below the minimum "
                f"{need} ({need / 2**30:.3f} GiB) needed to hold all {len(self.min_bytes)} experts at "
                f"{lowest}{pins}"
            )


@dataclass(frozen=True, eq=False)
class Plan:
    """One precision per expert. Arrays are layer-major (row ``layer * num_experts + expert``)."""

    method: str
    ladder: tuple[str, ...]
    levels: np.ndarray  # (N,) int8: index into ``ladder`` (0 = most precise)
    precision_ids: np.ndarray  # (N,) int8: ``PRECISION_ID`` codes, what runtimes store
    budget_bytes: int
    total_bytes: int
    sum_dloss: float  # sum_i dloss_i(p_i), nats per token
    sum_importance_quality: float  # sum_i I_i * Q(p_i), the paper's objective
    lp_bound: float | None = None  # lower bound on sum_dloss from the LP relaxation
    proven_optimal: bool = False  # True when a solver proved sum_dloss optimal

    def counts(self) -> dict[str, int]:
        per_level = np.bincount(self.levels, minlength=len(self.ladder))
        return {name: int(c) for name, c in zip(self.ladder, per_level, strict=True)}


def make_plan(
    problem: Problem,
    method: str,
    levels: np.ndarray,
    budget_bytes: int,
    lp_bound: float | None = None,
    proven_optimal: bool = False,
) -> Plan:
    table = problem.table
    levels = np.asarray(levels, dtype=np.int8)
    rows = np.arange(len(levels))
    if not problem.allowed[rows, levels].all():
        raise AssertionError(f"{method} chose an option that a pin forbids")  # a solver bug, not user input
    level_ids = np.array([PRECISION_ID[p] for p in table.ladder], dtype=np.int8)
    q = np.array([quality(p) for p in table.ladder])
    return Plan(
        method=method,
        ladder=table.ladder,
        levels=levels,
        precision_ids=level_ids[levels],
        budget_bytes=int(budget_bytes),
        total_bytes=int(table.bytes[rows, levels].sum()),
        sum_dloss=float(table.dloss[rows, levels].sum()),
        sum_importance_quality=float((table.importance * q[levels]).sum()),
        lp_bound=lp_bound,
        proven_optimal=proven_optimal,
    )


# --------------------------------------------------------------------------------------------
# Order-based sweeps: the paper's greedy and the frequency baseline
# --------------------------------------------------------------------------------------------


_NEVER = np.iinfo(np.int64).max  # the extra bytes of a forbidden option: it never fits


def _sweep_rows(problem: Problem, order: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``order``, each option's bytes above the expert's cheapest allowed one in that order
    (``_NEVER`` where a pin forbids it), and the cheapest bytes summed."""
    extra = problem.table.bytes[order] - problem.min_bytes[order, None]
    extra = np.where(problem.allowed[order], extra, _NEVER)
    return order, extra, int(problem.min_bytes[order].sum())


def _sweep(problem: Problem, order: np.ndarray, budget_bytes: int, levels: np.ndarray, rows=None) -> int:
    """Experts in ``order`` each take the most precise allowed option that still leaves room for
    every later expert of ``order`` at its cheapest option. Writes ``levels``; returns bytes used.
    ``rows``: ``_sweep_rows(problem, order)`` when the caller has them already.

    The slack (bytes left above every unplaced expert's cheapest option) only falls, so an
    expert's choice under the slack at the start of a run of experts stays its choice as long
    as the run's bytes so far leave it that much: a run ends at the first expert the cumulative
    sum squeezes out, which starts the next run with the slack it actually has. Each run is a
    few array operations; a model's experts of one size take about one run per ladder level
    (6,144 experts: ~0.1 ms, where a loop over experts took ~7 ms), and the result is the loop's
    exactly (tests/test_allocate.py checks it against the loop)."""
    order, extra, min_sum = rows or _sweep_rows(problem, order)
    slack = budget_bytes - min_sum
    if slack < 0:
        raise AssertionError("sweep ran out of budget after the feasibility check")
    chosen = np.empty(len(order), dtype=np.int64)
    used = 0
    i = 0
    while i < len(order):
        x = extra[i:]
        # The first level that fits is the most precise (ladder order); the cheapest fits (0).
        level = (x > slack).argmin(axis=1)
        cum = np.cumsum(x[np.arange(len(x)), level])
        run = int(np.searchsorted(cum, slack, side="right"))
        if run == 0:  # the first expert always fits; a run of none would never end
            raise AssertionError("sweep found no option that fits")
        chosen[i : i + run] = level[:run]
        spent = int(cum[run - 1])
        slack -= spent
        used += spent
        i += run
    levels[order] = chosen
    return min_sum + used
