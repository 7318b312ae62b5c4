"""Where a real engine step's time goes, op by op, against what the latency table says for it.

    python3 benchmarks/step_breakdown.py [--scenario scenarios/cpu_validate.yaml]
        [--policy pagedweight] [--table KERNELS.csv] [--out DIR] [--replay-moe]

Serves one policy of a scenario with the engine in this process, its ops wrapped in timers
(attention with its KV write, the rest of each layer, the experts, the LM head with sampling,
the dequantisation of experts into the CPU path's fp32 copies, the writes of precision changes,
the engine's host work inside and between steps), and times every step's shape, routing and
precision changes by the table (``--table``; default: measured now with ``pwgpu profile
--scenario``, so the table and the run see the machine in the same state). Prints the totals
and the median per step shape of measured and table time per op: which op the table misses,
and at which batch sizes, independent of how a simulated schedule would drift from the real one.
Wall-clock figures depend on the machine's load: run it on quiet cores, or with
OMP_NUM_THREADS=1 where other jobs share them.

``--replay-moe`` asks instead whether the table's way of timing the experts is the engine's:
during a real run, each MoE call is timed as it ran, then run again at once (warm), then after
the profiler's cold flush, then in the profiler's own form (every routed expert given the mean
count of tokens, fresh activations, cold), all at the same moment; medians by the call's tokens.
The replays slow the run down, so its schedule is not a plain run's; each call is compared only
with its own replays.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
# (measured, table) column pairs, in the order printed.
OPS = ("attention", "dense", "moe", "head", "dequantize", "transitions", "host_in_step")
# What _instrument times, seconds per step.
TIMERS = ("attn", "kv_write", "moe_call", "dequantize", "forward", "logits", "sample", "downgrade", "upgrade")


def _instrument():
    """Wrap the engine's ops in timers; returns (per-step rows, the open step's accumulator)."""
    import pwgpu.attention as attention
    import pwgpu.engine as engine
    import pwgpu.kernels.paging as paging
    import pwgpu.model as model
    import pwgpu.weights as weights

    acc: dict[str, float] = defaultdict(float)
    deq_calls: list[tuple[str, int, int]] = []  # (precision, n, k) of each matrix dequantised
    writes: list[int] = []  # target precision id of each expert written (downgrade or upgrade)

    def wrap(obj, name, key, before=None):
        fn = getattr(obj, name)

        def timed(*a, **k):
            if before is not None:
                before(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def note_dequant(experts, e, j, dtype=None):
        n, k = experts.matrix_shape(j)
        deq_calls.append((experts.precisions[e], n, k))

    wrap(model, "paged_attention", "attn")
    wrap(attention.PagedKvCache, "write", "kv_write")
    wrap(weights.WeightStore, "moe_ffn", "moe_call")
    wrap(paging.PagedExperts, "dequantize_matrix", "dequantize", before=note_dequant)
    wrap(model.MoeTransformer, "forward", "forward")
    wrap(model.MoeTransformer, "logits", "logits")
    wrap(engine, "sample", "sample")
    wrap(weights.WeightStore, "downgrade", "downgrade", before=lambda store, t: writes.append(t.to_id))
    wrap(weights.WeightStore, "start_upgrade", "upgrade", before=lambda store, t: writes.append(t.to_id))
    return acc, deq_calls, writes


def serve(scenario: str, policy: str, out_dir: Path) -> pd.DataFrame:
    """Serve ``policy`` with timers on; one row per recorded step."""
    import pagedweight.core.runtime as runtime
    import pwgpu.engine as engine
    from pagedweight.config.run import scenario_run
    from pagedweight.config.scenario import load_scenario
    from pwgpu.default_model import default_model_dir, random_model_dir
    from pwgpu.offline import run_scenario

    acc, deq_calls, writes = _instrument()
    rows: list[dict] = []
    pending: dict = {}
    record_step, observe = runtime.RuntimeCore.record_step, runtime.RuntimeCore.observe_routing
    engine_step = engine.Engine.step
    last_end = [None]

    def observe_routing(self, tokens):
        pending["routing"] = tokens.copy()
        pending["precisions"] = self.precision_grid.copy()
        return observe(self, tokens)

    def on_record(self, start_s, duration_s, batch, shape, bytes_swapped=0):
        pending.update(
            start_s=start_s, duration_s=duration_s, chunks=list(shape.prefill_tokens),
            chunk_kv=list(shape.prefill_kv_lens), decode_kv=list(shape.decode_kv_lens),
            downgrades=self._counters[0], upgrades=self._counters[1],
        )  # fmt: skip
        return record_step(self, start_s, duration_s, batch, shape, bytes_swapped)

    def step(self):
        acc.clear()
        deq_calls.clear()
        writes.clear()
        pending.clear()
        t0 = time.perf_counter()
        ran = engine_step(self)
        if ran:
            end = time.perf_counter()
            gap = None if last_end[0] is None else t0 - last_end[0]
            last_end[0] = end
            rows.append(
                {**pending, **acc, "gap_before_s": gap, "dequantized": list(deq_calls), "written": list(writes)}
            )
        return ran

    runtime.RuntimeCore.observe_routing = observe_routing
    runtime.RuntimeCore.record_step = on_record
    engine.Engine.step = step
    loaded = load_scenario(scenario, require_latency_table=False)
    model_dir = default_model_dir() if loaded.scenario.model == "tiny-moe" else random_model_dir(loaded.model, None)
    run_scenario(scenario_run(loaded, [policy]), model_dir, out_dir, report=False)
    return pd.DataFrame(rows)


def replay_moe(scenario: str, policy: str, out_dir: Path) -> pd.DataFrame:
    """Serve ``policy``, replaying each MoE call (see the module docstring); one row per call."""
    import torch

    import pwgpu.weights as weights
    from pagedweight.config.run import scenario_run
    from pagedweight.config.scenario import load_scenario
    from pwgpu.cpu_kernels import moe_ffn_grouped
    from pwgpu.default_model import default_model_dir, random_model_dir
    from pwgpu.offline import run_scenario
    from pwgpu.profile import _flush

    rows: list[dict] = []
    moe_ffn = weights.WeightStore.moe_ffn
    cpu = torch.device("cpu")

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def replayed(self, layer, x, topk_ids, topk_w):
        t0 = time.perf_counter()
        out = moe_ffn(self, layer, x, topk_ids, topk_w)
        ran_s = time.perf_counter() - t0
        again = lambda: moe_ffn(self, layer, x, topk_ids, topk_w)  # noqa: E731
        warm_s = timed(again)
        _flush(cpu, None)
        cold_s = timed(again)
        # The profiler's form (pwgpu/profile.py, moe_ffn): the routed experts, m tokens each.
        counts = torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts).tolist()
        used = [e for e, c in enumerate(counts) if c]
        m = max(1, round(sum(counts) / len(used)))
        dense = self._dense[layer]
        xe = torch.randn(m * len(used), x.shape[1], dtype=x.dtype)
        ids = torch.arange(len(used)).repeat_interleave(m)[:, None]
        w13, w2 = [dense[e][1] for e in used], [dense[e][2] for e in used]
        _flush(cpu, None)
        form_s = timed(lambda: moe_ffn_grouped(xe, ids, torch.ones(len(ids), 1), w13, w2, [m] * len(used),
                                               self.activation))  # fmt: skip
        rows.append(dict(tokens=x.shape[0], ran_s=ran_s, warm_s=warm_s, cold_s=cold_s, table_form_s=form_s))
        return out

    loaded = load_scenario(scenario, require_latency_table=False)
    if loaded.scenario.gpu != "cpu":
        raise SystemExit(f"{scenario}: gpu is {loaded.scenario.gpu!r}; --replay-moe times the CPU engine's MoE path")
    model_dir = default_model_dir() if loaded.scenario.model == "tiny-moe" else random_model_dir(loaded.model, None)
    weights.WeightStore.moe_ffn = replayed
    run_scenario(scenario_run(loaded, [policy]), model_dir, out_dir, report=False)
    return pd.DataFrame(rows)


def print_replays(calls: pd.DataFrame) -> None:
    edges = [0, 4, 8, 16, 256, 512, 1 << 30]
    calls["bucket"] = pd.cut(calls["tokens"], edges, labels=["1-4", "5-8", "9-16", "17-256", "257-512", ">512"])
    med = calls.groupby("bucket", observed=True)[["ran_s", "warm_s", "cold_s", "table_form_s"]].median() * 1e3
    med["calls"] = calls.groupby("bucket", observed=True).size()
    med["ran/cold"] = med["ran_s"] / med["cold_s"]
    med["cold/table_form"] = med["cold_s"] / med["table_form_s"]
    print("MoE calls by tokens: median ms as run, again warm, again cold, the profiler's form cold")
    print(med.round(3).to_string())


def predict(steps: pd.DataFrame, scenario: str, table: Path) -> pd.DataFrame:
    """The table's time for each op of each step (its scale 1, no step overhead)."""
    from pagedweight.config.scenario import load_scenario
    from pagedweight.core.spec import PRECISION_ID
    from pwsim.table_latency import TableLatencyModel

    loaded = load_scenario(scenario, [f"latency.path={table}", "latency.scale=1.0"])
    lm = TableLatencyModel(loaded.scenario.latency, loaded.model, loaded.gpu, ".")
    md = loaded.model
    fb = lm.fallback
    out = []
    for r in steps.itertuples():
        attn = sum(lm._one("attn_prefill", "attn_prefill", q, kv, lambda q=q, kv=kv: fb.attn_prefill_s(q, kv))
                   for q, kv in zip(r.chunks, r.chunk_kv, strict=True))  # fmt: skip
        nd = len(r.decode_kv)
        if nd:
            total_kv = float(sum(r.decode_kv))
            attn += lm._one(
                "attn_decode", "attn_decode", nd, total_kv / nd, lambda nd=nd, kv=total_kv: fb.attn_decode_s(nd, kv)
            )
        tokens, seqs = sum(r.chunks) + nd, len(r.chunks) + nd
        # Each downgrade, and each upgrade on a CPU (synchronous), writes every matrix of one
        # expert: the table's quantize of its target precision.
        quantize_s = sum(lm.quantize_time_s(n, k, pid) for pid in r.written for _, n, k in md.expert_matrices)
        out.append({
            "table_attention": md.num_layers * attn,
            "table_dense": md.num_moe_layers * lm._one("dense", "dense", tokens, 0.0, lambda t=tokens: fb.dense_s(t)),
            "table_moe": lm.moe_s(r.routing, r.precisions),
            "table_head": lm._one("lm_head", "lm_head", seqs, 0.0, lambda n=seqs: fb.lm_head_s(n)),
            "table_dequantize": sum(lm.dequantize_time_s(n, k, PRECISION_ID[p]) for p, n, k in r.dequantized),
            "table_transitions": quantize_s,
        })  # fmt: skip
    return pd.DataFrame(out, index=steps.index)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default=str(ROOT / "scenarios" / "cpu_validate.yaml"))
    p.add_argument("--policy", default="pagedweight")
    p.add_argument("--table", help="latency table to compare with (default: profile the scenario now)")
    p.add_argument("--out", help="folder for the run, the table and breakdown.csv (default: a temporary one)")
    p.add_argument("--replay-moe", action="store_true", help="replay each MoE call warm, cold and as profiled")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="step-breakdown-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.replay_moe:
        calls = replay_moe(args.scenario, args.policy, out / "run")
        calls.to_csv(out / "moe_replays.csv", index=False)
        print_replays(calls)
        print(f"written: {out / 'moe_replays.csv'}")
        return 0
    table = Path(args.table).resolve() if args.table else out / "kernels.csv"
    if not args.table:
        cmd = [sys.executable, "-m", "pwgpu.cli", "profile", "--scenario", args.scenario, "--out", str(table)]
        subprocess.run(cmd, check=True)
    steps = serve(args.scenario, args.policy, out / "run")
    d = pd.concat([steps, predict(steps, args.scenario, table)], axis=1).fillna(0.0)
    for timer in TIMERS:  # a timer whose op never ran in this run (a static policy's writes)
        if timer not in d:
            d[timer] = 0.0
    d["attention"] = d["attn"] + d["kv_write"]
    d["moe"] = d["moe_call"] - d["dequantize"]
    d["head"] = d["logits"] + d["sample"]
    d["transitions"] = d["downgrade"] + d["upgrade"]
    # Everything else of the forward pass: projections, norms, RoPE, router, residuals, embedding.
    d["dense"] = d["forward"] - d["attention"] - d["moe_call"]
    d["host_in_step"] = d["duration_s"] - d["forward"] - d["head"] - d["transitions"]
    d["table_host_in_step"] = 0.0
    d["shape"] = [
        f"prefill {sum(c)}" if c else f"decode {len(k)}" for c, k in zip(d["chunks"], d["decode_kv"], strict=True)
    ]
    from pagedweight.results.validation import _shape_bucket

    d["bucket"] = _shape_bucket(
        pd.DataFrame(
            {"num_prefill_tokens": [sum(c) for c in d["chunks"]], "num_decodes": [len(k) for k in d["decode_kv"]]}
        )
    ).to_numpy()
    cols = [c for op in OPS for c in (op, f"table_{op}")]
    d.drop(columns=["routing", "precisions"]).to_csv(out / "breakdown.csv", index=False)
    pd.set_option("display.width", 200)
    total = d[[*cols, "duration_s"]].sum() * 1e3
    gaps_ms = d["gap_before_s"].sum() * 1e3  # host work between steps, outside every step's time
    print(f"{args.policy}: {len(d)} steps, {total['duration_s']:.0f} ms in steps, {gaps_ms:.1f} ms between steps")
    print("op            measured ms   table ms   measured/table")
    for op in OPS:
        m, t = total[op], total[f"table_{op}"]
        print(f"  {op:13s} {m:10.1f} {t:10.1f}   {m / t if t else float('nan'):8.2f}")
    med = d.groupby("bucket")[[*cols, "duration_s"]].median() * 1e3
    med["steps"] = d.groupby("bucket").size()
    print("median ms per step shape (measured / table):")
    print(med.round(2).T.to_string())
    print(f"written: {out / 'breakdown.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
