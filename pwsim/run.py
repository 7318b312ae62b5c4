"""Run a scenario in the simulator: every policy over the same requests, then the results
directory (``pagedweight.results.writer``) and the report.

Every policy replays the same trace with the same seed, so differences come from the policy,
and a policy's results do not depend on which process ran it or on the others: ``jobs``
worker processes (``pwsim.executor``) give the same files as one process, byte for byte
(only the wall-clock figures differ). Each policy writes its tables as soon as it is done.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

from pagedweight.config.scenario import LoadedScenario, importance_table
from pagedweight.core.runtime import core_config
from pagedweight.policy.importance import ImportanceTable
from pagedweight.policy.policies import PolicyInfeasible
from pagedweight.results.metrics import Slo
from pagedweight.results.writer import ResultsWriter, policy_summary, write_policy_tables
from pagedweight.workload.build import build_workload
from pagedweight.workload.traces import RequestTrace
from pwsim.executor import Display, Job, auto_display, run_jobs


def run_scenario(
    loaded: LoadedScenario,
    out_dir: str | Path,
    policies: list[str] | None = None,
    progress: bool | Display = False,
    report: bool = True,
    jobs: int = 1,
    on_progress: Callable[[float], None] | None = None,
) -> dict:
    """Simulate the scenario's policies (or ``policies``) into ``out_dir``; returns the summary.

    ``jobs``: worker processes (1: in this process). ``progress``: True for the automatic
    display (bars on a terminal, a line per policy otherwise), or a ``Display``.
    ``on_progress(fraction)``: the run's progress over all policies, for a caller's own display."""
    sc, model = loaded.scenario, loaded.model
    trace = build_workload(sc.workload, loaded.base_dir, loaded.max_model_len, np.random.default_rng(sc.seed))
    table = importance_table(loaded)
    # In this process the policies share one latency model, as they always did (a table model
    # warns once per op); workers build their own and send back their out-of-grid counts.
    latency = _latency(loaded)
    shared = latency if jobs <= 1 else None
    names = list(policies or sc.policies)
    writer = ResultsWriter(
        Path(out_dir),
        {
            "runtime": "pwsim",
            "scenario": sc.name,
            "model": model.name,
            "gpu": loaded.gpu.name,
            "budget_bytes": loaded.budget_bytes,
            "page_bytes": sc.memory.page_bytes,
            "latency_model": latency.describe(),
            "importance": table.provenance,
            "trace": {"source": trace.source, "num_requests": len(trace), "notes": list(trace.notes)},
            "seed": sc.seed,
        },
    )
    try:
        job_list = [
            Job(name, simulate_policy, (loaded, name, trace, table, str(writer.parts_root / str(i)), shared))
            for i, name in enumerate(names)
        ]
        display = progress if isinstance(progress, Display) else auto_display(progress)
        if on_progress is not None:
            display = _Overall(display, len(job_list), on_progress)
        results = run_jobs(job_list, jobs, display, on_result=_result_line)
        out_of_grid: Counter = Counter()
        for name, r in zip(names, results, strict=True):
            if "error" in r:
                writer.add_error(name, r["error"])
            else:
                writer.add_parts(name, Path(r["parts_dir"]), r["summary"])
            out_of_grid.update(r["out_of_grid"])
        if shared is not None:
            out_of_grid = Counter(getattr(latency, "out_of_grid", None) or {})
        if out_of_grid:  # points the latency table did not cover: timed by the analytic fallback
            writer.meta["out_of_grid"] = dict(out_of_grid)
        meta = writer.write(yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False))
    finally:
        writer.discard_parts()
    if report:
        from pagedweight.results.report import write_report

        write_report([writer.out_dir], writer.out_dir / "report.html")
    return meta


def _latency(loaded: LoadedScenario):
    from pwsim.latency import build_latency_model

    return build_latency_model(loaded.scenario.latency, loaded.model, loaded.gpu, loaded.base_dir)


def simulate_policy(
    loaded: LoadedScenario,
    policy: str,
    trace: RequestTrace,
    table: ImportanceTable,
    parts_dir: str,
    latency=None,
    progress: Callable[[float], None] | None = None,
) -> dict:
    """One policy of a run (in this process or a worker): its tables go to ``parts_dir``;
    returns its summary (or ``error`` if the policy cannot run) and, when it built its own
    latency model, that model's out-of-grid counts."""
    from pwsim.engine import SimEngine

    sc = loaded.scenario
    own_latency = latency is None
    if own_latency:
        latency = _latency(loaded)
    wall0 = time.perf_counter()
    out: dict = {"policy": policy, "out_of_grid": {}}
    try:
        eng = SimEngine(
            core_config(loaded),
            policy,
            trace,
            table,
            latency,
            sc.routing.resolved_kind(True),
            seed=sc.seed,
            routing_alpha=sc.routing.zipf_alpha,
        )
    except PolicyInfeasible as e:
        out["error"] = str(e)
        return out
    horizon_s = float(trace.arrival_s[-1]) if len(trace) else 0.0
    if progress is not None:
        eng.run(progress=lambda now_s: progress(min(now_s / horizon_s, 1.0) if horizon_s > 0 else 1.0))
    else:
        eng.run()
    slo = Slo(sc.slo.ttft_ms, sc.slo.tpot_ms, sc.slo.e2el_ms)
    out["summary"] = policy_summary(eng.requests, eng.core, slo, time.perf_counter() - wall0, eng.bytes_h2d)
    write_policy_tables(Path(parts_dir), policy, eng.requests, eng.core)
    out["parts_dir"] = parts_dir
    if own_latency:
        out["out_of_grid"] = dict(getattr(latency, "out_of_grid", None) or {})
    return out


def _result_line(index: int, r: dict) -> str:
    if "error" in r:
        return f"{r['policy']}: infeasible: {r['error']}"
    s = r["summary"]
    return f"{r['policy']}: {s['num_steps']:,} steps, {s['simulated_s']:,.0f} simulated s in {s['wall_s']:.1f} s"


class _Overall(Display):
    """Passes every event on to ``inner`` and the mean progress over all jobs to ``callback``."""

    def __init__(self, inner: Display, num_jobs: int, callback: Callable[[float], None]):
        self.inner, self.callback = inner, callback
        self.fractions = [0.0] * num_jobs

    def start(self, jobs) -> None:
        self.inner.start(jobs)

    def update(self, index: int, fraction: float) -> None:
        self.fractions[index] = fraction
        self.callback(sum(self.fractions) / len(self.fractions))
        self.inner.update(index, fraction)

    def done(self, index: int, line: str) -> None:
        self.update(index, 1.0)
        self.inner.done(index, line)

    def close(self) -> None:
        self.inner.close()
