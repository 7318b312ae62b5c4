"""Summary statistics of a trace, with the definitions of ``../shared/traces/PROVENANCE.md``.

- rate: 1 / mean IAT = (rows - 1) / span, span = last arrival - first arrival.
- IAT CV: std/mean of the gaps between consecutive (sorted) arrivals (population std).
- per-W count CV / max: std/mean and max of the number of arrivals in each W-second window,
  windows [kW, (k+1)W) from the first arrival up to the one holding the last.
- lengths: numpy percentiles with linear interpolation.
"""

from __future__ import annotations

import numpy as np

from pagedweight.workload.traces import RequestTrace

COUNT_WINDOWS_S = (1.0, 3.0, 60.0)


def arrival_stats(arrival_s: np.ndarray, windows_s: tuple[float, ...] = COUNT_WINDOWS_S) -> dict:
    t = np.sort(np.asarray(arrival_s, dtype=np.float64))
    t = t - t[0]
    span_s = float(t[-1]) if len(t) else 0.0
    out: dict = {"rows": len(t), "span_s": span_s}
    # 1 / mean IAT, i.e. (rows - 1) / span: the figure PROVENANCE.md reports.
    out["rate_qps"] = (len(t) - 1) / span_s if span_s > 0 else float("nan")
    gaps = np.diff(t)
    if len(gaps) and gaps.mean() > 0:
        out["iat_cv"] = float(gaps.std() / gaps.mean())
        out["iat_under_1ms_share"] = float(np.mean(gaps < 1e-3))
        out["max_gap_s"] = float(gaps.max())
    for w in windows_s:
        counts = np.bincount((t // w).astype(np.int64), minlength=int(span_s // w) + 1)
        out[f"count_{w:g}s_cv"] = float(counts.std() / counts.mean())
        out[f"count_{w:g}s_max"] = int(counts.max())
    return out


def length_stats(tokens: np.ndarray) -> dict:
    x = np.asarray(tokens, dtype=np.float64)
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {
        "mean": float(x.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": int(x.max()),
        "min": int(x.min()),
    }


def trace_stats(trace: RequestTrace) -> dict:
    return {
        **arrival_stats(trace.arrival_s),
        "prompt_tokens": length_stats(trace.prompt_tokens),
        "output_tokens": length_stats(trace.output_tokens),
    }


def format_stats(stats: dict) -> str:
    """Plain text, one figure per line, in the order PROVENANCE.md lists them."""
    lines = [f"rows                      {stats['rows']:,}"]
    if "span_s" in stats:
        lines += [
            f"span                      {stats['span_s']:,.1f} s ({stats['span_s'] / 60:.1f} min)",
            f"mean arrival rate         {stats['rate_qps']:.3f} req/s",
        ]
        if "iat_cv" in stats:
            lines += [
                f"IAT CV                    {stats['iat_cv']:.2f}",
                f"share of IATs < 1 ms      {100 * stats['iat_under_1ms_share']:.1f} %",
                f"largest gap               {stats['max_gap_s']:.1f} s",
            ]
        for w in COUNT_WINDOWS_S:
            key = f"count_{w:g}s"
            if f"{key}_cv" in stats:
                label = f"per-{w:g} s count CV / max"
                lines.append(f"{label:26s}{stats[key + '_cv']:.3f} / {stats[key + '_max']}")
    for name in ("prompt_tokens", "output_tokens"):
        s = stats[name]
        label = name.replace("_", " ")
        lines.append(
            f"{label:26s}mean {s['mean']:,.1f}  median {s['median']:,.1f}  p90 {s['p90']:,.1f}  "
            f"p99 {s['p99']:,.1f}  max {s['max']:,}  min {s['min']:,}"
        )
    return "\n".join(lines)
