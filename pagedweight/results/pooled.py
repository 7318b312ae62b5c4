"""Real runs of one scenario repeated and pooled into one results directory
(``pwsim validate --repeats N``).

A real run of a few seconds on a machine whose speed drifts measures the machine as much as
the engine: on the shared 2-core VM, static-fp16's rate moved between 277 and 403 tok/s from one
run to the next. One simulated run compared with one real run then carries that drift into
every error. Repeating the real run and pooling the repeats averages it, and the spread of the
repeats says how far the real runs disagree with each other: no model can be checked more
tightly than that.

Pooled per policy, against which one simulated run is compared:

- throughputs: the completed requests and tokens of every run over their summed durations;
- TTFT, TPOT and E2E latency: mean, deviation and percentiles over every run's requests;
- counts (preemptions, downgrades, upgrades): the mean per run;
- mean KV usage: the runs' means weighted by their durations; inter-token latency: the mean of
  the runs' figures (the gaps themselves are not in the tables);
- ``real_runs``: each run's own output throughput, median TTFT and mean TPOT, in run order.

Tables: requests, steps and transitions of the runs one after another, each run's times moved
to start where the previous run of the same policy ended, with a ``run`` column (1, 2, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from pagedweight.errors import PagedWeightError
from pagedweight.results.metrics import latency_stats
from pagedweight.results.report_data import read_summary
from pagedweight.results.writer import atomic_write_csv, atomic_write_text

# Columns holding a time on the run's clock, per table: shifted by the run's offset.
TIME_COLUMNS = {
    "requests.csv": ("arrival_s", "first_scheduled_s", "first_token_s", "finish_s"),
    "steps.csv": ("start_s",),
    "transitions.csv": ("time_s",),
}
COUNTS = ("num_preemptions", "num_downgrades", "num_upgrades")
RUN_FIGURES = ("output_throughput", "median_ttft_ms", "mean_tpot_ms")


def pool_runs(run_dirs: list[Path], out_dir: Path) -> dict:
    """Pool the results directories ``run_dirs`` (runs of the same scenario and policies) into
    ``out_dir``; returns the pooled summary."""
    if not run_dirs:
        raise PagedWeightError("pool_runs: no runs to pool")
    summaries = [read_summary(d) for d in run_dirs]
    first = summaries[0]
    for d, s in zip(run_dirs[1:], summaries[1:], strict=True):
        if s.get("scenario") != first.get("scenario") or set(s["policies"]) != set(first["policies"]):
            raise PagedWeightError(
                f"{d}: scenario {s.get('scenario')!r} with policies {sorted(s['policies'])}; "
                f"{run_dirs[0]} has {first.get('scenario')!r} with {sorted(first['policies'])}: only runs of "
                "the same scenario and policies pool"
            )
    tables = {name: [_read(d / name) for d in run_dirs] for name in TIME_COLUMNS}
    offsets = _offsets(run_dirs, summaries, tables)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, frames in tables.items():
        shifted = [_shift(df, name, offsets[i], i + 1) for i, df in enumerate(frames) if df is not None]
        if shifted:
            atomic_write_csv(pd.concat(shifted, ignore_index=True), out_dir / name)
    for extra in ("initial_precisions.csv", "scenario.resolved.yaml"):
        if (run_dirs[0] / extra).is_file():
            atomic_write_text(out_dir / extra, (run_dirs[0] / extra).read_text())
    requests = pd.read_csv(out_dir / "requests.csv") if (out_dir / "requests.csv").is_file() else None
    pooled = {**first, "pooled_runs": [str(d) for d in run_dirs], "policies": {}}
    for policy, entry in first["policies"].items():
        runs = [s["policies"][policy] for s in summaries]
        if any("error" in r for r in runs):
            pooled["policies"][policy] = next(r for r in runs if "error" in r)
            continue
        mine = None if requests is None else requests[requests["policy"] == policy]
        pooled["policies"][policy] = _pool_policy(entry, runs, mine)
    atomic_write_text(out_dir / "summary.json", json.dumps(pooled, indent=2, default=float) + "\n")
    return pooled


def _read(path: Path) -> pd.DataFrame | None:
    return pd.read_csv(path) if path.is_file() and path.stat().st_size > 0 else None


def _offsets(run_dirs: list[Path], summaries: list[dict], tables: dict) -> list[dict[str, float]]:
    """Per run, per policy: where its times start in the pooled tables (the end of that policy's
    previous runs: its last finish or step end, whichever is later)."""
    offsets, at = [], dict.fromkeys(summaries[0]["policies"], 0.0)
    for i in range(len(run_dirs)):
        offsets.append(dict(at))
        for policy in at:
            end = 0.0
            req, steps = tables["requests.csv"][i], tables["steps.csv"][i]
            if req is not None and len(req):
                end = max(end, float(np.nanmax(req.loc[req["policy"] == policy, "finish_s"], initial=0.0)))
            if steps is not None and len(steps):
                mine = steps[steps["policy"] == policy]
                end = max(end, float((mine["start_s"] + mine["duration_s"]).max()) if len(mine) else 0.0)
            at[policy] += end
    return offsets


def _shift(df: pd.DataFrame, name: str, offset: dict[str, float], run: int) -> pd.DataFrame:
    df = df.copy()
    by_policy = df["policy"].map(offset).fillna(0.0) if "policy" in df else 0.0
    for col in TIME_COLUMNS[name]:
        if col in df:
            df[col] = df[col] + by_policy
    df.insert(0, "run", run)
    return df


def _pool_policy(first: dict, runs: list[dict], requests: pd.DataFrame | None) -> dict:
    out = dict(first)
    duration = sum(r["duration_s"] for r in runs)
    out["duration_s"] = duration
    for key in ("num_requests", "completed", "rejected", "unfinished", "total_input_tokens", "total_output_tokens"):
        out[key] = sum(r[key] for r in runs)
    out["request_throughput"] = out["completed"] / duration
    out["output_throughput"] = out["total_output_tokens"] / duration
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration
    if "request_goodput" in first:
        out["request_goodput"] = sum(r["request_goodput"] * r["duration_s"] for r in runs) / duration
    for key in COUNTS:
        if key in first:
            out[key] = float(np.mean([r[key] for r in runs]))
    if "mean_kv_cache_usage_perc" in first:
        out["mean_kv_cache_usage_perc"] = sum(r["mean_kv_cache_usage_perc"] * r["duration_s"] for r in runs) / duration
    if "max_kv_cache_usage_perc" in first:
        out["max_kv_cache_usage_perc"] = max(r["max_kv_cache_usage_perc"] for r in runs)
    for key in [k for k in first if k.endswith("_itl_ms")]:
        out[key] = float(np.mean([r[key] for r in runs]))
    if requests is not None and len(requests):
        done = requests[requests["state"] == "finished"]
        for name in ("ttft", "tpot", "e2el"):
            latency_stats(name, done[f"{name}_ms"].to_numpy(dtype=np.float64, copy=True), out)
    out["real_runs"] = {key: [r.get(key) for r in runs] for key in RUN_FIGURES}
    return out
