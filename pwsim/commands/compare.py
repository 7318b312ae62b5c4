"""Print a table across results directories: one row per run and policy, key metrics as columns."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dirs", nargs="+", metavar="DIR", help="results directories (from pwsim run, pwgpu or a sweep cell)")
    p.add_argument("--csv", action="store_true", help="comma-separated output for scripts")


def run(args: argparse.Namespace) -> int:
    from pagedweight.results.report_data import compare_table, format_compare

    table = compare_table(args.dirs)
    print(table.to_csv(index=False).rstrip() if args.csv else format_compare(table))
    return 0
