"""Plan one precision per routed expert within a memory budget, from an importance table.

Prints the plan's objectives, bytes used and experts per precision; --out writes one row per
expert (layer, expert, precision, bytes, dloss). Budgets cover routed experts only.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from pagedweight.core.spec import DEFAULT_LADDER, load_model
from pagedweight.errors import AllocationError
from pagedweight.policy.allocate import ALLOCATORS, Plan, allocate
from pagedweight.policy.importance import ImportanceTable, read_table, synthetic_table

GiB = 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--importance", metavar="TABLE.csv", help="importance table (see pagedweight/policy/importance.py)"
    )
    src.add_argument(
        "--synthetic-model", metavar="MODEL", help="plan a synthetic table for a built-in model (marked SYNTHETIC)"
    )
    p.add_argument("--ladder", default=",".join(DEFAULT_LADDER), help="precisions of a synthetic table (comma list)")
    p.add_argument("--seed", type=int, default=0, help="seed of a synthetic table")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-bytes", type=int, help="bytes for all routed experts")
    budget.add_argument(
        "--budget-fraction", type=float, help="fraction of the bytes with every expert at the ladder's top precision"
    )
    p.add_argument("--method", choices=list(ALLOCATORS), default="marginal")
    p.add_argument("--out", metavar="PLAN.csv", help="write one row per expert")


def budget_from_args(table: ImportanceTable, args: argparse.Namespace) -> int:
    if args.budget_bytes is not None:
        return args.budget_bytes
    if not 0 < args.budget_fraction <= 1:
        raise AllocationError(f"--budget-fraction(={args.budget_fraction}) must be in (0, 1]")
    return int(args.budget_fraction * int(table.bytes[:, 0].sum()))


def write_plan(table: ImportanceTable, plan: Plan, path: str | Path) -> None:
    rows = np.arange(table.num_rows)
    lines = [
        f"# {table.provenance}",
        f"# method: {plan.method}; budget_bytes: {plan.budget_bytes}; total_bytes: {plan.total_bytes}; "
        f"sum_dloss: {plan.sum_dloss!r}",
        "layer,expert,precision,bytes,dloss",
    ]
    names = np.array(plan.ladder)[plan.levels].tolist()
    plan_bytes = table.bytes[rows, plan.levels].tolist()
    plan_loss = table.dloss[rows, plan.levels].tolist()
    for i in rows.tolist():
        layer, expert = divmod(i, table.num_experts)
        lines.append(f"{layer},{expert},{names[i]},{plan_bytes[i]},{plan_loss[i]!r}")
    Path(path).write_text("\n".join(lines) + "\n")


def run(args: argparse.Namespace) -> int:
    if args.importance:
        table = read_table(args.importance)
    else:
        ladder_names = tuple(s.strip() for s in args.ladder.split(",") if s.strip())
        table = synthetic_table(load_model(args.synthetic_model), ladder_names, seed=args.seed)
    budget_bytes = budget_from_args(table, args)
    start = time.perf_counter()
    plan = allocate(table, budget_bytes, args.method)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    top_bytes = int(table.bytes[:, 0].sum())

    print(table.provenance)
    print(f"method {plan.method}: {table.num_rows} experts ({table.num_layers} layers x {table.num_experts})")
    print(
        f"budget {budget_bytes} bytes ({budget_bytes / GiB:.3f} GiB, {budget_bytes / top_bytes:.1%} of all at "
        f"{table.ladder[0]}); used {plan.total_bytes} bytes ({plan.total_bytes / GiB:.3f} GiB)"
    )
    line = f"sum dloss {plan.sum_dloss:.6g}  sum I*Q {plan.sum_importance_quality:.6g}"
    if plan.lp_bound is not None:
        gap = (plan.sum_dloss - plan.lp_bound) / plan.lp_bound if plan.lp_bound > 0 else 0.0
        line += f"  LP bound {plan.lp_bound:.6g} (gap {gap:.3%})"
    if plan.method == "exact":
        line += "  proven optimal" if plan.proven_optimal else "  NOT proven optimal"
    print(line)
    print("experts per precision: " + "  ".join(f"{k} {v}" for k, v in plan.counts().items()))
    print(f"decision time {elapsed_ms:.2f} ms")
    if args.out:
        write_plan(table, plan, args.out)
        print(f"wrote {args.out}")
    return 0
