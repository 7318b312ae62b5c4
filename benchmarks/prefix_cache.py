"""Prefix caching on vs off in the simulator: hit rate, prefill tokens saved, evictions, peak KV
held by requests, preemptions and TTFT per policy per scenario, and the simulator's speed (CPU
seconds of the same runs, on and off side by side, so machine load affects both alike, after
an untimed short run of each policy both ways so that neither mode pays the process's one-time
costs; each policy runs on, off, off, on (``--rounds 2``), so that neither mode always runs
first after the previous policy's runs, and the two runs of a mode must agree in every figure
but time).

Scenarios: the shipped ones named by --scenarios, and ``mooncake``: scenarios/longctx.yaml on
../shared/traces/mooncake_synthetic.jsonl (Mooncake's own hash_ids; skipped when absent), its
first --mooncake-requests requests.

    python benchmarks/prefix_cache.py [--scenarios chat,longctx,burst,multiturn] [--policies a,b]
                                      [--mooncake-requests 1000] [--caching on,off] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED = next(
    (p for p in (ROOT.parent / "shared", ROOT.parent.parent / "shared") if p.is_dir()), ROOT.parent / "shared"
)
MOONCAKE = SHARED / "traces" / "mooncake_synthetic.jsonl"


def run_one(path: Path, overrides: list[str], policy: str) -> dict:
    from pagedweight.config.run import scenario_run
    from pagedweight.config.scenario import load_scenario
    from pagedweight.results.writer import policy_summary
    from pwsim.latency import build_latency_model
    from pwsim.run import scenario_engine

    loaded = load_scenario(path, overrides)
    run = scenario_run(loaded, [policy])
    latency = build_latency_model(loaded.scenario.latency, loaded.model, loaded.gpu, loaded.base_dir)
    engine = scenario_engine(run, policy, latency, loaded.scenario.routing)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    engine.run()
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    s = policy_summary(engine.requests, engine.core, run.slo, wall_s, engine.bytes_h2d)
    keys = ("prefix_cache_hit_rate", "prefill_tokens_saved", "num_evicted_blocks", "peak_kv_bytes")
    keys += ("peak_kv_cached_bytes", "num_preemptions", "mean_ttft_ms", "p99_ttft_ms", "num_downgrades")
    keys += ("mean_quality_proxy", "completed", "num_steps")
    return {k: s[k] for k in keys} | {"cpu_s": cpu_s, "wall_s": wall_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="chat,longctx,burst,multiturn")
    ap.add_argument("--policies", default="static-fp16,static-int4,kv-swap,paper-greedy,pagedweight")
    ap.add_argument("--mooncake-requests", type=int, default=1000)
    ap.add_argument("--caching", default="on,off", help="on, off or both (on,off)")
    ap.add_argument("--rounds", type=int, default=2, help="timed runs of each mode, in ABBA order (1: AB)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    modes = [{"on": True, "off": False}[m] for m in args.caching.split(",")]
    cases = [(name, ROOT / "scenarios" / f"{name}.yaml", []) for name in args.scenarios.split(",") if name]
    if not MOONCAKE.is_file():
        print(f"note: {MOONCAKE} absent; the mooncake case is skipped")
    elif args.mooncake_requests > 0:
        mooncake = [f"workload.path={MOONCAKE}", f"workload.max_requests={args.mooncake_requests}"]
        cases.append(("mooncake", ROOT / "scenarios" / "longctx.yaml", mooncake))
    # One short untimed run of every policy both ways first: the first run in a process pays
    # one-time costs (imports, loading compiled kernels) that belong to neither mode.
    for policy in args.policies.split(","):
        for caching in modes:
            warm = [*cases[0][2], "workload.max_requests=300", f"memory.prefix_caching={str(caching).lower()}"]
            run_one(cases[0][1], warm, policy)
    rows = []
    print("| scenario | policy | caching | hit rate | prefill tokens saved | evicted blocks | peak KV GiB "
          "| peak cached GiB | preemptions | mean TTFT ms | p99 TTFT ms | downgrades | quality proxy "
          "| CPU s |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, path, overrides in cases:
        for policy in args.policies.split(","):
            order = [m for i in range(args.rounds) for m in (modes if i % 2 == 0 else modes[::-1])]
            runs: dict[bool, list[dict]] = {}
            for caching in order:
                r = run_one(path, [*overrides, f"memory.prefix_caching={str(caching).lower()}"], policy)
                runs.setdefault(caching, []).append(r)
            for caching in modes:
                first = runs[caching][0]
                if any(x | {"cpu_s": 0, "wall_s": 0} != first | {"cpu_s": 0, "wall_s": 0} for x in runs[caching]):
                    raise SystemExit(f"{name} {policy}: two runs of the same mode differ")
                r = first | {"cpu_s": sum(x["cpu_s"] for x in runs[caching]) / len(runs[caching])}
                rows.append({"scenario": name, "policy": policy, "caching": caching, **r})
                cells = [name, policy, "on" if caching else "off", f"{r['prefix_cache_hit_rate']:.1%}"]
                cells += [f"{r['prefill_tokens_saved']:,}", f"{r['num_evicted_blocks']:,}"]
                cells += [f"{r['peak_kv_bytes'] / 2**30:.1f}", f"{r['peak_kv_cached_bytes'] / 2**30:.1f}"]
                cells += [str(r["num_preemptions"]), f"{r['mean_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}"]
                cells += [str(r["num_downgrades"]), f"{r['mean_quality_proxy']:.4g}"]
                print("| " + " | ".join([*cells, f"{r['cpu_s']:.2f}"]) + " |", flush=True)
    print(f"\nSimulator CPU seconds, caching on / off (same runs, mean of {args.rounds} each):")
    for name, _, _ in cases:
        on = sum(r["cpu_s"] for r in rows if r["scenario"] == name and r["caching"])
        off = sum(r["cpu_s"] for r in rows if r["scenario"] == name and not r["caching"])
        if not on or not off:
            continue
        steps_on = sum(r["num_steps"] for r in rows if r["scenario"] == name and r["caching"])
        steps_off = sum(r["num_steps"] for r in rows if r["scenario"] == name and not r["caching"])
        print(f"  {name:10s} on {on:7.2f} s ({steps_on:,} steps)  off {off:7.2f} s ({steps_off:,} steps)  "
              f"ratio {on / off:.2f}x  per step {on / steps_on / (off / steps_off):.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
