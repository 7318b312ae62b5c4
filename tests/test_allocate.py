"""Allocators against brute force on random small instances, and their contracts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedweight.core.spec import PRECISION_ID, PRECISION_NAMES, load_model
from pagedweight.errors import AllocationError
from pagedweight.policy.allocate import ALLOCATORS, Problem, allocate, quality
from pagedweight.policy.exact import kept_options, solve_exact
from pagedweight.policy.hull import MarginalPlanner, lower_hulls
from pagedweight.policy.importance import ImportanceTable, synthetic_table

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LADDER_POOL = ("bf16", "fp8", "int8", "int4", "int3", "int2")  # most precise first


def make_table(num_layers, num_experts, names, bytes_, dloss, importance, freq=None, mass=None) -> ImportanceTable:
    n = num_layers * num_experts
    return ImportanceTable(
        model="random",
        ladder=tuple(names),
        num_layers=num_layers,
        num_experts=num_experts,
        routing_freq=np.asarray(freq if freq is not None else np.full(n, 0.5), dtype=np.float64),
        routing_weight_mass=np.asarray(mass if mass is not None else np.full(n, 0.25), dtype=np.float64),
        importance=np.asarray(importance, dtype=np.float64),
        dloss=np.asarray(dloss, dtype=np.float64),
        bytes=np.asarray(bytes_, dtype=np.int64),
    )


@st.composite
def instances(draw, max_experts=6, max_precisions=4, with_pins=True):
    """A random table (bytes non-increasing down the ladder, losses in any order), pins and a
    feasible budget between the all-lowest and a little over the all-highest bytes."""
    num_layers = draw(st.integers(1, 2))
    num_experts = draw(st.integers(1, max_experts // num_layers))
    n = num_layers * num_experts
    mask = draw(st.lists(st.booleans(), min_size=len(LADDER_POOL), max_size=len(LADDER_POOL)))
    names = [p for p, keep in zip(LADDER_POOL, mask, strict=True) if keep][:max_precisions] or ["bf16"]
    p = len(names)
    raw = draw(st.lists(st.integers(1, 60), min_size=n * p, max_size=n * p))
    bytes_ = -np.sort(-np.array(raw).reshape(n, p), axis=1)
    loss = np.array(draw(st.lists(st.floats(0, 10, allow_subnormal=False), min_size=n * p, max_size=n * p)))
    loss = loss.reshape(n, p)
    if draw(st.booleans()):
        loss = np.sort(loss, axis=1)  # the usual case: less precise, more loss
    importance = draw(st.lists(st.floats(0, 10, allow_subnormal=False), min_size=n, max_size=n))
    freq = draw(st.lists(st.floats(0, 1, allow_subnormal=False), min_size=n, max_size=n))
    mass = draw(st.lists(st.floats(0, 1, allow_subnormal=False), min_size=n, max_size=n))
    table = make_table(num_layers, num_experts, names, bytes_, loss, importance, freq, mass)
    pins = np.full(n, -1, dtype=np.int8)
    if with_pins:
        for i in range(n):
            level = draw(st.integers(-1, p - 1) if draw(st.integers(0, 3)) == 0 else st.just(-1))
            if level >= 0:
                pins[i] = PRECISION_ID[names[level]]
    problem = Problem.build(table, pins)
    low = int(problem.min_bytes.sum())
    high = int(np.where(problem.allowed, table.bytes, 0).max(axis=1).sum())
    budget = draw(st.integers(low, high + 5))
    return table, pins, budget


def brute_force(problem: Problem, budget_bytes: int) -> float:
    """Minimum sum dloss over every combination of allowed options."""
    t = problem.table
    options = [np.flatnonzero(row) for row in problem.allowed]
    combos = np.array(list(itertools.product(*options)))
    rows = np.arange(t.num_rows)
    used = t.bytes[rows, combos].sum(axis=1)
    loss = t.dloss[rows, combos].sum(axis=1)
    return float(loss[used <= budget_bytes].min())


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-7 * max(1.0, abs(a), abs(b))


@FAST
@given(instances())
def test_exact_equals_brute_force(inst):
    table, pins, budget = inst
    problem = Problem.build(table, pins)
    plan = solve_exact(problem, budget)
    assert plan.proven_optimal
    assert close(plan.sum_dloss, brute_force(problem, budget))


@FAST
@given(instances())
def test_every_method_fits_the_budget_and_keeps_pins(inst):
    table, pins, budget = inst
    for method in ALLOCATORS:
        plan = allocate(table, budget, method, pinned=pins)
        assert plan.total_bytes <= budget, method
        assert plan.total_bytes == int(table.bytes[np.arange(table.num_rows), plan.levels].sum())
        pinned = pins >= 0
        assert (plan.precision_ids[pinned] == pins[pinned]).all(), method
        names = np.array(PRECISION_NAMES)[plan.precision_ids]
        assert (names == np.array(table.ladder)[plan.levels]).all()
        assert plan.precision_ids.dtype == np.int8


@FAST
@given(instances())
def test_marginal_lies_between_its_lp_bound_and_the_rounding_gap(inst):
    """LP bound <= optimum <= marginal <= LP bound + the split segment's gain, and marginal is
    never worse than paper-greedy (the safeguard); the hull greedy alone may be, by at most
    the largest hull step."""
    table, pins, budget = inst
    problem = Problem.build(table, pins)
    plan = allocate(table, budget, "marginal", pins)
    optimum = brute_force(problem, budget)
    assert plan.lp_bound is not None
    assert plan.lp_bound <= optimum + 1e-9 * max(1.0, optimum)
    assert plan.sum_dloss >= optimum - 1e-9 * max(1.0, optimum)
    planner = MarginalPlanner(problem)
    largest_step = float(planner.seg_gain.max()) if planner.num_segments else 0.0
    assert plan.sum_dloss <= plan.lp_bound + largest_step + 1e-9 * max(1.0, plan.sum_dloss)
    greedy = allocate(table, budget, "paper-greedy", pins)
    assert plan.sum_dloss <= greedy.sum_dloss + 1e-12 * max(1.0, greedy.sum_dloss)  # the safeguard
    hull = planner.plan(budget)
    assert hull.sum_dloss <= greedy.sum_dloss + largest_step + 1e-9 * max(1.0, greedy.sum_dloss)


def test_the_hull_greedy_alone_can_lose_to_paper_greedy_on_a_tiny_instance():
    """Why the bound above has a slack term: the LP prefix takes A (ratio 0.6) and strands the
    budget that C + B (ratios 0.59, 0.5) would have used exactly. With thousands of experts the
    stranded bytes are one step out of thousands; with three they decide the answer."""
    table = make_table(1, 3, ["bf16", "int4"], [[11, 1], [3, 1], [10, 1]], [[0, 6], [0, 1], [0, 5.3]], [1, 2, 3])
    marginal = MarginalPlanner(Problem.build(table)).plan(14)  # the hull greedy alone
    greedy = allocate(table, 14, "paper-greedy")
    best = allocate(table, 14, "exact")
    assert marginal.sum_dloss == pytest.approx(6.3)  # A upgraded: 1 + 5.3 left
    assert allocate(table, 14, "marginal").sum_dloss == pytest.approx(6.0)  # safeguarded: takes C + B
    assert greedy.sum_dloss == pytest.approx(6.0)  # C and B upgraded: 6 left
    assert best.sum_dloss == pytest.approx(6.0)
    assert marginal.lp_bound == pytest.approx(12.3 - 6 - (1 / 9) * 5.3)
    # One byte more: the 2 bytes left after the prefix fill B's upgrade; C stays split.
    filled = MarginalPlanner(Problem.build(table)).plan(15)
    assert filled.levels.tolist() == [0, 0, 1] and filled.total_bytes == 15
    assert filled.lp_bound == pytest.approx(12.3 - 6 - (2 / 9) * 5.3)


@pytest.mark.parametrize("model", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite"])
def test_marginal_beats_paper_greedy_on_model_scale_tables(model):
    """At real expert counts a hull step is tiny next to the total, and paper-greedy's all-or-
    nothing split (top experts at bf16, the rest at the bottom) loses by a wide margin."""
    table = synthetic_table(load_model(model), ("bf16", "fp8", "int8", "int4", "int3"), seed=3)
    low, high = int(table.bytes[:, -1].sum()), int(table.bytes[:, 0].sum())
    planner = MarginalPlanner(Problem.build(table))
    for frac in np.linspace(0.0, 1.0, 11):
        budget = low + int(frac * (high - low))
        marginal = planner.plan(budget)
        greedy = allocate(table, budget, "paper-greedy")
        assert marginal.sum_dloss <= greedy.sum_dloss * (1 + 1e-12)


@FAST
@given(instances(max_experts=5, max_precisions=3), st.lists(st.integers(0, 10**6), min_size=2, max_size=4))
def test_more_budget_never_worse_for_exact(inst, extra):
    table, pins, budget = inst
    problem = Problem.build(table, pins)
    losses = [solve_exact(problem, budget + e).sum_dloss for e in sorted(set(x % 40 for x in extra))]
    assert all(b <= a + 1e-7 * max(1.0, a) for a, b in itertools.pairwise(losses))


@FAST
@given(instances(max_experts=6, max_precisions=4), st.lists(st.integers(0, 10**9), min_size=1, max_size=8))
def test_incremental_marginal_equals_from_scratch(inst, draws):
    table, pins, budget = inst
    problem = Problem.build(table, pins)
    low = int(problem.min_bytes.sum())
    high = int(table.bytes.max(axis=1).sum()) + 3
    planner = MarginalPlanner(problem)
    for d in [budget, *draws]:
        b = low + d % (high - low + 1)
        again = planner.plan(b)
        fresh = MarginalPlanner(problem).plan(b)
        assert (again.levels == fresh.levels).all()
        assert again.sum_dloss == fresh.sum_dloss and again.lp_bound == pytest.approx(fresh.lp_bound, abs=1e-9)


def test_incremental_marginal_at_deepseek_scale_matches_fresh_plans():
    table = synthetic_table(load_model("deepseek-v3"), ("bf16", "fp8", "int8", "int4", "int3"), seed=1)
    problem = Problem.build(table)
    low, high = int(problem.min_bytes.sum()), int(table.bytes[:, 0].sum())
    planner = MarginalPlanner(problem)
    rng = np.random.default_rng(0)
    budget = (low + high) // 2
    for _ in range(6):
        budget = int(np.clip(budget + rng.integers(-(2**33), 2**33), low, high))
        assert (planner.plan(budget).levels == MarginalPlanner(problem).plan(budget).levels).all()


@FAST
@given(instances(with_pins=True))
def test_infeasible_budget_names_budget_and_minimum(inst):
    table, pins, _ = inst
    problem = Problem.build(table, pins)
    need = int(problem.min_bytes.sum())
    for method in ALLOCATORS:
        with pytest.raises(AllocationError, match=rf"budget_bytes={need - 1} .* minimum {need} "):
            allocate(table, need - 1, method, pinned=pins)
    assert allocate(table, need, "marginal", pinned=pins).total_bytes == need


def test_paper_greedy_follows_importance_order():
    """Descending I: the first expert takes bf16 only while the rest can still sit at int4."""
    b = [[10, 5, 2]] * 3
    loss = [[0, 1, 2]] * 3
    table = make_table(1, 3, ["bf16", "int8", "int4"], b, loss, importance=[1.0, 3.0, 2.0])
    # Budget 16: expert 1 (I=3) gets bf16 (10 + 2 + 2 <= 16); expert 2 then has 6 - 2 = 4 -> int4.
    plan = allocate(table, 16, "paper-greedy")
    assert plan.levels.tolist() == [2, 0, 2]
    assert plan.sum_importance_quality == pytest.approx(1 * 0.25 + 3 * 1.0 + 2 * 0.25)
    assert quality("bf16") == 1.0 and quality("int8") == 0.5 and quality("int4") == 0.25


def test_uniform_takes_the_most_precise_format_that_fits_everyone():
    table = make_table(1, 4, ["bf16", "fp8", "int4"], [[8, 4, 2]] * 4, [[0, 1, 2]] * 4, [1, 1, 1, 1])
    assert allocate(table, 31, "uniform").counts() == {"bf16": 0, "fp8": 4, "int4": 0}
    assert allocate(table, 32, "uniform").counts() == {"bf16": 4, "fp8": 0, "int4": 0}


def test_frequency_ranks_by_routing_weight_mass_within_each_layer():
    # Two layers of two experts; the budget lets one expert per layer take bf16.
    table = make_table(2, 2, ["bf16", "int4"], [[4, 1]] * 4, [[0, 1]] * 4, [9, 0, 9, 0], mass=[0.1, 0.9, 0.8, 0.2])
    plan = allocate(table, 10, "frequency")
    assert plan.levels.tolist() == [1, 0, 0, 1]  # by mass, not by importance


def test_lower_hull_drops_dominated_and_non_convex_points():
    # bytes 10, 6, 6, 3, 1; losses 0, 5, 4, 4.5, 8: (6, 5) loses to its twin (6, 4), and (6, 4) lies
    # above the chord (3, 4.5) -> (10, 0) (2.57 there); the other three are vertices.
    b = np.array([[10, 6, 6, 3, 1]])
    loss = np.array([[0.0, 5.0, 4.0, 4.5, 8.0]])
    hull, size = lower_hulls(b, loss, np.ones_like(b, dtype=bool))
    assert size.tolist() == [3]
    assert hull[0, :3].tolist() == [4, 3, 0]
    assert (hull[0, 3:] == -1).all()


def test_exact_drops_only_dominated_options():
    table = make_table(1, 1, ["bf16", "fp8", "int8", "int4"], [[8, 4, 4, 2]], [[0, 3, 1, 5]], [1])
    assert kept_options(Problem.build(table)).tolist() == [[True, False, True, True]]


def test_pin_outside_the_ladder_is_rejected():
    table = make_table(1, 2, ["bf16", "int4"], [[4, 1]] * 2, [[0, 1]] * 2, [1, 1])
    with pytest.raises(AllocationError, match=r"pinned at fp8, which is not in the table's ladder"):
        allocate(table, 10, "marginal", pinned=np.array([PRECISION_ID["fp8"], -1]))
    with pytest.raises(AllocationError, match="unknown allocation method 'best'; allowed: paper-greedy"):
        allocate(table, 10, "best")


def test_tables_built_in_code_with_rising_bytes_are_rejected():
    table = make_table(1, 2, ["bf16", "int4"], [[4, 1], [2, 3]], [[0, 1]] * 2, [1, 1])
    with pytest.raises(AllocationError, match=r"expert 1: bytes \[2, 3\] increase down the ladder \['bf16', 'int4'\]"):
        allocate(table, 10, "marginal")


def test_exact_regression_three_experts_with_a_pin():
    """Hypothesis found this: HiGHS given the marginal plan as a warm start called it optimal."""
    z = np.zeros(3)
    table = ImportanceTable(
        model="random", ladder=("int8", "int4", "int3", "int2"), num_layers=1, num_experts=3,
        routing_freq=z.copy(), routing_weight_mass=z.copy(), importance=z.copy(),
        dloss=np.array([[0.0, 0, 2, 4], [0, 0, 0, 0], [0, 3, 6, 7]]),
        bytes=np.array([[14, 14, 9, 1], [10, 1, 1, 1], [28, 20, 5, 1]]),
    )  # fmt: skip
    problem = Problem.build(table, np.array([-1, PRECISION_ID["int8"], -1], dtype=np.int8))
    plan = solve_exact(problem, 51)
    assert plan.sum_dloss == pytest.approx(2.0) == brute_force(problem, 51)


def _sweep_by_loop(problem: Problem, order: np.ndarray, budget_bytes: int) -> tuple[list[int], int]:
    """The sweep as the paper states it, one expert at a time: the reference for ``_sweep``."""
    t = problem.table
    levels = [0] * len(order)
    remaining = budget_bytes
    reserve = int(problem.min_bytes[order].sum())
    for expert in order.tolist():
        reserve -= int(problem.min_bytes[expert])
        room = remaining - reserve
        level = next(j for j in range(t.bytes.shape[1]) if problem.allowed[expert, j] and t.bytes[expert, j] <= room)
        levels[expert] = level
        remaining -= int(t.bytes[expert, level])
    return levels, budget_bytes - remaining


@FAST
@given(instances(max_experts=12), st.randoms(use_true_random=False))
def test_the_vectorised_sweep_is_the_loop_exactly(inst, rnd):
    """Runs of experts in array operations (``problem._sweep``) choose what the loop over experts
    chooses, in any order, with pins, at any feasible budget."""
    from pagedweight.policy.problem import _sweep

    table, pins, budget = inst
    problem = Problem.build(table, pins)
    order = np.arange(table.num_rows)
    rnd.shuffle(order)
    for b in (budget, int(problem.min_bytes.sum()), int(table.bytes[:, 0].sum()) + 3):
        want, want_used = _sweep_by_loop(problem, order, b)
        levels = np.full(table.num_rows, -1, dtype=np.int64)
        assert _sweep(problem, order, b, levels) == want_used
        assert levels.tolist() == want


def test_the_vectorised_sweep_on_a_model_scale_table_with_mixed_sizes():
    """6,144 experts of three sizes in importance order, some pinned: the same levels as the
    loop at budgets across the whole range."""
    from pagedweight.policy.problem import _sweep

    rng = np.random.default_rng(7)
    n = 6144
    base = rng.choice([3, 4, 5], size=n)[:, None] * np.array([[16, 8, 4]])
    table = make_table(48, 128, ["bf16", "int8", "int4"], base, np.tile([0.0, 1.0, 2.0], (n, 1)), rng.random(n))
    pins = np.where(rng.random(n) < 0.05, PRECISION_ID["int8"], -1).astype(np.int8)
    problem = Problem.build(table, pins)
    order, rows = problem.greedy_order
    lo, hi = int(problem.min_bytes.sum()), int(table.bytes[:, 0].sum())
    for b in np.linspace(lo, hi, 9).astype(int).tolist():
        levels = np.zeros(n, dtype=np.int64)
        used = _sweep(problem, order, b, levels, rows)
        want, want_used = _sweep_by_loop(problem, order, b)
        assert used == want_used and levels.tolist() == want
