"""Compare a simulated run with a real run of the same scenario: signed % errors per metric.

Works only from two results directories (``pagedweight.results.writer``), so it compares whatever
produced them. Error = (simulated - real) / real * 100: positive means the simulator
over-predicts. ``validation.json`` holds every figure and the bounds they were checked against.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from pagedweight.errors import PagedWeightError
from pagedweight.results.report_data import read_summary, signed_error_perc

# Metric -> bound on |error| in % (None: reported, not checked). The GPU targets of the
# validation issue: throughput and mean TPOT within 5%, P50/P99 TTFT within 10%.
GPU_BOUNDS_PERC = {
    "output_throughput": 5.0,
    "request_throughput": 5.0,
    "mean_tpot_ms": 5.0,
    "median_ttft_ms": 10.0,
    "p99_ttft_ms": 10.0,
}
METRICS = (
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p90_tpot_ms",
    "p99_tpot_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p90_e2el_ms",
    "p99_e2el_ms",
    "num_preemptions",
    "mean_kv_cache_usage_perc",
    "num_downgrades",
    "num_upgrades",
)


def _load(d: Path) -> tuple[dict, pd.DataFrame | None, pd.DataFrame | None]:
    summary = read_summary(d)  # a clear error for anything but a results directory
    steps = pd.read_csv(d / "steps.csv") if (d / "steps.csv").is_file() else None
    tr = pd.read_csv(d / "transitions.csv") if (d / "transitions.csv").is_file() else None
    return summary, steps, tr


def _weight_bytes_over_time(steps: pd.DataFrame, page_bytes: int, grid_s: np.ndarray) -> dict[str, np.ndarray]:
    """Weight bytes per precision sampled on a common time grid (step-wise constant)."""
    out = {}
    idx = np.searchsorted(steps["start_s"].to_numpy(), grid_s, side="right") - 1
    idx = np.clip(idx, 0, len(steps) - 1)
    for c in steps.columns:
        if c.startswith("weight_pages_") and steps[c].any():
            out[c.removeprefix("weight_pages_")] = steps[c].to_numpy()[idx] * page_bytes
    return out


def compare(real_dir: str | Path, sim_dir: str | Path, bounds: dict[str, float] | None = None) -> dict:
    real_dir, sim_dir = Path(real_dir), Path(sim_dir)
    real, real_steps, real_tr = _load(real_dir)
    sim, sim_steps, sim_tr = _load(sim_dir)
    if real.get("scenario") != sim.get("scenario"):
        raise PagedWeightError(
            f"{real_dir} is scenario {real.get('scenario')!r} but {sim_dir} is {sim.get('scenario')!r}: "
            "validation compares runs of the same scenario"
        )
    bounds = GPU_BOUNDS_PERC if bounds is None else bounds
    out = {
        "scenario": real.get("scenario"),
        "real": {"dir": str(real_dir), "runtime": real.get("runtime"), "timed_by": real.get("latency_model")},
        "sim": {"dir": str(sim_dir), "runtime": sim.get("runtime"), "timed_by": sim.get("latency_model")},
        "bounds_perc": bounds,
        "policies": {},
    }
    num_runs = len(real.get("pooled_runs", ())) or 1
    for policy, r in real["policies"].items():
        s = sim["policies"].get(policy)
        if s is None or "error" in r or "error" in s:
            continue
        rows = {}
        for m in METRICS:
            if m in r and m in s:
                err = signed_error_perc(s[m], r[m])
                bound = bounds.get(m)
                rows[m] = {
                    "real": r[m],
                    "sim": s[m],
                    "error_perc": err,
                    "bound_perc": bound,
                    "ok": None if bound is None else bool(abs(err) <= bound),
                }
        entry = {"metrics": rows}
        if "real_runs" in r:  # pooled repeats (pagedweight.results.pooled): their own spread
            entry["real_runs"] = r["real_runs"]
            halves = split_half_perc(r["real_runs"])
            if halves:
                entry["real_split_half_perc"] = halves
        if real_steps is not None and sim_steps is not None:
            rs, ss = real_steps[real_steps["policy"] == policy], sim_steps[sim_steps["policy"] == policy]
            if len(rs) and len(ss):
                # Over time, one real run against the simulated one: the first of pooled repeats.
                first = rs[rs["run"] == 1] if "run" in rs else rs
                end_s = float(min(first["start_s"].max(), ss["start_s"].max()))
                grid = np.linspace(0.0, end_s, 200)
                wr = _weight_bytes_over_time(first, real["page_bytes"], grid)
                ws = _weight_bytes_over_time(ss, sim["page_bytes"], grid)
                entry["weight_bytes_mean_abs_error_perc"] = {
                    p: float(np.mean(np.abs(ws.get(p, 0 * grid) - wr[p])) / max(np.mean(wr[p]), 1.0) * 100) for p in wr
                }
            if len(rs) and len(ss):
                # Calibration aid: a per-step overhead the latency model lacks shows up as a
                # difference in the time of steps of the same shape; adding it to the analytic
                # model's (or the table's fallback's) step_overhead_s removes it.
                entry["mean_step_s"] = {"real": float(rs["duration_s"].mean()), "sim": float(ss["duration_s"].mean())}
                real_step_s, sim_step_s = matched_step_times(rs, ss)
                entry["matched_step_s"] = {"real": real_step_s, "sim": sim_step_s}
                entry["suggested_extra_step_overhead_s"] = real_step_s - sim_step_s
                entry["step_time_by_shape"] = step_time_by_shape(rs, ss)
        if real_tr is not None and sim_tr is not None:
            rt = real_tr[(real_tr["policy"] == policy) & (real_tr["kind"] != "abort")]
            st = sim_tr[(sim_tr["policy"] == policy) & (sim_tr["kind"] != "abort")]
            entry["transitions"] = {
                "real": len(rt) / num_runs,  # per run
                "sim": len(st),
                "first_real_s": float(rt["time_s"].min()) if len(rt) else None,
                "first_sim_s": float(st["time_s"].min()) if len(st) else None,
            }
        out["policies"][policy] = entry
    if real_steps is not None and sim_steps is not None:
        _add_cross_policy_ratios(out, real_steps, sim_steps)
    if real.get("out_of_grid") or sim.get("out_of_grid"):
        out["out_of_grid"] = sim.get("out_of_grid")
    checked = [row["ok"] for e in out["policies"].values() for row in e["metrics"].values() if row["ok"] is not None]
    out["all_within_bounds"] = all(checked)  # vacuously true when no bound is checked
    return out


def split_half_perc(real_runs: dict[str, list]) -> dict[str, float]:
    """How far the real runs disagree with themselves, per metric: the typical run (the median)
    of one half of the runs against the other's, in % of the typical run of all. A simulation
    checked against the pooled runs cannot be judged more finely than this: its error holds
    the pooled runs' own error, of the same size. The halves are balanced in time and in the
    order the policies ran (``_run_real`` reverses it every other run): of each pair of
    consecutive runs one goes to each half, the first of the pair to the first half in every
    other pair (runs 1, 4, 5, 8 against 2, 3, 6, 7). Empty below four runs."""
    out = {}
    for metric, values in real_runs.items():
        if len(values) < 4 or any(v is None or not np.isfinite(v) for v in values):
            continue
        first = [v for i, v in enumerate(values) if i % 4 in (0, 3)]  # runs 1, 4, 5, 8, ...
        second = [v for i, v in enumerate(values) if i % 4 in (1, 2)]
        typical = float(np.median(values))
        if typical:
            out[metric] = abs(float(np.median(first)) - float(np.median(second))) / abs(typical) * 100
    return out


def _shape_bucket(steps: pd.DataFrame) -> pd.Series:
    """A step's shape class: decode-only steps by batch size, others by prefill tokens, each in
    power-of-two ranges ("decode 9-16", "prefill 257-512")."""
    decode = steps["num_prefill_tokens"] == 0
    n = np.where(decode, steps["num_decodes"], steps["num_prefill_tokens"]).astype(np.int64)
    hi = 1 << np.ceil(np.log2(np.maximum(n, 1))).astype(np.int64)
    lo = np.where(hi > 1, hi // 2 + 1, 1)
    names = [f"{'decode' if d else 'prefill'} {a}-{b}" if a < b else f"{'decode' if d else 'prefill'} {b}"
             for d, a, b in zip(decode, lo, hi, strict=True)]  # fmt: skip
    return pd.Series(names, index=steps.index)


def _quiet_medians(steps: pd.DataFrame) -> pd.Series:
    """Median step time per shape class of the steps without precision changes."""
    return _quiet_by_shape(steps)["median"]


def _add_cross_policy_ratios(out: dict, real_steps: pd.DataFrame, sim_steps: pd.DataFrame) -> None:
    """How long each policy's steps took against the first policy's steps of the same shape
    class (both without precision changes), in the real runs and in the simulated ones. The
    simulated ratio is what the latency model expects from the two policies' different steps
    within a class (more requests, longer contexts); where the real ratio differs, either the
    machine's speed moved between the two real runs (a calibration fitted on one run cannot
    carry that to the other) or the latency model misses how the step grows within the class."""
    policies = [p for p in out["policies"] if p in set(real_steps["policy"]) and p in set(sim_steps["policy"])]
    if len(policies) < 2:
        return
    ref = policies[0]
    ref_real = _quiet_medians(real_steps[real_steps["policy"] == ref])
    ref_sim = _quiet_medians(sim_steps[sim_steps["policy"] == ref])
    for policy in policies[1:]:
        real = _quiet_medians(real_steps[real_steps["policy"] == policy])
        sim = _quiet_medians(sim_steps[sim_steps["policy"] == policy])
        shared = sorted(set(ref_real.index) & set(real.index) & set(ref_sim.index) & set(sim.index), key=_bucket_order)
        if shared:
            out["policies"][policy]["step_ratio_vs"] = {
                "vs": ref,
                "by_shape": {
                    b: {"real": float(real[b] / ref_real[b]), "sim": float(sim[b] / ref_sim[b])} for b in shared
                },
            }


def step_time_by_shape(real_steps: pd.DataFrame, sim_steps: pd.DataFrame) -> list[dict]:
    """Median step time per shape class in both runs: where the latency model is off, by how
    much and at which batch sizes, independent of how the two schedules drifted apart. Steps
    that changed an expert's precision are left out (their cost is the transition's)."""
    rows = []
    parts = {}
    for side, steps in (("real", real_steps), ("sim", sim_steps)):
        parts[side] = _quiet_by_shape(steps)
    for bucket in sorted(set(parts["real"].index) & set(parts["sim"].index), key=_bucket_order):
        r, s = parts["real"].loc[bucket], parts["sim"].loc[bucket]
        rows.append({
            "shape": bucket,
            "real_median_ms": float(r["median"]) * 1e3,
            "sim_median_ms": float(s["median"]) * 1e3,
            "error_perc": signed_error_perc(float(s["median"]), float(r["median"])),
            "real_steps": int(r["size"]),
            "sim_steps": int(s["size"]),
        })  # fmt: skip
    return rows


def _bucket_order(name: str) -> tuple[int, int]:
    kind, rng = name.split(" ")
    return (kind != "decode", int(rng.split("-")[0]))


def step_overhead_key(latency_kind: str) -> str:
    """The scenario key of the per-deployment step overhead for a latency model kind."""
    keys = {"analytic": "latency.step_overhead_s", "table": "latency.fallback.step_overhead_s"}
    if latency_kind not in keys:
        raise PagedWeightError(
            f"calibration fits the step overhead of an analytic or table latency model; "
            f"this scenario's latency kind is {latency_kind!r}"
        )
    return keys[latency_kind]


def matched_step_times_s(real_dir: str | Path, sim_dir: str | Path, policies: list[str]) -> tuple[float, float]:
    """``matched_step_times`` of the steps of ``policies`` in two results directories."""
    real_steps, sim_steps = _load(Path(real_dir))[1], _load(Path(sim_dir))[1]
    if real_steps is None or sim_steps is None:
        raise PagedWeightError(f"calibration needs steps.csv in {real_dir} and {sim_dir}")
    real_steps = real_steps[real_steps["policy"].isin(policies)]
    sim_steps = sim_steps[sim_steps["policy"].isin(policies)]
    if real_steps.empty or sim_steps.empty:
        raise PagedWeightError(f"calibration: no steps of {', '.join(policies)} in both runs")
    return matched_step_times(real_steps, sim_steps)


def matched_step_times(real_steps: pd.DataFrame, sim_steps: pd.DataFrame) -> tuple[float, float]:
    """(real, simulated) step time, compared shape class by shape class: each class's mean step
    time (steps without precision changes; ``_shape_bucket``), weighted by the real steps in the
    class, over the classes both sides have. Their difference is the per-step time the latency
    model lacks (Python and launch work between kernels, the machine's stalls), or has too much
    of. Pooled real repeats (a ``run`` column) give the median over the runs of each run's own
    weighted mean, as the headline figures are the runs' medians (``pagedweight.results.pooled``).

    Why not the two runs' plain mean steps: the two schedules part (a step that ends a few ms
    later gathers one more prompt), so the runs hold different mixes of shapes, and the means
    differ by the mix as much as by the time a shape takes. On the CPU validation (2026-12-02)
    the plain means of static-fp16's steps put the simulated step ~10% long where its
    throughput and TPOT were within 2.4% of the real run's, and a calibration fitted to them
    scaled the table by 0.90. Without a shared class, the plain means.

    Why means within a class, not medians: a run's throughput and latencies come from the total
    time its steps took, slow ones included. A real step's time has a tail (the machine's
    stalls, its neighbours) that a median leaves out. Re-fitted on the real runs of 31 CPU
    validations, the classes' medians left static-fp16's simulated throughput, in sample, -1.6
    to +8.6% off (6 of the 31 outside the bounds); each run's class means left it +0.3 to +0.7%
    off (benchmarks/RESULTS.md, 2026-12-03)."""
    real = _quiet_by_shape(real_steps)
    sim = _quiet_by_shape(sim_steps)
    shared = real.index.intersection(sim.index)
    if shared.empty:
        return float(real_steps["duration_s"].mean()), float(sim_steps["duration_s"].mean())
    weights = real.loc[shared, "size"].astype(float)
    sim_s = float(np.average(sim.loc[shared, "mean"], weights=weights))
    if "run" not in real_steps or real_steps["run"].nunique() < 2:
        return float(np.average(real.loc[shared, "mean"], weights=weights)), sim_s
    per_run = []
    for _, steps in real_steps.groupby("run"):
        own = _quiet_by_shape(steps)
        classes = own.index.intersection(shared)  # a run may lack a rare class: averaged over the rest
        if not classes.empty:
            per_run.append(float(np.average(own.loc[classes, "mean"], weights=weights.loc[classes])))
    return float(np.median(per_run)), sim_s


def _quiet_by_shape(steps: pd.DataFrame) -> pd.DataFrame:
    """Median and mean step time and step count per shape class of the steps without precision
    changes."""
    quiet = steps[(steps["num_downgrades"] == 0) & (steps["num_upgrades"] == 0)]
    return quiet.groupby(_shape_bucket(quiet))["duration_s"].agg(["median", "mean", "size"])


def format_validation(v: dict) -> str:
    lines = [f"validation of {v['scenario']}: {v['sim']['dir']} (sim) vs {v['real']['dir']} (real)"]
    cal = v.get("calibration")
    if cal:
        lines.append(
            f"  calibrated: step overhead {cal['step_overhead_s'] * 1e3:.2f} ms (was "
            f"{cal['initial_step_overhead_s'] * 1e3:.2f} ms), table times x{cal.get('scale', 1.0):.3f}, fitted on "
            f"{', '.join(cal['fitted_on'])} in {cal['iterations']} simulations; other policies are out of sample"
            + ("" if cal.get("converged", True) else "; NOT converged (the real steps are faster than the simulated)")
        )
    for policy, e in v["policies"].items():
        tag = ""
        if cal:
            tag = "  (in sample: fitted on it)" if policy in cal["fitted_on"] else "  (out of sample)"
        lines.append(f"  {policy}{tag}")
        for m, row in e["metrics"].items():
            flag = "" if row["ok"] is None else ("  ok" if row["ok"] else f"  OUT OF +-{row['bound_perc']:g}%")
            lines.append(
                f"    {m:26s} real {row['real']:12.4g}  sim {row['sim']:12.4g}  {row['error_perc']:+8.1f}%{flag}"
            )
        rates = [x for x in e.get("real_runs", {}).get("output_throughput", ()) if x]
        if rates:
            runs = e["real_runs"]
            lines.append(
                f"    real runs ({len(rates)}), their medians above: output tok/s "
                + ", ".join(f"{x:.4g}" for x in rates)
                + f" (fastest / slowest {max(rates) / min(rates):.2f}x); median TTFT ms "
                + ", ".join(f"{x:.4g}" for x in runs["median_ttft_ms"])
            )
        if e.get("real_split_half_perc"):
            lines.append(
                "    the real runs' two halves differ by "
                + ", ".join(f"{m} {x:.1f}%" for m, x in e["real_split_half_perc"].items())
                + " (no error can be resolved more finely)"
            )
        if cal and policy in cal.get("uncalibrated_errors_perc", {}):
            before = cal["uncalibrated_errors_perc"][policy]
            lines.append("    before calibration: " + ", ".join(f"{k} {x:+.1f}%" for k, x in before.items()))
        if e.get("step_time_by_shape"):
            lines.append("    median step time by shape (steps without precision changes):")
            for row in e["step_time_by_shape"]:
                lines.append(
                    f"      {row['shape']:20s} real {row['real_median_ms']:8.2f} ms ({row['real_steps']:4d})  "
                    f"sim {row['sim_median_ms']:8.2f} ms ({row['sim_steps']:4d})  {row['error_perc']:+7.1f}%"
                )
        if e.get("step_ratio_vs"):
            d = e["step_ratio_vs"]
            lines.append(
                f"    step time against {d['vs']}'s steps of the same shape, real / simulated (apart: the machine "
                "drifted between the real runs, or the model misses how a step grows within its class):"
            )
            lines.append(
                "      " + ", ".join(f"{b} x{x['real']:.2f} / x{x['sim']:.2f}" for b, x in d["by_shape"].items())
            )
        if "suggested_extra_step_overhead_s" in e:
            st, mt = e["mean_step_s"], e.get("matched_step_s", e["mean_step_s"])
            lines.append(
                f"    mean step: real {st['real'] * 1e3:.2f} ms, sim {st['sim'] * 1e3:.2f} ms; steps of the same "
                f"shape: real {mt['real'] * 1e3:.2f} ms, sim {mt['sim'] * 1e3:.2f} ms -> add "
                f"{e['suggested_extra_step_overhead_s'] * 1e3:+.2f} ms to the latency model's step_overhead_s"
            )
    if v.get("out_of_grid"):
        lines.append(f"  latency-table points outside the measured grid (timed by the fallback): {v['out_of_grid']}")
    return "\n".join(lines)
