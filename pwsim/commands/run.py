"""Run a scenario for every policy (or those named) and write a results directory and report."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pagedweight.config.scenario import load_scenario
from pagedweight.errors import ScenarioError
from pagedweight.policy.policies import POLICY_NAMES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="scenario YAML file")
    p.add_argument("--policy", action="append", metavar="NAME", help=f"run only these ({', '.join(POLICY_NAMES)})")
    p.add_argument("--out", help="results directory (default runs/<scenario name>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a scenario key")
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="policies run at once, each in its own process (default: the CPU count, here %(default)s)",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress display (bars on a terminal, else a line per policy)"
    )
    p.add_argument("--no-report", action="store_true", help="skip report.html")


def run(args: argparse.Namespace) -> int:
    from pagedweight.results.backlog import overload_notes
    from pwsim.run import run_scenario

    for name in args.policy or []:  # before loading: a bad name is the error to report
        if name not in POLICY_NAMES:
            raise ScenarioError(f"--policy {name!r} unknown; allowed: {', '.join(POLICY_NAMES)}")
    if args.jobs < 1:
        raise ScenarioError(f"--jobs(={args.jobs}) must be >= 1")
    loaded = load_scenario(args.scenario, args.set)
    out = Path(args.out or Path("runs") / loaded.scenario.name)
    summary = run_scenario(
        loaded, out, policies=args.policy, progress=not args.no_progress, report=not args.no_report, jobs=args.jobs
    )
    print(f"{summary['scenario']}: {summary['model']} on {summary['gpu']}, {summary['trace']['num_requests']} requests")
    print(f"timed by: {summary['latency_model']}")
    print(summary["importance"])
    for note in summary["trace"]["notes"]:
        print(f"trace: {note}")
    for note in summary.get("notes", []):
        print(f"note: {note}")
    print(format_table(summary))
    for note in overload_notes(summary["policies"]):
        print(f"note: {note}")
    print(f"results: {out}/ (summary.json, requests.csv, steps.csv, report.html)")
    return 0


def _cell(value, spec: str) -> str:
    from pagedweight.results.report_data import fmt

    if isinstance(value, list):  # the precision ladder, most precise first
        return ">".join(map(str, value))
    return fmt(value, spec)


def format_table(summary: dict) -> str:
    """One row per policy; each column as wide as its widest cell, two spaces apart, so values
    of any magnitude (a TTFT of 1e6 ms and more) stay apart."""

    cols = [
        ("output_throughput", "out tok/s", "{:.1f}"),
        ("mean_ttft_ms", "TTFT ms", "{:.1f}"),
        ("p99_ttft_ms", "P99 TTFT", "{:.1f}"),
        ("mean_tpot_ms", "TPOT ms", "{:.2f}"),
        ("num_preemptions", "preempt", "{:.0f}"),
        ("mean_quality_proxy", "quality", "{:.4f}"),
        ("prefill_recompute_ratio", "prefill/prompt", "{:.2f}"),
        ("transitions_per_request", "trans/req", "{:.2f}"),
        ("prefix_cache_hit_rate", "prefix hit", "{:.1%}"),
        ("completed", "done", "{:.0f}"),
        ("precision_ladder", "precisions", "{}"),
    ]
    rows = [["policy", *(h for _, h, _ in cols)]]
    errors = {}
    for name, s in summary["policies"].items():
        if "error" in s:
            errors[len(rows)] = s["error"]
            rows.append([name])
        else:
            rows.append([name, *(_cell(s.get(k), spec) for k, _, spec in cols)])
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(rows[0]))]
    lines = []
    for n, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=False)]
        line = "  ".join(cells)
        lines.append(f"{line}  infeasible: {errors[n]}" if n in errors else line.rstrip())
    return "\n".join(lines)
