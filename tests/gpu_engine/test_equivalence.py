"""The promise that both runtimes run the same policy, kept by a test: on a fixed-step clock, with
the same requests, the same configuration and the same routing (the engine's real per-step
router counts replayed into the simulator), ``pwsim`` and ``pwgpu`` make the same decisions step
by step: the same batches, the same preemptions and the same precision changes.

The budget puts the tiny model under KV pressure (downgrades, preemptions), the load then falls
away (upgrades), and the routing of random prompts differs from the table's, so the controller
re-scales its losses on the way. The second test shows the comparison has teeth: a simulator
whose controller does not see the routing decides differently."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pagedweight.config.latency import ConstantLatencyConfig
from pagedweight.core.runtime import CoreConfig
from pagedweight.core.scheduler import SchedulerConfig
from pagedweight.core.spec import load_gpu
from pagedweight.policy.controller import DOWNGRADE, UPGRADE, Controller, ControllerSettings
from pagedweight.policy.importance import synthetic_table
from pagedweight.workload.traces import RequestTrace
from pwgpu.engine import Engine, EngineConfig, FixedStepClock
from pwgpu.offline import run_trace
from pwsim.engine import SimEngine
from pwsim.latency import ConstantLatencyModel
from pwsim.routing_source import ReplayRouting

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-moe"
STEP_S = 0.05
SEED = 0
# Twelve requests arriving over the first 0.3 s, while the first ones still run (no idle engine).
TRACE = RequestTrace(
    arrival_s=np.array([0.0] * 4 + [0.05, 0.1, 0.1, 0.15, 0.2, 0.25, 0.3, 0.3]),
    prompt_tokens=np.array([150, 90, 200, 60, 120, 180, 40, 160, 100, 140, 70, 110]),
    output_tokens=np.array([30, 24, 18, 40, 28, 20, 36, 22, 26, 32, 30, 16]),
    source="equivalence test",
)
CONTROLLER = ControllerSettings(plan_interval_s=0.0, min_dwell_s=0.1, rescale_interval_s=0.2)


def recorder(core, out):
    """Every step's decisions, as comparable values."""

    def on_step(step):
        batch = step.batch
        out.append(
            {
                "start_s": step.start_s,
                "batch": [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)],
                "preempted": [r.request_id for r in batch.preempted],
                "changes": [(c.kind.value, c.expert, c.to_id) for c in step.changes],
                "routing": step.routing,
                "in_flight_after": len(core.page_table.in_flight),
                "protected": core.kv.num_protected_blocks,
            }
        )

    core.on_step = on_step


def transitions(core):
    return [(t.kind.value, t.expert, t.from_precision, t.to_precision) for t in core.transitions]


@pytest.fixture(scope="module")
def engine_run():
    return run_engine(CONTROLLER)


def run_engine(controller: ControllerSettings):
    if not (MODEL / "model.safetensors").is_file():
        pytest.skip("needs models/tiny-moe")
    probe = Engine(MODEL, EngineConfig(CoreConfig(budget_bytes=256 << 20), "static-fp16", dtype="float32"))
    usage, page_bytes, spec = probe.core.pool.usage(), probe.page_bytes, probe.spec
    del probe
    # Room for 60% of the experts' bf16 pages and 60 KV pages: at their peak the requests want
    # 140 KV pages, more than even int4 experts leave, so there are downgrades and preemptions.
    budget = (usage["pinned"] + int(0.6 * usage["weight:bf16"]) + 60) * page_bytes
    # Promises of only 4 outputs at admission: the decodes outgrow them, so preemption happens
    # under forecast admission too.
    sched = SchedulerConfig(admission_reserve_tokens=4)
    core_cfg = CoreConfig(budget_bytes=budget, controller=controller, scheduler=sched)
    cfg = EngineConfig(core_cfg, "pagedweight", dtype="float32")
    table = synthetic_table(spec, ("bf16", "fp8", "int8", "int4"))
    eng = Engine(MODEL, cfg, table, FixedStepClock(STEP_S))
    steps: list[dict] = []
    recorder(eng.core, steps)
    ers = run_trace(eng, TRACE, SEED)
    assert all(len(er.output_ids) == n for er, n in zip(ers, TRACE.output_tokens, strict=True))
    return eng, table, steps


def simulate(eng, table, steps) -> tuple[SimEngine, list[dict]]:
    """The simulator on the engine's configuration, timed by a constant step, fed the engine's routing."""
    latency = ConstantLatencyModel(ConstantLatencyConfig(kind="constant", step_time_s=STEP_S), load_gpu("cpu"))
    replay = ReplayRouting([s["routing"] for s in steps], eng.spec.top_k)
    sim = SimEngine(eng.core.config, "pagedweight", TRACE, table, latency, "uniform", SEED, routing=replay)
    out: list[dict] = []
    recorder(sim.core, out)
    sim.run()
    return sim, out


def decisions(steps):
    return [{k: v for k, v in s.items() if k not in ("routing", "in_flight_after")} for s in steps]


def test_simulator_and_engine_decide_alike_step_by_step(engine_run):
    eng, table, steps = engine_run
    kinds = {t.kind for t in eng.core.transitions}
    assert {DOWNGRADE, UPGRADE} <= kinds, "the run must both shrink and restore precision"
    assert any(s["preempted"] for s in steps), "the run must preempt"
    assert "rescaled" in eng.core.controller.table.source, "the routing never re-scaled the losses"
    sim, sim_steps = simulate(eng, table, steps)
    # In the simulator every upgrade lands within the step that started it (its copy takes
    # microseconds of the 50 ms step); the engine flips it at the next step's poll. Either way
    # the next step plans with it landed.
    assert all(s["in_flight_after"] == 0 for s in sim_steps)
    ours, theirs = decisions(steps), decisions(sim_steps)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        assert a == b, f"step {i}: engine {a} != simulator {b}"
    assert len(ours) == len(theirs)
    assert transitions(eng.core) == transitions(sim.core)
    assert np.array_equal(eng.core.page_table.precision_ids, sim.core.page_table.precision_ids)
    assert [r.num_preemptions for r in eng.records] == [r.num_preemptions for r in sim.requests]
    # Prefix caching (on by default): the engine keys blocks by token ids, the simulator, without
    # a trace's hash_ids, by request; a preempted request finds its own blocks again in both.
    assert eng.core.scheduler.prefix_hit_tokens == sim.core.scheduler.prefix_hit_tokens > 0
    assert eng.core.kv.num_evicted_blocks == sim.core.kv.num_evicted_blocks


def test_a_simulator_blind_to_routing_decides_otherwise(engine_run, monkeypatch):
    eng, table, steps = engine_run
    monkeypatch.setattr(Controller, "observe_routing", lambda self, tokens_per_expert: None)
    sim, sim_steps = simulate(eng, table, steps)
    assert decisions(sim_steps) != decisions(steps) or transitions(sim.core) != transitions(eng.core)


def test_protected_prefixes_are_decided_alike():
    """pagedweight with a cache priced high enough to be protected (the engine learns a token's
    prefill seconds from its own steps, as the simulator does): the same protection, downgrades,
    evictions and preemptions step by step."""
    eng, table, steps = run_engine(replace(CONTROLLER, recompute_weight=1e4))
    assert max(s["protected"] for s in steps) > 0, "the cache was never protected"
    sim, sim_steps = simulate(eng, table, steps)
    assert decisions(steps) == decisions(sim_steps)
    assert transitions(eng.core) == transitions(sim.core)
    assert eng.core.kv.ghosts.num_hits == sim.core.kv.ghosts.num_hits > 0
    assert eng.core.kv.num_evicted_blocks == sim.core.kv.num_evicted_blocks
