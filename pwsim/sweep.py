"""Sweeps: a grid of ``pwsim run``s over scenario keys, resumable, on local processes or Ray.

A sweep file names a scenario, keys fixed for every cell (``set``) and the grid (``grid``);
keys are dotted paths into the scenario, exactly as ``pwsim run --set`` takes them:

    name: sweep_budget
    scenario: longctx.yaml               # relative to this file
    set:                                 # applied to every cell
      workload.duration_s: 240
      policies: [static-fp16, static-int4, pagedweight]
    grid:                                # every combination is one cell
      memory.budget: [100 GiB, 110 GiB, 120 GiB]
      workload.rate_scale: [0.5, 1.0]
    cell_reports: false                  # also write each cell's report.html

Under ``policies`` in the grid a single name means a one-policy run (``[static-fp16,
pagedweight]`` gives two cells). Each cell runs into ``<out>/<cell name>/``; the name is built
from its grid values plus a hash of every override, so it is the same on every re-run and
different whenever an override changes. A cell is written under a temporary name and renamed
when complete: a directory with a readable ``summary.json`` is finished and skipped on the
next run, anything else is run again. Editing the scenario file itself does not rename cells:
sweep into a new ``--out`` after such a change.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedweight.config.scenario import load_scenario
from pagedweight.errors import ConfigError, PagedWeightError, ScenarioError, read_yaml_model
from pagedweight.results.report_data import METRIC_KEYS, policy_metrics, read_summary
from pagedweight.results.writer import atomic_write_csv, atomic_write_text
from pwsim.executor import EXECUTORS, Display, Job, auto_display, run_jobs

_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class SweepError(PagedWeightError):
    """A sweep file is malformed, or a cell of its grid is not a valid scenario."""


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    description: str = ""
    scenario: str = Field(min_length=1)
    set: dict[str, Any] = {}
    grid: dict[str, list[Any]] = Field(min_length=1)
    cell_reports: bool = False

    @field_validator("set", "grid")
    @classmethod
    def _dotted(cls, v: dict) -> dict:
        for key in v:
            if not _KEY.fullmatch(key):
                raise ConfigError(f"{key!r} is not a dotted scenario key like memory.budget or workload.rate_scale")
        return v

    @field_validator("grid")
    @classmethod
    def _values(cls, v: dict[str, list]) -> dict[str, list]:
        for key, values in v.items():
            if not values:
                raise ConfigError(f"{key}: give at least one value")
            canon = [json.dumps(x, sort_keys=True) for x in values]
            if len(set(canon)) != len(canon):
                raise ConfigError(f"{key}: a value is listed twice")
        return v

    @model_validator(mode="after")
    def _disjoint(self) -> SweepSpec:
        both = sorted(set(self.set) & set(self.grid))
        if both:
            raise ConfigError(f"{', '.join(both)} both in set and in grid; keep each key in one of them")
        return self


@dataclass(frozen=True)
class Cell:
    name: str
    params: dict[str, Any]  # the grid values of this cell
    overrides: tuple[str, ...]  # every ``key=value`` applied to the scenario (set, then grid)


@dataclass(frozen=True)
class Sweep:
    spec: SweepSpec
    source: Path
    scenario_path: Path
    cells: tuple[Cell, ...]


def _slug(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return re.sub(r"[^A-Za-z0-9.+-]+", "", text.replace(" ", ""))[:40] or "x"


def _override(key: str, value: Any) -> str:
    # JSON is YAML: the scenario loader parses the value back exactly.
    return f"{key}={json.dumps(value)}"


def cell_for(spec: SweepSpec, params: dict[str, Any]) -> Cell:
    values = dict(params)
    if isinstance(values.get("policies"), str):
        values["policies"] = [values["policies"]]
    overrides = tuple(_override(k, v) for k, v in (*spec.set.items(), *values.items()))
    digest = hashlib.sha1("\n".join(overrides).encode()).hexdigest()[:8]
    label = "_".join(f"{k.rsplit('.', 1)[-1]}-{_slug(v)}" for k, v in params.items())
    return Cell(f"{label}_{digest}", dict(params), overrides)


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file; every cell is validated as a scenario before anything runs."""
    path = Path(path)
    src = str(path)
    spec, raw = read_yaml_model(path, SweepSpec, SweepError, "sweep file")
    scenario_path = Path(spec.scenario)
    if not scenario_path.is_absolute():
        scenario_path = (path.parent / scenario_path).resolve()
    if not scenario_path.is_file():
        raise SweepError(f"{src}: scenario: file {scenario_path} does not exist (relative to {path.parent})")
    try:
        load_scenario(scenario_path, [_override(k, v) for k, v in spec.set.items()])
    except ScenarioError as e:
        raise SweepError(f"{src}: set: {e}") from None
    keys = list(spec.grid)
    cells = tuple(
        cell_for(spec, dict(zip(keys, combo, strict=True))) for combo in itertools.product(*spec.grid.values())
    )
    for cell in cells:
        try:
            load_scenario(scenario_path, list(cell.overrides))
        except ScenarioError as e:
            where = ", ".join(f"{k}={v!r}" for k, v in cell.params.items())
            raise SweepError(f"{src}: grid cell {where}: {e}") from None
    return Sweep(spec, path, scenario_path, cells)


def is_finished(cell_dir: Path) -> bool:
    try:
        return bool(read_summary(cell_dir)["policies"])
    except (PagedWeightError, OSError):
        return False


def run_cell(
    scenario_path: str,
    overrides: list[str],
    cell_dir: str,
    params: dict,
    report: bool,
    step_tables: bool = True,
    progress=None,
) -> dict:
    """One ``pwsim run`` into ``cell_dir``, written under a temporary name and renamed when
    complete. Runs in a worker process or a Ray task: arguments and result are plain data.
    ``step_tables``: as ``pwsim.run.run_scenario``'s. ``progress(fraction)``: the cell's
    progress, for the sweep's display."""
    from pwsim import run

    t0 = time.perf_counter()
    final = Path(cell_dir)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    loaded = load_scenario(scenario_path, overrides)
    run.run_scenario(loaded, tmp, report=report, on_progress=progress, step_tables=step_tables)
    atomic_write_text(tmp / "cell.json", json.dumps({"params": params, "overrides": overrides}, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)  # an unfinished cell from an earlier run
    os.replace(tmp, final)
    return {"cell": final.name, "wall_s": time.perf_counter() - t0}


def _tasks(sweep: Sweep, out_dir: Path, cells: list[Cell]) -> list[tuple]:
    report = sweep.spec.cell_reports
    return [(str(sweep.scenario_path), list(c.overrides), str(out_dir / c.name), c.params, report) for c in cells]


def _run_ray(tasks: list[tuple], address: str | None, workers: int) -> Iterator[dict]:
    try:
        import ray
    except ImportError:
        raise SweepError("--executor ray needs Ray: pip install 'pagedweight[ray]'") from None
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=workers, log_to_driver=False, include_dashboard=False)
    try:
        remote = ray.remote(num_cpus=1)(run_cell)
        pending = [remote.remote(*t) for t in tasks]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
    finally:
        ray.shutdown()


def run_sweep(
    sweep: Sweep,
    out_dir: str | Path,
    executor: str = "local",
    workers: int | None = None,
    address: str | None = None,
    log=print,
    display: Display | None = None,
) -> dict:
    """Run the cells not yet finished, then write ``sweep.csv``, ``sweep.json`` and the sweep
    report. Returns ``{"ran": [...], "skipped": [...], "table": DataFrame}``.

    For Ray clusters of several machines, ``out_dir`` and the scenario's files must be on a
    file system every node sees."""
    if executor not in EXECUTORS:
        raise SweepError(f"--executor {executor!r} unknown; allowed: {', '.join(EXECUTORS)}")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(".*.tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)  # a cell interrupted mid-run
    todo = [c for c in sweep.cells if not is_finished(out_dir / c.name)]
    skipped = [c.name for c in sweep.cells if c not in todo]
    workers = workers or max(1, min(len(todo), os.cpu_count() or 1))
    log(f"{sweep.spec.name}: {len(sweep.cells)} cells, {len(skipped)} finished already, {len(todo)} to run")
    ran = []
    tasks = _tasks(sweep, out_dir, todo)

    def finished(i: int, r: dict) -> str:
        ran.append(r["cell"])
        return f"[{len(ran)}/{len(todo)}] {r['cell']} ({r['wall_s']:.1f} s)"

    if executor == "ray" and tasks:
        for r in _run_ray(tasks, address, workers):
            log(finished(0, r))
    elif tasks:
        # One display for the whole sweep: a bar on a terminal, else a line per cell.
        jobs = [Job(c.name, run_cell, t) for c, t in zip(todo, tasks, strict=True)]
        run_jobs(jobs, workers, display or auto_display(True, log), on_result=finished)
    table = sweep_table(sweep, out_dir)
    atomic_write_csv(table, out_dir / "sweep.csv")
    meta = {
        "name": sweep.spec.name,
        "description": sweep.spec.description,
        "sweep_file": str(sweep.source),
        "scenario": str(sweep.scenario_path),
        "set": sweep.spec.set,
        "grid": sweep.spec.grid,
        "cells": [{"name": c.name, "params": c.params} for c in sweep.cells],
    }
    atomic_write_text(out_dir / "sweep.json", json.dumps(meta, indent=2) + "\n")
    from pagedweight.results.report_sweep import write_sweep_report

    write_sweep_report(table, meta, out_dir / "report.html")
    return {"ran": ran, "skipped": skipped, "table": table}


def sweep_table(sweep: Sweep, out_dir: Path) -> pd.DataFrame:
    """One row per cell and policy: the cell, its grid values, the budget and the metrics."""
    rows = []
    for cell in sweep.cells:
        summary = read_summary(out_dir / cell.name)
        for policy, entry in summary["policies"].items():
            row = {
                "cell": cell.name,
                **{k: json.dumps(v) if isinstance(v, list) else v for k, v in cell.params.items()},
            }
            row |= {
                "model": summary.get("model"),
                "gpu": summary.get("gpu"),
                "budget_gib": summary["budget_bytes"] / 2**30,
                "policy": policy,
                "error": entry.get("error", ""),
            }
            m = policy_metrics(entry)
            row |= {k: m.get(k) for k in METRIC_KEYS}
            rows.append(row)
    return pd.DataFrame(rows)
