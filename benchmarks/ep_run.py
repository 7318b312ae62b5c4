"""Wall time of ``pwgpu run --scenario S --ep 2`` against ``--ep 1`` (one process), side by side.

Each repeat runs three commands back to back (in rotating order), each a fresh process (torch
import, checkpoint load, every policy of the scenario, results and report): ``--ep 1`` as is
(torch's default threads: one per core), ``--ep 1`` on one torch thread (``OMP_NUM_THREADS=1``,
what each rank gets on a 2-core machine with ``--ep 2``) and ``--ep 2``; it prints their wall
times, the ratios, each run's output tokens per second and the load average before and after.
Both write the same results directory; their greedy tokens agree (``tests/gpu_engine/
test_ep_launch.py`` checks that, on fp32).

On one machine the ranks share its cores (each rank gets cores / N torch threads), and every MoE
layer adds an all-to-all over gloo, so EP is not expected to be faster here: this shows the
launch path works end to end and what it costs, not a speed-up. EP pays off when each rank has
its own GPU and the experts would not fit on one.

``--budget`` replaces the scenario's ``memory.budget`` (each rank's, as in the simulator): with
one budget for both, ``--ep 2`` has twice the memory in all, so a budget with room for the whole
load in one process compares compute alone.

    python3 benchmarks/ep_run.py [--scenario scenarios/cpu_validate.yaml] [--budget 64MiB] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


# name -> (--ep, torch threads per process or None for torch's default)
VARIANTS = {"ep1": (1, None), "ep1-1thread": (1, 1), "ep2": (2, None)}


def _run(scenario: str, ep: int, threads: int | None, out: Path) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "pwgpu.cli", "run", "--scenario", scenario, "--ep", str(ep), "--out", str(out)]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wall_s = time.perf_counter() - start
    summary = json.loads((out / "summary.json").read_text())
    return wall_s, {p: (s.get("output_throughput"), s.get("num_preemptions")) for p, s in summary["policies"].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=str(ROOT / "scenarios" / "cpu_validate.yaml"))
    ap.add_argument("--budget", help="memory.budget for every run (default: the scenario's)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    walls: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="ep_run_") as tmp:
        scenario = args.scenario
        if args.budget:
            raw = yaml.safe_load(Path(scenario).read_text())
            raw["memory"]["budget"] = args.budget
            raw.pop("latency", None)  # the engine times itself; a table path would be relative to the original
            scenario = str(Path(tmp) / "scenario.yaml")
            Path(scenario).write_text(yaml.safe_dump(raw))
            print(f"{args.scenario} with memory.budget {args.budget}")
        for i in range(args.repeats):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                ep, threads = VARIANTS[name]
                wall_s, tok_s = _run(scenario, ep, threads, Path(tmp) / f"{name}-{i}")
                walls[name].append(wall_s)
                rates = ", ".join(f"{p} {r:.1f} tok/s, {n} preemptions" for p, (r, n) in tok_s.items() if r is not None)
                print(f"repeat {i}  {name:12s} {wall_s:6.1f} s wall  ({rates})", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    best = {name: min(w) for name, w in walls.items()}
    print("best wall: " + ", ".join(f"{name} {b:.1f} s" for name, b in best.items()))
    print(f"ep2 / ep1 = {best['ep2'] / best['ep1']:.2f}; ep2 / ep1-1thread = {best['ep2'] / best['ep1-1thread']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
