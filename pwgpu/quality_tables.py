"""The Markdown tables of ``reports/quality/README.md``, rendered from the committed outputs.

Each table in the README sits between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``
and is exactly what ``render(NAME, directory)`` returns for the CSV and JSON files there. ``pwgpu
tables --write`` rewrites the blocks; ``pwgpu tables`` (and a test) fails when one differs, so a
table can never drift from the outputs it reports. Pure numpy/csv/json: no torch needed.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

BLOCK = re.compile(r"<!-- generated: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- end: (?P=name) -->", re.S)


# ------------------------------------------------------------------------------------------
# Formatting
# ------------------------------------------------------------------------------------------


def g(x, digits: int = 3) -> str:
    """A number with ``digits`` significant digits; "n/a" for missing or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)) or x == "":
        return "n/a"
    return f"{float(x):.{digits}g}"


def pct(x, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * float(x):.{digits}f}%"


def ci(lo, hi, f: Callable = g) -> str:
    return f"[{f(lo)}, {f(hi)}]"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def read_csv(path: Path) -> list[dict]:
    lines = [ln for ln in Path(path).read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def _f(row: dict, key: str) -> float:
    v = row.get(key, "")
    return float(v) if v not in ("", None) else float("nan")


# ------------------------------------------------------------------------------------------
# Experiments 1-4 (pwgpu experiments)
# ------------------------------------------------------------------------------------------


def _md4(header, rows) -> str:
    from pwgpu.experiments import md_table

    return md_table(header, rows) + "\n"


def exp1(d: Path) -> str:
    rows = read_csv(d / "exp1_quality_vs_memory.csv")
    fractions = sorted({float(r["fraction"]) for r in rows})
    domains = sorted({r["domain"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    kl = {(r["method"], float(r["fraction"]), r["domain"]): float(r["kl_nats_per_token"]) for r in rows}
    header = ["method", *(f"{f:.0%} {dom}" for f in fractions for dom in domains)]
    body = [[m, *(kl[(m, f, dom)] for f in fractions for dom in domains)] for m in methods]
    return _md4(header, body)


def _uniform_at(summary: dict, fraction, tau: float) -> str:
    """The single format at ``fraction`` that meets the threshold (fp8 and int8 share bytes)."""
    for u in summary["headline"]["uniform"]:
        if fraction is not None and abs(u["fraction"] - fraction) < 1e-9 and u["kl_max"] <= tau:
            return u["precision"]
    return ""


def _sci(x: float) -> str:
    m, e = f"{x:.0e}".split("e")
    return f"{m}e{int(e)}"


def _saving(summary: dict, fraction) -> str:
    if fraction is None:
        return "none"
    h = summary["headline"]
    e, p = h["expert_bytes_bf16"], h["pinned_bytes_bf16"]
    whole = 1 - (p + fraction * e) / (p + e)
    return f"{pct(1 - fraction)} / {pct(whole)}"


def exp2_thresholds(d: Path) -> str:
    s = json.loads((d / "summary.json").read_text())
    rows = []
    for t in s["headline"]["thresholds"]:
        ppl = t["marginal_ppl_ratio"] or {}
        worst = max((abs(v - 1) for v in ppl.values()), default=float("nan"))
        grid = t["grid_min_fraction"]
        rows.append(
            [
                f"{_sci(t['kl_threshold'])} (marginal's ppl within {pct(worst, 2)})",
                pct(t["marginal_min_fraction"]),
                _saving(s, t["marginal_min_fraction"]),
                f"{pct(t['uniform_min_fraction'])} ({_uniform_at(s, t['uniform_min_fraction'], t['kl_threshold'])})"
                if t["uniform_min_fraction"] is not None
                else "none",
                _saving(s, t["uniform_min_fraction"]),
                ", ".join("none" if v is None else f"{v:.0%}" for v in grid.values()),
            ]
        )
    methods = ", ".join(s["headline"]["thresholds"][0]["grid_min_fraction"])
    header = [
        "KL threshold (nats/token)",
        "`marginal`: least expert bytes (bisection)",
        "saving, experts / whole model",
        "uniform (one format): least bytes",
        "saving, experts / whole model",
        f"smallest grid budget (exp 1) per method: {methods}",
    ]
    return table(header, rows)


def exp2_gains(d: Path) -> str:
    s = json.loads((d / "summary.json").read_text())
    gains = s["headline"]["gains"]
    domains = sorted({x["domain"] for x in gains})
    by = {(x["fraction"], x["domain"]): x["kl_reduction"] for x in gains}
    rows = [[f"{f:.0%}", *(pct(by.get((f, dom))) for dom in domains)] for f in sorted({x["fraction"] for x in gains})]
    return table(["budget", *domains], rows)


def exp3(d: Path) -> str:
    import numpy as np

    rows = read_csv(d / "exp3_rank_correlation.csv")
    precs = list(dict.fromkeys(r["precision"] for r in rows))
    estimators = list(dict.fromkeys(r["estimator"] for r in rows))

    def mean_rho(e, p, across: bool) -> float:
        sel = [
            _f(r, "spearman")
            for r in rows
            if r["estimator"] == e and r["precision"] == p and (r["layer"] == "all") == across
        ]
        return float(np.nanmean(sel))

    body = [[e, *(mean_rho(e, p, False) for p in precs), *(mean_rho(e, p, True) for p in precs)] for e in estimators]
    return _md4(["estimator", *(f"{p} in layer" for p in precs), *(f"{p} all" for p in precs)], body)


def exp4(d: Path) -> str:
    rows = read_csv(d / "exp4_drift.csv")
    body = [
        [r["calibrated_on"], r["served"], r["plan"], float(r["kl_nats_per_token"]), float(r["ppl_plan"])] for r in rows
    ]
    return _md4(["calibrated on", "served", "plan", "KL nats/token", "ppl"], body)


ROOT = Path(__file__).resolve().parents[1]


def _model_dir(d: Path, model: str) -> Path:
    """The checkpoint an output names (a path relative to the repository root)."""
    p = Path(model)
    if p.is_absolute():
        return p
    for root in (Path(d).resolve().parents[1], ROOT):
        if (root / p / "training_log.json").is_file():
            return root / p
    return ROOT / p


def uniform_int4_cost(d: Path) -> dict | None:
    """KL and perplexity ratio, with intervals, of every expert at int4, from equal_memory.csv
    (the uniform mix of a budget whose mix is int4 in every layer)."""
    if not (Path(d) / "equal_memory.csv").is_file():
        return None
    out = {}
    for r in read_csv(Path(d) / "equal_memory.csv"):
        mix = r["counts"].split(" | ")[0].split()
        if r["method"] == "uniform-mix" and mix and all(c.startswith("int4:") for c in mix):
            out.setdefault(r["domain"], r)
    return out or None


def _pct2(x) -> str:
    return pct(x, 2)


def model_facts(d: Path) -> str:
    """What model the outputs were measured on: its size, training, held-out perplexity (from its
    training log) and what uniform int4 costs it (from equal_memory.csv)."""
    s = json.loads((Path(d) / "equal_memory.json").read_text())
    log = json.loads((_model_dir(d, s["settings"]["model"]) / "training_log.json").read_text())
    mc, final = log["model_config"], log["final"]
    hours = final["elapsed_s"] / 3600
    ppl = "; ".join(
        f"{dom} {final['eval_ppl'][dom]:.0f} (unigram {log['unigram_ppl'][dom]:.0f}, "
        f"{final.get('eval_tokens', {}).get(dom, 0):,} tokens)"
        for dom in final["eval_ppl"]
    )
    machines = sorted({r.get("machine", "machine not recorded") for r in log.get("runs") or []})
    lines = [
        f"- `{s['settings']['model']}` (sha256 {s['settings']['model_sha256'][:12]}): {log['params'] / 1e6:.1f}M "
        f"parameters, {mc['num_hidden_layers']} layers of {mc['num_local_experts']} experts (FFN "
        f"{mc['intermediate_size']}, top-{mc['num_experts_per_tok']}), vocabulary {mc['vocab_size']}",
        f"- trained on {final['tokens']:,} tokens in {final['step']:,} steps, {hours:.1f} h of training wall time "
        f"({'; '.join(machines or ['machine not recorded'])})",
        f"- held-out perplexity: {ppl}",
    ]
    cost = uniform_int4_cost(d)
    if cost:
        lines.append(
            "- every expert at int4 costs "
            + "; ".join(
                f"{dom}: KL {g(_f(r, 'kl'))} {ci(_f(r, 'kl_lo'), _f(r, 'kl_hi'))} nats/token, perplexity "
                f"{_pct2(_f(r, 'ppl_ratio') - 1)} {ci(_f(r, 'ppl_ratio_lo') - 1, _f(r, 'ppl_ratio_hi') - 1, _pct2)}"
                for dom, r in cost.items()
            )
        )
    return "\n".join(lines) + "\n"


def details_header(d: Path) -> dict[str, str]:
    """The ``# key: value; ...`` line on top of ``estimators.csv`` (``pwgpu importance --details``)."""
    first = (Path(d) / "estimators.csv").read_text().split("\n", 1)[0]
    if not first.startswith("#"):
        return {}
    items = (part.split(":", 1) for part in first.lstrip("# ").split(";") if ":" in part)
    return {k.strip(): v.strip() for k, v in items}


def exp3_oracle(d: Path) -> str:
    h = details_header(d)
    text = h.get("oracle_text")
    if text is None:
        where = "the calibration text itself (this file predates `--folds`: not disjoint)"
    elif text == "calibration text":
        where = "the calibration text itself (not disjoint)"
    else:
        where = f"calibration {text}"
    return (
        f"Estimators calibrated on {int(h.get('calibration_tokens', 0)):,} tokens; the oracle measured on "
        f"{int(h.get('oracle_tokens', 0)):,} tokens of {where}.\n"
    )


def run_times(d: Path) -> str:
    """What each committed output recorded about its own run (seconds; the machine's load)."""
    rows = []
    h = details_header(d) if (Path(d) / "estimators.csv").is_file() else {}
    rt = h.get("run_time_s")
    load = {"start": float(h["load_start"]), "end": float(h["load_end"]), "cpus": h["cpus"]} if "cpus" in h else None
    took = f"{float(rt):.0f} s" if rt else "not recorded"
    rows.append(["importance table and `estimators.csv`", took, _load_cell({"load_average": load})])
    if (Path(d) / "summary.json").is_file():
        s = json.loads((Path(d) / "summary.json").read_text())
        tokens = ", ".join(f"{k} {v:,}" for k, v in (s.get("eval_tokens") or {}).items())
        rt = s.get("run_time_s")
        took = f"{rt:.0f} s" if rt else "not recorded"
        rows.append([f"experiments 1-4 ({tokens} evaluation tokens)", took, _load_cell(s)])
    if (Path(d) / "equal_memory.json").is_file():
        s = json.loads((Path(d) / "equal_memory.json").read_text())
        tokens = ", ".join(f"{k} {v:,}" for k, v in s["settings"]["eval_tokens"].items())
        fresh = s.get("compute_time_s")
        took = f"{s['run_time_s']:.0f} s" + (f"; a fresh run {fresh:.0f} s" if fresh is not None else "")
        rows.append([f"equal memory ({tokens} evaluation tokens)", took, _load_cell(s)])
    if (Path(d) / "served_quality.json").is_file():
        s = json.loads((Path(d) / "served_quality.json").read_text())
        t = s["run_time_s"]
        fresh = sum(t.get(k, 0) for k in ("engine_s", "sim_s", "rescore_s"))
        rows.append(["served quality", f"{t['total']:.0f} s; a fresh run {fresh:.0f} s", _load_cell(s)])
    board = next(
        (b for b in (Path(d).parent / "claims" / "sim_scoreboard.csv", ROOT / "reports/claims/sim_scoreboard.csv")
         if b.is_file()),
        None,
    )  # fmt: skip
    if board is not None:
        head = dict(
            ln[2:].split(": ", 1) for ln in board.read_text().splitlines() if ln.startswith("# ") and ": " in ln
        )
        rt = head.get("run_time_s")
        took = f"{float(rt):.0f} s" if rt else "not recorded"
        rows.append(["simulator scoreboard (`pwgpu claims --run`)", took, head.get("load_average", "not recorded")])
    return table(["step", "recorded run time", "load average (start, end)"], rows)


def _load_cell(s: dict) -> str:
    la = s.get("load_average")
    return f"{la['start']:.1f}, {la['end']:.1f} on {la['cpus']} CPUs" if la else "not recorded"


# ------------------------------------------------------------------------------------------
# Equal memory (pwgpu equal-memory)
# ------------------------------------------------------------------------------------------


def _em(d: Path) -> tuple[dict, list[dict], list[dict]]:
    return (
        json.loads((d / "equal_memory.json").read_text()),
        read_csv(d / "equal_memory.csv"),
        read_csv(d / "equal_memory_ratios.csv"),
    )


def _kl_cell(r: dict) -> str:
    if r["below_noise_floor"] == "True":
        return f"< floor ({g(_f(r, 'kl'))})"
    return f"{g(_f(r, 'kl'))} {ci(_f(r, 'kl_lo'), _f(r, 'kl_hi'))}"


def equal_memory_setup(d: Path) -> str:
    s, _, _ = _em(d)
    st = s["settings"]
    floor = s.get("noise_floor") or {}
    lines = [
        f"- model `{st['model']}` (sha256 {st['model_sha256'][:12]}), evaluation text "
        + ", ".join(f"{k} {v:,} tokens" for k, v in st["scored_tokens"].items())
        + f" scored, windows of {st['window']}, bootstrap {st['bootstrap']} replicates"
        + f" over blocks of {st['block_tokens']} tokens",
        f"- {st['seeds']} calibration seeds (disjoint folds of {st['folds']}; per seed "
        + ", ".join(f"{k} {v:,}" for k, v in st["calib_tokens_per_seed"].items())
        + " tokens); the uniform mix is chosen on the last fold ("
        + ", ".join(f"{k} {v:,}" for k, v in st["selection_tokens"].items())
        + " tokens)",
        "- noise floor (KL of the float32 model against float64, upper end of the 95% interval): "
        + (", ".join(f"{k} {g(v['kl_hi'])}" for k, v in floor.items()) if floor else "not measured"),
        f"- expert bytes at bf16 {s['expert_bytes_bf16']:,}; "
        f"pinned (attention, embeddings, norms, routers) {s['pinned_bytes_bf16']:,}",
        f"- run time {s['run_time_s']:.0f} s ({s['evaluations']['computed']} plans evaluated, "
        f"{s['evaluations']['from_cache']} from the cache)"
        + (
            f"; computing every result, cached ones included, took {s['compute_time_s']:.0f} s"
            if "compute_time_s" in s
            else ""
        ),
    ]
    return "\n".join(lines) + "\n"


def equal_memory_ladder(d: Path, ladder: str) -> str:
    s, rows, ratios = _em(d)
    rows = [r for r in rows if r["ladder"] == ladder]
    if not rows:
        return f"(no rows for ladder {ladder})\n"
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    ratio_of = {(r["target_fraction"], r["method"], r["domain"]): r for r in ratios if r["ladder"] == ladder}
    mix = {(m["ladder"], m["target_fraction"]): m for m in s["uniform_mix"]}
    header = ["budget (uniform mix)", "method", "bytes used (max over seeds)"]
    header += [f"KL {dom} [95% CI]" for dom in domains]
    header += [f"KL / uniform mix, {dom} [95% CI]" for dom in domains]
    body = []
    for (frac, method), group in _group(rows, ("target_fraction", "method")).items():
        m = mix[(ladder, float(frac))]
        by = {r["domain"]: r for r in group}
        first = by[domains[0]]
        label = f"{float(frac):.0%}: {'/'.join(m['layers'])}"
        used = f"{pct(_f(first, 'fraction_used_max'))}" + (
            " (paper ladder)" if first["method_ladder"] != ladder else ""
        )
        cells = [label, method, used, *(_kl_cell(by[dom]) for dom in domains)]
        for dom in domains:
            r = ratio_of.get((frac, method, dom))
            if r is None:
                cells.append("1 (baseline)")
            else:
                verdict = "" if r["resolved"] == "True" else " not resolved"
                cells.append(f"{g(_f(r, 'ratio'))} {ci(_f(r, 'ratio_lo'), _f(r, 'ratio_hi'))}{verdict}")
        body.append(cells)
    return table(header, body)


def equal_memory_equivalence(d: Path) -> str:
    s, _, _ = _em(d)
    eq = s["equivalence"]
    e, p = s["expert_bytes_bf16"], s["pinned_bytes_bf16"]
    body = []
    for method, m in eq["methods"].items():
        f = m["least_fraction"]

        def whole(x):
            return None if x is None else 1 - (p + x * e) / (p + e)

        body.append(
            [
                method,
                "none on the grid" if f is None else pct(f),
                ci(m["least_fraction_lo"], m["least_fraction_hi"], pct),
                "n/a" if f is None else pct(1 - f),
                "n/a" if f is None else pct(whole(f)),
                ci(whole(m["least_fraction_hi"]), whole(m["least_fraction_lo"]), pct),
                ", ".join(f"{pct(pt['fraction'])}: {g(max(pt['ppl_ratio'].values()), 5)}" for pt in m["points"]),
            ]
        )
    header = [
        "method (our ladder)",
        "least expert bytes",
        "95% CI",
        "saving, experts",
        "saving, whole model",
        "95% CI (whole model)",
        "evaluated: bytes: worst ppl ratio",
    ]
    return f"Criterion, fixed before measuring: {eq['criterion']}.\n\n" + table(header, body)


def _group(rows: list[dict], keys: tuple[str, ...]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def equal_memory_markdown(d: Path) -> str:
    s, _, _ = _em(d)
    parts = ["# Quality at equal bytes actually used (`pwgpu equal-memory`)\n", equal_memory_setup(d)]
    for ladder, names in s["settings"]["ladders"].items():
        parts.append(f"\n## Ladder {ladder}: {' > '.join(names)}\n")
        parts.append(equal_memory_ladder(d, ladder))
    parts.append("\n## Equivalent quality\n")
    parts.append(equal_memory_equivalence(d))
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------
# Served quality (pwgpu served-quality)
# ------------------------------------------------------------------------------------------


def served_setup(d: Path) -> str:
    s = json.loads((d / "served_quality.json").read_text())
    w = s["workload"]
    rt = s["run_time_s"]
    lengths = w.get("lengths", {})
    return (
        f"- scenario `{s['scenario']}` ({s['scenario_name']}): arena {s['budget_bytes'] / 2**20:.0f} MiB for every "
        f"policy, {w.get('num_requests', '?')} requests, prompt {lengths.get('prompt_tokens', '?')} / output "
        f"{lengths.get('output_tokens', '?')} tokens; prompts cut from {', '.join(f'`{p}`' for p in s['prompts'])}\n"
        f"- engine: {s['engine']['latency_model']}; ladders: "
        + "; ".join(f"{p} {'/'.join(ld)}" for p, ld in s["ladders"].items())
        + f"\n- run time {rt['total']:.0f} s (engine {rt.get('engine_s', 0):.0f} s, "
        f"simulator {rt.get('sim_s', 0):.0f} s, re-scoring {rt.get('rescore_s', 0):.0f} s)" + _load(s) + "\n"
    )


def _load(s: dict) -> str:
    la = s.get("load_average")
    if not la:
        return ""
    return (
        f"; load average {la['start']:.1f} at the start and {la['end']:.1f} at the end on {la['cpus']} CPUs "
        "(engine tokens/s are wall clock and scale with it)"
    )


def served_table(d: Path) -> str:
    rows = read_csv(d / "served_quality.csv")
    header = [
        "policy",
        "tokens",
        "served KL, engine [95% CI]",
        "time avg",
        "map KL, replay [95% CI]",
        "time avg",
        "proxy, engine run (same steps)",
        "proxy, simulator",
        "transitions engine / sim",
        "tok/s engine / sim",
        "replay argmax = served",
    ]
    body = []
    for r in rows:
        body.append(
            [
                r["policy"],
                r["tokens"],
                f"{g(_f(r, 'kl_engine_mean'))} {ci(_f(r, 'kl_engine_lo'), _f(r, 'kl_engine_hi'))}",
                g(_f(r, "kl_engine_time_avg")),
                f"{g(_f(r, 'kl_replay_mean'))} {ci(_f(r, 'kl_replay_lo'), _f(r, 'kl_replay_hi'))}",
                g(_f(r, "kl_replay_time_avg")),
                g(_f(r, "proxy_engine_time_avg")),
                g(_f(r, "proxy_sim_mean_all_steps")),
                f"{r['transitions_engine']} / {r['transitions_sim']}",
                f"{_f(r, 'output_throughput_engine'):.1f} / {_f(r, 'output_throughput_sim'):.1f}",
                pct(_f(r, "argmax_agree_replay")),
            ]
        )
    return table(header, body)


def served_correlations(d: Path) -> str:
    s = json.loads((d / "served_quality.json").read_text())
    c = s["correlations"]
    across = c["across_policies"]
    body = [[k, v["n"], g(v["spearman"]), g(v["pearson_log10"])] for k, v in across.items()]
    out = table(["measured vs proxy, across policies", "policies", "Spearman", "Pearson of log10"], body)
    time_rows = []
    for k, per in c["over_time"].items():
        time_rows.append([k, *(g(v) for v in per.values())])
    names = list(next(iter(c["over_time"].values())))
    out += "\n" + table(["over time (Spearman over time bins)", *names], time_rows)
    return out


def served_markdown(d: Path) -> str:
    return "\n".join(
        [
            "# Served quality at equal memory (`pwgpu served-quality`)\n",
            served_setup(d),
            served_table(d),
            served_correlations(d),
        ]
    )


# ------------------------------------------------------------------------------------------
# The registry
# ------------------------------------------------------------------------------------------

RENDERERS: dict[str, Callable[[Path], str]] = {
    "exp1": exp1,
    "exp2-thresholds": exp2_thresholds,
    "exp2-gains": exp2_gains,
    "exp3": exp3,
    "exp4": exp4,
    "model": model_facts,
    "exp3-oracle": exp3_oracle,
    "run-times": run_times,
    "equal-memory-setup": equal_memory_setup,
    "equal-memory-ours": lambda d: equal_memory_ladder(d, "ours"),
    "equal-memory-paper": lambda d: equal_memory_ladder(d, "paper"),
    "equal-memory-equivalence": equal_memory_equivalence,
    "served-setup": served_setup,
    "served": served_table,
    "served-correlations": served_correlations,
}


def register(name: str, fn: Callable[[Path], str]) -> None:
    RENDERERS[name] = fn


def render(name: str, d: Path) -> str:
    from pagedweight.errors import PagedWeightError

    if name not in RENDERERS:
        raise PagedWeightError(f"unknown generated block {name!r}; known: {', '.join(RENDERERS)}")
    return RENDERERS[name](Path(d))


def sync(doc: Path, d: Path, write: bool = False) -> list[str]:
    """Blocks of ``doc`` whose text differs from ``render``; with ``write`` rewrite them.
    Returns the names that differed (before writing)."""
    text = Path(doc).read_text()
    stale = []

    def fill(m: re.Match) -> str:
        name = m.group("name")
        body = render(name, d)
        if body != m.group("body"):
            stale.append(name)
        return f"<!-- generated: {name} -->\n{body}<!-- end: {name} -->"

    new = BLOCK.sub(fill, text)
    if write and new != text:
        Path(doc).write_text(new)
    return stale


# The whole-file reports the commands write beside their outputs.
WHOLE_FILES: dict[str, tuple[str, Callable[[Path], str]]] = {
    "equal_memory.md": ("equal_memory.json", equal_memory_markdown),
    "served_quality.md": ("served_quality.json", served_markdown),
}


def sync_files(d: Path, write: bool = False) -> list[str]:
    """The whole-file reports in ``d`` (those whose outputs are there) that differ from their
    rendering; with ``write`` rewrite them. Returns the names that differed (before writing)."""
    stale = []
    for name, (source, fn) in WHOLE_FILES.items():
        if not (Path(d) / source).is_file():
            continue
        path, body = Path(d) / name, fn(Path(d))
        if not path.is_file() or path.read_text() != body:
            stale.append(name)
            if write:
                path.write_text(body)
    return stale
