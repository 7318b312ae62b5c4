"""Run a grid of scenario variants and draw Pareto plots; re-running skips finished cells.

The grid may span any scenario key: memory budget, load scale, policies, model, GPU, ...

The sweep file: name, scenario (path, relative to the sweep file), set (dotted key: value for
every cell), grid (dotted key: [values]), cell_reports (bool). See pwsim/sweep.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pwsim.executor import EXECUTORS


def add_executor_arguments(p: argparse.ArgumentParser, runs: str, out_help: str) -> None:
    """The options of a command that runs independent ``runs`` on the sweep executor (``pwsim
    sweep``, ``pwsim bench``): where they run, how many at once, and the output directory."""
    p.add_argument("--executor", choices=EXECUTORS, default="local", help="local process pool (default) or Ray")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    p.add_argument(
        "--workers",
        "--jobs",
        dest="workers",
        type=int,
        metavar="N",
        help=f"{runs} at once, each in its own process (local default: the CPU count; Ray without --address: CPUs)",
    )
    p.add_argument("--out", help=out_help)


def check_executor_arguments(args: argparse.Namespace, error: type[Exception]) -> None:
    """One-line errors (``error``) for executor options that cannot work together."""
    if args.workers is not None and args.workers < 1:
        raise error(f"--workers(={args.workers}) must be >= 1")
    if args.address and args.executor != "ray":
        raise error("--address is for --executor ray")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", help="sweep YAML file")
    add_executor_arguments(p, "cells", "sweep directory (default runs/sweeps/<sweep name>)")


def run(args: argparse.Namespace) -> int:
    from pwsim.sweep import SweepError, load_sweep, run_sweep

    check_executor_arguments(args, SweepError)
    sweep = load_sweep(args.sweep)
    out = Path(args.out or Path("runs") / "sweeps" / sweep.spec.name)
    result = run_sweep(sweep, out, executor=args.executor, workers=args.workers, address=args.address)
    print(f"ran {len(result['ran'])} cells, skipped {len(result['skipped'])} finished ones")
    print(f"results: {out}/ (sweep.csv, sweep.json, report.html, one directory per cell)")
    return 0
