"""The report's figures, one function per figure, each from a ``RunResults`` to a PNG.

Matplotlib's object API (``Figure``) only: no pyplot state, no GUI backend, safe in worker
processes. Colours are fixed per policy and per precision so that every figure of every
report reads the same way: full precision is green, fewer bits are warmer, KV is blue.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from pagedweight.core.spec import PRECISIONS
from pagedweight.results.report_data import (
    PRECISION_ORDER,
    RunResults,
    bin_sum,
    precision_timeline,
    sample_steps,
)

POLICY_COLOURS = {
    "static-fp16": "#444444",
    "static-int8": "#b8860b",
    "static-int4": "#d62728",
    "static-mixed": "#9467bd",
    "kv-swap": "#17becf",
    "paper-greedy": "#ff7f0e",
    "pagedweight": "#1f77b4",
}
_SPARE_COLOURS = ("#2ca02c", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
PRECISION_COLOURS = {
    "fp16": "#1a9641",
    "bf16": "#1a9641",
    "fp8": "#a6d96a",
    "int8": "#fdae61",
    "int4": "#d7191c",
    "int3": "#9e0142",
    "int2": "#5e3c99",
}
MEMORY_COLOURS = {
    "pinned": "#636363",
    "transition": "#e377c2",
    "kv": "#4f81bd",
    "kv_cached": "#9ecae1",
    "free": "#ececec",
}
GIB = 2**30
DPI = 90
FIG_WIDTH_IN = 13.0  # every figure the same width: they stack in one column of the page


def policy_colour(policy: str) -> str:
    if policy in POLICY_COLOURS:
        return POLICY_COLOURS[policy]
    return _SPARE_COLOURS[sum(map(ord, policy)) % len(_SPARE_COLOURS)]


def _time_label(run: RunResults) -> str:
    return "simulated time (s)" if run.runtime == "pwsim" else "time (s)"


def save_png(fig: Figure, out_png: Path) -> Path:
    """Written under a temporary name and renamed: a reader never sees half a PNG."""
    out_png = Path(out_png)
    tmp = out_png.with_name(f".{out_png.name}.tmp")
    fig.savefig(tmp, dpi=DPI, format="png")
    tmp.replace(out_png)
    return out_png


def _grid(n: int, row_h: float, width: float = FIG_WIDTH_IN) -> tuple[Figure, list[Axes]]:
    ncols = 1 if n <= 2 else 2
    nrows = -(-n // ncols)
    fig = Figure(figsize=(width, row_h * nrows + 1.3), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def memory_figure(run: RunResults, out_png: Path) -> Path | None:
    """Stacked memory over time per policy: pinned weights, expert weights by precision,
    pages of in-flight transitions, KV cache and free pages, against the budget."""
    steps, summary = run.steps, run.summary
    # GiB for real GPUs, MiB for the toy budgets of tests and teaching
    unit, unit_bytes = ("GiB", GIB) if summary["budget_bytes"] >= GIB else ("MiB", 2**20)
    page_u = summary["page_bytes"] / unit_bytes
    budget_u = summary["budget_bytes"] / unit_bytes
    policies = [p for p in run.policies if not run.policy_steps(p).empty]
    if not policies:
        return None
    precisions = [p for p in PRECISION_ORDER if f"weight_pages_{p}" in steps and steps[f"weight_pages_{p}"].any()]
    layers = [
        ("pinned_pages", "pinned (attention, shared)", MEMORY_COLOURS["pinned"]),
        *((f"weight_pages_{p}", f"experts {p}", PRECISION_COLOURS.get(p, "#17becf")) for p in precisions),
        ("transition_pages", "transition in flight", MEMORY_COLOURS["transition"]),
        ("kv_pages", "KV cache", MEMORY_COLOURS["kv"]),
        # Runs written before prefix caching have no such column.
        *(
            [("kv_cached_pages", "cached prefixes (evictable)", MEMORY_COLOURS["kv_cached"])]
            if "kv_cached_pages" in steps and steps["kv_cached_pages"].any()
            else []
        ),
        ("free_pages", "free", MEMORY_COLOURS["free"]),
    ]
    fig, axes = _grid(len(policies), 2.3)
    for ax, policy in zip(axes, policies, strict=True):
        s = sample_steps(run.policy_steps(policy), [c for c, _, _ in layers])
        ax.stackplot(s["time_s"], *[s[c] * page_u for c, _, _ in layers], colors=[c for _, _, c in layers])
        ax.axhline(budget_u, color="black", lw=1.0, ls="--")
        m = run.metrics(policy)
        kv_u = float((s["kv_pages"] * page_u).mean()) if len(s) else 0.0
        experts_u = m.get("mean_weight_gib", 0) * GIB / unit_bytes
        ax.set_title(
            f"{policy}: experts {experts_u:.0f} {unit}, KV {kv_u:.0f} {unit} on average; "
            f"{m.get('num_preemptions', 0):.0f} preemptions",
            fontsize=10,
            loc="left",
            color=policy_colour(policy),
        )
        ax.set_ylim(0, budget_u * 1.08)
        ax.margins(x=0)
    ncols = 1 if len(axes) <= 2 else 2
    for i, ax in enumerate(axes):
        ax.set_ylabel(unit)
        ax.label_outer()
        if i + ncols >= len(axes):  # no panel below: this one carries the time axis
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel(_time_label(run))
    handles = [Patch(color=c, label=label) for _, label, c in reversed(layers)]
    handles.append(Line2D([], [], color="black", lw=1.0, ls="--", label="budget"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), fontsize=9)
    fig.suptitle(
        f"Memory over time: {summary['model']} on {summary['gpu']}, {budget_u:.0f} {unit} budget "
        "(weights shrink so the KV cache can grow)",
        fontsize=12,
    )
    return save_png(fig, out_png)


def dynamic_policies(run: RunResults) -> list[str]:
    """Policies whose precision map changed during the run."""
    if run.transitions.empty:
        return []
    changed = set(run.transitions.loc[run.transitions["kind"] != "abort", "policy"].unique())
    return [p for p in run.policies if p in changed]


def precision_map_figure(run: RunResults, out_png: Path, num_times: int = 400) -> Path | None:
    """Experts (rows) over time (columns) coloured by precision, one panel per policy that
    changed precision. Rows are sorted by time-averaged precision: experts kept at full precision
    on top, the first to be downgraded at the bottom."""
    policies = dynamic_policies(run)
    if not policies or run.initial_precisions.empty:
        return None
    fig = Figure(figsize=(FIG_WIDTH_IN, 3.4 * len(policies) + 0.8), layout="constrained")
    axes = fig.subplots(len(policies), 1, squeeze=False)[:, 0]
    used: list[str] = []
    for ax, policy in zip(axes, policies, strict=True):
        steps = run.policy_steps(policy)
        end_s = float(steps["start_s"].iloc[-1] + steps["duration_s"].iloc[-1]) if len(steps) else 1.0
        times = np.linspace(0.0, end_s, num_times)
        initial = run.initial_precisions[run.initial_precisions["policy"] == policy]
        grid, names = precision_timeline(initial, run.transitions[run.transitions["policy"] == policy], times)
        rank = np.array([PRECISIONS[n].rank for n in names], dtype=float)
        order = np.lexsort((np.arange(len(grid)), -rank[grid].mean(axis=1)))
        colours = [PRECISION_COLOURS.get(n, "#17becf") for n in names]
        ax.imshow(
            grid[order],
            aspect="auto",
            interpolation="nearest",
            cmap=ListedColormap(colours),
            norm=BoundaryNorm(np.arange(len(names) + 1) - 0.5, len(names)),
            extent=(0.0, end_s, len(grid), 0),
        )
        low = (grid != 0).mean(axis=0) * 100
        ax.set_title(
            f"{policy}: {len(initial)} experts; at most {low.max():.0f}% below {names[0]} at once",
            fontsize=10,
            loc="left",
            color=policy_colour(policy),
        )
        ax.set_ylabel("experts, by time-avg precision")
        ax.set_xlabel(_time_label(run))
        used += [n for n in names if n not in used]
    handles = [Patch(color=PRECISION_COLOURS.get(n, "#17becf"), label=n) for n in PRECISION_ORDER if n in used]
    fig.legend(handles=handles, loc="outside right upper", title="precision")
    fig.suptitle("Precision map over time (each row one routed expert)", fontsize=12)
    return save_png(fig, out_png)


CDF_POINTS = 4096


def _cdf(ax: Axes, values: np.ndarray, **kw) -> None:
    """The empirical CDF as a step line. Past ``CDF_POINTS`` values it is drawn through that many
    evenly spaced ranks and the last (a step of at most 1/4096 of the axis, under a pixel of
    the figure), so that a cluster's hour (~800,000 requests a policy) draws in milliseconds."""
    v = np.sort(values[np.isfinite(values)])
    n = len(v)
    if not n:
        return
    ranks = np.arange(n) if n <= CDF_POINTS else np.unique(np.linspace(0, n - 1, CDF_POINTS).astype(np.int64))
    ax.step(v[ranks], (ranks + 1) / n, where="post", **kw)


def _log_if_wide(ax: Axes) -> bool:
    """Log x when the data span more than a decade: narrow ranges read better on a linear axis."""
    lo, hi = ax.dataLim.x0, ax.dataLim.x1
    if lo > 0 and hi / lo > 10:
        ax.set_xscale("log")
        return True
    return False


def latency_figure(run: RunResults, out_png: Path) -> Path:
    """CDFs of TTFT, TPOT and end-to-end latency per policy; throughput, goodput and
    preemption bars."""
    req = run.requests
    policies = run.policies
    fig = Figure(figsize=(FIG_WIDTH_IN, 7.5), layout="constrained")
    axes = fig.subplots(2, 3)
    for ax, (col, label) in zip(
        axes[0],
        (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2el_ms", "end-to-end latency (ms)")),
        strict=True,
    ):
        for p in policies:
            rows = req[(req["policy"] == p) & (req["state"] == "finished")] if len(req) else req
            if col in rows:
                _cdf(ax, rows[col].to_numpy(dtype=float), color=policy_colour(p), label=p, lw=1.6)
        ax.set_xlabel(label + (", log scale" if _log_if_wide(ax) else ""))
        ax.set_ylabel("fraction of completed requests")
        ax.set_title(f"{label.split(' (')[0]} CDF (left is better)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0, 0].legend(fontsize=8, loc="lower right")
    x = np.arange(len(policies))
    colours = [policy_colour(p) for p in policies]
    m = [run.metrics(p) for p in policies]
    ax = axes[1, 0]
    ax.bar(x, [v.get("output_throughput", 0) for v in m], color=colours)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput (higher is better)", fontsize=10)
    ax = axes[1, 1]
    ax.bar(x - 0.2, [v.get("request_throughput", 0) for v in m], 0.4, color=colours, alpha=0.45, label="completed")
    ax.bar(x + 0.2, [v.get("request_goodput", 0) for v in m], 0.4, color=colours, label="within SLO (goodput)")
    ax.set_ylabel("requests/s")
    ax.set_title("Throughput (pale) and goodput (solid)", fontsize=10)
    ax = axes[1, 2]
    ax.bar(x, [v.get("num_preemptions", 0) for v in m], color=colours)
    ax.set_ylabel("preemptions")
    ax.set_title("Preemptions (lower is better)", fontsize=10)
    for ax in axes[1]:
        ax.set_xticks(x, policies, rotation=30, ha="right", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Latency and throughput per policy", fontsize=12)
    return save_png(fig, out_png)


def queue_figure(run: RunResults, out_png: Path, num_bins: int = 60) -> Path | None:
    """Median TTFT per policy by arrival time (``num_bins`` equal spans of the arrivals): a
    policy that keeps up draws a flat line, however high; one whose queue keeps growing, a line
    that keeps rising (``results.backlog``). None without requests."""
    req = run.requests
    if req.empty or "arrival_s" not in req or "ttft_ms" not in req:
        return None
    lo, hi = float(req["arrival_s"].min()), float(req["arrival_s"].max())
    edges = np.linspace(lo, hi, num_bins + 1) if hi > lo else np.array([lo, lo + 1.0])
    centres = (edges[:-1] + edges[1:]) / 2 - lo
    fig = Figure(figsize=(FIG_WIDTH_IN, 4.0), layout="constrained")
    ax = fig.subplots()
    values = []
    for p in run.policies:
        rows = req[(req["policy"] == p) & req["ttft_ms"].notna()]
        if rows.empty:
            continue
        which = np.clip(np.searchsorted(edges, rows["arrival_s"].to_numpy(), side="right") - 1, 0, len(centres) - 1)
        medians = rows["ttft_ms"].groupby(which).median()
        ax.plot(centres[medians.index], medians.to_numpy() / 1e3, color=policy_colour(p), lw=1.6, label=p, marker=".")
        values += medians.tolist()
    pos = [v for v in values if v > 0]
    if pos and max(pos) / min(pos) > 100:
        ax.set_yscale("log")
    ax.set_xlabel("arrival time (s from the first arrival)")
    ax.set_ylabel("median TTFT (s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("TTFT by arrival time: flat keeps up, rising is a queue that keeps growing", fontsize=12)
    return save_png(fig, out_png)


def quality_scale(ax: Axes, values: list[float], axis: str = "y") -> None:
    """Symmetric-log when the proxies span orders of magnitude (full precision is exactly 0)."""
    pos = [v for v in values if v > 0]
    if pos and max(pos) / min(pos) > 30:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("symlog", linthresh=min(pos))


def quality_figure(run: RunResults, out_png: Path) -> Path:
    """The quality proxy over time per policy, and quality against throughput."""
    fig = Figure(figsize=(FIG_WIDTH_IN, 5.0), layout="constrained")
    ax_t, ax_q = fig.subplots(1, 2, width_ratios=(1.6, 1))
    values = []
    for p in run.policies:
        s = sample_steps(run.policy_steps(p), ["quality_proxy"])
        ax_t.step(s["time_s"], s["quality_proxy"], where="post", color=policy_colour(p), label=p, lw=1.4)
        values += s["quality_proxy"].tolist()
    quality_scale(ax_t, values)
    ax_t.set_xlabel(_time_label(run))
    ax_t.set_ylabel("predicted loss increase (nats/token)")
    ax_t.set_title("Quality proxy over time (lower is better)", fontsize=10)
    ax_t.grid(alpha=0.3)
    qs = []
    for p in run.policies:
        m = run.metrics(p)
        q, tput = m.get("mean_quality_proxy", np.nan), m.get("output_throughput", np.nan)
        qs.append(q)
        ax_q.scatter(tput, q, s=80, color=policy_colour(p), zorder=3, edgecolors="white", linewidths=0.8)
    quality_scale(ax_q, qs)
    ax_q.set_xlabel("output throughput (tokens/s)")
    ax_q.set_ylabel("mean quality proxy (nats/token)")
    ax_q.set_title("Trade-off: best is bottom right", fontsize=10)
    ax_q.grid(alpha=0.3)
    # One legend for both panels: labels beside points overlap when policies tie on throughput.
    fig.legend(*ax_t.get_legend_handles_labels(), loc="outside lower center", ncols=min(len(run.policies), 7))
    fig.suptitle("Quality (predicted loss increase of the current precision map)", fontsize=12)
    return save_png(fig, out_png)


def prefix_figure(run: RunResults, out_png: Path) -> Path | None:
    """Prefix caching over time per policy: the prefill tokens cache hits have saved so far,
    the cached blocks evicted so far, and the memory cached prefixes hold. None for a run
    without prefix caching's columns, or in which it never hit or evicted."""
    steps = run.steps
    if "prefix_hit_tokens" not in steps or not (steps["prefix_hit_tokens"].any() or steps["kv_evicted_blocks"].any()):
        return None
    page_gib = run.summary["page_bytes"] / GIB
    fig = Figure(figsize=(FIG_WIDTH_IN, 4.0), layout="constrained")
    ax_hit, ax_ev, ax_mem = fig.subplots(1, 3)
    for p in run.policies:
        mine = run.policy_steps(p)
        if mine.empty:
            continue
        # Running totals on every step, then sampled (sampling first would drop steps' counts).
        totals = mine.assign(hits=mine["prefix_hit_tokens"].cumsum(), evicted=mine["kv_evicted_blocks"].cumsum())
        s = sample_steps(totals, ["hits", "evicted", "kv_cached_pages"])
        style = {"color": policy_colour(p), "lw": 1.4, "label": p}
        ax_hit.plot(s["time_s"], s["hits"], **style)
        ax_ev.plot(s["time_s"], s["evicted"], **style)
        ax_mem.step(s["time_s"], s["kv_cached_pages"] * page_gib, where="post", **style)
    for ax, title in (
        (ax_hit, "prefill tokens saved (cumulative)"),
        (ax_ev, "cached blocks evicted (cumulative)"),
        (ax_mem, "memory of cached prefixes (GiB)"),
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(_time_label(run))
        ax.grid(alpha=0.3)
    fig.legend(*ax_hit.get_legend_handles_labels(), loc="outside lower center", ncols=min(len(run.policies), 7))
    fig.suptitle("Prefix caching: hits, evictions and the memory it holds", fontsize=12)
    return save_png(fig, out_png)


def transitions_figure(run: RunResults, out_png: Path, num_bins: int = 200) -> Path | None:
    """Bytes upgraded (host to device, up) and downgraded (on the device, down) per second per
    policy that changed precision, KV bytes swapped per second for kv-swap, against the
    host-to-device copy budget."""
    swapping = set()
    if "bytes_swapped" in run.steps:
        swapping = set(run.steps.loc[run.steps["bytes_swapped"] > 0, "policy"].unique())
    moving = set(dynamic_policies(run)) | swapping
    policies = [p for p in run.policies if p in moving]
    if not policies:
        return None
    budget = run.copy_budget_bytes_per_s()
    fig = Figure(figsize=(FIG_WIDTH_IN, 2.6 * len(policies) + 1.0), layout="constrained")
    axes = fig.subplots(len(policies), 1, squeeze=False, sharex=True)[:, 0]
    for ax, policy in zip(axes, policies, strict=True):
        steps = run.policy_steps(policy)
        end_s = float(steps["start_s"].iloc[-1] + steps["duration_s"].iloc[-1])
        t = steps["start_s"].to_numpy()
        edges, up = bin_sum(t, steps["bytes_upgraded"].to_numpy(), end_s, num_bins)
        _, down = bin_sum(t, steps["bytes_downgraded"].to_numpy(), end_s, num_bins)
        width = edges[1] - edges[0] if len(edges) > 1 else end_s
        ax.bar(edges, up / 1e9, width, align="edge", color=PRECISION_COLOURS["bf16"], label="upgraded (host to device)")
        ax.bar(edges, -down / 1e9, width, align="edge", color=PRECISION_COLOURS["int4"], label="downgraded (on device)")
        if policy in swapping:
            _, swap = bin_sum(t, steps["bytes_swapped"].to_numpy(), end_s, num_bins)
            ax.bar(
                edges, swap / 1e9, width, align="edge", color="#1f77b4", alpha=0.7, label="KV swapped (host <-> device)"
            )
        if budget:
            ax.axhline(budget / 1e9, color="black", ls="--", lw=1.0, label="host-to-device copy budget")
        ax.axhline(0, color="black", lw=0.5)
        m = run.metrics(policy)
        ax.set_title(
            f"{policy}: {m.get('num_upgrades', 0):.0f} upgrades, {m.get('num_downgrades', 0):.0f} downgrades, "
            f"{m.get('h2d_gib', 0):.1f} GiB host to device",
            fontsize=10,
            loc="left",
            color=policy_colour(policy),
        )
        ax.set_ylabel(f"GB/s ({width:.1f} s bins)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel(_time_label(run))
    fig.suptitle("Precision transitions: bytes moved per second", fontsize=12)
    return save_png(fig, out_png)


def sim_real_figure(sim: RunResults, real: RunResults, out_png: Path) -> Path | None:
    """TTFT and TPOT CDFs of the simulated (dashed) and the real (solid) run per policy."""
    policies = [p for p in sim.policies if p in real.policies]
    if not policies or sim.requests.empty or real.requests.empty:
        return None
    fig = Figure(figsize=(FIG_WIDTH_IN, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, (col, label) in zip(axes, (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)")), strict=True):
        for p in policies:
            for run, ls, tag in ((real, "-", real.runtime), (sim, "--", sim.runtime)):
                rows = run.requests[(run.requests["policy"] == p) & (run.requests["state"] == "finished")]
                _cdf(ax, rows[col].to_numpy(dtype=float), color=policy_colour(p), ls=ls, label=f"{p} ({tag})")
        ax.set_xlabel(label + (", log scale" if _log_if_wide(ax) else ""))
        ax.set_ylabel("fraction of completed requests")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Simulated ({sim.name}, dashed) vs real ({real.name}, solid)", fontsize=12)
    return save_png(fig, out_png)
