"""Reports from results directories: one self-contained ``report.html`` and the PNGs beside it.

Works only from the result tables (``pagedweight.results.writer``), never from a runtime's internals,
so the same code reads a simulated and a real run. Per results directory the report holds:

1. a headline and the summary table: every metric per policy with its change against
   ``static-fp16`` (green where better, red where worse);
2. memory over time per policy (KV, expert weights by precision, transitions, free, budget);
3. the precision map over time for policies that changed precision;
4. latency CDFs, throughput, goodput and preemption bars;
5. the quality proxy over time and quality against throughput;
6. transition traffic per second against the host-to-device copy budget;

and, for every simulated and real run of the same scenario among the directories, the metrics
side by side with the simulator's signed % error. Images are embedded as ``data:`` URIs: the
page fetches nothing and opens from a file.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import math
from pathlib import Path
from typing import TYPE_CHECKING

from pagedweight.results import report_plots as plots
from pagedweight.results.backlog import overload_notes
from pagedweight.results.report_data import (
    KEY_METRICS,
    METRICS,
    PRECISION_ORDER,
    RunResults,
    fmt,
    load_run,
    signed_error_perc,
    sim_real_pairs,
)
from pagedweight.results.report_parallel import parallel_section
from pagedweight.results.writer import atomic_write_text

if TYPE_CHECKING:
    import pandas as pd

BASELINE = "static-fp16"
# The open rows of the summary table: what was served, how fast, at what memory and quality.
FIRST_METRICS = (
    "completed",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "p99_e2el_ms",
    "num_preemptions",
    "mean_kv_cache_usage_perc",
    "mean_weight_gib",
    "mean_quality_proxy",
    "h2d_gib",
)
_METRIC = {key: (label, spec, better) for key, label, spec, better in METRICS}
CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em auto;max-width:1200px;color:#222;
padding:0 1em}
h1{margin-bottom:.2em}h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:2em}
.facts{color:#555;font-size:.9em}.headline{background:#eef5fb;border-left:4px solid #1f77b4;padding:.6em 1em}
table{border-collapse:collapse;font-size:.86em;margin:.6em 0}td,th{border:1px solid #ddd;padding:3px 8px}
td{text-align:right;white-space:nowrap}th{background:#f6f6f6;text-align:left}
.d{display:block;font-size:.82em}.better{color:#1a7f37}.worse{color:#c62828}.same{color:#888}
.base{color:#888;font-size:.82em;display:block}.err{color:#b00}
img{max-width:100%;border:1px solid #eee}figure{margin:1em 0}figcaption{color:#555;font-size:.9em}
nav a{margin-right:1em}
"""


def png_tag(path: Path, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    cap = html.escape(caption)
    return f'<figure><img alt="{cap}" src="data:image/png;base64,{data}"><figcaption>{cap}</figcaption></figure>'


def _change(value, base, better: str, spec: str) -> str:
    """The change of ``value`` against ``base``: percent, or an absolute difference when the
    baseline is 0 (a quality proxy of exactly 0 at full precision)."""
    if value is None or base is None or not (math.isfinite(value) and math.isfinite(base)):
        return ""
    diff = value - base
    if diff == 0 or (base != 0 and abs(diff / base) < 5e-4):
        return '<span class="d same">=</span>'
    text = f"{diff / abs(base) * 100:+.1f}%" if base != 0 else "+" * (diff > 0) + spec.format(diff)
    cls = ""
    if better:
        cls = "better" if (diff > 0) == (better == "higher") else "worse"
    return f'<span class="d {cls}">{text}</span>'


def summary_table(run: RunResults) -> str:
    """Every metric per policy; below each value its change against ``static-fp16``. The
    metrics a reader checks first are in the open table, the rest one click below it."""
    policies = run.policies
    base = run.metrics(BASELINE) if BASELINE in policies else None
    precisions = [p for p in PRECISION_ORDER if any(p in (run.metrics(q).get("weight_bytes") or {}) for q in policies)]
    rows = [*METRICS, *((f"mean_weight_gib_{p}", f"experts at {p} (GiB, time-avg)", "{:.2f}", "") for p in precisions)]
    head = "<tr><th>metric</th>" + "".join(
        f'<th style="color:{plots.policy_colour(p)}">{html.escape(p)}</th>' for p in policies
    )
    first, more = [], []
    for key, label, spec, better in rows:
        default = 0.0 if key.startswith("mean_weight_gib_") else None  # no expert at that precision
        values = [run.metrics(p).get(key, default) for p in policies]
        finite = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
        best = (max(finite) if better == "higher" else min(finite)) if better and len(set(finite)) > 1 else None
        cells = []
        for p, v in zip(policies, values, strict=True):
            cell = fmt(v, spec)
            if best is not None and v == best:
                cell = f"<b>{cell}</b>"
            if base is not None and p != BASELINE:
                cell += _change(v, base.get(key, default), better, spec)
            elif base is not None:
                cell += '<span class="base">baseline</span>'
            cells.append(f"<td>{cell}</td>")
        row = f"<tr><th>{html.escape(label)}</th>{''.join(cells)}</tr>"
        (first if key in FIRST_METRICS else more).append(row)
    note = (
        f"Change against <b>{BASELINE}</b> below each value: green is better, red is worse; the best value "
        "of each row is in bold."
        if base is not None
        else f"<b>{BASELINE}</b> did not run here, so no changes are shown."
    )
    return (
        f"<p>{note}</p><table>{head}{''.join(first)}</table>"
        f"<details><summary>More metrics ({len(more)})</summary><table>{head}{''.join(more)}</table></details>"
    )


def _duration(ms: float | None) -> str:
    if ms is None or not math.isfinite(ms):
        return "-"
    if ms >= 10_000:
        return f"{ms / 1000:.0f} s"
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def headline(run: RunResults) -> str:
    """One line per policy that changed precision: what it bought against static-fp16 and
    what it cost in quality against static-int4."""
    if BASELINE not in run.policies:
        return ""
    base = run.metrics(BASELINE)
    int4 = run.metrics("static-int4") if "static-int4" in run.policies else None
    lines = []
    for p in plots.dynamic_policies(run) or [q for q in run.policies if q != BASELINE][:1]:
        m = run.metrics(p)
        parts = []
        if base.get("output_throughput"):
            change = (m["output_throughput"] - base["output_throughput"]) / base["output_throughput"] * 100
            parts.append(f"output throughput {change:+.0f}%")
        for key, label in (("p99_ttft_ms", "P99 TTFT"), ("mean_tpot_ms", "mean TPOT")):
            parts.append(f"{label} {_duration(base.get(key))} &rarr; {_duration(m.get(key))}")
        parts.append(f"preemptions {base.get('num_preemptions', 0):.0f} &rarr; {m.get('num_preemptions', 0):.0f}")
        q = f"quality proxy {m.get('mean_quality_proxy', float('nan')):.4g}"
        if int4 is not None:
            q += f" (static-int4: {int4.get('mean_quality_proxy', float('nan')):.4g})"
        parts.append(q)
        if m.get("precision_ladder"):
            parts.append("precisions " + " &gt; ".join(html.escape(str(x)) for x in m["precision_ladder"]))
        lines.append(f"<b>{html.escape(p)}</b> against {BASELINE}: " + ", ".join(parts))
    return '<p class="headline">' + "<br>".join(lines) + "</p>" if lines else ""


def notes(run: RunResults) -> str:
    """What the run's summary notes (the trace's, the run's) and each policy whose queue kept
    growing (``backlog.overload_notes``): the lines ``pwsim run`` prints beside its table."""
    s = run.summary
    lines = [f"trace: {n}" for n in s.get("trace", {}).get("notes", [])] + list(s.get("notes", []))
    lines += overload_notes({p: run.metrics(p) for p in run.policies})
    if not lines:
        return ""
    return '<p class="facts">' + "<br>".join(f"Note: {html.escape(n)}" for n in lines) + "</p>"


def all_metrics_table(run: RunResults) -> str:
    policies = run.policies
    keys = [k for k in dict.fromkeys(k for p in policies for k in run.metrics(p)) if k != "weight_bytes"]
    head = "".join(f"<th>{html.escape(p)}</th>" for p in policies)
    body = []
    for k in keys:
        cells = []
        for p in policies:
            v = run.metrics(p).get(k)
            cells.append(f"<td>{fmt(v, '{:.6g}') if isinstance(v, int | float) else html.escape(str(v))}</td>")
        body.append(f"<tr><th>{html.escape(k)}</th>{''.join(cells)}</tr>")
    return (
        "<details><summary>Every field of summary.json</summary>"
        f"<table><tr><th>field</th>{head}</tr>{''.join(body)}</table></details>"
    )


def sim_real_table(sim: RunResults, real: RunResults) -> str:
    """Per policy and key metric: simulated, real, and (sim - real) / |real| in percent."""
    from pagedweight.results.validation import split_half_perc

    rows = []
    pooled = False
    for p in (p for p in sim.policies if p in real.policies):
        s, r = sim.metrics(p), real.metrics(p)
        # Pooled real runs: how far two halves of them differ, the finest error they resolve.
        halves = split_half_perc(r.get("real_runs") or {})
        pooled = pooled or bool(halves)
        for key in (*KEY_METRICS, "mean_e2el_ms"):
            label, spec, _ = _METRIC[key]
            err = signed_error_perc(s.get(key), r.get(key))
            size = abs(err) if math.isfinite(err) else math.inf
            cls = "better" if size <= 10 else "worse" if size > 25 else ""
            half = f"<td>{halves[key]:.1f}%</td>" if key in halves else "<td></td>"
            rows.append(
                f"<tr><th>{html.escape(p)}</th><th>{html.escape(label)}</th><td>{fmt(s.get(key), spec)}</td>"
                f'<td>{fmt(r.get(key), spec)}</td><td class="{cls}">{fmt(err, "{:+.1f}%")}</td>{half}</tr>'
            )
    missing = sorted(set(sim.policies) ^ set(real.policies))
    note = f"<p>Only in one of the two runs: {html.escape(', '.join(missing))}.</p>" if missing else ""
    halves_head = "<th>real runs' halves differ by</th>" if pooled else ""
    halves_note = (
        " The real runs are pooled repeats; their two halves (runs 1, 4, 5, 8, ... against 2, 3, 6, 7, ...) "
        "differ from each other by the last column: no error is resolved more finely."
        if pooled
        else ""
    )
    return (
        f"<table><tr><th>policy</th><th>metric</th><th>simulated ({html.escape(sim.name)})</th>"
        f"<th>real ({html.escape(real.name)}, {html.escape(real.runtime)})</th><th>signed error</th>{halves_head}</tr>"
        f"{''.join(rows)}</table>{note}"
        "<p>Signed error = (simulated &minus; real) / |real|: positive means the simulator predicts more."
        f"{halves_note}</p>"
    )


def replica_view(run: RunResults, replica: int) -> RunResults:
    """A cluster run's tables restricted to one replica's rows (requests stay whole)."""

    def one(df):
        return df[df["replica"] == replica].drop(columns="replica") if "replica" in df.columns else df

    return dataclasses.replace(
        run, steps=one(run.steps), transitions=one(run.transitions), initial_precisions=one(run.initial_precisions)
    )


def run_section(run: RunResults, prefix: str, out_dir: Path, anchor: str) -> str:
    s = run.summary
    trace = s.get("trace", {})
    facts = (
        f"{html.escape(s.get('model', '?'))} on {html.escape(s.get('gpu', '?'))}, "
        f"budget {s.get('budget_bytes', 0) / 2**30:.4g} GiB in {s.get('page_bytes', 0) / 2**20:g} MiB pages; "
        f"{trace.get('num_requests', '?')} requests ({html.escape(str(trace.get('source', '?')))}); "
        f"runtime {html.escape(run.runtime)}.<br>Timed by: {html.escape(str(s.get('latency_model', '?')))}."
        f"<br>{html.escape(str(s.get('importance', '')))}"
    )
    errors = "".join(f"<p class=err>{html.escape(p)} did not run: {html.escape(e)}</p>" for p, e in run.errors.items())
    parts = [
        f'<h2 id="{anchor}">{html.escape(s.get("scenario", run.name))} <small>({html.escape(run.name)})</small></h2>',
        f'<p class="facts">{facts}</p>',
        headline(run),
        notes(run),
        errors,
    ]
    if not run.policies:
        return "".join(parts)
    parts.append("<h3>Summary</h3>" + summary_table(run))
    parts.append(parallel_section(run, prefix, out_dir, png_tag))
    if "replica" in run.steps.columns:  # a cluster: the time series of one replica
        parts.append("<p>Memory, precision, quality and transition figures below show replica 0.</p>")
        run = replica_view(run, 0)
    figures = (
        ("memory", plots.memory_figure, "Memory over time per policy: where the budget goes, step by step."),
        ("precision_map", plots.precision_map_figure, "Precision of every routed expert over time."),
        ("latency", plots.latency_figure, "Latency CDFs, throughput, goodput and preemptions."),
        ("queue", plots.queue_figure, "TTFT by arrival time: flat keeps up, rising is a growing queue."),
        ("quality", plots.quality_figure, "Quality proxy over time, and quality against throughput."),
        ("transitions", plots.transitions_figure, "Precision transitions: bytes per second moved."),
        ("prefix", plots.prefix_figure, "Prefix caching: prefill saved by hits, evictions, cached memory."),
    )
    if run.steps.empty:
        parts.append("<p>No steps.csv: memory, quality and transition figures are not drawn.</p>")
        figures = figures[2:4]  # latency and queue: requests alone
    for name, draw, caption in figures:
        png = draw(run, out_dir / f"{prefix}_{name}.png")
        if png is not None:
            parts.append(png_tag(png, caption))
    parts.append(all_metrics_table(run))
    return "".join(parts)


def validation_section(v: dict) -> str:
    """What ``pwsim validate`` adds under its simulated-vs-real table: the calibration it did
    and the median step time by step shape, where the latency model is off."""
    parts = []
    cal = v.get("calibration")
    if cal:
        fitted, scale = ", ".join(cal["fitted_on"]), cal.get("scale", 1.0)
        parts.append(
            f"<p>Calibrated on <b>{html.escape(fitted)}</b> (in sample; the other policies are out of sample): "
            f"step overhead {cal['step_overhead_s'] * 1e3:.2f} ms (was {cal['initial_step_overhead_s'] * 1e3:.2f} ms)"
            + (f", table times x{scale:.3f}" if scale != 1.0 else "")
            + ("" if cal.get("converged", True) else " &mdash; <b>not converged</b>")
            + ". Before calibration: "
            + "; ".join(
                f"{html.escape(p)} "
                + ", ".join(f"{html.escape(_METRIC[m][0] if m in _METRIC else m)} {e:+.1f}%" for m, e in errs.items())
                for p, errs in cal["uncalibrated_errors_perc"].items()
            )
            + ".</p>"
        )
    rows = []
    for policy, e in v.get("policies", {}).items():
        for r in e.get("step_time_by_shape", []):
            size = abs(r["error_perc"])
            cls = "better" if size <= 10 else "worse" if size > 25 else ""
            rows.append(
                f"<tr><th>{html.escape(policy)}</th><th>{html.escape(r['shape'])}</th>"
                f"<td>{r['real_median_ms']:.2f} ({r['real_steps']})</td>"
                f"<td>{r['sim_median_ms']:.2f} ({r['sim_steps']})</td>"
                f'<td class="{cls}">{r["error_perc"]:+.1f}%</td></tr>'
            )
    if rows:
        parts.append(
            "<h3>Median step time by step shape</h3><p>Steps without precision changes, grouped by decode batch "
            "or prefill tokens: where the latency model is off, independent of how the two schedules drifted "
            "apart.</p><table><tr><th>policy</th><th>step shape</th><th>real ms (steps)</th>"
            f"<th>simulated ms (steps)</th><th>signed error</th></tr>{''.join(rows)}</table>"
        )
    if v.get("out_of_grid"):
        parts.append(f"<p>Latency-table points outside the measured grid: {html.escape(str(v['out_of_grid']))}.</p>")
    return "".join(parts)


def write_report(
    result_dirs: list[Path],
    out_html: Path,
    validation: dict | None = None,
    steps: dict[Path, pd.DataFrame] | None = None,
) -> Path:
    """The report of one or more results directories, with its PNGs beside ``out_html``.
    ``validation``: ``pwsim validate``'s result, shown under the pair of runs it compared.
    ``steps``: step tables the caller holds already, by directory (``load_run``)."""
    out_html = Path(out_html)
    out_dir = out_html.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = steps or {}
    runs = [load_run(d, steps=steps.get(Path(d))) for d in result_dirs]
    prefixes = [r.name if [q.name for q in runs].count(r.name) == 1 else f"{r.name}{i}" for i, r in enumerate(runs)]
    nav, sections = [], []
    for i, (run, prefix) in enumerate(zip(runs, prefixes, strict=True)):
        anchor = f"run{i}"
        nav.append(
            f'<a href="#{anchor}">{html.escape(run.summary.get("scenario", run.name))} ({html.escape(run.name)})</a>'
        )
        sections.append(run_section(run, prefix, out_dir, anchor))
    pairs = [(s.path.resolve(), r.path.resolve()) for s, r in sim_real_pairs(runs)]
    # The pair pwsim validate compared, whatever produced the two runs.
    checked = tuple(Path(validation[side]["dir"]).resolve() for side in ("sim", "real")) if validation else None
    by_path = {r.path.resolve(): r for r in runs}
    if checked and checked not in pairs and all(p in by_path for p in checked):
        pairs.append(checked)
    for j, (sim_path, real_path) in enumerate(pairs):
        sim, real = by_path[sim_path], by_path[real_path]
        anchor = f"simreal{j}"
        nav.append(f'<a href="#{anchor}">simulated vs real: {html.escape(sim.summary.get("scenario", ""))}</a>')
        body = f'<h2 id="{anchor}">Simulated vs real: {html.escape(sim.summary.get("scenario", ""))}</h2>'
        body += sim_real_table(sim, real)
        if (sim_path, real_path) == checked:
            body += validation_section(validation)
        png = plots.sim_real_figure(sim, real, out_dir / f"simreal{j}_{sim.name}_{real.name}.png")
        if png is not None:
            body += png_tag(png, "TTFT and TPOT distributions, simulated (dashed) and real (solid).")
        sections.append(body)
    page = (
        "<!doctype html><html><head><meta charset=utf-8><title>PagedWeight report</title>"
        f"<style>{CSS}</style></head><body><h1>PagedWeight report</h1>"
        "<p>What does dynamic expert precision buy here? Compare the dynamic policies against "
        f"<b>{BASELINE}</b> in the summary, then see why in the memory plot.</p>"
        f"<nav>{''.join(nav)}</nav>{''.join(sections)}</body></html>"
    )
    atomic_write_text(out_html, page)
    return out_html
