"""Run a scenario in the simulator: every policy over the same requests, then the results
directory (``pagedweight.results.writer``) and the report.

Every policy replays the same trace with the same seed, so differences come from the policy.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import yaml

from pagedweight.config.scenario import LoadedScenario, importance_table
from pagedweight.core.runtime import core_config
from pagedweight.policy.policies import PolicyInfeasible
from pagedweight.results.metrics import Slo
from pagedweight.results.writer import ResultsWriter, policy_summary
from pagedweight.workload.build import build_workload
from pwsim.engine import SimEngine
from pwsim.latency import build_latency_model


def run_scenario(
    loaded: LoadedScenario,
    out_dir: str | Path,
    policies: list[str] | None = None,
    progress: bool = False,
    report: bool = True,
) -> dict:
    sc, model = loaded.scenario, loaded.model
    trace = build_workload(sc.workload, loaded.base_dir, loaded.max_model_len, np.random.default_rng(sc.seed))
    table = importance_table(loaded)
    latency = build_latency_model(sc.latency, model, loaded.gpu, loaded.base_dir)
    cfg = core_config(loaded)
    routing_kind = sc.routing.resolved_kind(True)
    slo = Slo(sc.slo.ttft_ms, sc.slo.tpot_ms, sc.slo.e2el_ms)
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
    for policy in policies or list(sc.policies):
        wall0 = time.perf_counter()
        try:
            eng = SimEngine(
                cfg, policy, trace, table, latency, routing_kind, seed=sc.seed, routing_alpha=sc.routing.zipf_alpha
            )
        except PolicyInfeasible as e:
            writer.add_error(policy, str(e))
            continue
        bar = _progress_bar(policy, trace) if progress else None
        eng.run(progress=bar.update_to if bar else None)
        if bar:
            bar.close()
        summary = policy_summary(eng.requests, eng.core, slo, time.perf_counter() - wall0, eng.bytes_h2d)
        writer.add(policy, eng.requests, eng.core, summary)
    out_of_grid = getattr(latency, "out_of_grid", None)
    if out_of_grid:  # points the latency table did not cover: timed by the analytic fallback
        writer.meta["out_of_grid"] = dict(out_of_grid)
    meta = writer.write(yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False))
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
