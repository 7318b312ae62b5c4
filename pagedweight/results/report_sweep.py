"""The sweep report: Pareto plots and a table across the cells of a sweep.

Reads only the sweep table (``sweep.csv``: one row per cell and policy, with the cell's grid
values and the policy's metrics), so any set of runs tabulated that way can be drawn.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from pagedweight.results.report import CSS, png_tag
from pagedweight.results.report_data import KEY_METRICS, METRICS, fmt
from pagedweight.results.report_plots import policy_colour, quality_scale, save_png
from pagedweight.results.writer import atomic_write_text

_LINESTYLES = ("-", "--", ":", "-.")


def pareto_front(throughput: np.ndarray, quality: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats on both axes (higher throughput, lower
    quality proxy), ordered by throughput."""
    order = np.lexsort((quality, -throughput))
    front, best_q = [], np.inf
    for i in order:
        if quality[i] < best_q:
            front.append(i)
            best_q = quality[i]
    return np.array(front[::-1], dtype=int)


def _x_axis(table: pd.DataFrame, grid_keys: list[str]) -> tuple[str, str]:
    """The x of the per-policy lines: the memory budget when it varies, else the first
    numeric grid key."""
    if table["budget_gib"].nunique() > 1:
        return "budget_gib", "memory budget (GiB)"
    for key in grid_keys:
        if pd.api.types.is_numeric_dtype(table[key]) and table[key].nunique() > 1:
            return key, key
    return "budget_gib", "memory budget (GiB)"


def pareto_figure(table: pd.DataFrame, grid_keys: list[str], out_png: Path) -> Path | None:
    ok = table[(table["error"].fillna("") == "") & table["output_throughput"].notna()]
    if ok.empty:
        return None
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    ax_q, ax_b, ax_bq = fig.subplots(1, 3)
    tput = ok["output_throughput"].to_numpy(dtype=float)
    qual = ok["mean_quality_proxy"].to_numpy(dtype=float)
    for policy, rows in ok.groupby("policy", sort=False):
        ax_q.scatter(rows["output_throughput"], rows["mean_quality_proxy"], s=45, color=policy_colour(policy),
                     label=policy, zorder=3, alpha=0.85)  # fmt: skip
    front = pareto_front(tput, qual)
    ax_q.step(tput[front], qual[front], where="pre", color="black", lw=1.0, ls="--", label="Pareto front", zorder=2)
    quality_scale(ax_q, qual.tolist())
    ax_q.set_xlabel("output throughput (tokens/s)")
    ax_q.set_ylabel("mean quality proxy (nats/token)")
    ax_q.set_title("Quality vs throughput, every cell (best is bottom right)", fontsize=10)
    ax_q.grid(alpha=0.3)
    ax_q.legend(fontsize=8)
    x_col, x_label = _x_axis(ok, grid_keys)
    others = [k for k in grid_keys if k != x_col and k != "memory.budget" and k != "policies"]
    for policy, rows in ok.groupby("policy", sort=False):
        groups = rows.groupby(others, sort=False) if others else [((), rows)]
        for i, (values, g) in enumerate(groups):
            g = g.sort_values(x_col)
            values = values if isinstance(values, tuple) else (values,)
            label = policy + "".join(f", {k}={v}" for k, v in zip(others, values, strict=True))
            style = {"marker": "o", "color": policy_colour(policy), "ls": _LINESTYLES[i % len(_LINESTYLES)]}
            ax_b.plot(g[x_col], g["output_throughput"], label=label, **style)
            ax_bq.plot(g[x_col], g["mean_quality_proxy"], **style)
    ax_b.set_xlabel(x_label)
    ax_b.set_ylabel("output throughput (tokens/s)")
    ax_b.set_title(f"Throughput vs {x_label.split(' (')[0]}, per policy", fontsize=10)
    ax_b.grid(alpha=0.3)
    ax_b.legend(fontsize=8)
    quality_scale(ax_bq, qual.tolist())
    ax_bq.set_xlabel(x_label)
    ax_bq.set_ylabel("mean quality proxy (nats/token)")
    ax_bq.set_title(f"Quality vs {x_label.split(' (')[0]}, per policy (lower is better)", fontsize=10)
    ax_bq.grid(alpha=0.3)
    fig.suptitle("Sweep: what each policy gets from the memory it is given", fontsize=12)
    return save_png(fig, out_png)


def _table_html(table: pd.DataFrame, grid_keys: list[str]) -> str:
    labels = {k: (label, spec) for k, label, spec, _ in METRICS}
    cols = ["cell", *grid_keys, "policy", *KEY_METRICS]
    head = "".join(f"<th>{html.escape(labels.get(c, (c,))[0])}</th>" for c in cols)
    body = []
    for _, row in table.iterrows():
        cells = []
        for c in cols:
            v = row.get(c)
            if c in labels and row.get("error"):
                cells.append("<td>-</td>")
            elif c in labels:
                cells.append(f"<td>{fmt(v, labels[c][1])}</td>")
            else:
                cells.append(f"<td>{html.escape(str(v))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def write_sweep_report(table: pd.DataFrame, meta: dict, out_html: Path) -> Path:
    out_html = Path(out_html)
    grid_keys = list(meta.get("grid", {}))
    png = pareto_figure(table, grid_keys, out_html.parent / "sweep_pareto.png")
    errors = table[table["error"].fillna("") != ""] if "error" in table else table.iloc[0:0]
    err_html = "".join(
        f"<p class=err>{html.escape(r['cell'])} / {html.escape(r['policy'])}: {html.escape(r['error'])}</p>"
        for _, r in errors.iterrows()
    )
    grid = ", ".join(f"{k}: {json.dumps(v)}" for k, v in meta.get("grid", {}).items())
    fixed = ", ".join(f"{k}: {json.dumps(v)}" for k, v in meta.get("set", {}).items()) or "none"
    page = (
        f"<!doctype html><html><head><meta charset=utf-8><title>Sweep {html.escape(meta['name'])}</title>"
        f"<style>{CSS}</style></head><body><h1>Sweep: {html.escape(meta['name'])}</h1>"
        f"<p class=facts>{html.escape(meta.get('description', ''))}<br>scenario {html.escape(meta['scenario'])}"
        f"<br>grid: {html.escape(grid)}<br>fixed: {html.escape(fixed)}<br>{len(meta['cells'])} cells; each cell's "
        "results directory is beside this file.</p>"
        + (png_tag(png, "Pareto plots: quality vs throughput; throughput and quality vs memory budget.") if png else "")
        + err_html
        + _table_html(table, grid_keys)
        + "</body></html>"
    )
    atomic_write_text(out_html, page)
    return out_html
