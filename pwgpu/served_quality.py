"""Served quality per policy at equal memory, beside the simulator's quality proxy:
``pwgpu served-quality``.

1. The scenario on the engine (``pwgpu run --scenario``) for every policy, prompts cut from the
   held-out evaluation texts, recording the served tokens, the map in force for every chunk and
   the engine's own next-token logits (``pwgpu.served``). ``paper-greedy`` runs on the paper's
   ladder (FP16/INT8/INT4), the others on the scenario's. Every policy gets the same arena.
2. The same scenario in the simulator (``pwsim run``, paper-greedy with the paper's ladder too),
   for its quality proxy (sum of the importance table's dL over the map in force, nats/token).
3. Re-scoring (``pwgpu.served.rescore``): per generated token, ``kl_engine`` = KL(full precision
   || the distribution the engine actually sampled from), and ``kl_replay`` = KL(full precision ||
   the map in force, replayed in float32), which isolates what the precision maps cost from the
   engine's own arithmetic (bfloat16 activations in a scenario run).

Means per policy are over generated tokens, with 95% bootstrap intervals over requests;
*time-averaged* values weight each step that produced tokens by its duration, exactly as
``mean_quality_proxy`` weights the proxy, and are taken over the same steps. Correlations:
across policies (Spearman of the time averages; Pearson of their logarithms), and over time
(per policy, Spearman over equal-width time bins of the run; pooled over all policies' bins).
The simulator's proxy over time is binned on the fraction of its own run (the runtimes run at
different speeds), so its time correlation is only indicative.

Runs are reused when their key (model bytes, scenario text, importance table, policies, prompts)
matches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

POLICIES = ("static-fp16", "static-int8", "static-int4", "static-mixed", "paper-greedy", "pagedweight")
PAPER_LADDER = ("bf16", "int8", "int4")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--scenario", default="scenarios/cpu_validate.yaml")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--paper-ladder", default=",".join(PAPER_LADDER), help="paper-greedy's precisions in both runtimes")
    ap.add_argument("--prompt-text", nargs="+", default=["data/eval/code.txt", "data/eval/shakespeare.txt"])
    ap.add_argument("--model", default=None, help="checkpoint (default: the scenario's model)")
    ap.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="engine activations (default: the scenario's, bf16)"
    )
    ap.add_argument("--runs", default="runs/served-quality", help="engine and simulator results directories")
    ap.add_argument("--out", default="reports/quality", help="directory for served_quality.{csv,json,md}")
    ap.add_argument("--time-bins", type=int, default=10)
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--rerun", action="store_true", help="run the engine and the simulator even if the runs match")
    ap.add_argument("--cache-dir", default=None)


def _key(args, model_dir: Path, policies: list[str], importance: Path | None) -> str:
    """What the engine and simulator runs depend on: a change to any of it reruns them."""
    from pwgpu.qcache import DiskCache

    h = hashlib.sha256()
    for part in (
        DiskCache.model_key(model_dir),
        Path(args.scenario).read_text(),
        importance.read_bytes() if importance is not None else b"synthetic",
        policies,
        args.paper_ladder,
        args.dtype,
        [Path(f).read_bytes() for f in args.prompt_text],
    ):
        h.update(repr(part).encode())
    return h.hexdigest()[:32]


def _fresh(run_dir: Path, key: str) -> bool:
    stamp = run_dir / "run_key.json"
    return stamp.is_file() and json.loads(stamp.read_text()).get("key") == key


def _stamp(run_dir: Path, key: str, seconds: float) -> None:
    (run_dir / "run_key.json").write_text(json.dumps({"key": key, "run_time_s": round(seconds, 1)}) + "\n")


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from pagedweight.config.run import scenario_run
    from pagedweight.config.scenario import importance_path, load_scenario
    from pagedweight.errors import ConfigError
    from pagedweight.policy.policies import POLICY_NAMES
    from pwgpu.default_model import default_model_dir
    from pwgpu.offline import run_scenario
    from pwgpu.qcache import DiskCache
    from pwgpu.served import TextPrompts, rescore

    start = time.monotonic()
    load_start = os.getloadavg()[0]

    def log(msg):
        print(f"[{time.monotonic() - start:6.0f} s] {msg}", flush=True)

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICY_NAMES]
    if bad or not policies:
        raise ConfigError(f"--policies {args.policies!r}: allowed {', '.join(POLICY_NAMES)}")
    paper = tuple(p.strip() for p in args.paper_ladder.split(",") if p.strip())
    loaded = load_scenario(args.scenario, require_latency_table=False)
    model_dir = Path(args.model or default_model_dir())
    key = _key(args, model_dir, policies, importance_path(loaded))
    runs = Path(args.runs)
    engine_dir, sim_dir, sim_paper_dir = runs / "engine", runs / "sim", runs / "sim-paper"
    times = {}

    if args.rerun or not _fresh(engine_dir, key):
        t0 = time.monotonic()
        run = scenario_run(loaded, policies)
        # paper-greedy on its own ladder: the table of the same scenario with that ladder, as
        # the simulator gets it from --set memory.precisions below.
        paper_set = [f"memory.precisions=[{', '.join(paper)}]"]
        paper_table = scenario_run(load_scenario(args.scenario, paper_set, require_latency_table=False)).table
        prompts = TextPrompts(model_dir, args.prompt_text, run.seed)
        run_scenario(
            run, model_dir, engine_dir, dtype=args.dtype, prompt_source=prompts,
            tables={"paper-greedy": paper_table}, record_logits=True,
        )  # fmt: skip
        times["engine_s"] = time.monotonic() - t0
        _stamp(engine_dir, key, times["engine_s"])
        log(f"engine run done in {times['engine_s']:.0f} s")
    else:
        times["engine_s"] = json.loads((engine_dir / "run_key.json").read_text())["run_time_s"]
        log(f"engine run reused ({engine_dir})")
    if args.rerun or not _fresh(sim_dir, key):
        t0 = time.monotonic()
        others = [p for p in policies if p != "paper-greedy"]
        base = [sys.executable, "-m", "pwsim.cli", "run", str(args.scenario), "--no-progress", "--no-report"]
        if others:
            _pwsim([*base, *sum((["--policy", p] for p in others), []), "--out", str(sim_dir)])
        if "paper-greedy" in policies:
            ladder = "[" + ", ".join(paper) + "]"
            _pwsim(
                [*base, "--policy", "paper-greedy", "--set", f"memory.precisions={ladder}", "--out", str(sim_paper_dir)]
            )
        times["sim_s"] = time.monotonic() - t0
        sim_dir.mkdir(parents=True, exist_ok=True)
        _stamp(sim_dir, key, times["sim_s"])
        log(f"simulator runs done in {times['sim_s']:.0f} s")
    else:
        times["sim_s"] = json.loads((sim_dir / "run_key.json").read_text())["run_time_s"]
    t0 = time.monotonic()
    tokens = pd.DataFrame(rescore(engine_dir, model_dir, DiskCache(args.cache_dir), progress=log))
    times["rescore_s"] = time.monotonic() - t0
    sim = _sim_results(sim_dir, sim_paper_dir)
    engine_summary = json.loads((engine_dir / "summary.json").read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_policy, per_bin, correlations = analyse(tokens, engine_summary, sim, args.time_bins, args.bootstrap)
    from pwgpu.equal_memory import write_csv

    write_csv(out / "served_quality.csv", per_policy)
    write_csv(out / "served_time.csv", per_bin)
    sc = loaded.scenario
    summary = {
        "scenario": str(args.scenario),
        "scenario_name": sc.name,
        "model": str(model_dir),
        "budget_bytes": loaded.budget_bytes,
        "workload": sc.workload.model_dump(mode="json"),
        "ladders": {p: list(paper) if p == "paper-greedy" else list(sc.memory.precisions) for p in policies},
        "prompts": list(args.prompt_text),
        "engine": {"device": engine_summary.get("gpu"), "latency_model": engine_summary.get("latency_model")},
        "importance": engine_summary.get("importance"),
        "correlations": correlations,
        "time_bins": args.time_bins,
        "bootstrap": args.bootstrap,
        "run_time_s": {k: round(v, 1) for k, v in times.items()} | {"total": round(time.monotonic() - start, 1)},
        # Wall-clock throughput depends on what else the machine runs: the 1-minute load average.
        "load_average": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()},
    }
    (out / "served_quality.json").write_text(json.dumps(_clean(summary), indent=1, default=_json) + "\n")
    from pwgpu.quality_tables import served_markdown

    (out / "served_quality.md").write_text(served_markdown(out))
    log(f"done; wrote {out}/served_quality.{{csv,json,md}} and served_time.csv")
    return 0


def _pwsim(cmd: list[str]) -> None:
    from pagedweight.errors import PagedWeightError

    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PagedWeightError(f"{' '.join(cmd[2:])} failed: {done.stderr.strip().splitlines()[-1:]}")


def _sim_results(*dirs: Path) -> dict:
    """{policy: {"summary": ..., "steps": DataFrame}} from pwsim results directories."""
    import pandas as pd

    out = {}
    for d in dirs:
        if not (d / "summary.json").is_file():
            continue
        s = json.loads((d / "summary.json").read_text())
        steps = pd.read_csv(d / "steps.csv")
        for policy, summ in s["policies"].items():
            out[policy] = {"summary": summ, "steps": steps[steps["policy"] == policy]}
    return out


def _time_avg(df, column: str) -> float:
    """Duration-weighted mean over the steps that produced tokens (each step's tokens averaged)."""
    per_step = df.groupby("step").agg(v=(column, "mean"), w=("step_duration_s", "first"))
    w = per_step["w"].to_numpy()
    return float((per_step["v"].to_numpy() * w).sum() / w.sum()) if w.sum() > 0 else float("nan")


def _settle(x, digits: int = 9) -> np.ndarray:
    """Values rounded to ``digits`` significant digits: a static map's proxy is the same sum at
    every step, added in another order, so it differs in the last bits, and ranking that
    rounding noise would report a correlation with a constant."""
    x = np.asarray(x, float)
    out = x.copy()
    ok = np.isfinite(x) & (x != 0)
    scale = 10.0 ** (digits - 1 - np.floor(np.log10(np.abs(x[ok]))))
    out[ok] = np.round(x[ok] * scale) / scale
    return out


def _spearman(a, b) -> float:
    from pwgpu.experiments import spearman

    a, b = _settle(a), _settle(b)
    ok = np.isfinite(a) & np.isfinite(b)
    return spearman(a[ok], b[ok]) if ok.sum() >= 3 else float("nan")


def _log_pearson(a, b) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    ok = (a > 0) & (b > 0)
    if ok.sum() < 3:
        return float("nan")
    la, lb = np.log10(a[ok]), np.log10(b[ok])
    if la.std() == 0 or lb.std() == 0:
        return float("nan")
    return float(np.corrcoef(la, lb)[0, 1])


def analyse(tokens, engine_summary: dict, sim: dict, bins: int, replicates: int):
    from pwgpu.bootstrap import Resampler, ratio_of_sums

    policies = list(dict.fromkeys(tokens["policy"]))
    per_request = {p: tokens[tokens["policy"] == p].groupby("request_id") for p in policies}
    rs = Resampler({p: per_request[p].ngroups for p in policies}, replicates)
    rows, bin_rows = [], []
    for p in policies:
        df = tokens[tokens["policy"] == p]
        g = per_request[p]
        n = g.size().to_numpy().astype(float)
        es = engine_summary["policies"].get(p, {})
        ss = sim.get(p, {}).get("summary", {})
        row = {"policy": p, "tokens": len(df), "requests": len(n)}
        for col, name in (("kl_engine", "kl_engine"), ("kl", "kl_replay")):
            mean, lo, hi = ratio_of_sums(rs, p, g[col].sum().to_numpy(), n)
            row |= {f"{name}_mean": mean, f"{name}_lo": lo, f"{name}_hi": hi, f"{name}_time_avg": _time_avg(df, col)}
        row |= {
            "proxy_engine_time_avg": _time_avg(df, "quality_proxy"),
            "proxy_engine_mean_all_steps": es.get("mean_quality_proxy", float("nan")),
            "proxy_sim_mean_all_steps": ss.get("mean_quality_proxy", float("nan")),
            "argmax_agree_replay": float(df["argmax_agree"].mean()),
            "map_by_time_agrees": float(df["map_by_time_agrees"].mean()),
            "transitions_engine": int(es.get("num_downgrades", 0)) + int(es.get("num_upgrades", 0)),
            "transitions_sim": int(ss.get("num_downgrades", 0)) + int(ss.get("num_upgrades", 0)),
            "output_throughput_engine": es.get("output_throughput", float("nan")),
            "output_throughput_sim": ss.get("output_throughput", float("nan")),
            "completed_engine": es.get("completed", 0),
            "completed_sim": ss.get("completed", 0),
        }
        rows.append(row)
        # Over time: equal-width bins of the engine run's token times; the simulator's proxy on
        # the same fractions of its own run.
        t = df["time_s"].to_numpy()
        edges = np.linspace(t.min(), t.max() + 1e-9, bins + 1)
        which = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
        st = sim.get(p, {}).get("steps")
        for b in range(bins):
            sel = df[which == b]
            sim_proxy = float("nan")
            if st is not None and len(st):
                ends = st["start_s"].to_numpy() + st["duration_s"].to_numpy()
                frac = (ends - ends.min()) / max(ends.max() - ends.min(), 1e-12)
                in_bin = (frac >= b / bins) & ((frac < (b + 1) / bins) | (b == bins - 1))
                if in_bin.any():
                    w = st["duration_s"].to_numpy()[in_bin]
                    sim_proxy = float((st["quality_proxy"].to_numpy()[in_bin] * w).sum() / max(w.sum(), 1e-12))
            bin_rows.append(
                {
                    "policy": p,
                    "bin": b,
                    "t_start_s": float(edges[b]),
                    "t_end_s": float(edges[b + 1]),
                    "tokens": len(sel),
                    "kl_engine": float(sel["kl_engine"].mean()) if len(sel) else float("nan"),
                    "kl_replay": float(sel["kl"].mean()) if len(sel) else float("nan"),
                    "proxy_engine": float(sel["quality_proxy"].mean()) if len(sel) else float("nan"),
                    "proxy_sim": sim_proxy,
                }
            )
    corr = {"across_policies": {}, "over_time": {}, "paired_ratios": paired_ratios(tokens, policies, replicates)}
    pairs = {
        "kl_replay vs proxy_engine": ("kl_replay_time_avg", "proxy_engine_time_avg"),
        "kl_engine vs proxy_engine": ("kl_engine_time_avg", "proxy_engine_time_avg"),
        "kl_replay vs proxy_sim": ("kl_replay_time_avg", "proxy_sim_mean_all_steps"),
        "kl_engine vs proxy_sim": ("kl_engine_time_avg", "proxy_sim_mean_all_steps"),
    }
    for name, (a, b) in pairs.items():
        x, y = [r[a] for r in rows], [r[b] for r in rows]
        corr["across_policies"][name] = {
            "n": len(rows),
            "spearman": _spearman(x, y),
            "pearson_log10": _log_pearson(x, y),
        }
    for name, (a, b) in {
        "kl_replay vs proxy_engine": ("kl_replay", "proxy_engine"),
        "kl_engine vs proxy_engine": ("kl_engine", "proxy_engine"),
        "kl_replay vs proxy_sim": ("kl_replay", "proxy_sim"),
    }.items():
        entry = {}
        for p in policies:
            sel = [r for r in bin_rows if r["policy"] == p]
            entry[p] = _spearman([r[a] for r in sel], [r[b] for r in sel])
        entry["pooled"] = _spearman([r[a] for r in bin_rows], [r[b] for r in bin_rows])
        corr["over_time"][name] = entry
    return rows, bin_rows, corr


def paired_ratios(tokens, policies: list[str], replicates: int, focus: str = "pagedweight") -> list[dict]:
    """KL of ``focus`` / KL of each other policy, paired over requests (the same prompts and the
    same number of output tokens in every policy), with bootstrap intervals."""
    from pwgpu.bootstrap import Resampler, ratio_of_sums

    if focus not in policies:
        return []
    out = []
    mine = tokens[tokens["policy"] == focus].groupby("request_id")
    for other in policies:
        if other == focus:
            continue
        theirs = tokens[tokens["policy"] == other].groupby("request_id")
        ids = sorted(set(mine.groups) & set(theirs.groups))
        if len(ids) < 2:
            continue
        rs = Resampler({"pair": len(ids)}, replicates)
        entry = {"policy": focus, "versus": other, "requests": len(ids)}
        for col, name in (("kl_engine", "kl_engine"), ("kl", "kl_replay")):
            a = mine[col].sum().loc[ids].to_numpy()
            b = theirs[col].sum().loc[ids].to_numpy()
            ratio, lo, hi = ratio_of_sums(rs, "pair", a, b)
            entry |= {f"{name}_ratio": ratio, f"{name}_ratio_lo": lo, f"{name}_ratio_hi": hi}
        out.append(entry)
    return out


def _clean(x):
    """NaN -> None (JSON has no NaN), recursively."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float | np.floating) and math.isnan(x):
        return None
    return x


def _json(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and math.isnan(x):
        return None
    raise TypeError(type(x))
