"""Compare a simulated and a real run of one scenario and print signed % errors.

    pwsim validate --real DIR --sim DIR [--out validation.json] [--check]
    pwsim validate SCENARIO [--policy NAME ...] [--out-dir DIR] [--check]

The second form runs both: the simulator here, and the real engine through the ``pwgpu run``
command (a separate process: the simulator never imports the engine; they meet through files).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from pagedweight.cli_util import EXIT_FAILED
from pagedweight.errors import PagedWeightError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", nargs="?", help="scenario YAML: run it in both runtimes, then compare")
    p.add_argument("--real", help="results directory of a real (pwgpu) run")
    p.add_argument("--sim", help="results directory of a simulated (pwsim) run")
    p.add_argument("--policy", action="append", metavar="NAME", help="with SCENARIO: run only these policies")
    p.add_argument("--out-dir", help="with SCENARIO: where both runs go (default runs/<name>-validate)")
    p.add_argument("--out", help="validation.json path (default: beside the simulated run)")
    p.add_argument("--check", action="store_true", help="exit 1 when an error is outside its bound")
    p.add_argument("--no-bounds", action="store_true", help="report errors without checking bounds (CPU runs)")


def run(args: argparse.Namespace) -> int:
    from pagedweight.results import atomic_write_text
    from pagedweight.validation import compare, format_validation

    if args.scenario:
        if args.real or args.sim:
            raise PagedWeightError("give either SCENARIO or --real/--sim, not both")
        real_dir, sim_dir = _run_both(args)
    else:
        if not (args.real and args.sim):
            raise PagedWeightError("give SCENARIO, or both --real DIR and --sim DIR")
        real_dir, sim_dir = Path(args.real), Path(args.sim)
    v = compare(real_dir, sim_dir, bounds={} if args.no_bounds else None)
    out = Path(args.out) if args.out else sim_dir / "validation.json"
    atomic_write_text(out, json.dumps(v, indent=2, default=float) + "\n")
    from pagedweight.report import write_report

    page = write_report([sim_dir, real_dir], out.with_name("validation_report.html"))
    print(format_validation(v))
    print(f"written: {out}, {page}")
    return EXIT_FAILED if args.check and not v["all_within_bounds"] else 0


def _run_both(args: argparse.Namespace) -> tuple[Path, Path]:
    from pagedweight.scenario import load_scenario
    from pwsim.run import run_scenario

    loaded = load_scenario(args.scenario)
    base = Path(args.out_dir or Path("runs") / f"{loaded.scenario.name}-validate")
    sim_dir, real_dir = base / "sim", base / "real"
    # The engine runs as its own process (``python -m pwgpu.cli``, so a checkout on PYTHONPATH
    # works too): the simulator never imports it.
    if importlib.util.find_spec("pwgpu") is None or importlib.util.find_spec("torch") is None:
        raise PagedWeightError("the real run needs pwgpu and torch (pip install -e '.[gpu]')")
    cmd = [sys.executable, "-m", "pwgpu.cli", "run", "--scenario", str(args.scenario), "--out", str(real_dir)]
    if args.policy:
        cmd += ["--policies", ",".join(args.policy)]
    if subprocess.run(cmd).returncode != 0:
        raise PagedWeightError(f"the real run failed: {' '.join(cmd)}")
    run_scenario(loaded, sim_dir, policies=args.policy, progress=False, report=False)
    return real_dir, sim_dir
