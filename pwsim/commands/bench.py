"""The policy scoreboard: every policy on a suite of cells at several loads, each policy's
largest sustainable load by bisection; resumable, on local processes or Ray. See pwsim/bench.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pwsim.commands.sweep import add_executor_arguments, check_executor_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", help="suite YAML file (e.g. scenarios/bench_small.yaml)")
    add_executor_arguments(p, "runs", "suite directory (default runs/bench/<suite name>)")
    p.add_argument(
        "--tables",
        action="store_true",
        help="keep every run's step, transition and initial-precision tables as `pwsim run` writes them "
        "(default: each run's summary.json and requests.csv, all the scoreboard reads); runs already "
        "finished are kept as they are",
    )


def run(args: argparse.Namespace) -> int:
    from pwsim.bench import BenchError, load_suite, run_bench

    check_executor_arguments(args, BenchError)
    suite = load_suite(args.suite)
    out = Path(args.out or Path("runs") / "bench" / suite.spec.name)
    result = run_bench(
        suite, out, executor=args.executor, workers=args.workers, address=args.address, step_tables=args.tables
    )
    print(f"ran {len(result['ran'])} runs, skipped {len(result['skipped'])} finished ones")
    print((out / "bench.md").read_text())
    per_run = "its tables" if args.tables else "its summary and request table; --tables keeps the step tables too"
    print(f"results: {out}/ (bench.csv, sustainable.csv, bench.md, report.html, one directory per run: {per_run})")
    return 0
