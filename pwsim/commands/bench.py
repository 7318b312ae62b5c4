"""The policy scoreboard: every policy on a suite of cells at several loads, each policy's
largest sustainable load by bisection; resumable, on local processes or Ray. See pwsim/bench.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", help="suite YAML file (e.g. scenarios/bench_small.yaml)")
    p.add_argument("--executor", choices=("local", "ray"), default="local", help="local process pool (default) or Ray")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    p.add_argument(
        "--workers", "--jobs", dest="workers", type=int, metavar="N", help="runs at once (default: the CPU count)"
    )
    p.add_argument("--out", help="suite directory (default runs/bench/<suite name>)")


def run(args: argparse.Namespace) -> int:
    from pwsim.bench import BenchError, load_suite, run_bench

    if args.workers is not None and args.workers < 1:
        raise BenchError(f"--workers(={args.workers}) must be >= 1")
    if args.address and args.executor != "ray":
        raise BenchError("--address is for --executor ray")
    suite = load_suite(args.suite)
    out = Path(args.out or Path("runs") / "bench" / suite.spec.name)
    result = run_bench(suite, out, executor=args.executor, workers=args.workers, address=args.address)
    print(f"ran {len(result['ran'])} runs, skipped {len(result['skipped'])} finished ones")
    print((out / "bench.md").read_text())
    print(f"results: {out}/ (bench.csv, sustainable.csv, bench.md, report.html, one directory per run)")
    return 0
