"""Quality at equal bytes actually used, with error bars: ``pwgpu equal-memory``.

Every comparison is between plans that use the same routed-expert bytes:

- **The baseline is the best uniform mix that fits**, not one format: every layer gets one
  format of the ladder (all its experts alike), chosen so that the layers' summed cost is least
  within the budget. The cost of a layer at a format is measured (KL with only that layer's
  experts at that format) on calibration text that no table was calibrated on and that is not
  the evaluation text, and costs are added across layers (the stated rule; exact by dynamic
  programming over the layers). The mix's bytes actually used, ``U``, then become the budget of
  every other method, so no method is compared at more bytes than the baseline holds.
- **Both ladders**: ours (bf16 > fp8 > int8 > int4 > int3 > int2) and the paper's FP16/INT8/INT4
  (bf16 > int8 > int4). ``paper-greedy`` runs on the paper's ladder in both tables (its own
  ladder; the paper's algorithm knows no other), at the table's ``U``.
- **Seeds**: each calibration file is cut into windows dealt round-robin to ``seeds + 1`` folds;
  seed k's importance table is calibrated on fold k alone, the last fold is the selection text
  of the uniform mix (and the oracle's text in ``pwgpu importance --folds``). A method's KL is
  the mean over seeds (the expected KL of a plan from a random calibration subset); the seed
  range is reported beside it.
- **Error bars**: paired bootstrap over blocks of ``--block-tokens`` evaluation tokens
  (``pwgpu.bootstrap``), 95% percentile intervals, for each KL, each perplexity ratio, and each
  method / uniform-mix ratio (numerator and denominator from the same drawn blocks).
- **Noise floor**: the KL between the full model computed in float64 and in float32 (fp32
  arithmetic alone), upper end of its interval. A difference between two methods is *resolved*
  only when its interval excludes 0, it exceeds the floor, and every seed has the same sign;
  else it is reported "not resolved". KLs below the floor are printed as "< floor".
- **Equivalent quality** (defined before measuring): perplexity at most ``1 + --ppl-tolerance``
  times full precision on every evaluation domain. On a grid of budgets (evaluated upwards until
  the upper end of the interval meets it, assuming more bytes never hurt beyond), the least
  budget from which every evaluated budget meets it, for ``marginal`` (seed mean) and the
  uniform mix, with a bootstrap interval of that least budget.

Evaluations and tables are cached on disk (``pwgpu.qcache``): a stopped run resumes, and a
rerun recomputes only what changed. Run times are printed and recorded.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

OUR_LADDER = ("bf16", "fp8", "int8", "int4", "int3", "int2")
PAPER_LADDER = ("bf16", "int8", "int4")  # the paper's FP16/INT8/INT4, on a bf16 checkpoint
LADDERS = {"ours": OUR_LADDER, "paper": PAPER_LADDER}
METHODS = ("uniform-mix", "frequency", "paper-greedy", "marginal", "exact")
FRACTIONS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.75)
EQUIVALENCE_FRACTIONS = (0.0, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # 0: the ladder's floor
BASELINE = "uniform-mix"


# ------------------------------------------------------------------------------------------
# The uniform mix
# ------------------------------------------------------------------------------------------


def best_layer_mix(cost: np.ndarray, layer_bytes: np.ndarray, budget_bytes: int) -> tuple[np.ndarray, int, float]:
    """One format per layer minimising the summed ``cost[l, f]`` with ``sum layer_bytes[l, f] <=
    budget_bytes``; ties go to fewer bytes... then to the earlier (more precise) format.
    Dynamic programming over layers, keeping only the (bytes, cost) states no other dominates.
    Returns (format index per layer, bytes, cost); raises ValueError when nothing fits."""
    states: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for layer in range(cost.shape[0]):
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for b, (c, choice) in states.items():
            for f in range(cost.shape[1]):
                nb, nc = b + int(layer_bytes[layer, f]), c + float(cost[layer, f])
                if nb > budget_bytes:
                    continue
                old = nxt.get(nb)
                if old is None or nc < old[0]:
                    nxt[nb] = (nc, (*choice, f))
        # Drop dominated states: more bytes for no less cost.
        kept, best = {}, math.inf
        for b in sorted(nxt):
            if nxt[b][0] < best:
                kept[b], best = nxt[b], nxt[b][0]
        states = kept
    if not states:
        raise ValueError(f"no per-layer format assignment fits in {budget_bytes} bytes")
    b = min(states, key=lambda k: (states[k][0], k))
    return np.array(states[b][1]), b, states[b][0]


def layer_costs(model, sel: dict[str, np.ndarray], window: int, cache) -> np.ndarray:
    """(L, len(OUR_LADDER)) mean KL per token on ``sel`` with every expert of one layer at one
    format and the rest at full precision; a forward restarts at that layer from cached hidden
    states. Other ladders take their columns (``ladder_columns``)."""
    import torch

    from pwgpu.evaluate import MASTER, ScoredReference, windows

    key = cache.key("layer-costs", cache.model_key(model.model_dir), OUR_LADDER, window, *sorted(sel.items()))
    hit = cache.load(key)
    if hit is not None:
        return hit["cost"]
    t0 = time.monotonic()
    model.reset()
    rows = [r for ids in sel.values() for r in windows(ids, window)]
    cost = np.zeros((model.num_layers, len(OUR_LADDER)))
    with torch.no_grad():
        cached = [model.layer_inputs(r) for r in rows]
        ref = [ScoredReference(model.run_from(0, h[0], rope)) for h, rope in cached]
        tokens = sum(int(r.shape[1]) for r in rows)
        for layer in range(model.num_layers):
            for j, p in enumerate(OUR_LADDER):
                if p == MASTER:
                    continue
                for e in range(model.num_experts):
                    model.set_precision(layer, e, p)
                kl = sum(
                    float(r.kl(model.run_from(layer, h[layer], rope))[0].sum())
                    for (h, rope), r in zip(cached, ref, strict=True)
                )
                cost[layer, j] = kl / tokens
            for e in range(model.num_experts):
                model.set_precision(layer, e, MASTER)
    cache.save(key, time.monotonic() - t0, cost=cost)
    return cost


def ladder_columns(cost: np.ndarray, ladder: tuple[str, ...]) -> np.ndarray:
    return cost[:, [OUR_LADDER.index(p) for p in ladder]]


# ------------------------------------------------------------------------------------------
# Evaluation with a cache
# ------------------------------------------------------------------------------------------


@dataclass
class Evaluator:
    model: object
    ref: object
    block_tokens: int
    cache: object
    data_key: str
    log: object
    evaluations: int = 0
    cached: int = 0

    def __call__(self, plan: np.ndarray) -> dict:
        """``{domain: BlockStats}`` for a plan ([L, E] precision names), from the cache if there."""
        from pwgpu.evaluate import BlockStats, evaluate_blocks

        key = self.cache.key("plan-blocks", self.data_key, plan.reshape(-1).tolist())
        hit = self.cache.load(key)
        if hit is not None:
            self.cached += 1
            domains = sorted({k.split(".")[0] for k in hit})
            return {
                d: BlockStats(**{f: hit[f"{d}.{f}"] for f in ("tokens", "kl", "nll_full", "nll_plan")}) for d in domains
            }
        t0 = time.monotonic()
        stats = evaluate_blocks(self.model, self.ref, plan, self.block_tokens)
        self.evaluations += 1
        self.cache.save(
            key,
            time.monotonic() - t0,
            **{f"{d}.{f}": getattr(s, f) for d, s in stats.items() for f in ("tokens", "kl", "nll_full", "nll_plan")},
        )
        self.log(f"  evaluated a plan in {time.monotonic() - t0:.1f} s")
        return stats


def plan_names(table, plan) -> np.ndarray:
    return np.array(plan.ladder, dtype=object)[plan.levels].reshape(table.num_layers, table.num_experts)


def mix_plan(model, ladder, choice) -> np.ndarray:
    return np.array([[ladder[f]] * model.num_experts for f in choice], dtype=object)


# ------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------


def seed_mean(stats: list[dict]) -> dict:
    """Per-block mean over seeds' ``{domain: BlockStats}`` (same blocks in each)."""
    from pwgpu.evaluate import BlockStats

    out = {}
    for d in stats[0]:
        out[d] = BlockStats(
            tokens=stats[0][d].tokens,
            kl=np.mean([s[d].kl for s in stats], axis=0),
            nll_full=stats[0][d].nll_full,
            nll_plan=np.mean([s[d].nll_plan for s in stats], axis=0),
        )
    return out


def quality_row(rs, domain: str, s) -> dict:
    """KL and perplexity ratio with intervals for one domain's BlockStats."""
    from pwgpu.bootstrap import interval

    kl, kl_lo, kl_hi = _ratio(rs, domain, s.kl, s.tokens)
    n = float(s.tokens.sum())
    ratio = math.exp((float(s.nll_plan.sum()) - float(s.nll_full.sum())) / n)
    reps = np.exp((rs.sums(domain, s.nll_plan) - rs.sums(domain, s.nll_full)) / rs.sums(domain, s.tokens))
    lo, hi = interval(reps)
    return {
        "tokens": int(n),
        "kl": kl,
        "kl_lo": kl_lo,
        "kl_hi": kl_hi,
        "ppl_full": math.exp(float(s.nll_full.sum()) / n),
        "ppl_ratio": ratio,
        "ppl_ratio_lo": lo,
        "ppl_ratio_hi": hi,
    }


def _ratio(rs, domain, num, den):
    from pwgpu.bootstrap import ratio_of_sums

    return ratio_of_sums(rs, domain, num, den)


def compare(rs, domain: str, a: list[dict], b: list[dict], floor: float) -> dict:
    """Method a against method b (lists of per-seed ``{domain: BlockStats}``; b may have one
    entry, the seedless uniform mix): ratio and difference of seed-mean KL, paired."""
    from pwgpu.bootstrap import interval

    sa, sb = seed_mean(a)[domain], seed_mean(b)[domain]
    tokens = sa.tokens
    ratio, r_lo, r_hi = _ratio(rs, domain, sa.kl, sb.kl)
    diff = float((sa.kl.sum() - sb.kl.sum()) / tokens.sum())
    d_lo, d_hi = interval((rs.sums(domain, sa.kl) - rs.sums(domain, sb.kl)) / rs.sums(domain, tokens))
    per_seed = []
    for s in a:
        b_kl = sb.kl.sum()
        per_seed.append(float(s[domain].kl.sum() / b_kl) if b_kl > 0 else float("nan"))
    signs = {np.sign(r - 1) for r in per_seed}
    if not (d_lo > 0 or d_hi < 0):
        verdict = "not resolved: the interval of the difference contains 0"
    elif abs(diff) <= floor:
        verdict = f"not resolved: |difference| {abs(diff):.2g} is below the noise floor {floor:.2g}"
    elif len(signs) > 1:
        verdict = "not resolved: the seeds disagree in sign"
    else:
        verdict = "resolved"
    return {
        "ratio": ratio,
        "ratio_lo": r_lo,
        "ratio_hi": r_hi,
        "diff": diff,
        "diff_lo": d_lo,
        "diff_hi": d_hi,
        "seed_ratio_min": min(per_seed),
        "seed_ratio_max": max(per_seed),
        "resolved": verdict == "resolved",
        "verdict": verdict,
    }


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="models/tiny-moe")
    ap.add_argument("--eval", nargs="+", default=["data/eval/code.txt", "data/eval/shakespeare.txt"])
    ap.add_argument("--calib", nargs="+", default=["data/calib/code.txt", "data/calib/shakespeare.txt"])
    ap.add_argument("--out", default="reports/quality", help="directory for equal_memory.{csv,json,md} and tables/")
    ap.add_argument("--seeds", type=int, default=3, help="calibration subsets (disjoint folds), >= 1 (default 3)")
    ap.add_argument("--calib-window", type=int, default=256, help="tokens per calibration window and fold unit")
    ap.add_argument(
        "--calib-tokens",
        type=int,
        default=None,
        help="calibration tokens per domain per seed (default: the whole fold)",
    )
    ap.add_argument("--selection-tokens", type=int, default=2048, help="tokens per domain choosing the uniform mix")
    ap.add_argument("--max-eval-tokens", type=int, default=4096, help="evaluation tokens per domain (default 4096)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per evaluation window")
    ap.add_argument("--block-tokens", type=int, default=128, help="bootstrap block (default 128 tokens)")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap replicates (default 2000)")
    ap.add_argument(
        "--fractions", default=",".join(map(str, FRACTIONS)), help="budgets, fractions of bf16 expert bytes"
    )
    ap.add_argument("--ladders", default="ours,paper")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--ppl-tolerance", type=float, default=0.005, help="'equivalent quality': ppl <= (1 + this) x full")
    ap.add_argument("--equivalence-fractions", default=",".join(map(str, EQUIVALENCE_FRACTIONS)),
                    help="grid for the least equivalent budget (0: all at the ladder's lowest format)")  # fmt: skip
    ap.add_argument("--no-noise-floor", action="store_true", help="skip the float64 reference (tests)")
    ap.add_argument("--cache-dir", default=None, help="disk cache (default $PAGEDWEIGHT_CACHE or ~/.cache/pagedweight)")
    ap.add_argument("--threads", type=int, default=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def _csv_list(text: str, allowed, what: str) -> list[str]:
    from pagedweight.errors import ConfigError

    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ConfigError(f"--{what} {text!r}: allowed {', '.join(allowed)}")
    return items


def _fractions(text: str, what: str) -> list[float]:
    from pagedweight.errors import ConfigError

    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--{what} {text!r}: a comma list of numbers in [0, 1]") from None
    if not out or any(not 0 <= f <= 1 for f in out):
        raise ConfigError(f"--{what} {text!r}: a comma list of numbers in [0, 1]")
    return sorted(out)


def seed_tables(model, texts: dict[str, np.ndarray], args, cache, log) -> list:
    """One importance table per seed, calibrated on fold k of ``seeds + 1`` (cached)."""
    from pagedweight.policy.importance import read_table, write_table
    from pwgpu.importance import build_table, calibrate, fold_tokens

    folds = args.seeds + 1
    tables = []
    for k in range(args.seeds):
        data = {d: fold_tokens(ids, args.calib_window, folds, [k]) for d, ids in texts.items()}
        tokens = args.calib_tokens or max(len(v) for v in data.values())
        key = cache.key("table", cache.model_key(model.model_dir), args.calib_window, tokens, *sorted(data.items()))
        path = cache.root / f"{key}.csv"
        if not path.is_file() or cache.load(f"{key}-time") is None:
            t0 = time.monotonic()
            est = calibrate(model, data, tokens, args.calib_window)
            table, _ = build_table(
                model,
                est,
                model_name=Path(args.model).resolve().name,
                source=f"seed {k}: calibration fold {k} of {folds}",
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            write_table(table, path)
            cache.save(f"{key}-time", time.monotonic() - t0)
            log(f"seed {k}: calibrated on {est.tokens:,} tokens in {time.monotonic() - t0:.0f} s")
        tables.append(read_table(path))
    return tables


def noise_floor(args, ref, full, rs, cache, data_key: str, log) -> dict[str, dict]:
    """fp32 arithmetic's own KL per domain: the float64 model against the float32 reference
    (cached), with its bootstrap interval."""
    import torch

    from pwgpu.evaluate import MoeForward, block_sums, kl_per_position

    key = cache.key("noise-floor", data_key)
    hit = cache.load(key)
    if hit is None:
        t0 = time.monotonic()
        exact = MoeForward(args.model, dtype=torch.float64)
        stats = {}
        for d, rows in ref.rows.items():
            kl = []
            for row, ref_logits in zip(rows, ref.ref[d], strict=True):
                with torch.no_grad():
                    kl.append(
                        block_sums(kl_per_position(exact.logits(row)[0, :-1], ref_logits[0, :-1]), args.block_tokens)
                    )
            stats[d] = np.concatenate(kl)
        del exact
        cache.save(key, time.monotonic() - t0, **stats)
        hit = stats
        log("noise floor measured (float64 forward)")
    floor = {}
    for d, s in full.items():
        point, lo, hi = _ratio(rs, d, hit[d], s.tokens)
        floor[d] = {"kl": point, "kl_lo": lo, "kl_hi": hi}
    return floor


@dataclass(frozen=True)
class Cell:
    """One comparison: a ladder at a target fraction, every method at the uniform mix's bytes."""

    ladder: str
    target_fraction: float
    baseline_bytes: int  # U: the uniform mix's bytes actually used, every method's budget
    expert_bytes_bf16: int


def _methods_at(cell: Cell, methods, evaluate, baseline_plan, ladder_tables, paper_tables, log) -> tuple:
    """Each method's evaluations (one per seed's table), bytes used and expert counts at the
    cell's budget; a method infeasible for any seed is left out (and logged)."""
    from pagedweight.errors import AllocationError
    from pagedweight.policy.allocate import allocate

    per_method: dict[str, list[dict]] = {BASELINE: [evaluate(baseline_plan)]}
    bytes_used: dict[str, list[int]] = {BASELINE: [cell.baseline_bytes]}
    counts: dict[str, list[str]] = {}
    for method in methods:
        if method == BASELINE:
            continue
        src = paper_tables if method == "paper-greedy" else ladder_tables
        stats, used_m, cnt = [], [], []
        for t in src:
            try:
                plan = allocate(t, cell.baseline_bytes, method)
            except AllocationError as e:
                log(f"{cell.ladder} {cell.target_fraction:.2f} {method}: infeasible ({e})")
                stats = []
                break
            stats.append(evaluate(plan_names(t, plan)))
            used_m.append(plan.total_bytes)
            cnt.append(" ".join(f"{p}:{c}" for p, c in plan.counts().items() if c))
        if stats:
            per_method[method], bytes_used[method], counts[method] = stats, used_m, cnt
    return per_method, bytes_used, counts


def _cell_rows(cell: Cell, per_method, bytes_used, counts, rs, full, floor_of, has_floor: bool) -> tuple:
    """The cell's rows of ``equal_memory.csv`` (method x domain) and of ``equal_memory_ratios.csv``
    (each method against the uniform mix)."""
    rows, ratio_rows = [], []
    for method, stats in per_method.items():
        mean = seed_mean(stats)
        for d in full:
            q = quality_row(rs, d, mean[d])
            seeds_kl = [float(s[d].kl.sum() / s[d].tokens.sum()) for s in stats]
            rows.append(
                {
                    "ladder": cell.ladder,
                    "method_ladder": "paper" if method == "paper-greedy" else cell.ladder,
                    "target_fraction": cell.target_fraction,
                    "method": method,
                    "seeds": len(stats),
                    "bytes_used_max": max(bytes_used[method]),
                    "fraction_used_max": max(bytes_used[method]) / cell.expert_bytes_bf16,
                    "baseline_bytes": cell.baseline_bytes,
                    "domain": d,
                    **q,
                    "kl_seed_min": min(seeds_kl),
                    "kl_seed_max": max(seeds_kl),
                    "below_noise_floor": bool(q["kl"] <= floor_of[d]) if has_floor else False,
                    "counts": " | ".join(counts[method]),
                }
            )
            if method != BASELINE:
                ratio_rows.append(
                    {
                        "ladder": cell.ladder,
                        "target_fraction": cell.target_fraction,
                        "baseline_bytes": cell.baseline_bytes,
                        "method": method,
                        "domain": d,
                        "kl_method": float(mean[d].kl.sum() / mean[d].tokens.sum()),
                        "kl_uniform_mix": float(per_method[BASELINE][0][d].kl.sum() / mean[d].tokens.sum()),
                        **compare(rs, d, stats, per_method[BASELINE], floor_of[d]),
                    }
                )
    return rows, ratio_rows


def _settings(args, evals, full, calib, selection, fractions, ladders) -> dict:
    """What the run was asked and what it read, for ``equal_memory.json``."""
    from pwgpu.importance import fold_tokens
    from pwgpu.qcache import DiskCache

    return {
        "model": args.model,
        "model_sha256": DiskCache.model_key(args.model),
        "eval_tokens": {d: int(len(v)) for d, v in evals.items()},
        "scored_tokens": {d: int(s.tokens.sum()) for d, s in full.items()},
        "seeds": args.seeds,
        "folds": args.seeds + 1,
        "calib_tokens_per_seed": {
            d: int(len(fold_tokens(ids, args.calib_window, args.seeds + 1, [0]))) for d, ids in calib.items()
        },
        "selection_tokens": {d: int(len(v)) for d, v in selection.items()},
        "window": args.window,
        "block_tokens": args.block_tokens,
        "bootstrap": args.bootstrap,
        "fractions": fractions,
        "ladders": {n: list(LADDERS[n]) for n in ladders},
        "ppl_tolerance": args.ppl_tolerance,
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedweight.errors import ConfigError
    from pagedweight.policy.importance import on_ladder, write_table
    from pwgpu.bootstrap import Resampler
    from pwgpu.evaluate import MoeForward, ReferenceCache, load_tokens
    from pwgpu.importance import fold_tokens
    from pwgpu.qcache import DiskCache

    if args.seeds < 1:
        raise ConfigError(f"--seeds {args.seeds}: must be >= 1")
    ladders = _csv_list(args.ladders, LADDERS, "ladders")
    methods = _csv_list(args.methods, METHODS, "methods")
    if BASELINE not in methods:
        methods.insert(0, BASELINE)
    fractions = _fractions(args.fractions, "fractions")
    eq_fractions = _fractions(args.equivalence_fractions, "equivalence-fractions")
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    load_start = os.getloadavg()[0]

    def log(msg):
        print(f"[{time.monotonic() - start:6.0f} s] {msg}", flush=True)

    cache = DiskCache(args.cache_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = MoeForward(args.model)
    calib = {Path(f).stem: load_tokens(args.model, f) for f in args.calib}
    evals = {Path(f).stem: load_tokens(args.model, f, args.max_eval_tokens) for f in args.eval}
    tables = seed_tables(model, calib, args, cache, log)
    (out / "tables").mkdir(exist_ok=True)
    for k, t in enumerate(tables):
        write_table(t, out / "tables" / f"seed{k}.csv")
    selection = {
        d: fold_tokens(ids, args.calib_window, args.seeds + 1, [args.seeds])[: args.selection_tokens]
        for d, ids in calib.items()
    }

    ref = ReferenceCache(model, evals, args.window, cache)
    data_key = cache.key("eval", cache.model_key(args.model), args.window, args.block_tokens, *sorted(evals.items()))
    evaluate = Evaluator(model, ref, args.block_tokens, cache, data_key, log)
    full = evaluate(np.full((model.num_layers, model.num_experts), "bf16", dtype=object))
    rs = Resampler({d: len(s.tokens) for d, s in full.items()}, args.bootstrap)
    log(f"reference ready: {', '.join(f'{d} {s.tokens.sum():.0f} tokens' for d, s in full.items())}")

    floor = {} if args.no_noise_floor else noise_floor(args, ref, full, rs, cache, data_key, log)
    floor_of = {d: (floor[d]["kl_hi"] if floor else 0.0) for d in full}

    expert_bytes_bf16 = int(tables[0].bytes[:, 0].sum())
    pinned = model.embed.numel() + model.lm_head.numel() + model.norm.numel()
    pinned += sum(t.numel() for lw in model.layers for t in lw.values())
    pinned_bytes = 2 * int(pinned)

    t0 = time.monotonic()
    all_costs = layer_costs(model, selection, args.calib_window, cache)
    log(f"per-layer costs of the uniform mix ready ({time.monotonic() - t0:.0f} s)")
    rows, ratio_rows, mixes = [], [], {}
    for ladder_name in ladders:
        ladder = LADDERS[ladder_name]
        ladder_tables = [on_ladder(t, ladder) for t in tables]
        paper_tables = [on_ladder(t, PAPER_LADDER) for t in tables]
        per_expert = ladder_tables[0].bytes[0]  # bytes of one expert at each format (all alike here)
        layer_bytes = np.broadcast_to(per_expert * model.num_experts, (model.num_layers, len(ladder)))
        cost = ladder_columns(all_costs, ladder)
        for frac in fractions:
            try:
                choice, used, _ = best_layer_mix(cost, layer_bytes, int(frac * expert_bytes_bf16))
            except ValueError:
                log(f"{ladder_name} {frac:.2f}: no uniform mix fits; skipped")
                continue
            mixes[(ladder_name, frac)] = {
                "layers": [ladder[f] for f in choice],
                "bytes": int(used),
                "fraction": used / expert_bytes_bf16,
            }
            cell = Cell(ladder_name, frac, int(used), expert_bytes_bf16)
            per_method, bytes_used, counts = _methods_at(
                cell, methods, evaluate, mix_plan(model, ladder, choice), ladder_tables, paper_tables, log
            )
            counts[BASELINE] = [" ".join(f"{ladder[f]}:{model.num_experts}" for f in choice)]
            new_rows, new_ratios = _cell_rows(cell, per_method, bytes_used, counts, rs, full, floor_of, bool(floor))
            rows += new_rows
            ratio_rows += new_ratios
            log(
                f"{ladder_name} {frac:.2f}: uniform mix {'/'.join(ladder[f] for f in choice)} "
                f"at {used / expert_bytes_bf16:.3f}"
            )

    equivalence = equivalent_budgets(
        model,
        tables,
        evaluate,
        rs,
        full,
        eq_fractions,
        args.ppl_tolerance,
        expert_bytes_bf16,
        cache,
        selection,
        args,
        log,
    )
    run_time = time.monotonic() - start
    summary = {
        "settings": _settings(args, evals, full, calib, selection, fractions, ladders),
        "expert_bytes_bf16": expert_bytes_bf16,
        "pinned_bytes_bf16": pinned_bytes,
        "noise_floor": floor,
        "uniform_mix": [{"ladder": k[0], "target_fraction": k[1], **v} for k, v in mixes.items()],
        "equivalence": equivalence,
        "evaluations": {"computed": evaluate.evaluations, "from_cache": evaluate.cached},
        "run_time_s": round(run_time, 1),
        # What every result cost to compute, cached ones included (a rerun from the cache is
        # fast; this is what a fresh run takes, up to loading the model and the texts).
        "compute_time_s": round(cache.spent_s, 1),
        # Wall clock on a shared machine depends on what else runs: the 1-minute load average.
        "load_average": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()},
    }
    write_csv(out / "equal_memory.csv", rows)
    write_csv(out / "equal_memory_ratios.csv", ratio_rows)
    (out / "equal_memory.json").write_text(json.dumps(summary, indent=1, default=_json) + "\n")
    from pwgpu.quality_tables import equal_memory_markdown

    (out / "equal_memory.md").write_text(equal_memory_markdown(out))
    log(
        f"done in {run_time:.0f} s ({evaluate.evaluations} plans evaluated, {evaluate.cached} from the cache); "
        f"wrote {out}"
    )
    return 0


def equivalent_budgets(
    model, tables, evaluate, rs, full, grid, tol, expert_bytes_bf16, cache, selection, args, log
) -> dict:
    """The least grid budget from which on a method keeps perplexity within ``1 + tol`` of full
    precision on every domain (seed mean for ``marginal``), with a bootstrap interval; grid
    points are evaluated upwards until one meets it at the upper end of its interval."""
    from pagedweight.errors import AllocationError
    from pagedweight.policy.allocate import allocate
    from pagedweight.policy.importance import on_ladder

    out = {"criterion": f"perplexity <= {1 + tol:g} x full precision on every domain", "methods": {}}
    ladder = OUR_LADDER
    lowest = float(tables[0].bytes[:, -1].sum() / expert_bytes_bf16)
    cost = layer_costs(model, selection, args.calib_window, cache)
    per_expert = on_ladder(tables[0], ladder).bytes[0]
    layer_bytes = np.broadcast_to(per_expert * model.num_experts, (model.num_layers, len(ladder)))
    for method in ("marginal", BASELINE):
        points = []
        for frac in grid:
            budget = int(max(frac, lowest) * expert_bytes_bf16)
            if method == BASELINE:
                choice, used, _ = best_layer_mix(cost, layer_bytes, budget)
                stats = [evaluate(mix_plan(model, ladder, choice))]
            else:
                try:
                    plans = [allocate(on_ladder(t, ladder), budget, method) for t in tables]
                except AllocationError:
                    continue
                stats = [evaluate(plan_names(t, p)) for t, p in zip(tables, plans, strict=True)]
                used = max(p.total_bytes for p in plans)
            mean = seed_mean(stats)
            q = {d: quality_row(rs, d, mean[d]) for d in full}
            reps = np.max(
                [
                    np.exp((rs.sums(d, mean[d].nll_plan) - rs.sums(d, mean[d].nll_full)) / rs.sums(d, mean[d].tokens))
                    for d in full
                ],
                axis=0,
            )
            points.append(
                {
                    "fraction": used / expert_bytes_bf16,
                    "bytes": int(used),
                    "ppl_ratio": {d: q[d]["ppl_ratio"] for d in full},
                    "ppl_ratio_hi": {d: q[d]["ppl_ratio_hi"] for d in full},
                    "kl": {d: q[d]["kl"] for d in full},
                    "meets": bool(max(q[d]["ppl_ratio"] for d in full) <= 1 + tol),
                    "_reps": reps,
                }
            )
            log(
                f"equivalence {method} at {used / expert_bytes_bf16:.3f}: "
                f"worst ppl ratio {max(q[d]['ppl_ratio'] for d in full):.5f}"
            )
            if max(q[d]["ppl_ratio_hi"] for d in full) <= 1 + tol:
                break  # more bytes are assumed never to hurt: the rest of the grid meets it too
        # The least budget from which every evaluated budget meets the criterion (not merely the
        # first that does: with sampling noise a lucky low budget can pass while higher ones fail).
        # Past the last point the grid is assumed to meet it when that point met it at its
        # interval's upper end (the loop stopped there); otherwise the grid ran out: infinity.
        if not points:  # no budget of the grid could be planned
            out["methods"][method] = {"least_fraction": None, "least_fraction_lo": None,
                                      "least_fraction_hi": None, "points": []}  # fmt: skip
            continue
        fr = np.array([p["fraction"] for p in points] + [math.inf])
        stopped = bool(points) and max(points[-1]["ppl_ratio_hi"].values()) <= 1 + tol
        if stopped:
            fr[-1] = fr[-2]
        meets = np.array([p["meets"] for p in points] + [stopped])
        least_i = _least_suffix(meets[:, None])[0]
        least = None if math.isinf(fr[least_i]) else float(fr[least_i])
        ok = np.array([p["_reps"] <= 1 + tol for p in points]).reshape(len(points), -1)  # (points, replicates)
        ok = np.vstack([ok, np.full((1, ok.shape[1]), stopped)])
        least_reps = fr[_least_suffix(ok)]
        lo, hi = (float(np.percentile(least_reps, 2.5)), float(np.percentile(least_reps, 97.5)))
        lo, hi = (None if math.isinf(lo) else lo), (None if math.isinf(hi) else hi)
        for p in points:
            del p["_reps"]
        out["methods"][method] = {
            "least_fraction": least,
            "least_fraction_lo": lo,
            "least_fraction_hi": hi,
            "points": points,
        }
    return out


def _least_suffix(ok: np.ndarray) -> np.ndarray:
    """Per column of ``ok`` (points x replicates, the last row the assumption past the grid):
    the first row from which every row is True (the last row's index when none is)."""
    suffix = np.flip(np.logical_and.accumulate(np.flip(ok, 0), 0), 0)
    return np.where(suffix.any(axis=0), suffix.argmax(axis=0), ok.shape[0] - 1)


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        path.write_text("")
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(v) for k, v in r.items()})


def _cell(v):
    return repr(float(v)) if isinstance(v, float | np.floating) else v


def _json(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x))


if __name__ == "__main__":
    raise SystemExit(main())
