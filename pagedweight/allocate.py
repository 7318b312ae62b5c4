"""Allocators: one precision per routed expert, total bytes within a budget.

Every allocator solves the same problem on an ``ImportanceTable``: pick for each expert i a
precision ``p_i`` from the table's ladder so that ``sum_i bytes_i(p_i) <= budget_bytes``. The
budget covers routed experts only (the caller subtracts attention, embeddings, routers and shared
experts). ``pinned`` forces chosen experts to one precision (an upgrade still in flight, an expert
an operator keeps exact); their bytes count against the budget like any other.

Methods (``ALLOCATORS``):
- ``paper-greedy``: the paper's algorithm, verbatim; maximises ``sum_i I_i * Q(p_i)``.
- ``marginal``: minimises ``sum_i dloss_i(p_i)`` by marginal loss per byte over each expert's
  lower convex hull, with the LP bound; incremental in the budget (``MarginalPlanner``); the
  full method is safeguarded to be never worse than ``paper-greedy``.
- ``exact``: the optimum of ``sum_i dloss_i(p_i)`` (MILP through HiGHS), to measure gaps.
- ``uniform``: every expert at the most precise format that fits for all.
- ``frequency``: MC-MoE-like, experts ranked by routing-weight mass within per-layer budgets.

``Q(p) = weight_bits(p) / 16``: the paper's quality of a precision, 1 for BF16/FP16, 0.5 for
FP8/INT8, 0.25 for INT4 (scales not counted, as in the paper).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pagedweight.errors import AllocationError
from pagedweight.importance import ImportanceTable
from pagedweight.spec import PRECISION_ID, PRECISION_NAMES, PRECISIONS


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


def _sweep_rows(problem: Problem, order: np.ndarray) -> tuple[list[int], list, list, list[int]]:
    """``order`` and the bytes, allowed and cheapest-bytes rows in that order, as lists."""
    bytes_rows, allowed_rows = problem.table.bytes[order].tolist(), problem.allowed[order].tolist()
    return order.tolist(), bytes_rows, allowed_rows, problem.min_bytes[order].tolist()


def _sweep(problem: Problem, order: np.ndarray, budget_bytes: int, levels: list[int], rows=None) -> int:
    """Experts in ``order`` each take the most precise allowed option that still leaves room for
    every later expert of ``order`` at its cheapest option. Writes ``levels``; returns bytes used.
    ``rows``: ``_sweep_rows(problem, order)`` when the caller has them already."""
    order_list, bytes_rows, allowed_rows, min_rows = rows or _sweep_rows(problem, order)
    reserve = sum(min_rows)  # cheapest bytes of the experts not yet placed, this one included
    remaining = budget_bytes
    for i, expert in enumerate(order_list):
        reserve -= min_rows[i]
        room = remaining - reserve
        for level, (b, ok) in enumerate(zip(bytes_rows[i], allowed_rows[i], strict=True)):
            if ok and b <= room:  # ladder order: the first that fits is the most precise
                levels[expert] = level
                remaining -= b
                break
        else:
            raise AssertionError("sweep ran out of budget after the feasibility check")
    return budget_bytes - remaining


def paper_greedy(problem: Problem, budget_bytes: int) -> Plan:
    """Experts in descending ``I_i`` (ties: lower row first), each given the highest precision
    that still leaves room for every remaining expert at the lowest precision."""
    problem.check_budget(budget_bytes)
    order, rows = problem.greedy_order
    levels = [0] * len(order)
    _sweep(problem, order, budget_bytes, levels, rows)
    return make_plan(problem, "paper-greedy", np.array(levels), budget_bytes)


def frequency(problem: Problem, budget_bytes: int) -> Plan:
    """MC-MoE-like: score = routing frequency x mean gate weight when routed, which is the
    routing-weight mass. Each layer gets the budget's slack above the all-lowest bytes in
    proportion to what its experts could use (MC-MoE plans bit widths per layer); within a layer,
    experts in descending score take the most precise option that leaves room for the rest.
    Bytes a layer cannot use pass to the next layer."""
    problem.check_budget(budget_bytes)
    t = problem.table
    max_bytes = np.where(problem.allowed, t.bytes, 0).max(axis=1)
    upgrade = t.grid(max_bytes - problem.min_bytes).sum(axis=1)
    slack = budget_bytes - int(problem.min_bytes.sum())
    share = upgrade / upgrade.sum() if upgrade.sum() > 0 else np.zeros(t.num_layers)
    levels = [0] * t.num_rows
    carry = 0
    for layer in range(t.num_layers):
        rows = np.arange(layer * t.num_experts, (layer + 1) * t.num_experts)
        layer_budget = int(problem.min_bytes[rows].sum()) + int(slack * share[layer]) + carry
        order = rows[np.argsort(-t.routing_weight_mass[rows], kind="stable")]
        carry = layer_budget - _sweep(problem, order, layer_budget, levels)
    return make_plan(problem, "frequency", np.array(levels), budget_bytes)


def uniform(problem: Problem, budget_bytes: int) -> Plan:
    """The most precise ladder format that fits with every free expert at it."""
    problem.check_budget(budget_bytes)
    t = problem.table
    for level in range(len(t.ladder)):
        levels = np.where(problem.allowed[:, level], level, problem.allowed.argmax(axis=1))
        if t.bytes[np.arange(t.num_rows), levels].sum() <= budget_bytes:
            return make_plan(problem, "uniform", levels, budget_bytes)
    raise AssertionError("the cheapest uniform plan exceeds a budget that passed the feasibility check")


def marginal(problem: Problem, budget_bytes: int) -> Plan:
    """The hull greedy, safeguarded: when paper-greedy's plan has the lower sum dL (possible on
    tiny instances, where the bytes the LP prefix strands decide the answer; see the tests),
    take that one. Both fit the budget; the LP bound stays the hull's. The controller's
    incremental re-plans use ``MarginalPlanner`` alone, for speed (~0.25 ms vs ~20 ms at
    DeepSeek-V3 scale), where one hull step is negligible."""
    from pagedweight.allocate_hull import MarginalPlanner

    plan = MarginalPlanner(problem).plan(budget_bytes)
    other = paper_greedy(problem, budget_bytes)
    if other.sum_dloss < plan.sum_dloss:
        return make_plan(problem, "marginal", other.levels, budget_bytes, lp_bound=plan.lp_bound)
    return plan


def exact(problem: Problem, budget_bytes: int) -> Plan:
    from pagedweight.allocate_exact import solve_exact

    return solve_exact(problem, budget_bytes)


ALLOCATORS: dict[str, Callable[[Problem, int], Plan]] = {
    "paper-greedy": paper_greedy,
    "marginal": marginal,
    "exact": exact,
    "uniform": uniform,
    "frequency": frequency,
}


def allocate(
    table: ImportanceTable, budget_bytes: int, method: str = "marginal", pinned: np.ndarray | None = None
) -> Plan:
    """Plan ``table`` into ``budget_bytes`` with the allocator named ``method``."""
    try:
        solver = ALLOCATORS[method]
    except KeyError:
        raise AllocationError(f"unknown allocation method {method!r}; allowed: {', '.join(ALLOCATORS)}") from None
    return solver(Problem.build(table, pinned), int(budget_bytes))
