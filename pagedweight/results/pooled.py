"""Real runs of one scenario repeated and pooled into one results directory
(``pwsim validate --repeats N``).

A real run of a few seconds on a machine whose speed drifts measures the machine as much as
the engine: on the shared 2-core VM, static-fp16's rate moved between 277 and 403 tok/s from one
run to the next. One simulated run compared with one real run then carries that drift into
every error. Repeating the real run and pooling the repeats averages it, and the spread of the
repeats says how far the real runs disagree with each other: no model can be checked more
tightly than that.

Pooled per policy, against which one simulated run is compared: totals (requests, tokens,
duration, steps) summed over the runs; every other figure (throughputs, latency means and
percentiles, counts, KV usage) the median over the runs of each run's own figure: the typical
run. A percentile over the requests of all runs together would mix the machine's fast and slow
spells into a tail that no single run has: in five validations of four runs each, the
simulation of static-fp16 (fitted in sample) came 10-27% short of its P99 TTFT pooled that way,
and within 11% of the median of the runs' own. ``real_runs`` keeps each run's figures
of the checked metrics (throughputs, median and P99 TTFT, mean TPOT), in run order.

Tables: requests, steps and transitions of the runs one after another, each run's times moved
to start where the previous run of the same policy ended, with a ``run`` column (1, 2, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from pagedweight.errors import PagedWeightError
from pagedweight.results.report_data import read_summary
from pagedweight.results.writer import atomic_write_csv, atomic_write_text

# Columns holding a time on the run's clock, per table: shifted by the run's offset.
TIME_COLUMNS = {
    "requests.csv": ("arrival_s", "first_scheduled_s", "first_token_s", "finish_s"),
    "steps.csv": ("start_s",),
    "transitions.csv": ("time_s",),
}
# Totals over the runs; any other number in a run's summary is pooled as the runs' median.
SUMMED = (
    "num_requests", "completed", "rejected", "unfinished", "duration_s", "total_input_tokens",
    "total_output_tokens", "prefill_tokens_computed", "num_steps", "wall_s",
)  # fmt: skip
# Each run's own figures kept beside the pooled ones: the validation's checked metrics (their
# spread across runs is what a check against them can resolve; ``validation.split_half_perc``).
RUN_FIGURES = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")


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
    offsets = _offsets(summaries, tables)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, frames in tables.items():
        shifted = [_shift(df, name, offsets[i], i + 1) for i, df in enumerate(frames) if df is not None]
        if shifted:
            atomic_write_csv(pd.concat(shifted, ignore_index=True), out_dir / name)
    for extra in ("initial_precisions.csv", "scenario.resolved.yaml"):
        if (run_dirs[0] / extra).is_file():
            atomic_write_text(out_dir / extra, (run_dirs[0] / extra).read_text())
    pooled = {**first, "pooled_runs": [str(d) for d in run_dirs], "policies": {}}
    for policy, entry in first["policies"].items():
        runs = [s["policies"][policy] for s in summaries]
        if any("error" in r for r in runs):
            pooled["policies"][policy] = next(r for r in runs if "error" in r)
            continue
        pooled["policies"][policy] = _pool_policy(entry, runs)
    atomic_write_text(out_dir / "summary.json", json.dumps(pooled, indent=2, default=float) + "\n")
    return pooled


def _read(path: Path) -> pd.DataFrame | None:
    return pd.read_csv(path) if path.is_file() and path.stat().st_size > 0 else None


def _offsets(summaries: list[dict], tables: dict) -> list[dict[str, float]]:
    """Per run, per policy: where its times start in the pooled tables (the end of that policy's
    previous runs: its last finish or step end, whichever is later)."""
    offsets, at = [], dict.fromkeys(summaries[0]["policies"], 0.0)
    for i in range(len(summaries)):
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


def _pool_policy(first: dict, runs: list[dict]) -> dict:
    out = dict(first)
    for key in first:
        values = [r.get(key) for r in runs]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            continue  # text, lists and mappings: the first run's
        if key in SUMMED:
            out[key] = sum(values)
        else:
            finite = [float(v) for v in values if np.isfinite(v)]
            out[key] = float(np.median(finite)) if finite else float("nan")
    out["real_runs"] = {key: [r.get(key) for r in runs] for key in RUN_FIGURES}
    return out
