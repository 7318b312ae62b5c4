"""The report's sections for runs on more than one GPU: an expert-parallel replica's GPUs
(``pwsim.parallel``: ``ranks`` in the summary, ``steps_by_rank.csv``, ``ep_steps.csv``) and a
cluster's replicas (``pwsim.cluster``: ``replicas`` in the summary, a ``replica`` column in
the tables).

- per GPU: a table (requests, KV usage, weight memory by precision, transitions, compute time,
  how often it was the slowest), weight memory by precision over time for each GPU, and the
  rank imbalance (slowest GPU's compute over the mean) and all-to-all share over time;
- per replica: a table (requests, output tokens, TTFT, KV usage, transitions) and the load each
  replica carried.
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from pagedweight.results.report_data import PRECISION_ORDER, RunResults
from pagedweight.results.report_plots import FIG_WIDTH_IN, PRECISION_COLOURS, policy_colour, save_png

GIB = 2**30


def _weight_gib(entry: dict) -> dict[str, float]:
    return {p: w["mean_bytes"] / GIB for p, w in (entry.get("weight_bytes") or {}).items()}


def _table(head: list[str], rows: list[list[str]]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + f"</tr>{cells}</table>"


def rank_table(entry: dict) -> str:
    rows = []
    for r in entry["ranks"]:
        weights = ", ".join(f"{p} {g:.1f}" for p, g in _weight_gib(r).items())
        rows.append(
            [
                str(r["rank"]),
                str(r["num_requests"]),
                f"{r.get('mean_kv_cache_usage_perc', float('nan')):.1f}",
                html.escape(weights),
                str(r["num_downgrades"]),
                str(r["num_upgrades"]),
                f"{r['mean_compute_ms']:.1f}",
                f"{100 * r['slowest_share']:.0f}%",
                f"{r['routed_tokens']:,}",
            ]
        )
    head = ["GPU", "requests", "mean KV %", "mean weight GiB by precision", "downgrades", "upgrades",
            "mean compute ms", "slowest in", "routed tokens"]  # fmt: skip
    return _table(head, rows)


def replica_table(entry: dict) -> str:
    rows = []
    for r in entry["replicas"]:
        rows.append(
            [
                str(r["replica"]),
                str(r["num_requests"]),
                f"{r['total_output_tokens']:,}",
                f"{r.get('mean_ttft_ms', float('nan')):.1f}",
                f"{r.get('p99_ttft_ms', float('nan')):.1f}",
                f"{r.get('mean_kv_cache_usage_perc', float('nan')):.1f}",
                str(r["num_preemptions"]),
                str(r["num_downgrades"]),
            ]
        )
    head = ["replica", "requests", "output tokens", "mean TTFT ms", "P99 TTFT ms", "mean KV %", "preemptions",
            "downgrades"]  # fmt: skip
    return _table(head, rows)


def gpu_memory_figure(path: Path, policy: str, out_png: Path, num_points: int = 400) -> Path | None:
    """Weight memory by precision over time, one panel per GPU, for ``policy``."""
    f = path / "steps_by_rank.csv"
    if not f.is_file():
        return None
    df = pd.read_csv(f)
    df = df[df["policy"] == policy]
    if df.empty:
        return None
    if "replica" in df.columns:
        df = df[df["replica"] == df["replica"].min()]
    ranks = sorted(df["rank"].unique())
    cols = [c for c in df.columns if c.startswith("weight_pages_")]
    ncols = 4 if len(ranks) > 4 else len(ranks)
    nrows = -(-len(ranks) // ncols)
    fig = Figure(figsize=(FIG_WIDTH_IN, 2.2 * nrows + 1.0), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True).ravel()
    for ax in axes[len(ranks) :]:
        ax.set_visible(False)
    for ax, rank in zip(axes, ranks, strict=False):
        rows = df[df["rank"] == rank]
        step = max(len(rows) // num_points, 1)
        rows = rows.iloc[::step]
        t = rows["start_s"].to_numpy()
        stack, labels, colours = [], [], []
        for name in PRECISION_ORDER:
            c = f"weight_pages_{name}"
            if c in cols and rows[c].any():
                stack.append(rows[c].to_numpy())
                labels.append(name)
                colours.append(PRECISION_COLOURS.get(name, "#999999"))
        if stack:
            ax.stackplot(t, *stack, labels=labels, colors=colours, step="post")
        ax.set_title(f"GPU {rank}", fontsize=9)
    axes[0].set_ylabel("weight pages")
    axes[0].legend(loc="lower left", fontsize=7)
    fig.suptitle(f"{policy}: each GPU's routed-expert pages by precision")
    fig.supxlabel("simulated time (s)")
    return save_png(fig, out_png)


def imbalance_figure(path: Path, out_png: Path, num_bins: int = 200) -> Path | None:
    """Rank imbalance (slowest GPU's compute / mean) and the all-to-all's share of each step,
    step-time weighted in time bins, per policy."""
    f = path / "ep_steps.csv"
    if not f.is_file():
        return None
    df = pd.read_csv(f, usecols=lambda c: c in ("policy", "replica", "start_s", "duration_s", "a2a_s", "imbalance"))
    if df.empty:
        return None
    if "replica" in df.columns:
        df = df[df["replica"] == df["replica"].min()]
    fig = Figure(figsize=(FIG_WIDTH_IN, 4.2), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    end = float((df["start_s"] + df["duration_s"]).max()) or 1.0
    edges = np.linspace(0.0, end, num_bins + 1)
    for policy, rows in df.groupby("policy", sort=False):
        b = np.clip(np.searchsorted(edges, rows["start_s"].to_numpy(), side="right") - 1, 0, num_bins - 1)
        w = rows["duration_s"].to_numpy()
        wsum = np.bincount(b, weights=w, minlength=num_bins)
        ok = wsum > 0
        mids = (edges[:-1] + edges[1:])[ok] / 2
        imb = np.bincount(b, weights=w * rows["imbalance"].to_numpy(), minlength=num_bins)[ok] / wsum[ok]
        a2a = np.bincount(b, weights=rows["a2a_s"].to_numpy(), minlength=num_bins)[ok] / wsum[ok]
        ax1.plot(mids, imb, label=str(policy), color=policy_colour(str(policy)))
        ax2.plot(mids, 100 * a2a, label=str(policy), color=policy_colour(str(policy)))
    ax1.set_ylabel("slowest GPU / mean GPU compute")
    ax1.axhline(1.0, color="#999999", lw=0.8)
    ax2.set_ylabel("all-to-all share of step time (%)")
    for ax in (ax1, ax2):
        ax.set_xlabel("simulated time (s)")
        ax.legend(fontsize=8)
    fig.suptitle("Rank imbalance and all-to-all over time (step-time weighted)")
    return save_png(fig, out_png)


def replica_load_figure(run: RunResults, out_png: Path) -> Path | None:
    policies = [p for p in run.policies if "cluster" in run.summary["policies"][p]]
    if not policies:
        return None
    fig = Figure(figsize=(FIG_WIDTH_IN, 3.6), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        tokens = run.summary["policies"][policy]["cluster"]["output_tokens_per_replica"]
        x = np.arange(len(tokens)) + i * width
        ax.bar(x, tokens, width=width, label=policy, color=policy_colour(policy))
    ax.set_xlabel("replica")
    ax.set_ylabel("output tokens served")
    ax.legend(fontsize=8)
    fig.suptitle("Load per replica")
    return save_png(fig, out_png)


def parallel_section(run: RunResults, prefix: str, out_dir: Path, png_tag) -> str:
    """The per-GPU and per-replica part of a run's section ('' for a one-GPU run)."""
    entries = {p: run.summary["policies"][p] for p in run.policies}
    parts = []
    if any("replicas" in e for e in entries.values()):
        parts.append("<h3>Replicas</h3>")
        for policy, e in entries.items():
            c = e["cluster"]
            parts.append(
                f"<p><b>{html.escape(policy)}</b>: {c['replicas']} replicas, router {html.escape(c['router'])}, "
                f"load imbalance (most output tokens / mean) {c['load_imbalance']:.3f}</p>" + replica_table(e)
            )
        png = replica_load_figure(run, out_dir / f"{prefix}_replica_load.png")
        if png is not None:
            parts.append(png_tag(png, "Output tokens each replica served, per policy."))
    first = next(iter(entries.values()), {})
    rank_entries = {p: (e["replicas"][0] if "replicas" in e else e) for p, e in entries.items()}
    if any("ranks" in e for e in rank_entries.values()):
        where = " (replica 0)" if "replicas" in first else ""
        parts.append(f"<h3>GPUs of the expert-parallel replica{where}</h3>")
        for policy, e in rank_entries.items():
            ep = e["ep"]
            parts.append(
                f"<p><b>{html.escape(policy)}</b>: {ep['ep']} GPUs ({html.escape(ep['interconnect'])}), experts "
                f"placed {html.escape(ep['placement'])}, requests by {html.escape(ep['request_router'])}; "
                f"imbalance mean {ep['mean_imbalance']:.2f}, P99 {ep['p99_imbalance']:.2f}; all-to-all "
                f"{100 * ep['a2a_share']:.1f}% of the time</p>" + rank_table(e)
            )
        png = imbalance_figure(run.path, out_dir / f"{prefix}_imbalance.png")
        if png is not None:
            parts.append(png_tag(png, "Rank imbalance and the all-to-all's share of each step over time."))
        for i, policy in enumerate(rank_entries):
            png = gpu_memory_figure(run.path, policy, out_dir / f"{prefix}_gpu_memory{i}.png")
            if png is not None:
                parts.append(png_tag(png, f"{policy}: per-GPU expert memory by precision over time."))
    return "".join(parts)
