"""A scenario on two gloo ranks whose budgets differ, for ``test_ep_launch.py``: what ``pwgpu run
--scenario S --ep 2`` does (``pwgpu.ep_launch``), except that rank r's pool holds
``BUDGETS[r]`` bytes, so that the ranks' pools, and their controllers' precision changes, differ.

    python ep_launch_worker.py SCENARIO MODEL OUT BUDGET0 BUDGET1

Rank 0 writes the results directory OUT; every rank writes OUT/rank{r}.json: its precision
changes, how its requests ended and its steps' KV blocks in use.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


def _stats(engine) -> dict:
    core = engine.core
    return {
        "num_transitions": {k.value: v for k, v in core.num_transitions.items()},
        "states": {str(r.request_id): r.state.value for r in engine.records},
        "kv_blocks_used": core.steps.columns()["kv_blocks_used"].tolist(),
    }


def _rank(rank: int, world: int, scenario: str, model: str, out: str, budgets: list[int]) -> None:
    from pagedweight.config.run import scenario_run
    from pagedweight.config.scenario import load_scenario
    from pwgpu import offline
    from pwgpu.ep_launch import rank_engine

    run = scenario_run(load_scenario(scenario, require_latency_table=False))
    base = offline.scenario_engine_config(run, "cpu", "float32", world)
    base = dataclasses.replace(base, core=dataclasses.replace(base.core, budget_bytes=budgets[rank]))
    stats = {}
    if rank == 0:
        inner = offline.policy_engine

        def keep(*args, **kw):  # the engines run_policies builds, to read their cores afterwards
            engine = inner(*args, **kw)
            engines.append(engine)
            return engine

        engines: list = []
        offline.policy_engine = keep
        offline.run_policies(model, run.trace, base, run.policies, out, run.seed, report=False, scenario=run.name,
                             table=run.table, ep=True)  # fmt: skip
        stats = {e.cfg.policy: _stats(e) for e in engines}
    else:
        for policy in run.policies:
            engine = rank_engine(model, dataclasses.replace(base, policy=policy), run.table)
            engine.agreement.follow()
            stats[policy] = _stats(engine)
    Path(out, f"rank{rank}.json").write_text(json.dumps(stats))


def main() -> None:
    scenario, model, out, *budgets = sys.argv[1:]
    from pwgpu.ep_launch import launch

    Path(out).mkdir(parents=True, exist_ok=True)
    launch(2, "gloo", _rank, (scenario, model, out, [int(b) for b in budgets]))


if __name__ == "__main__":
    main()
