"""Compare a simulated and a real run of one scenario and print signed % errors.

    pwsim validate --real DIR --sim DIR [--out DIR | --out FILE.json] [--check]
    pwsim validate SCENARIO [--policy NAME ...] [--out-dir DIR] [--check] [--calibrate [POLICIES]] [--profile]
                   [--threads N] [--repeats N]

The second form runs both: the simulator here, and the real engine through the ``pwgpu run``
command (a separate process: the simulator never imports the engine; they meet through files).
``--profile`` measures the scenario's latency table here (``pwgpu profile --scenario``) before
each real run and once after the last, and times the simulation by each row's median: on a
machine whose speed drifts (a shared VM ran the same table 0.5-0.8x as long minutes apart, and
not alike for every op), a table measured across the real runs is the fair one.

``--calibrate`` fits a per-deployment term to the real run: the simulator is re-run with the
step overhead moved by the step-time gap until the gap is under 1% of a real step (a few runs).
The gap is taken between steps of the same shape class (``matched_step_times``), not between
the runs' mean steps, whose mixes of shapes differ. Where even no overhead leaves the simulated
steps slower (the machine ran faster than when a table was profiled), the table's times are
scaled down instead. Fit on one policy (``--calibrate static-fp16``) and the errors of the
others are out of sample; fitted on all, every error is in sample. The uncalibrated errors
stay in the output beside the calibrated ones.

``--repeats N`` runs the engine N times (the policies' order reversed every other run) and
compares the typical run (``pagedweight.results.pooled``), printing each run's own figures and
how far two halves of the runs differ (``split_half_perc``), the finest error the check resolves.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
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
    p.add_argument(
        "--out",
        help="a directory for validation.json and validation_report.html, or a FILE.json (the report goes "
        "beside it); default: the simulated run's directory",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when an error is outside its bound")
    p.add_argument("--no-bounds", action="store_true", help="report errors without checking bounds (CPU runs)")
    p.add_argument(
        "--calibrate",
        nargs="?",
        const="all",
        metavar="POLICIES",
        help="with SCENARIO: fit the step overhead to the real run of these policies (comma list; default all), "
        "then compare the calibrated simulation",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="with SCENARIO: the profiler and the engine compute with N CPU threads (OMP_NUM_THREADS); on "
        "cores shared with other jobs 1 keeps each op from waiting on a descheduled thread",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="with SCENARIO: run the real engine N times, the policies in alternating order, and compare "
        "the simulation with the typical run (the medians of the runs' figures; each run's own printed beside "
        "the errors); default 1",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="with SCENARIO: measure its latency table here (pwgpu profile --scenario) before each real run "
        "and after the last, and time the simulation by each row's median, so the table and the real runs "
        "see the machine in the same states",
    )


def run(args: argparse.Namespace) -> int:
    from pagedweight.policy.policies import POLICY_NAMES
    from pagedweight.results.validation import compare, format_validation
    from pagedweight.results.writer import atomic_write_text

    unknown = [p for p in args.policy or [] if p not in POLICY_NAMES]
    if unknown:  # before minutes of profiling and real runs
        raise PagedWeightError(f"--policy {unknown[0]!r} unknown; allowed: {', '.join(POLICY_NAMES)}")
    calibration = None
    args.overrides = []
    if args.scenario:
        if args.real or args.sim:
            raise PagedWeightError("give either SCENARIO or --real/--sim, not both")
        if args.calibrate:
            _check_calibrate_policies(args)  # before minutes of real run, not after
        real_dir, sim_dir = _run_both(args)
        if args.calibrate:
            calibration, sim_dir = _calibrate(args, real_dir, sim_dir)
    else:
        if getattr(args, "repeats", 1) != 1:
            raise PagedWeightError("--repeats runs the engine: give SCENARIO, not --real/--sim")
        if not (args.real and args.sim):
            raise PagedWeightError("give SCENARIO, or both --real DIR and --sim DIR")
        if args.calibrate or args.profile:
            raise PagedWeightError("--calibrate and --profile run the runtimes: give SCENARIO, not --real/--sim")
        real_dir, sim_dir = Path(args.real), Path(args.sim)
    v = compare(real_dir, sim_dir, bounds={} if args.no_bounds else None)
    if calibration:
        v["calibration"] = calibration
    out = _validation_path(args.out, sim_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(v, indent=2, default=float) + "\n")
    from pagedweight.results.report import write_report

    page = write_report([sim_dir, real_dir], out.with_name("validation_report.html"), validation=v)
    if calibration:
        sets = f"--set {calibration['key']}={calibration['step_overhead_s']:.6g}"
        if calibration["scale"] != calibration["initial_scale"]:
            sets += f" --set latency.scale={calibration['scale']:.6g}"
        print(f"calibrated scenario settings: {sets}")
    print(format_validation(v))
    print(f"written: {out}, {page}")
    return EXIT_FAILED if args.check and not v["all_within_bounds"] else 0


def _validation_path(out: str | None, sim_dir: Path) -> Path:
    """Where validation.json goes: ``--out`` is a directory (both files go inside it) unless it
    names a .json file (the report goes beside that)."""
    if not out:
        return sim_dir / "validation.json"
    path = Path(out)
    if path.suffix.lower() == ".json" and not path.is_dir():
        return path
    return path / "validation.json"


def _calibrate_policies(args: argparse.Namespace, ran: list[str]) -> list[str]:
    fit_on = ran if args.calibrate == "all" else [p.strip() for p in args.calibrate.split(",") if p.strip()]
    unknown = [p for p in fit_on if p not in ran]
    if unknown:
        raise PagedWeightError(f"--calibrate {args.calibrate}: {', '.join(unknown)} not run; allowed: {', '.join(ran)}")
    return fit_on


def _check_calibrate_policies(args: argparse.Namespace) -> None:
    from pagedweight.config.scenario import load_scenario

    sc = load_scenario(args.scenario, require_latency_table=False).scenario
    _calibrate_policies(args, args.policy or list(sc.policies))


def _run_both(args: argparse.Namespace) -> tuple[Path, Path]:
    from pagedweight.config.scenario import load_scenario
    from pwsim.run import run_scenario

    if getattr(args, "repeats", 1) < 1:  # before minutes of profiling
        raise PagedWeightError(f"--repeats {args.repeats}: must be at least 1")
    loaded = load_scenario(args.scenario, require_latency_table=not args.profile)
    env = None
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise PagedWeightError(f"--threads {args.threads}: must be at least 1")
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    base = Path(args.out_dir or Path("runs") / f"{loaded.scenario.name}-validate")
    sim_dir, real_dir = base / "sim", base / "real"
    # The engine runs as its own process (``python -m pwgpu.cli``, so a checkout on PYTHONPATH
    # works too): the simulator never imports it.
    if importlib.util.find_spec("pwgpu") is None or importlib.util.find_spec("torch") is None:
        raise PagedWeightError("the real run needs pwgpu and torch (pip install -e '.[gpu]')")
    profile = None
    if args.profile:
        if loaded.scenario.latency.kind != "table":
            raise PagedWeightError(
                f"--profile measures a latency table; {args.scenario}: latency.kind is "
                f"{loaded.scenario.latency.kind!r}; allowed: table"
            )
        profile = _Profiles(args, loaded, base, env)
    _run_real(args, loaded, real_dir, env, before_each=profile)
    if profile is not None:
        args.overrides = [f"latency.path={profile.finish()}"]
        loaded = load_scenario(args.scenario, args.overrides)
    run_scenario(loaded, sim_dir, policies=args.policy, progress=False, report=False)
    return real_dir, sim_dir


class _Profiles:
    """``--profile``: the scenario's latency table measured before each real run and once after
    the last (``DIR/tables/kernels-K.csv``), and ``DIR/kernels.csv``, each row the median of
    them (``kernel_table.median_of_tables``). A shared CPU drifts by tens of percent over the
    minutes of the runs, and unevenly across ops (2026-12-02: an hour apart, the same table's
    small decode-sized rows 0.62-0.73x, its large matmuls 0.78-0.89x): profiled only first, the
    table timed the machine as the first run found it. (Five validations on that machine moved
    by no more than their real runs differ from each other either way: benchmarks/RESULTS.md.)"""

    def __init__(self, args: argparse.Namespace, loaded, base: Path, env: dict | None):
        self.args, self.loaded, self.env = args, loaded, env
        self.folder = (base / "tables").resolve()
        self.table = (base / "kernels.csv").resolve()
        self.paths: list[Path] = []

    def __call__(self) -> None:
        path = self.folder / f"kernels-{len(self.paths) + 1}.csv"
        cmd = [sys.executable, "-m", "pwgpu.cli", "profile", "--scenario", str(self.args.scenario), "--out", str(path)]
        if self.loaded.scenario.latency.model:  # the table's rows are for this model (e.g. a full-depth spec)
            cmd += ["--model", self.loaded.scenario.latency.model]
        if subprocess.run(cmd, env=self.env).returncode != 0:
            raise PagedWeightError(f"profiling failed: {' '.join(cmd)}")
        self.paths.append(path)

    def finish(self) -> Path:
        """The last profile, then the median table; returns its path."""
        from pagedweight.config.kernel_table import median_of_tables, write_kernel_table

        self()
        df, meta = median_of_tables(self.paths)
        note = f"each row the median of {len(self.paths)} profiles, one before each real run and one after the last"
        write_kernel_table(df, self.table, {**meta, "notes": [note, *meta.get("notes", [])]})
        return self.table


def _run_real(args: argparse.Namespace, loaded, real_dir: Path, env: dict | None, before_each=None) -> None:
    """The real engine on the scenario into ``real_dir``; with ``--repeats N``, N runs (the
    policies' order reversed every other run, so that each policy runs first as often as
    second) pooled into ``real_dir`` (``pagedweight.results.pooled``). ``before_each()``, if
    given, runs before each run (``_Profiles``)."""
    repeats = getattr(args, "repeats", 1)
    policies = list(args.policy or loaded.scenario.policies)
    runs = [real_dir] if repeats == 1 else [real_dir.with_name("real-runs") / f"run-{i + 1}" for i in range(repeats)]
    for i, out in enumerate(runs):
        if before_each is not None:
            before_each()
        order = policies if i % 2 == 0 else policies[::-1]
        cmd = [sys.executable, "-m", "pwgpu.cli", "run", "--scenario", str(args.scenario), "--out", str(out)]
        cmd += ["--policies", ",".join(order)]
        if subprocess.run(cmd, env=env).returncode != 0:
            raise PagedWeightError(f"the real run failed: {' '.join(cmd)}")
    if repeats > 1:
        from pagedweight.results.pooled import pool_runs

        pool_runs(runs, real_dir)


CALIBRATION_TOLERANCE = 0.01  # stop when the step-time gap is under 1% of a real step
CALIBRATION_MAX_RUNS = 5


def _calibrate(args: argparse.Namespace, real_dir: Path, sim_dir: Path) -> tuple[dict, Path]:
    """Move the step overhead (or, below zero overhead, a table's scale) by the step-time gap
    of the ``--calibrate`` policies (steps of the same shape) and re-simulate until it closes. Returns the
    calibration record and the calibrated run's directory."""
    from pagedweight.config.scenario import load_scenario
    from pagedweight.results.validation import compare, matched_step_times_s, step_overhead_key
    from pwsim.run import run_scenario

    loaded = load_scenario(args.scenario, args.overrides)
    fit_on = _calibrate_policies(args, list(json.loads((real_dir / "summary.json").read_text())["policies"]))
    key = step_overhead_key(loaded.scenario.latency.kind)
    lat = loaded.scenario.latency
    is_table = lat.kind == "table"
    initial = lat.fallback.step_overhead_s if is_table else lat.step_overhead_s
    initial_scale = lat.scale if is_table else 1.0
    cal_dir = sim_dir.with_name("sim-calibrated")

    def simulate(scale: float, overhead: float) -> None:
        sets = [f"{key}={overhead!r}"] + ([f"latency.scale={scale!r}"] if is_table else [])
        run_scenario(load_scenario(args.scenario, [*args.overrides, *sets]), cal_dir, policies=args.policy,
                     progress=False, report=False)  # fmt: skip

    scale, overhead, runs = initial_scale, initial, 0
    last: tuple[float, float] | None = None  # (overhead, gap) of the previous run at this scale
    while runs < CALIBRATION_MAX_RUNS:
        # Steps of the same shape compared (``matched_step_times_s``): the two schedules hold
        # different mixes of shapes, and plain means would fit the mix.
        real_step_s, sim_step_s = matched_step_times_s(real_dir, cal_dir if runs else sim_dir, fit_on)
        gap = real_step_s - sim_step_s
        if runs and abs(gap) < CALIBRATION_TOLERANCE * real_step_s:
            break
        if overhead + gap >= 0 or not is_table:
            step = gap
            # A step's overhead also changes the batches (slower steps gather more tokens), so
            # the gap does not move one for one with it: after two runs, a secant step.
            if last is not None and last[1] != gap and last[0] != overhead:
                secant = gap * (overhead - last[0]) / (last[1] - gap)
                if secant > 0 if gap > 0 else secant < 0:  # same direction, else the plain step
                    step = secant
            last = (overhead, gap)
            overhead = max(0.0, overhead + step)
        else:  # the table alone takes longer than the real steps: scale its times to fit
            last = None
            kernels_s = sim_step_s - overhead  # the simulated step without overhead
            scale *= real_step_s / kernels_s
            overhead = 0.0
        simulate(scale, overhead)
        runs += 1
    before = compare(real_dir, sim_dir, bounds={})
    headline = ("output_throughput", "mean_tpot_ms", "median_ttft_ms", "p99_ttft_ms")
    real_step_s, sim_step_s = matched_step_times_s(real_dir, cal_dir, fit_on)
    remaining = real_step_s - sim_step_s
    return {
        "key": key,
        "initial_step_overhead_s": initial,
        "step_overhead_s": overhead,
        "initial_scale": initial_scale,
        "scale": scale,
        "fitted_on": fit_on,
        "iterations": runs,
        "remaining_gap_s": remaining,
        "converged": abs(remaining) < CALIBRATION_TOLERANCE * real_step_s,
        "uncalibrated_dir": str(sim_dir),
        "uncalibrated_errors_perc": {
            p: {m: e["metrics"][m]["error_perc"] for m in headline if m in e["metrics"]}
            for p, e in before["policies"].items()
        },
    }, cal_dir
