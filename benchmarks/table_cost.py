"""What a run's tables cost to write: one policy of a scenario simulated once, then its tables
written with and without the step tables (``step_tables=False``, as ``pwsim bench`` writes its
runs), CPU seconds of each beside the simulation's own, and the bytes.

    python benchmarks/table_cost.py SCENARIO POLICY [--set key=value ...]

e.g. ``python benchmarks/table_cost.py scenarios/manyexperts.yaml paper-greedy --set
workload.path=../traces/bench/chat_1h.jsonl --set workload.duration_s=900``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario")
    ap.add_argument("policy")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="scenario override")
    args = ap.parse_args(argv)

    from pagedweight.config.run import scenario_run
    from pagedweight.config.scenario import load_scenario
    from pwsim.run import _latency, scenario_engine, write_engine_tables

    loaded = load_scenario(args.scenario, args.set)
    run = scenario_run(loaded, [args.policy])
    engine = scenario_engine(run, args.policy, _latency(loaded), loaded.scenario.routing, loaded)
    cpu0 = time.process_time()
    engine.run()
    simulate_s = time.process_time() - cpu0

    def write(parts: Path, step_tables: bool) -> float:
        cpu0 = time.process_time()
        write_engine_tables(parts, args.policy, engine, step_tables)
        return time.process_time() - cpu0

    with tempfile.TemporaryDirectory() as tmp:
        lean_s, full_s = write(Path(tmp) / "lean", False), write(Path(tmp) / "full", True)
        sizes = {d: sum(f.stat().st_size for f in (Path(tmp) / d).iterdir()) for d in ("lean", "full")}
    print(f"{args.scenario} {args.policy}: simulated in {simulate_s:.1f} CPU s")
    print(f"  request table only: {lean_s:.2f} CPU s, {sizes['lean'] / 1e6:.1f} MB")
    print(
        f"  every table:        {full_s:.2f} CPU s, {sizes['full'] / 1e6:.1f} MB"
        f" ({100 * full_s / (simulate_s + full_s):.0f}% of the run)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
