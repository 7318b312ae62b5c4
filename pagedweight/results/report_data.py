"""Reading results directories for reports and comparisons.

Only the tables a results directory holds (``pagedweight.results.writer``) are read, so a simulated
and a real run look the same here. Tables that a directory lacks come back empty; every
consumer draws what the tables allow and says what is missing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from pagedweight.core.spec import PRECISION_NAMES, PRECISIONS
from pagedweight.errors import PagedWeightError

# (summary key, label, format, better): better is "higher", "lower" or "" (no direction).
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("completed", "completed requests", "{:.0f}", "higher"),
    ("request_throughput", "request throughput (req/s)", "{:.3f}", "higher"),
    ("request_goodput", "goodput (req/s within SLO)", "{:.3f}", "higher"),
    ("output_throughput", "output throughput (tok/s)", "{:.1f}", "higher"),
    ("total_token_throughput", "total token throughput (tok/s)", "{:.1f}", "higher"),
    ("mean_ttft_ms", "mean TTFT (ms)", "{:.1f}", "lower"),
    ("median_ttft_ms", "median TTFT (ms)", "{:.1f}", "lower"),
    ("p99_ttft_ms", "P99 TTFT (ms)", "{:.1f}", "lower"),
    ("mean_tpot_ms", "mean TPOT (ms)", "{:.2f}", "lower"),
    ("p99_tpot_ms", "P99 TPOT (ms)", "{:.2f}", "lower"),
    ("mean_itl_ms", "mean ITL (ms)", "{:.2f}", "lower"),
    ("mean_e2el_ms", "mean end-to-end latency (ms)", "{:.1f}", "lower"),
    ("p99_e2el_ms", "P99 end-to-end latency (ms)", "{:.1f}", "lower"),
    ("num_preemptions", "preemptions", "{:.0f}", "lower"),
    ("load_ratio", "offered load / served, late in the run (above 1: the queue kept growing)", "{:.2f}", "lower"),
    ("mean_kv_cache_usage_perc", "mean KV cache usage (%)", "{:.1f}", ""),
    ("mean_weight_gib", "mean weight memory (GiB)", "{:.2f}", "lower"),
    ("mean_quality_proxy", "quality proxy, mean dloss (nats/token)", "{:.4g}", "lower"),
    ("max_quality_proxy", "quality proxy, max dloss (nats/token)", "{:.4g}", "lower"),
    ("num_downgrades", "downgrades", "{:.0f}", ""),
    ("num_upgrades", "upgrades", "{:.0f}", ""),
    ("h2d_gib", "host-to-device traffic (GiB)", "{:.2f}", "lower"),
    ("prefix_cache_hit_rate", "prefix cache hit rate (prompt tokens)", "{:.1%}", "higher"),
    ("prefill_tokens_saved", "prefill tokens saved by prefix caching", "{:.0f}", "higher"),
    ("num_evicted_blocks", "cached prefix blocks evicted", "{:.0f}", ""),
    ("prefix_ghost_hits", "evicted prefix blocks asked for again (ghost hits)", "{:.0f}", "lower"),
    ("peak_kv_gib", "peak KV held by requests (GiB)", "{:.2f}", "lower"),
    ("rejected", "rejected requests", "{:.0f}", "lower"),
    ("unfinished", "unfinished requests", "{:.0f}", "lower"),
)
METRIC_KEYS = tuple(m[0] for m in METRICS)
# Columns of ``pwsim compare`` and the sim-vs-real table: the figures a reader checks first.
KEY_METRICS = (
    "request_throughput",
    "output_throughput",
    "request_goodput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "num_preemptions",
    "load_ratio",
    "mean_quality_proxy",
)
# Precisions from the most to the fewest bits: stacking and colour order.
PRECISION_ORDER: tuple[str, ...] = tuple(sorted(PRECISION_NAMES, key=lambda p: -PRECISIONS[p].rank))


def policy_metrics(entry: dict) -> dict:
    """One policy's ``summary.json`` entry plus derived figures (GiB, not bytes)."""
    out = dict(entry)
    weights = entry.get("weight_bytes") or {}
    if weights:
        out["mean_weight_gib"] = sum(w["mean_bytes"] for w in weights.values()) / 2**30
        for name, w in weights.items():
            out[f"mean_weight_gib_{name}"] = w["mean_bytes"] / 2**30
    if "h2d_bytes" in entry:
        out["h2d_gib"] = entry["h2d_bytes"] / 2**30
    if "peak_kv_bytes" in entry:
        out["peak_kv_gib"] = entry["peak_kv_bytes"] / 2**30
    return out


def fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return spec.format(value)


@dataclass
class RunResults:
    """One results directory, loaded."""

    path: Path
    summary: dict
    steps: pd.DataFrame
    requests: pd.DataFrame
    transitions: pd.DataFrame
    initial_precisions: pd.DataFrame
    scenario: dict  # scenario.resolved.yaml, or {} when the run did not come from a scenario

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def runtime(self) -> str:
        return self.summary.get("runtime", "?")

    @property
    def policies(self) -> list[str]:
        """Policies that ran (infeasible ones have an ``error`` entry instead of metrics)."""
        return [p for p, v in self.summary.get("policies", {}).items() if "error" not in v]

    @property
    def errors(self) -> dict[str, str]:
        return {p: v["error"] for p, v in self.summary.get("policies", {}).items() if "error" in v}

    def metrics(self, policy: str) -> dict:
        return policy_metrics(self.summary["policies"][policy])

    def policy_steps(self, policy: str) -> pd.DataFrame:
        """The step rows of ``policy``, as ``steps[steps["policy"] == policy]`` gives them. A
        run writes each policy's rows together, so they are a slice of the table: the figures
        take it six times per policy, and a boolean mask copied every column each time (~1 s
        for the 2.8 million steps of 7 policies over a long-context hour)."""
        steps = self.steps
        cached = self.__dict__.get("_policy_spans")
        if cached is None or cached[0] is not steps:
            cached = self.__dict__["_policy_spans"] = (steps, _policy_spans(steps))
        span = cached[1].get(policy)
        if span is None:  # absent, or in more than one run of rows
            return steps[steps["policy"] == policy] if "policy" in steps else steps.iloc[0:0]
        return steps.iloc[span[0] : span[1]]

    def copy_budget_bytes_per_s(self) -> float | None:
        value = (self.scenario.get("controller") or {}).get("copy_budget_bytes_per_s")
        return float(value) if value is not None else None


def _policy_spans(steps: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """Each policy whose rows of ``steps`` are contiguous: their first and past-last row."""
    if "policy" not in steps or steps.empty:
        return {}
    codes, names = pd.factorize(steps["policy"], sort=False)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(codes)) + 1))
    stops = np.append(starts[1:], len(codes))
    runs = codes[starts]
    counts = np.bincount(runs, minlength=len(names))
    return {str(names[c]): (int(a), int(b)) for c, a, b in zip(runs, starts, stops, strict=True) if counts[c] == 1}


def read_summary(path: Path) -> dict:
    f = Path(path) / "summary.json"
    if not f.is_file():
        raise PagedWeightError(f"{path}: not a results directory (no summary.json)")
    try:
        summary = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise PagedWeightError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("policies"), dict):
        raise PagedWeightError(f"{f}: no 'policies' mapping")
    return summary


def _csv(path: Path) -> pd.DataFrame:
    return pd.read_csv(path) if path.is_file() and path.stat().st_size > 0 else pd.DataFrame()


# steps.csv of 7 policies over an hour of long context is ~2.5M rows. Read with pandas'
# defaults it costs ~600 bytes a row at the peak (4M rows: 2.4 GB); here the columns take the
# step recorder's types (policy names as categories, counts as int32) and are filled chunk by
# chunk into arrays of their final length, so the peak is the table (~130 bytes a row) plus a chunk.
_STEP_TYPES = {"policy": "str", "start_s": "float64", "duration_s": "float64", "kv_usage": "float64"}
_STEP_TYPES |= {"quality_proxy": "float64", "bytes_downgraded": "int64", "bytes_upgraded": "int64"}
_STEP_TYPES |= {"bytes_swapped": "int64"}
_CHUNK_ROWS = 200_000


def _steps_csv(path: Path) -> pd.DataFrame:
    if not (path.is_file() and path.stat().st_size > 0):
        return pd.DataFrame()
    header = list(pd.read_csv(path, nrows=0).columns)
    if "policy" not in header:
        return pd.read_csv(path)
    with path.open("rb") as f:
        num_rows = sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 24), b"")) - 1
    types = {c: _STEP_TYPES.get(c, "int32") for c in header}
    try:
        cols = {c: np.empty(num_rows + 1, dtype=np.int16 if c == "policy" else types[c]) for c in header}
        names: dict[str, int] = {}
        n = 0
        for chunk in pd.read_csv(path, dtype=types, chunksize=_CHUNK_ROWS):
            m = len(chunk)
            for c in header:
                if c == "policy":
                    values = chunk[c].to_numpy()
                    for name in pd.unique(values):
                        names.setdefault(name, len(names))
                    cols[c][n : n + m] = pd.Series(values).map(names).to_numpy()
                else:
                    cols[c][n : n + m] = chunk[c].to_numpy()
            n += m
    except (ValueError, OverflowError):  # a table from elsewhere with other types: pandas decides
        return pd.read_csv(path)
    cols = {c: a[:n] for c, a in cols.items()}
    cols["policy"] = pd.Categorical.from_codes(cols["policy"], categories=list(names))
    return pd.DataFrame(cols, copy=False)


def report_step_arrays(columns: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """A policy's step columns in the types the report reads steps.csv into (``_STEP_TYPES``;
    counts as int32), or None if a value does not fit its type (the CSV reader would then
    fall back to pandas' own types: the report reads the CSV)."""
    out = {}
    for name, values in columns.items():
        dtype = np.dtype(_STEP_TYPES.get(name, "int32"))
        if dtype.kind == "i":
            info = np.iinfo(dtype)
            if values.dtype.kind not in "iu" or (len(values) and (values.min() < info.min or values.max() > info.max)):
                return None
        out[name] = values.astype(dtype, copy=False)
    return out


# A step-arrays folder: one ``.npy`` per column, and this list of the columns in order, written
# last (a folder without it, say from a worker stopped mid-write, holds no arrays).
STEP_ARRAY_COLUMNS = "columns.json"


def save_step_arrays(folder: Path, arrays: dict[str, np.ndarray]) -> None:
    """``report_step_arrays``' columns into ``folder``, each as its own ``.npy`` file: the run's
    report maps them (``step_array_files``) and copies each once into the joined table, where
    the members of a ``numpy.savez`` archive were read into memory first (0.24 s against 0.44 s
    in the parent for the 2.8 million steps of 7 policies over a long-context hour)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i, values in enumerate(arrays.values()):
        np.save(folder / f"{i}.npy", np.ascontiguousarray(values))
    (folder / STEP_ARRAY_COLUMNS).write_text(json.dumps(list(arrays)))


def step_array_files(folder: Path) -> dict[str, Path] | None:
    """The column files ``save_step_arrays`` wrote, by column in order (``numpy.load`` each,
    ``mmap_mode="r"`` to map it); None where the folder holds no complete set."""
    folder = Path(folder)
    try:
        names = json.loads((folder / STEP_ARRAY_COLUMNS).read_text())
    except (OSError, ValueError):
        return None
    files = {name: folder / f"{i}.npy" for i, name in enumerate(names)}
    return files if all(f.is_file() for f in files.values()) else None


def steps_from_arrays(parts: list[tuple[str, Path]]) -> pd.DataFrame | None:
    """The frame ``_steps_csv`` reads from the steps.csv of these parts (each a policy and the
    folder of its ``report_step_arrays``, ``save_step_arrays``), without parsing 30 columns of
    text per step (~3.5 s for the 2.8 million steps of 7 policies over a long-context hour);
    filled column by column into arrays of their final length, as ``_steps_csv`` fills them,
    each part's column mapped only while it is copied (mapped pages count in the process's
    memory). None where a part has no arrays, the parts do not have the same columns or there
    are no rows: the caller reads the CSV."""
    files = [(policy, step_array_files(path)) for policy, path in parts]
    if not files or any(f is None for _, f in files):
        return None
    names = list(files[0][1])
    if not names or any(list(f) != names for _, f in files):
        return None
    lengths = [len(np.load(f[names[0]], mmap_mode="r")) for _, f in files]
    total = sum(lengths)
    if not total:
        return None
    # As the CSV reader names them: in order of their first row.
    categories = list(dict.fromkeys(policy for (policy, _), n in zip(files, lengths, strict=True) if n))
    codes = np.concatenate(
        [np.full(n, categories.index(p) if n else 0, np.int16) for (p, _), n in zip(files, lengths, strict=True)]
    )
    cols: dict[str, object] = {"policy": pd.Categorical.from_codes(codes, categories=categories)}
    for name in names:
        out, at = None, 0
        for (_, f), n in zip(files, lengths, strict=True):
            values = np.load(f[name], mmap_mode="r")
            if out is None:
                out = np.empty(total, dtype=values.dtype)
            if values.dtype != out.dtype or len(values) != n:
                return None
            out[at : at + n] = values
            at += n
            del values  # unmapped here, not when the frame is done
        cols[name] = out
    return pd.DataFrame(cols, copy=False)


def load_run(path: str | Path, tables: bool = True, steps: pd.DataFrame | None = None) -> RunResults:
    """``tables=False`` reads only the summary (enough for ``pwsim compare``); ``steps``: the
    step table if the caller has it already (``steps_from_arrays``)."""
    path = Path(path)
    summary = read_summary(path)
    empty = pd.DataFrame()
    resolved = path / "scenario.resolved.yaml"
    scenario = (yaml.safe_load(resolved.read_text()) or {}) if resolved.is_file() else {}
    if not tables:
        return RunResults(path, summary, empty, empty, empty, empty, scenario)
    return RunResults(
        path,
        summary,
        steps if steps is not None else _steps_csv(path / "steps.csv"),
        _csv(path / "requests.csv"),
        _csv(path / "transitions.csv"),
        _csv(path / "initial_precisions.csv"),
        scenario,
    )


def sample_steps(steps: pd.DataFrame, columns: list[str], num_points: int = 600) -> pd.DataFrame:
    """The step table sampled at ``num_points`` evenly spaced times: the row in force at each
    time (steps are piecewise constant). A run of an hour has ~150k steps; drawing all of them
    costs seconds and shows nothing more at report resolution."""
    if steps.empty:
        return pd.DataFrame(columns=["time_s", *columns])
    start = steps["start_s"].to_numpy()
    end_s = float(start[-1] + steps["duration_s"].to_numpy()[-1])
    t = np.linspace(float(start[0]), end_s, num_points)
    idx = np.clip(np.searchsorted(start, t, side="right") - 1, 0, len(start) - 1)
    out = steps[columns].iloc[idx].reset_index(drop=True)
    out.insert(0, "time_s", t)
    return out


def bin_sum(
    times_s: np.ndarray, values: np.ndarray, end_s: float, num_bins: int = 200
) -> tuple[np.ndarray, np.ndarray]:
    """Sum of ``values`` per time bin, divided by the bin width: a rate per second.
    Returns (bin left edges, rate per second)."""
    width = max(end_s, 1e-9) / num_bins
    edges = np.arange(num_bins) * width
    idx = np.clip((np.asarray(times_s) / width).astype(int), 0, num_bins - 1)
    sums = np.bincount(idx, weights=np.asarray(values, dtype=float), minlength=num_bins)
    return edges, sums / width


def precision_timeline(
    initial: pd.DataFrame, transitions: pd.DataFrame, times_s: np.ndarray
) -> tuple[np.ndarray, list[str]]:
    """Every expert's precision at each of ``times_s`` (sorted), rebuilt from its initial
    precision and the committed transitions (aborted upgrades change nothing).

    Returns ``(grid, names)``: ``grid[e, j]`` is an index into ``names`` (precisions ordered
    from the most bits to the fewest) for expert ``e`` at ``times_s[j]``."""
    # unique() first: iterating a pandas string column costs ~1 us an element (300,000 changes)
    seen = set(initial["precision"].unique())
    if "to_precision" in transitions:
        seen |= set(transitions["to_precision"].unique())
    names = [p for p in PRECISION_ORDER if p in seen]
    code = {p: i for i, p in enumerate(names)}
    current = initial.sort_values("expert")["precision"].map(code).to_numpy().copy()
    grid = np.empty((len(current), len(times_s)), dtype=np.int8)
    done = (
        transitions[transitions["kind"] != "abort"].sort_values("time_s", kind="stable") if len(transitions) else None
    )
    t_arr = done["time_s"].to_numpy() if done is not None else np.zeros(0)
    e_arr = done["expert"].to_numpy() if done is not None else np.zeros(0, dtype=int)
    p_arr = done["to_precision"].map(code).to_numpy() if done is not None else np.zeros(0, dtype=int)
    k = 0
    for j, t in enumerate(times_s):
        while k < len(t_arr) and t_arr[k] <= t:
            current[e_arr[k]] = p_arr[k]
            k += 1
        grid[:, j] = current
    return grid, names


def sim_real_pairs(runs: list[RunResults]) -> list[tuple[RunResults, RunResults]]:
    """(simulated, real) pairs of runs of the same scenario: one from ``pwsim``, one from
    another runtime."""
    pairs = []
    for sim in runs:
        if sim.runtime != "pwsim":
            continue
        for real in runs:
            if real.runtime != "pwsim" and real.summary.get("scenario") == sim.summary.get("scenario"):
                pairs.append((sim, real))
    return pairs


def signed_error_perc(sim: float | None, real: float | None) -> float:
    """(sim - real) / |real| in percent: positive means the simulator predicts more."""
    if sim is None or real is None or not math.isfinite(sim) or not math.isfinite(real):
        return float("nan")
    if real == 0:
        return 0.0 if sim == 0 else math.copysign(math.inf, sim)
    return (sim - real) / abs(real) * 100.0


_SHORT = {
    "request_throughput": "req/s",
    "output_throughput": "out tok/s",
    "request_goodput": "goodput",
    "mean_ttft_ms": "TTFT ms",
    "p99_ttft_ms": "P99 TTFT",
    "mean_tpot_ms": "TPOT ms",
    "p99_tpot_ms": "P99 TPOT",
    "num_preemptions": "preempt",
    "load_ratio": "load x",
    "mean_quality_proxy": "quality",
}


def compare_table(dirs: list[str | Path]) -> pd.DataFrame:
    """One row per results directory and policy: where it came from and its key metrics;
    a policy that could not run has its reason in ``error`` and no metrics."""
    rows = []
    for d in dirs:
        run = load_run(d, tables=False)
        s = run.summary
        for policy, entry in s["policies"].items():
            m = policy_metrics(entry)
            rows.append(
                {
                    "run": run.name,
                    "runtime": run.runtime,
                    "scenario": s.get("scenario", ""),
                    "budget_gib": s.get("budget_bytes", float("nan")) / 2**30,
                    "policy": policy,
                    **{k: m.get(k, float("nan")) for k in KEY_METRICS},
                    "error": entry.get("error", ""),
                }
            )
    return pd.DataFrame(rows)


def format_compare(table: pd.DataFrame) -> str:
    """``compare_table`` as aligned text, formats from ``METRICS``. A policy that could not run
    shows its reason in place of the metrics."""
    spec = {k: s for k, _, s, _ in METRICS}
    head = ["run", "runtime", "scenario", "budget GiB", "policy", *(_SHORT[k] for k in KEY_METRICS)]
    rows = []
    for _, r in table.iterrows():
        cells = [str(r["run"]), str(r["runtime"]), str(r["scenario"]), f"{r['budget_gib']:.4g}", str(r["policy"])]
        rows.append(cells + ([] if r["error"] else [fmt(r[k], spec[k]) for k in KEY_METRICS]))
    widths = [max([len(h)] + [len(c[i]) for c in rows if i < len(c)]) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=False))  # error rows stop after the policy
        return "  ".join(c.ljust(w) if i in (0, 1, 2, 4) else c.rjust(w) for i, (c, w) in pairs)

    out = [line(head)]
    for cells, (_, r) in zip(rows, table.iterrows(), strict=True):
        out.append(line(cells) + (f"  infeasible: {r['error']}" if r["error"] else ""))
    return "\n".join(out)
