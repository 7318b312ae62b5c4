"""The results directory both runtimes write and the report reads.

    <out>/
      requests.csv            one row per request and policy (lifecycle timestamps, TTFT, TPOT, ...)
      steps.csv               one row per engine step and policy (batch, KV/weight/free pages, quality)
      transitions.csv         one row per precision change (time, expert, from, to, bytes)
      initial_precisions.csv  one row per policy and routed expert: its precision at the start
                              (with transitions.csv this gives every expert's precision over time)
      summary.json            run facts + per policy: vLLM benchmark names, weight bytes by precision
      scenario.resolved.yaml  the scenario with every default filled in (when run from a scenario)

Every file is written atomically (temporary file + rename): an interrupted run never leaves a
half-written table that a later reader would take for a result.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from pagedweight.core.runtime import TRANSITION_COLUMNS, RuntimeCore
from pagedweight.core.scheduler import Request
from pagedweight.core.spec import PRECISION_NAMES
from pagedweight.results.metrics import Slo, request_rows, summarize


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_write_csv(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)


def trace_meta(trace) -> dict:
    """What summary.json says about a ``RequestTrace``."""
    return {"source": trace.source, "num_requests": len(trace), "notes": list(trace.notes)}


def run_meta(
    *,
    runtime: str,
    scenario: str,
    model: str,
    gpu: str,
    budget_bytes: int,
    page_bytes: int,
    latency_model: str,
    importance: str,
    trace: dict,
    seed: int | None = None,
    **extra,
) -> dict:
    """The run facts at the top of summary.json, in one order for both runtimes. ``extra``
    (runtime-specific facts) comes before the trace; ``seed`` is left out when there is none
    (a live server)."""
    meta = {
        "runtime": runtime,
        "scenario": scenario,
        "model": model,
        "gpu": gpu,
        "budget_bytes": budget_bytes,
        "page_bytes": page_bytes,
        "latency_model": latency_model,
        "importance": importance,
        **extra,
        "trace": trace,
    }
    if seed is not None:
        meta["seed"] = seed
    return meta


def weight_summary(steps: dict[str, np.ndarray], page_bytes: int) -> dict:
    """Time-weighted mean and final weight bytes per precision, from the step table."""
    dur = steps["duration_s"]
    total = float(dur.sum()) or 1.0
    out = {}
    for name in PRECISION_NAMES:
        pages = steps[f"weight_pages_{name}"]
        if len(pages) and pages.any():
            out[name] = {
                "mean_bytes": float((pages * dur).sum() / total * page_bytes),
                "final_bytes": int(pages[-1] * page_bytes),
            }
    return out


def policy_summary(requests: list[Request], core: RuntimeCore, slo: Slo, wall_s: float, h2d_bytes: int) -> dict:
    """``summarize`` plus what only a run with precision changes has to say."""
    steps = core.steps.columns()
    s = summarize(requests, slo, steps)
    n = len(core.steps)
    dur = steps["duration_s"]
    sim_s = float(steps["start_s"][-1] + dur[-1]) if n else 0.0
    s.update(
        num_steps=n,
        weight_bytes=weight_summary(steps, core.pool.page_bytes),
        mean_quality_proxy=float((steps["quality_proxy"] * dur).sum() / max(dur.sum(), 1e-12)) if n else 0.0,
        max_quality_proxy=float(steps["quality_proxy"].max()) if n else 0.0,
        num_downgrades=int(steps["num_downgrades"].sum()),
        num_upgrades=int(steps["num_upgrades"].sum()),
        h2d_bytes=int(h2d_bytes),
        simulated_s=sim_s,
        wall_s=wall_s,
        sim_s_per_wall_s=sim_s / wall_s if wall_s > 0 else float("inf"),
    )
    return s


@dataclass
class ResultsWriter:
    """Collects one run's policies, then writes the directory."""

    out_dir: Path
    meta: dict
    _requests: list[pd.DataFrame] = field(default_factory=list)
    _steps: list[pd.DataFrame] = field(default_factory=list)
    _transitions: list[pd.DataFrame] = field(default_factory=list)
    _initial: list[pd.DataFrame] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.meta.setdefault("policies", {})

    def add_error(self, policy: str, message: str) -> None:
        self.meta["policies"][policy] = {"error": message}

    def add(self, policy: str, requests: list[Request], core: RuntimeCore, summary: dict) -> None:
        self.meta["policies"][policy] = summary
        ids = np.asarray(core.setup.initial_ids)
        experts = np.arange(len(ids))
        initial = pd.DataFrame(
            {
                "expert": experts,
                "layer": experts // core.model.num_experts,
                "precision": np.asarray(PRECISION_NAMES)[ids],
            }
        )
        for frames, df in (
            (self._requests, pd.DataFrame(request_rows(requests))),
            (self._steps, pd.DataFrame(core.steps.columns())),
            (self._transitions, pd.DataFrame([t.row() for t in core.transitions], columns=TRANSITION_COLUMNS)),
            (self._initial, initial),
        ):
            df.insert(0, "policy", policy)
            frames.append(df)

    def write(self, scenario_yaml: str | None = None) -> dict:
        out = self.out_dir
        tables = (
            ("requests", self._requests),
            ("steps", self._steps),
            ("transitions", self._transitions),
            ("initial_precisions", self._initial),
        )
        for name, frames in tables:
            if frames:
                atomic_write_csv(pd.concat(frames, ignore_index=True), out / f"{name}.csv")
        atomic_write_text(out / "summary.json", json.dumps(self.meta, indent=2, default=_json_default) + "\n")
        if scenario_yaml is not None:
            atomic_write_text(out / "scenario.resolved.yaml", scenario_yaml)
        return self.meta


def _json_default(v):
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")
