"""Run a scenario in the simulator: every policy over the same requests, then the results
directory (``pagedweight.results.writer``) and the report.

Every policy replays the same trace with the same seed, so differences come from the policy.
"""

from __future__ import annotations

import time
from pathlib import Path

from pagedweight.config.latency import RoutingConfig
from pagedweight.config.run import ScenarioRun, scenario_run
from pagedweight.config.scenario import LoadedScenario
from pagedweight.policy.policies import PolicyInfeasible
from pagedweight.results.writer import ResultsWriter, policy_summary, run_meta, trace_meta
from pwsim.engine import SimEngine
from pwsim.latency import LatencyModel, build_latency_model


def scenario_engine(run: ScenarioRun, policy: str, latency: LatencyModel, routing: RoutingConfig) -> SimEngine:
    """The simulated engine of one policy of a scenario."""
    return SimEngine(
        run.core, policy, run.trace, run.table, latency, routing.resolved_kind(True), seed=run.seed,
        routing_alpha=routing.zipf_alpha,
    )  # fmt: skip


def run_scenario(
    loaded: LoadedScenario,
    out_dir: str | Path,
    policies: list[str] | None = None,
    progress: bool = False,
    report: bool = True,
) -> dict:
    sc, model = loaded.scenario, loaded.model
    run = scenario_run(loaded, policies)
    trace, table = run.trace, run.table
    latency = build_latency_model(sc.latency, model, loaded.gpu, loaded.base_dir)
    meta = run_meta(
        runtime="pwsim",
        scenario=run.name,
        model=model.name,
        gpu=loaded.gpu.name,
        budget_bytes=run.core.budget_bytes,
        page_bytes=run.core.page_bytes,
        latency_model=latency.describe(),
        importance=table.provenance,
        trace=trace_meta(trace),
        seed=run.seed,
    )
    writer = ResultsWriter(Path(out_dir), meta)
    for policy in run.policies:
        wall0 = time.perf_counter()
        try:
            eng = scenario_engine(run, policy, latency, sc.routing)
        except PolicyInfeasible as e:
            writer.add_error(policy, str(e))
            continue
        bar = _progress_bar(policy, trace) if progress else None
        eng.run(progress=bar.update_to if bar else None)
        if bar:
            bar.close()
        summary = policy_summary(eng.requests, eng.core, run.slo, time.perf_counter() - wall0, eng.bytes_h2d)
        writer.add(policy, eng.requests, eng.core, summary)
    out_of_grid = getattr(latency, "out_of_grid", None)
    if out_of_grid:  # points the latency table did not cover: timed by the analytic fallback
        writer.meta["out_of_grid"] = dict(out_of_grid)
    meta = writer.write(run.resolved_yaml)
    if report:
        from pagedweight.results.report import write_report

        write_report([writer.out_dir], writer.out_dir / "report.html")
    return meta


def _progress_bar(policy: str, trace):
    from tqdm import tqdm

    total_s = float(trace.arrival_s[-1]) if len(trace) else 0.0

    class Bar(tqdm):
        def update_to(self, now_s: float) -> None:
            self.update(max(0.0, min(now_s, total_s) - self.n))

    fmt = "{desc} {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} sim s [{elapsed}]"
    return Bar(total=total_s, desc=f"{policy:13s}", unit="sim s", bar_format=fmt)
