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

The problem and plan types are ``pagedweight.policy.problem``; the paper's ``Q(p)`` is
``problem.quality``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pagedweight.errors import AllocationError
from pagedweight.policy.exact import solve_exact
from pagedweight.policy.hull import MarginalPlanner
from pagedweight.policy.importance import ImportanceTable
from pagedweight.policy.problem import Plan, Problem, _sweep, make_plan, quality

__all__ = ["ALLOCATORS", "Plan", "Problem", "allocate", "make_plan", "quality"]


def paper_greedy(problem: Problem, budget_bytes: int) -> Plan:
    """Experts in descending ``I_i`` (ties: lower row first), each given the highest precision
    that still leaves room for every remaining expert at the lowest precision."""
    problem.check_budget(budget_bytes)
    order, rows = problem.greedy_order
    levels = np.zeros(len(order), dtype=np.int64)
    _sweep(problem, order, budget_bytes, levels, rows)
    return make_plan(problem, "paper-greedy", levels, budget_bytes)


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
    levels = np.zeros(t.num_rows, dtype=np.int64)
    carry = 0
    for layer in range(t.num_layers):
        rows = np.arange(layer * t.num_experts, (layer + 1) * t.num_experts)
        layer_budget = int(problem.min_bytes[rows].sum()) + int(slack * share[layer]) + carry
        order = rows[np.argsort(-t.routing_weight_mass[rows], kind="stable")]
        carry = layer_budget - _sweep(problem, order, layer_budget, levels)
    return make_plan(problem, "frequency", levels, budget_bytes)


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
    plan = MarginalPlanner(problem).plan(budget_bytes)
    other = paper_greedy(problem, budget_bytes)
    if other.sum_dloss < plan.sum_dloss:
        return make_plan(problem, "marginal", other.levels, budget_bytes, lp_bound=plan.lp_bound)
    return plan


def exact(problem: Problem, budget_bytes: int) -> Plan:
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
