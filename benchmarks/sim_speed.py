"""Simulator speed: the full Azure conversation trace (19,366 requests, one hour) for one policy
on Mixtral-8x7B / H200, at 1x, 2x and 4x the requests (the trace tiled end to end, so the load
stays the same and cost should grow linearly).

    python benchmarks/sim_speed.py [--trace ../shared/traces/azure_conv_2023.csv] [--policy pagedweight]

Prints wall seconds, simulated seconds per wall second and steps per second, side by side.
Target: the 1x run under 15 s wall on one core.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

from pagedweight.config.run import core_config
from pagedweight.config.scenario import importance_table, load_scenario
from pagedweight.results.metrics import Slo
from pagedweight.results.writer import policy_summary
from pagedweight.workload.traces import RequestTrace, load_azure
from pwsim.engine import SimEngine
from pwsim.latency import build_latency_model

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = """\
name: sim-speed
model: mixtral-8x7b
gpu: h200
memory: {budget: 120 GiB}
workload: {kind: trace, path: PLACEHOLDER, format: azure}
"""


def tiled(trace: RequestTrace, times: int) -> RequestTrace:
    span = float(trace.arrival_s[-1]) + 1.0
    return RequestTrace(
        np.concatenate([trace.arrival_s + k * span for k in range(times)]),
        np.tile(trace.prompt_tokens, times),
        np.tile(trace.output_tokens, times),
        source=f"{trace.source} x{times}",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "azure_conv_2023.csv"))
    ap.add_argument("--policy", default="pagedweight")
    ap.add_argument("--times", default="1,2,4")
    args = ap.parse_args()
    if not Path(args.trace).is_file():
        print(f"trace {args.trace} not found; pass --trace", file=sys.stderr)
        return 2
    tmp = ROOT / "benchmarks" / ".sim_speed.yaml"
    tmp.write_text(SCENARIO.replace("PLACEHOLDER", str(Path(args.trace).resolve())))
    try:
        loaded = load_scenario(tmp)
    finally:
        tmp.unlink()
    base = load_azure(args.trace)
    table = importance_table(loaded)
    latency = build_latency_model(loaded.scenario.latency, loaded.model, loaded.gpu)
    cfg = core_config(loaded)
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, policy {args.policy}")
    heads = (("x", 3), ("requests", 9), ("steps", 9), ("sim_s", 9), ("wall_s", 8), ("sim_s/wall_s", 13))
    print(" ".join(f"{h:>{w}}" for h, w in heads + (("steps/s", 9), ("us/step", 8))))
    for times in map(int, args.times.split(",")):
        trace = tiled(base, times)
        t0 = time.perf_counter()
        eng = SimEngine(cfg, args.policy, trace, table, latency, "importance", seed=0)
        eng.run()
        wall_s = time.perf_counter() - t0
        s = policy_summary(eng.requests, eng.core, Slo(), wall_s, eng.bytes_h2d)
        print(
            f"{times:>3} {len(trace):>9} {s['num_steps']:>9} {s['simulated_s']:>9.0f} {wall_s:>8.2f} "
            f"{s['simulated_s'] / wall_s:>13.1f} {s['num_steps'] / wall_s:>9.0f} {wall_s / s['num_steps'] * 1e6:>8.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
