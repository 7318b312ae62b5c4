"""Build report.html (and its PNGs) from one or more results directories.

Given a simulated and a real run of the same scenario, the report also puts their metrics side
by side with the simulator's signed % error.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dirs", nargs="+", metavar="DIR", help="results directories (from pwsim run or pwgpu)")
    p.add_argument("--out", metavar="FILE", help="report file (default DIR/report.html for one DIR, else report.html)")


def run(args: argparse.Namespace) -> int:
    from pagedweight.results.report import write_report

    dirs = [Path(d) for d in args.dirs]
    out = Path(args.out) if args.out else (dirs[0] / "report.html" if len(dirs) == 1 else Path("report.html"))
    write_report(dirs, out)
    print(f"report: {out} (PNGs beside it)")
    return 0
