"""Instructions the simulator executes for the first requests of a ``sim_speed`` case, counted by
valgrind's callgrind: a figure a shared machine's neighbours cannot move, for changes of a few
percent that wall-clock timings on such a machine cannot resolve (the same run's CPU time moved
by +/-15% between consecutive runs on the 2-core VM; its instruction count is the same to the
last digit).

Each tree runs in its own process under callgrind: a warm-up run of ``--warm`` requests (numba
loaded, code paths taken once), then the measured run of ``--requests`` requests, and only the
measured run is counted (callgrind collects inside ``functools.reduce``, which wraps it and
nothing else). The count includes building the run (the routing sampler's pools), the same for
every tree. Instructions are not time: a change that trades instructions for memory traffic can
move them apart, so the wall-clock benchmark (``sim_speed.py``) still has the last word.

    python benchmarks/sim_instructions.py [--case azure] [--policy pagedweight] [--requests 1000]
                                          [--warm 200] [--before DIR]

valgrind must be installed; each tree takes ~2 minutes for 1,000 Azure requests.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent


def measured(workdir: Path, case: str, policy: str, requests: int, warm: int) -> int:
    """In the process under callgrind: the warm run, then the measured one; returns its steps."""
    import numpy as np
    import sim_speed

    from pagedweight.config.run import core_config
    from pagedweight.config.scenario import importance_table
    from pagedweight.workload.build import build_workload
    from pagedweight.workload.traces import RequestTrace
    from pwsim.engine import SimEngine
    from pwsim.latency import build_latency_model

    loaded = sim_speed._loaded(workdir, case)
    sc = loaded.scenario
    full = build_workload(sc.workload, loaded.base_dir, loaded.max_model_len, np.random.default_rng(sc.seed))
    table = importance_table(loaded)
    cfg = core_config(loaded)

    def run(n: int) -> SimEngine:
        trace = RequestTrace(full.arrival_s[:n], full.prompt_tokens[:n], full.output_tokens[:n], source="first")
        latency = build_latency_model(sc.latency, loaded.model, loaded.gpu, loaded.base_dir)
        eng = SimEngine(cfg, policy, trace, table, latency, "importance", seed=sc.seed)
        eng.run()
        return eng

    run(warm)
    eng = functools.reduce(lambda _a, _b: run(requests), [0, 0])  # counted: functools_reduce
    return eng.core.steps.num_recorded


def count(tree: Path, args, workdir: Path) -> tuple[int, int]:
    """(instructions, steps) of the measured run with ``tree`` first on the path."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = [
            "valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
            f"--callgrind-out-file={out}", sys.executable, __file__, "--child", "--workdir", str(workdir),
            "--case", args.case, "--policy", args.policy, "--requests", str(args.requests), "--warm", str(args.warm),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{tree}: the run under callgrind failed:\n{done.stderr[-2000:]}")
        collected = re.search(r"Collected : (\d+)", done.stderr)
        steps = re.search(r"^steps (\d+)$", done.stdout, re.MULTILINE)
        if collected is None or steps is None:
            raise SystemExit(f"{tree}: no instruction count in callgrind's output:\n{done.stderr[-2000:]}")
        return int(collected.group(1)), int(steps.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="azure", choices=["azure", "longctx"])
    ap.add_argument("--policy", default="pagedweight")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--before", help="another checkout to count side by side (its root)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(f"steps {measured(Path(args.workdir), args.case, args.policy, args.requests, args.warm)}")
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt install valgrind)")
    trees = [("after", ROOT)] + ([("before", Path(args.before).resolve())] if args.before else [])
    with tempfile.TemporaryDirectory() as workdir:
        results = {name: count(tree, args, Path(workdir)) for name, tree in trees}
    print(f"# {args.case}, {args.policy}: the first {args.requests} requests after {args.warm} (callgrind)")
    print(f"{'tree':8s} {'steps':>8s} {'instructions':>16s} {'per step':>10s}")
    for name, (instructions, steps) in results.items():
        print(f"{name:8s} {steps:8,d} {instructions:16,d} {instructions / steps:10,.0f}")
    if "before" in results:
        (a, sa), (b, sb) = results["after"], results["before"]
        same = "the same steps" if sa == sb else f"DIFFERENT steps ({sa} vs {sb})"
        print(f"after / before: {a / b:.4f} ({same})")


if __name__ == "__main__":
    main()
