"""The policy scoreboard: every policy on a suite of cells (scenario variants) at several loads,
and each policy's maximum sustainable load per cell, found by bisection.

A suite file (``scenarios/bench_*.yaml``)::

    name: bench_small
    policies: [static-fp16, static-int4, paper-greedy, pagedweight]
    set: {workload.duration_s: 60}          # every run of every cell
    cells:
      - {name: chat, scenario: chat.yaml}
      - {name: storm, scenario: storm.yaml, set: {memory.budget: 110 GiB}}
      - {name: azure, scenario: bench/azure_conv.yaml, optional: true}
      - {name: big, scenario: deepseek_v3_ep8.yaml, policies: [static-int4, pagedweight]}
    loads: [1.0, 2.0]                       # multiples of each cell's workload.rate_scale
    sustainable: {min_good_fraction: 0.9, low: 0.25, high: 4.0, rounds: 4}

A load is *sustainable* for a policy when at least ``min_good_fraction`` of the requests meet
the scenario's SLOs; the bisection (geometric, ``rounds`` steps between ``low`` and ``high``)
runs one-policy probes. An ``optional`` cell whose scenario names a file that is not there (a
trace from the shared traces folder beside the checkout) is skipped, and the log and
``bench.md`` say which file; a missing file of any other cell is an error. A cell's ``policies``
(a subset of the suite's) limits the cell to those, where the others would cost too much to
simulate; its margins are then over the best of those. Every run is a sweep cell (``pwsim.sweep.run_cell``) in its own
directory named by its overrides (its ``summary.json`` and ``requests.csv``; ``--tables`` keeps
the step tables of ``pwsim run`` too), written under a temporary name and renamed when complete: a
re-run skips finished runs, so the suite is resumable, and it runs on the same executor as
``pwsim sweep`` (local processes or Ray).

Outputs in the suite directory: ``bench.csv`` (cell, load, policy and its figures),
``sustainable.csv`` (cell, policy, largest sustainable load and its arrival rate), ``bench.md``
(both as Markdown tables, with each policy's margin over the best other policy) and
``report.html`` (heat maps of those margins).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedweight.config.scenario import load_scenario
from pagedweight.errors import MissingFileError, PagedWeightError, ScenarioError, read_yaml_model
from pagedweight.results.report_data import policy_metrics, read_summary
from pagedweight.results.writer import atomic_write_csv, atomic_write_text, markdown_table
from pwsim.bench_targets import cell_verdicts, margins, sustainable_verdicts, targets_markdown
from pwsim.executor import Display, Job, auto_display, run_jobs
from pwsim.sweep import EXECUTORS, _override, _run_ray, _slug, is_finished, run_cell

# The scoreboard's columns, from each run's summary.json.
BENCH_METRICS = (
    "request_goodput",
    "output_throughput",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "num_preemptions",
    "prefill_recompute_ratio",
    "transitions_per_request",
    "mean_quality_proxy",
    "max_quality_proxy",
)


class BenchError(PagedWeightError):
    """A suite file is malformed, or one of its runs is not a valid scenario."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CellSpec(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.+-]+$")
    scenario: str = Field(min_length=1)
    set: dict[str, Any] = {}
    # Skipped (with a note naming the file) when a file its scenario names is absent.
    optional: bool = False
    # Only these of the suite's policies, in the grid and the bisection (None: all of them).
    policies: list[str] | None = Field(default=None, min_length=1)


class Sustainable(_Strict):
    min_good_fraction: float = Field(default=0.9, gt=0, le=1)
    low: float = Field(default=0.25, gt=0)
    high: float = Field(default=4.0, gt=0)
    rounds: int = Field(default=4, ge=0, le=12)

    @model_validator(mode="after")
    def _ordered(self) -> Sustainable:
        if self.low >= self.high:
            raise ValueError(f"low(={self.low}) must be < high(={self.high})")
        return self


class SuiteSpec(_Strict):
    name: str = Field(min_length=1)
    description: str = ""
    policies: list[str] = Field(min_length=1)
    set: dict[str, Any] = {}
    cells: list[CellSpec] = Field(min_length=1)
    loads: list[float] = Field(default=[1.0], min_length=1)
    sustainable: Sustainable | None = None

    @model_validator(mode="after")
    def _unique(self) -> SuiteSpec:
        names = [c.name for c in self.cells]
        if len(set(names)) != len(names):
            raise ValueError("cell names must be unique")
        if any(x <= 0 for x in self.loads):
            raise ValueError("loads must be > 0")
        for c in self.cells:
            extra = [p for p in c.policies or [] if p not in self.policies]
            if extra:
                raise ValueError(f"cell {c.name}: policies {extra} are not among the suite's {self.policies}")
        return self


@dataclass(frozen=True)
class Probe:
    """One run: a cell at a load, for some policies."""

    cell: str
    load: float
    policies: tuple[str, ...]
    scenario_path: str
    overrides: tuple[str, ...]

    @property
    def dirname(self) -> str:
        digest = hashlib.sha1("\n".join((self.scenario_path, *self.overrides)).encode()).hexdigest()[:8]
        who = "all" if len(self.policies) > 1 else _slug(self.policies[0])
        return f"{self.cell}_load-{self.load:.4g}_{who}_{digest}"


@dataclass(frozen=True)
class Suite:
    spec: SuiteSpec
    source: Path
    scenarios: dict[str, Path]  # cell name -> scenario file
    base_rate_scale: dict[str, float]  # cell name -> its workload.rate_scale
    absent: dict[str, str] = field(default_factory=dict)  # optional cell skipped -> why

    @property
    def cells(self) -> list[CellSpec]:
        """The cells that run (every cell but the absent optional ones)."""
        return [c for c in self.spec.cells if c.name in self.scenarios]

    def policies(self, cell: CellSpec) -> tuple[str, ...]:
        """The cell's policies, in the suite's order."""
        return tuple(p for p in self.spec.policies if cell.policies is None or p in cell.policies)

    def probe(self, cell: str, load: float, policies: tuple[str, ...]) -> Probe:
        spec = next(c for c in self.spec.cells if c.name == cell)
        rate = self.base_rate_scale[cell] * load
        overrides = (
            *(_override(k, v) for k, v in self.spec.set.items()),
            *(_override(k, v) for k, v in spec.set.items()),
            _override("policies", list(policies)),
            _override("workload.rate_scale", rate),
        )
        return Probe(cell, load, policies, str(self.scenarios[cell]), overrides)


def load_suite(path: str | Path) -> Suite:
    """Read and check a suite; every cell is validated as a scenario before anything runs. An
    optional cell whose scenario names an absent file is left out (``Suite.absent`` says why)."""
    path = Path(path)
    src = str(path)
    spec, raw = read_yaml_model(path, SuiteSpec, BenchError, "suite file")
    scenarios, rates, absent = {}, {}, {}
    for cell in spec.cells:
        scenario = Path(cell.scenario)
        scenario = scenario if scenario.is_absolute() else (path.parent / scenario).resolve()
        sets = [_override(k, v) for k, v in (*spec.set.items(), *cell.set.items())]
        sets.append(_override("policies", cell.policies or spec.policies))
        try:
            loaded = load_scenario(scenario, sets)
        except MissingFileError as e:
            if not cell.optional:
                raise BenchError(f"{src}: cell {cell.name}: {e}") from None
            absent[cell.name] = str(e)
            continue
        except ScenarioError as e:
            raise BenchError(f"{src}: cell {cell.name}: {e}") from None
        rate = getattr(loaded.scenario.workload, "rate_scale", None)
        if rate is None:
            raise BenchError(
                f"{src}: cell {cell.name}: its workload ({loaded.scenario.workload.kind}) has no rate_scale; "
                "the bench scales load through workload.rate_scale (trace workloads)"
            )
        scenarios[cell.name], rates[cell.name] = scenario, float(rate)
    if not scenarios:
        raise BenchError(f"{src}: every cell is optional and absent: " + "; ".join(absent.values()))
    return Suite(spec, path, scenarios, rates, absent)


def good_fraction(summary_entry: dict) -> float:
    """Share of the run's requests that finished within every SLO."""
    n = summary_entry.get("num_requests") or 0
    if not n or "error" in summary_entry:
        return 0.0
    return summary_entry["request_goodput"] * summary_entry["duration_s"] / n


class _Runner:
    def __init__(
        self, out_dir: Path, executor: str, workers: int | None, address: str | None, log, display, step_tables: bool
    ):
        self.out_dir, self.executor, self.workers, self.address = out_dir, executor, workers, address
        self.log, self.display, self.step_tables = log, display, step_tables
        self.ran: list[str] = []
        self.skipped: list[str] = []

    def finished(self, probe: Probe) -> bool:
        """Whether ``probe``'s run is on disk; one this invocation did not run counts as skipped."""
        done = is_finished(self.out_dir / probe.dirname)
        if done and probe.dirname not in self.ran and probe.dirname not in self.skipped:
            self.skipped.append(probe.dirname)
        return done

    def run(self, probes: list[Probe], then=None) -> list[Probe]:
        """Run every probe not finished yet (each once, even if listed twice). ``then(probe)``,
        called as each finishes, returns probes to run next, in the same workers (the local
        executor; Ray runs the list given and returns what ``then`` asked for, to run next)."""
        unique = {p.dirname: p for p in probes}
        todo = [p for name, p in unique.items() if not is_finished(self.out_dir / name)]
        self.skipped += [name for name in unique if unique[name] not in todo and name not in self.skipped]
        queued = {p.dirname for p in todo}
        later: list[Probe] = []

        def fresh(more: list[Probe]) -> list[Probe]:
            out = []
            for p in more:
                if p.dirname not in queued and not self.finished(p):
                    queued.add(p.dirname)
                    out.append(p)
            return out

        if not todo:
            return []
        workers = self.workers or max(1, min(len(todo), os.cpu_count() or 1))

        def finished(_i: int, r: dict) -> str:
            self.ran.append(r["cell"])
            return f"[{len(self.ran)}] {r['cell']} ({r['wall_s']:.1f} s)"

        if self.executor == "ray":
            for r in _run_ray([self._task(p) for p in todo], self.address, workers):
                self.log(finished(0, r))
            if then is not None:
                for p in todo:
                    later += fresh(then(p))
            return later
        jobs = [Job(p.dirname, run_cell, self._task(p)) for p in todo]

        def follow(i: int, _r: dict) -> list[Job]:
            more = fresh(then(todo[i]))
            todo.extend(more)
            return [Job(p.dirname, run_cell, self._task(p)) for p in more]

        display = self.display or auto_display(True, self.log)
        run_jobs(jobs, workers, display, on_result=finished, then=follow if then is not None else None)
        return []

    def _task(self, p: Probe) -> tuple:
        return (
            p.scenario_path,
            list(p.overrides),
            str(self.out_dir / p.dirname),
            {"cell": p.cell, "load": p.load},
            False,
            self.step_tables,
        )

    def offered_rate(self, probe: Probe, policy: str) -> float:
        """Requests per second the probe's trace offered to ``policy`` (arrivals over their span)."""
        requests = pd.read_csv(self.out_dir / probe.dirname / "requests.csv", usecols=["policy", "arrival_s"])
        arrival_s = requests.loc[requests["policy"] == policy, "arrival_s"]
        span_s = float(arrival_s.max() - arrival_s.min()) if len(arrival_s) > 1 else 0.0
        return len(arrival_s) / span_s if span_s > 0 else 0.0

    def summary(self, probe: Probe) -> dict:
        return read_summary(self.out_dir / probe.dirname)


def run_bench(
    suite: Suite,
    out_dir: str | Path,
    executor: str = "local",
    workers: int | None = None,
    address: str | None = None,
    log=print,
    display: Display | None = None,
    step_tables: bool = False,
) -> dict:
    """Run the suite's grid, then the bisection rounds; write the tables and the report.
    ``step_tables``: keep every run's step, transition and initial-precision tables (the
    suite's figures need only each run's summary and request table; the step tables of the
    default suite take ~7 GB and a few percent of its time to write)."""
    if executor not in EXECUTORS:
        raise BenchError(f"--executor {executor!r} unknown; allowed: {', '.join(EXECUTORS)}")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(".*.tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)  # a run interrupted mid-way
    spec = suite.spec
    runner = _Runner(out_dir, executor, workers, address, log, display, step_tables)
    policies = tuple(spec.policies)
    grid = [suite.probe(c.name, load, suite.policies(c)) for c in suite.cells for load in spec.loads]
    for cell, why in suite.absent.items():
        log(f"{spec.name}: cell {cell} skipped (optional, a file is absent): {why}")
    log(f"{spec.name}: {len(suite.cells)} cells x {len(spec.loads)} loads x {len(policies)} policies")
    search = _Bisection(suite, runner) if spec.sustainable else None
    todo = grid + (search.start() if search else [])
    while todo:  # one pass with the local executor; Ray runs the bisection round by round
        todo = runner.run(todo, then=search.after if search else None)
    rows = []
    for probe in grid:
        summary = runner.summary(probe)
        for policy, entry in summary["policies"].items():
            m = policy_metrics(entry)
            row = {"cell": probe.cell, "load": probe.load, "policy": policy, "error": entry.get("error", "")}
            row |= {k: m.get(k) for k in BENCH_METRICS}
            row["good_fraction"] = good_fraction(entry)
            rows.append(row)
    table = pd.DataFrame(rows)
    sustainable = search.table() if search else pd.DataFrame()
    atomic_write_csv(table, out_dir / "bench.csv")
    if len(sustainable):
        atomic_write_csv(sustainable, out_dir / "sustainable.csv")
    md = bench_markdown(spec, table, sustainable, suite.absent)
    atomic_write_text(out_dir / "bench.md", md)
    meta = {"name": spec.name, "description": spec.description, "suite_file": str(suite.source)}
    meta["skipped_cells"] = suite.absent
    atomic_write_text(out_dir / "bench.json", json.dumps(meta | {"spec": spec.model_dump()}, indent=2) + "\n")
    write_bench_report(spec, table, sustainable, out_dir / "report.html")
    return {"ran": runner.ran, "skipped": runner.skipped, "table": table, "sustainable": sustainable}


class _Bisection:
    """Largest sustainable load per cell and policy: probe ``low`` and ``high``, then halve the
    bracket (geometrically) ``rounds`` times. Each pair advances on its own: its next probe is
    run as soon as the runs it depends on have finished (its cell's grid runs, its last probe),
    in the same workers as the grid, so none waits for a whole round or for the grid to end."""

    def __init__(self, suite: Suite, runner: _Runner):
        self.s, self.suite, self.runner = suite.spec.sustainable, suite, runner
        self.cell_policies = {c.name: suite.policies(c) for c in suite.cells}
        self.pairs = [(c.name, p) for c in suite.cells for p in suite.policies(c)]
        self.grid_loads = set(suite.spec.loads)
        self.bracket: dict[tuple[str, str], list] = {}  # pair -> [lo, hi, lo_ok, hi_ok]
        self.rounds: dict[tuple[str, str], int] = {}
        self.waiting: dict[str, set[tuple[str, str]]] = {}  # probe dirname -> pairs waiting on it

    def probe(self, cell: str, policy: str, load: float) -> Probe:
        """The policy's own run at ``load``, or its cell's grid run where the grid has that load:
        a policy's figures do not depend on the policies run beside it (a test checks it), so
        the bisection does not run again what the grid ran."""
        if load in self.grid_loads:
            return self.suite.probe(cell, load, self.cell_policies[cell])
        return self.suite.probe(cell, load, (policy,))

    def ok(self, cell: str, policy: str, load: float) -> bool:
        entry = self.runner.summary(self.probe(cell, policy, load))["policies"][policy]
        return "error" not in entry and good_fraction(entry) >= self.s.min_good_fraction

    def start(self) -> list[Probe]:
        """The probes every pair needs first (the grid's runs, where it has the loads)."""
        return [p for pair in self.pairs for p in self._advance(pair)]

    def after(self, probe: Probe) -> list[Probe]:
        """``probe`` has finished: the probes the pairs waiting on it need next."""
        return [p for pair in sorted(self.waiting.pop(probe.dirname, ())) for p in self._advance(pair)]

    def _wait(self, pair: tuple[str, str], probes: list[Probe]) -> list[Probe]:
        for p in probes:
            self.waiting.setdefault(p.dirname, set()).add(pair)
        return probes

    def _advance(self, pair: tuple[str, str]) -> list[Probe]:
        """Take the pair's search as far as finished runs allow; the probes it waits on."""
        s, cell, policy = self.s, *pair
        while True:
            b = self.bracket.get(pair)
            if b is None:
                ends = [self.probe(cell, policy, x) for x in (s.low, s.high)]
                todo = [p for p in ends if not self.runner.finished(p)]
                if todo:
                    return self._wait(pair, todo)
                self.bracket[pair] = [s.low, s.high, self.ok(cell, policy, s.low), self.ok(cell, policy, s.high)]
                self.rounds[pair] = 0
                continue
            lo, hi, lo_ok, hi_ok = b
            if not lo_ok or hi_ok or self.rounds[pair] >= s.rounds:
                return []
            mid = math.sqrt(lo * hi)
            probe = self.probe(cell, policy, mid)
            if not self.runner.finished(probe):
                r = self.rounds[pair] + 1
                self.runner.log(
                    f"{self.suite.spec.name}: sustainable load of {policy} on {cell}, round {r}/{s.rounds}: {mid:.3g}x"
                )
                return self._wait(pair, [probe])
            b[0 if self.ok(cell, policy, mid) else 1] = mid
            self.rounds[pair] += 1

    def table(self) -> pd.DataFrame:
        s, rows = self.s, []
        for c, p in self.pairs:
            lo, hi, lo_ok, hi_ok = self.bracket[(c, p)]
            if hi_ok:
                load, note = s.high, f">= {s.high:g} (the top of the search)"
            elif not lo_ok:
                load, note = 0.0, f"< {s.low:g} (below the search)"
            else:
                load, note = lo, f"in [{lo:.3g}, {hi:.3g})"
            qps = self.runner.offered_rate(self.probe(c, p, load), p) if load > 0 else 0.0
            rows.append({"cell": c, "policy": p, "max_load": load, "max_request_rate": qps, "bracket": note})
        return pd.DataFrame(rows)


def bench_markdown(
    spec: SuiteSpec, table: pd.DataFrame, sustainable: pd.DataFrame, absent: dict[str, str] | None = None
) -> str:
    parts = [f"# {spec.name}", "", spec.description, ""]
    if absent:
        parts += ["Skipped (optional cells whose files are absent):", ""]
        parts += [f"- {cell}: {why}" for cell, why in absent.items()] + [""]
    view = table.copy()
    view["goodput_margin"] = np.nan
    for (_cell, _load), g in view.groupby(["cell", "load"], sort=False):
        view.loc[g.index, "goodput_margin"] = margins(g.set_index("policy")["request_goodput"]).to_numpy()
    cols = ["cell", "load", "policy", *BENCH_METRICS, "good_fraction", "goodput_margin"]
    parts += ["## Every cell, load and policy", "", markdown_table(view[cols]), ""]
    if len(sustainable):
        sv = sustainable.copy()
        sv["margin"] = np.nan
        for _cell, g in sv.groupby("cell", sort=False):
            sv.loc[g.index, "margin"] = margins(g.set_index("policy")["max_load"]).to_numpy()
        parts += ["## Largest sustainable load", "", markdown_table(sv), ""]
    if "pagedweight" in spec.policies:
        parts += targets_markdown(table, sustainable, "pagedweight")
    return "\n".join(parts)


def write_bench_report(spec: SuiteSpec, table: pd.DataFrame, sustainable: pd.DataFrame, out_html: Path) -> None:
    """Heat maps of each policy's margin over the best other policy: goodput per cell and load,
    and largest sustainable load per cell."""
    import html

    from matplotlib.figure import Figure

    from pagedweight.results.report import CSS, png_tag
    from pagedweight.results.report_plots import save_png

    out_html = Path(out_html)
    figs = []

    def heat(matrix: pd.DataFrame, title: str, name: str) -> None:
        if matrix.empty:
            return
        fig = Figure(figsize=(1.2 * len(matrix.columns) + 3, 0.45 * len(matrix) + 1.6), layout="constrained")
        ax = fig.add_subplot()
        data = matrix.to_numpy(dtype=float) * 100
        lim = max(5.0, float(np.nanmax(np.abs(data))) if np.isfinite(data).any() else 5.0)
        im = ax.imshow(data, cmap="RdYlGn", vmin=-lim, vmax=lim, aspect="auto")
        ax.set_xticks(range(len(matrix.columns)), matrix.columns, rotation=30, ha="right")
        ax.set_yticks(range(len(matrix)), [str(i) for i in matrix.index])
        for (i, j), v in np.ndenumerate(data):
            ax.text(j, i, "-" if not np.isfinite(v) else f"{v:+.0f}%", ha="center", va="center", fontsize=8)
        ax.set_title(title)
        fig.colorbar(im, ax=ax, label="% over the best other policy")
        figs.append(png_tag(save_png(fig, out_html.with_name(name)), title))

    rows = {}
    for (cell, load), g in table.groupby(["cell", "load"], sort=False):
        rows[f"{cell} x{load:g}"] = margins(g.set_index("policy")["request_goodput"])
    cols = list(spec.policies)
    heat(pd.DataFrame(rows).T.reindex(columns=cols) if rows else pd.DataFrame(), "Goodput margin", "goodput_margin.png")
    if len(sustainable):
        rows = {c: margins(g.set_index("policy")["max_load"]) for c, g in sustainable.groupby("cell", sort=False)}
        heat(pd.DataFrame(rows).T.reindex(columns=cols), "Largest sustainable load margin", "sustainable_margin.png")
    body = [
        f"<h1>{html.escape(spec.name)}</h1><p class='facts'>{html.escape(spec.description)}</p>",
        *figs,
        "<h2>Every cell, load and policy</h2>",
        table.to_html(index=False, float_format=lambda v: f"{v:.4g}"),
    ]
    if len(sustainable):
        body += ["<h2>Largest sustainable load</h2>", sustainable.to_html(index=False, float_format="{:.4g}".format)]
    if "pagedweight" in spec.policies:
        verdicts = cell_verdicts(table, "pagedweight")
        if len(verdicts):
            body += ["<h2>Targets: pagedweight</h2>", verdicts.to_html(index=False, float_format="{:.4g}".format)]
        if len(sustainable):
            held = sustainable_verdicts(sustainable, "pagedweight")
            body += [held.to_html(index=False, float_format="{:.4g}".format)] if len(held) else []
    head = f"<!doctype html><html><head><meta charset='utf-8'><style>{CSS}</style></head>"
    page = f"{head}<body>{''.join(body)}</body></html>"
    atomic_write_text(out_html, page)
