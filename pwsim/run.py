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

from pagedweight.config.latency import RoutingConfig
from pagedweight.config.run import ScenarioRun, scenario_run
from pagedweight.config.scenario import LoadedScenario
from pagedweight.policy.policies import PolicyInfeasible, relative_run_cost
from pagedweight.results.metrics import RequestColumns
from pagedweight.results.report_data import steps_from_arrays
from pagedweight.results.writer import ResultsWriter, policy_summary, run_meta, trace_meta, write_policy_tables
from pwsim.executor import Display, Job, auto_display, run_jobs
from pwsim.latency import LatencyModel, build_latency_model


def scenario_engine(
    run: ScenarioRun,
    policy: str,
    latency: LatencyModel,
    routing: RoutingConfig,
    loaded: LoadedScenario | None = None,
    env=None,
):
    """The simulated engine of one policy of a scenario: one GPU, or (``loaded`` with
    ``parallel.ep`` > 1) an expert-parallel replica (``pwsim.parallel``). ``env``: a SimPy
    environment to share (a cluster's replicas)."""
    from pwsim.engine import SimEngine

    if loaded is not None and loaded.scenario.parallel.ep > 1:
        from pwsim.parallel import EpEngine

        sc = loaded.scenario
        placement_file = sc.parallel.resolved_placement_file(loaded.base_dir)
        parallel = sc.parallel.model_copy(update={"placement_file": str(placement_file) if placement_file else None})
        return EpEngine(
            run.core, policy, run.trace, run.table,
            lambda share: build_latency_model(sc.latency, share, loaded.gpu, loaded.base_dir, like=loaded.model),
            loaded.gpu, parallel, routing.resolved_kind(True), seed=run.seed, routing_alpha=routing.zipf_alpha,
            env=env,
        )  # fmt: skip

    return SimEngine(
        run.core, policy, run.trace, run.table, latency, routing.resolved_kind(True), seed=run.seed,
        routing_alpha=routing.zipf_alpha, env=env,
    )  # fmt: skip


def run_scenario(
    loaded: LoadedScenario,
    out_dir: str | Path,
    policies: list[str] | None = None,
    progress: bool | Display = False,
    report: bool = True,
    jobs: int = 1,
    on_progress: Callable[[float], None] | None = None,
    step_tables: bool = True,
) -> dict:
    """Simulate the scenario's policies (or ``policies``) into ``out_dir``; returns the summary.

    ``step_tables``: False writes the summary and the request table only (no steps,
    transitions or initial precisions: the report needs them, so ``report`` must be False).
    ``jobs``: worker processes (1: in this process). ``progress``: True for the automatic
    display (bars on a terminal, a line per policy otherwise), or a ``Display``.
    ``on_progress(fraction)``: the run's progress over all policies, for a caller's own display."""
    if report and not step_tables:
        raise ValueError("a report needs the step tables: run_scenario(report=True, step_tables=False)")
    model = loaded.model
    run = scenario_run(loaded, policies)
    trace, table = run.trace, run.table
    # In this process the policies share one latency model, as they always did (a table model
    # warns once per op); workers build their own and send back their out-of-grid counts.
    latency = _latency(loaded)
    shared = latency if jobs <= 1 else None
    ep, cluster = loaded.scenario.parallel, loaded.scenario.cluster
    extra = {"parallel": ep.model_dump()} if ep.ep > 1 else {}
    if cluster.replicas > 1:
        extra["cluster"] = cluster.model_dump()
    if ep.ep > 1:  # a table without all-to-all rows for this many GPUs: the run says so
        from pwsim.parallel import a2a_source

        note = a2a_source(latency, ep.ep)[1]
        if note:
            extra["notes"] = [note]
    meta = run_meta(
        runtime="pwsim",
        scenario=run.name,
        model=model.name,
        gpu=loaded.gpu.name if ep.ep == 1 else f"{ep.ep}x {loaded.gpu.name}",
        budget_bytes=run.core.budget_bytes,
        page_bytes=run.core.page_bytes,
        latency_model=latency.describe(),
        importance=table.provenance,
        trace=trace_meta(trace),
        seed=run.seed,
        **extra,
    )
    writer = ResultsWriter(Path(out_dir), meta)
    names = list(run.policies)
    if cluster.replicas > 1:
        from pwsim.cluster import run_cluster

        try:
            display = progress if isinstance(progress, Display) else auto_display(progress)
            if on_progress is not None:
                per_policy = cluster.replicas if cluster.router == "round-robin" else 1  # jobs per policy
                display = _Overall(display, len(names) * per_policy, on_progress)
            run_cluster(loaded, run, names, writer, display, jobs, step_tables)
            meta = writer.write(run.resolved_yaml)
        finally:
            writer.discard_parts()
        if report:
            from pagedweight.results.report import write_report

            write_report([writer.out_dir], writer.out_dir / "report.html")
        return meta
    try:
        job_list = [
            Job(
                name,
                simulate_policy,
                (loaded, run, name, str(writer.parts_root / str(i)), shared, step_tables, report),
                cost=relative_run_cost(name),
            )
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
        arrays = writer.step_arrays() if report else None
        steps = steps_from_arrays(arrays) if arrays else None
        meta = writer.write(run.resolved_yaml)
    finally:
        writer.discard_parts()
    if report:
        from pagedweight.results.report import write_report

        held = {writer.out_dir: steps} if steps is not None else None
        write_report([writer.out_dir], writer.out_dir / "report.html", steps=held)
    return meta


def _latency(loaded: LoadedScenario):
    from pwsim.latency import build_latency_model

    return build_latency_model(loaded.scenario.latency, loaded.model, loaded.gpu, loaded.base_dir)


def simulate_policy(
    loaded: LoadedScenario,
    run: ScenarioRun,
    policy: str,
    parts_dir: str,
    latency=None,
    step_tables: bool = True,
    step_arrays: bool = False,
    progress: Callable[[float], None] | None = None,
) -> dict:
    """One policy of a run (in this process or a worker): its tables go to ``parts_dir``
    (the request table alone without ``step_tables``; with ``step_arrays``, the step table
    for the run's report too, ``writer.STEP_ARRAYS``);
    returns its summary (or ``error`` if the policy cannot run) and, when it built its own
    latency model, that model's out-of-grid counts."""
    own_latency = latency is None
    if own_latency:
        latency = _latency(loaded)
    wall0 = time.perf_counter()
    out: dict = {"policy": policy, "out_of_grid": {}}
    try:
        eng = scenario_engine(run, policy, latency, loaded.scenario.routing, loaded)
    except PolicyInfeasible as e:
        out["error"] = str(e)
        return out
    trace = run.trace
    horizon_s = float(trace.arrival_s[-1]) if len(trace) else 0.0
    if progress is not None:
        eng.run(progress=lambda now_s: progress(min(now_s / horizon_s, 1.0) if horizon_s > 0 else 1.0))
    else:
        eng.run()
    columns = None
    if hasattr(eng, "ranks"):  # an expert-parallel replica
        from pwsim.parallel import ep_summary

        out["summary"] = ep_summary(eng, run.slo, time.perf_counter() - wall0)
    else:
        wall_s = time.perf_counter() - wall0
        columns = RequestColumns.of(eng.requests)
        out["summary"] = policy_summary(eng.requests, eng.core, run.slo, wall_s, eng.bytes_h2d, columns)
    write_engine_tables(Path(parts_dir), policy, eng, step_tables, columns, step_arrays=step_arrays)
    out["parts_dir"] = parts_dir
    if own_latency:
        out["out_of_grid"] = dict(getattr(latency, "out_of_grid", None) or {})
    return out


def write_engine_tables(
    parts_dir: Path,
    policy: str,
    eng,
    step_tables: bool = True,
    columns: RequestColumns | None = None,
    replica: int | None = None,
    step_arrays: bool = False,
) -> None:
    """A simulated engine's tables into ``parts_dir``: one GPU's, or an expert-parallel
    replica's (``eng.ranks``); the request table alone without ``step_tables``; with
    ``replica`` (a cluster's), a ``replica`` column."""
    if hasattr(eng, "ranks"):
        from pwsim.parallel import write_ep_tables

        write_ep_tables(parts_dir, policy, eng, replica, step_tables)
    else:
        columns = columns if columns is not None else RequestColumns.of(eng.requests)
        write_policy_tables(parts_dir, policy, eng.requests, eng.core, replica, columns, step_tables, step_arrays)


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
