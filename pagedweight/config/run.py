"""A scenario resolved into what both runtimes run: the one path from a scenario's settings to
the core's, for ``pwsim run`` and ``pwgpu run --scenario`` alike.

``scenario_run`` builds the requests, the importance table and the ``CoreConfig`` once; each
runtime adds only what is its own (the simulator: latency model and routing sampler; the
engine: checkpoint, device and dtype). tests/gpu_engine/test_scenario_keys.py walks every key
of the scenario schema and checks it reaches both runtimes with the same value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import yaml

from pagedweight.config.scenario import LoadedScenario, importance_table
from pagedweight.core.runtime import CoreConfig
from pagedweight.core.scheduler import SchedulerConfig
from pagedweight.policy.controller import ControllerSettings
from pagedweight.policy.importance import ImportanceTable
from pagedweight.results.metrics import Slo
from pagedweight.workload.build import build_workload
from pagedweight.workload.traces import RequestTrace


def core_config(loaded: LoadedScenario) -> CoreConfig:
    """The ``CoreConfig`` of a scenario: every memory, scheduler and controller setting, by name."""
    sc = loaded.scenario
    c = sc.controller
    return CoreConfig(
        model=loaded.model,
        budget_bytes=loaded.budget_bytes,
        page_bytes=sc.memory.page_bytes,
        kv_block_tokens=sc.memory.kv_block_tokens,
        prefix_caching=sc.memory.prefix_caching,
        scheduler=SchedulerConfig(
            **sc.scheduler.model_dump(exclude={"max_model_len"}), max_model_len=loaded.max_model_len
        ),
        controller=ControllerSettings(
            **c.model_dump(exclude={"static_mixed_fraction", "max_in_flight"}),
            max_in_flight_bytes=c.max_in_flight,
            tpot_slo_s=None if sc.slo.tpot_ms is None else sc.slo.tpot_ms / 1e3,
            ttft_slo_s=None if sc.slo.ttft_ms is None else sc.slo.ttft_ms / 1e3,
        ),
        static_mixed_fraction=c.static_mixed_fraction,
        paper_greedy_precisions=sc.memory.paper_greedy_precisions,
    )


@dataclass(frozen=True, eq=False)
class ScenarioRun:
    """What a scenario asks of a runtime, whichever it is."""

    name: str
    core: CoreConfig
    table: ImportanceTable  # restricted to the scenario's precision ladder
    trace: RequestTrace
    policies: tuple[str, ...]
    seed: int  # of the workload's generator, the simulator's routing and the engine's prompts
    slo: Slo
    resolved_yaml: str  # the scenario with every default filled in (scenario.resolved.yaml)
    ep: int = 1  # GPUs of the replica under expert parallelism (``parallel.ep``)
    ep_placement: str = "contiguous"  # which experts each of them holds (``parallel.placement``)
    replicas: int = 1  # replicas behind a router (``cluster.replicas``)


def scenario_run(loaded: LoadedScenario, policies: list[str] | None = None) -> ScenarioRun:
    """``policies``: a subset to run (default: the scenario's)."""
    sc = loaded.scenario
    trace = build_workload(sc.workload, loaded.base_dir, loaded.max_model_len, np.random.default_rng(sc.seed))
    return ScenarioRun(
        name=sc.name,
        core=core_config(loaded),
        table=importance_table(loaded),
        trace=trace,
        policies=tuple(policies or sc.policies),
        seed=sc.seed,
        slo=Slo(**sc.slo.model_dump()),
        resolved_yaml=yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False),
        ep=sc.parallel.ep,
        ep_placement=sc.parallel.placement,
        replicas=sc.cluster.replicas,
    )
