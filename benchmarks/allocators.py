"""Decision time and quality of every allocator, side by side, on synthetic model-scale tables.

    python benchmarks/allocators.py [--exact-time-limit-s 20] [--seed 0]

For each model and budget (a fraction of the bytes with every expert at bf16) it prints one row
per method: full decision time (median of repeats), sum dloss, its gap to the exact optimum and
to the LP bound. For ``marginal`` it also prints the incremental re-plan time over a random walk
of small budget changes (2 MiB .. 512 MiB, a page to a few experts; p50/p90/p99) and of large
ones (+-10% of the budget; p50). Percentiles above p90 move with the machine's load (printed).
``exact`` runs under a time limit; where it does not prove optimality the gap is an upper bound
(its incumbent) and the LP gap bounds the truth from the other side. Tables are SYNTHETIC
(``pagedweight.policy.importance.synthetic_table``), so the quality columns compare methods on a
plausible skew, not on a real model's measured losses.

Every method plans on the case's whole ladder; the row ``paper-greedy/P`` is the paper-greedy
allocator on the paper's own ladder (the top precision, INT8, INT4: what the ``paper-greedy``
policy uses), its loss compared with the same exact optimum on the whole ladder.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

from pagedweight.core.spec import load_model
from pagedweight.policy.allocate import ALLOCATORS, Problem
from pagedweight.policy.exact import solve_exact
from pagedweight.policy.hull import MarginalPlanner
from pagedweight.policy.importance import on_ladder, synthetic_table
from pagedweight.policy.policies import policy_ladder

MiB = 2**20
CASES = (
    ("mixtral-8x7b", ("bf16", "fp8", "int8", "int4")),
    ("deepseek-v3", ("bf16", "fp8", "int8", "int4", "int3")),
)
FRACTIONS = (0.35, 0.5, 0.7)


def timed(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times) * 1e3


def incremental_ms(planner: MarginalPlanner, budget: int, low: int, high: int, rng, small: bool) -> tuple[float, ...]:
    planner.plan(budget)
    times = []
    for _ in range(400 if small else 50):
        if small:
            step = int(rng.integers(2 * MiB, 512 * MiB)) * int(rng.choice([-1, 1]))
        else:
            step = int(0.1 * budget) * int(rng.choice([-1, 1]))
        budget = int(np.clip(budget + step, low, high))
        start = time.perf_counter()
        planner.plan(budget)
        times.append(time.perf_counter() - start)
    return tuple(float(np.percentile(times, q) * 1e3) for q in (50, 90, 99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exact-time-limit-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# Python {platform.python_version()}, {os.cpu_count()} CPUs, numpy {np.__version__}, load average {load}")
    print(f"# tables: SYNTHETIC (synthetic_table defaults, seed {args.seed}); budgets: fractions of all-bf16 bytes")
    columns = [("model", 13), ("experts", 9), ("budget", 6), ("method", 12), ("full_ms", 9), ("incr_p50_ms", 11)]
    columns += [("incr_p90_ms", 11), ("incr_p99_ms", 11), ("big_p50_ms", 10), ("sum_dloss", 11), ("vs_exact", 9)]
    columns += [("vs_LP", 8)]
    print(" ".join(f"{c:>{w}s}" for c, w in columns) + "  per precision")
    for name, ladder in CASES:
        table = synthetic_table(load_model(name), ladder, seed=args.seed)
        problem = Problem.build(table)
        low, high = int(problem.min_bytes.sum()), int(table.bytes[:, 0].sum())
        shape = f"{table.num_rows}x{len(ladder)}"
        for frac in FRACTIONS:
            budget = int(frac * high)
            exact, exact_ms = timed(lambda p=problem, b=budget: solve_exact(p, b, args.exact_time_limit_s), 1)
            lp = MarginalPlanner(problem).plan(budget).lp_bound
            paper_problem = Problem.build(on_ladder(table, policy_ladder("paper-greedy", ladder)))
            for method in (*ALLOCATORS, "paper-greedy/P"):
                if method == "exact":
                    plan, full_ms = exact, exact_ms
                elif method == "paper-greedy/P":
                    plan, full_ms = timed(lambda p=paper_problem, b=budget: ALLOCATORS["paper-greedy"](p, b), 3)
                else:
                    repeats = 3 if table.num_rows > 1000 else 20
                    plan, full_ms = timed(lambda p=problem, m=method, b=budget: ALLOCATORS[m](p, b), repeats)
                incr = big = ("", "", "")
                if method == "marginal":
                    planner = MarginalPlanner(problem)
                    incr = tuple(f"{x:.3f}" for x in incremental_ms(planner, budget, low, high, rng, small=True))
                    big = tuple(f"{x:.3f}" for x in incremental_ms(planner, budget, low, high, rng, small=False))
                vs_exact = 100 * (plan.sum_dloss - exact.sum_dloss) / exact.sum_dloss
                vs_lp = 100 * (plan.sum_dloss - lp) / lp
                tag = "" if method != "exact" else (" (optimal)" if exact.proven_optimal else " (time limit)")
                counts = " ".join(f"{k}:{v}" for k, v in plan.counts().items())
                cells = [name, shape, f"{frac:.2f}", method, f"{full_ms:.2f}", *incr, big[0]]
                cells += [f"{plan.sum_dloss:.5g}", f"{vs_exact:.3f}%", f"{vs_lp:.3f}%"]
                print(" ".join(f"{c:>{w}s}" for c, (_, w) in zip(cells, columns, strict=True)) + f"  {counts}{tag}")


if __name__ == "__main__":
    main()
