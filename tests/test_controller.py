"""The precision controller on scripted KV demand, through the same RuntimeCore both runtimes use.

A fake backend completes upgrades a fixed number of steps after they start (a copy engine), so
pages really are in flight while KV demand moves."""

from dataclasses import replace

import numpy as np
import pytest

from pagedweight.core.pool import OWNER_KV, OWNER_PINNED, OWNER_TRANSITION
from pagedweight.core.runtime import CoreConfig, RuntimeCore
from pagedweight.core.scheduler import Request, SchedulerConfig
from pagedweight.core.spec import FP8_BLOCK_LADDER, PRECISION_ID, load_model
from pagedweight.errors import ConfigError
from pagedweight.policy.controller import DOWNGRADE, UPGRADE, ControllerSettings
from pagedweight.policy.importance import synthetic_table

MODEL = load_model("tiny-moe")
PAGE = 16 * 1024  # small pages: the tiny model's INT4 matrix is 67 KB


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self):
        return self.now_s


class DelayedCopies:
    """Upgrades land ``delay_steps`` steps after they start; downgrades are immediate."""

    def __init__(self, delay_steps=3):
        self.delay_steps = delay_steps
        self.pending = []  # (due step, transition)
        self.events = []
        self.step = 0

    def downgrade(self, t):
        self.events.append(("downgrade", t.expert))

    def start_upgrade(self, t):
        self.pending.append((self.step + self.delay_steps, t))

    def abort_upgrade(self, t):
        self.events.append(("abort", t.expert))

    def poll(self):
        pass  # ``drive`` lands copies itself, by step number

    def land(self, core):
        due = [t for s, t in self.pending if s <= self.step]
        self.pending = [(s, t) for s, t in self.pending if s > self.step]
        for t in due:
            core.complete_upgrade(t)


def make_core(policy="pagedweight", budget_mib=40, ladder=("bf16", "int8", "int4"), admission="forecast", **settings):
    table = synthetic_table(MODEL, ladder, seed=1)
    cfg = CoreConfig(
        model=MODEL,
        budget_bytes=budget_mib * 2**20,
        page_bytes=PAGE,
        kv_block_tokens=8,
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=2048, admission=admission),
        controller=ControllerSettings(**settings),
    )
    clock, backend = Clock(), DelayedCopies()
    return RuntimeCore(cfg, policy, table, backend, clock), clock, backend


def drive(core, clock, backend, demand, step_s=0.05):
    """Run the scheduler for ``len(demand)`` steps; ``demand[i]`` requests are submitted at step i."""
    log = []
    rid = 0
    for i, n_new in enumerate(demand):
        for _ in range(n_new):
            core.scheduler.add(Request(rid, clock.now_s, 400, 60))
            rid += 1
        backend.step = i
        backend.land(core)
        core.plan_step()
        batch = core.scheduler.schedule(clock.now_s)
        shape = batch.shape()
        clock.now_s += step_s
        core.scheduler.finish_step(batch, clock.now_s)
        core.record_step(clock.now_s - step_s, step_s, batch, shape)
        pool = core.pool
        pool.check()
        core.kv.check()
        # Never over budget, counting pages in flight: every page has exactly one owner.
        used = pool.num_owned(OWNER_PINNED) + pool.num_weight_pages() + pool.num_owned(OWNER_TRANSITION)
        assert used + pool.num_owned(OWNER_KV) + pool.num_free == pool.num_pages
        in_flight = sum(len(t.pages) for t in core.page_table.in_flight.values())
        assert in_flight == pool.num_owned(OWNER_TRANSITION)
        log.append((len(batch.preempted), core.page_table.precision_ids.copy(), dict(core.page_table.in_flight)))
    return log


def sawtooth(num_cycles=4, burst=12, quiet=60):
    return ([burst] + [0] * quiet) * num_cycles


def test_pressure_downgrades_then_load_drop_restores():
    core, clock, backend = make_core(min_dwell_s=0.5)
    top = PRECISION_ID["bf16"]
    assert (core.page_table.precision_ids == top).all()  # room for everything at start
    log = drive(core, clock, backend, [16] + [0] * 400)
    lowest = min(len(np.flatnonzero(ids != top)) for _, ids, _ in log)
    most_down = max(len(np.flatnonzero(ids != top)) for _, ids, _ in log)
    assert most_down > 0, "KV pressure must move some experts below bf16"
    assert lowest == 0 and (log[-1][1] == top).all(), "precision must come back when load drops"
    assert not core.scheduler.has_work()


def test_an_fp8_block_ladder_goes_to_int4_and_back():
    """An FP8 checkpoint's experts: the top is fp8-b128 (what the host master holds), pressure
    takes them to INT4, falling load restores fp8-b128; static-fp16 means the FP8 checkpoint."""
    core, clock, backend = make_core(budget_mib=24, ladder=FP8_BLOCK_LADDER, min_dwell_s=0.5)
    top = PRECISION_ID["fp8-b128"]
    assert (core.page_table.precision_ids == top).all()
    log = drive(core, clock, backend, [16] + [0] * 400)
    seen = set(np.concatenate([ids for _, ids, _ in log]).tolist())
    assert seen == {top, PRECISION_ID["int4"]}, "pressure must move some experts from fp8-b128 to int4 only"
    assert (log[-1][1] == top).all(), "precision must come back to fp8-b128 when load drops"
    static, _, _ = make_core("static-fp16", budget_mib=24, ladder=FP8_BLOCK_LADDER)
    assert (static.page_table.precision_ids == top).all() and np.isfinite(static.quality_proxy)


def test_downgrades_come_before_any_preemption():
    # vLLM's admission, which preempts here even at the floor; forecast admission does not.
    core, clock, backend = make_core(budget_mib=18, admission="greedy")
    floor = core.setup.floor_ids
    log = drive(core, clock, backend, [40] + [0] * 600)
    preempting = [ids for n, ids, in_flight in log if n]
    assert preempting, "this budget is meant to force preemptions even at the floor"
    forecast = make_core(budget_mib=18)
    assert not any(n for n, _, _ in drive(*forecast, [40] + [0] * 600))
    for ids in preempting:
        # A step may only preempt once every expert sits at the policy's floor.
        assert (core.page_table.pages_by_id[ids] <= core.page_table.pages_by_id[floor]).all()


@pytest.mark.parametrize("dwell_s", [0.5, 2.0])
def test_flips_per_expert_are_bounded_by_the_dwell_time(dwell_s):
    core, clock, backend = make_core(min_dwell_s=dwell_s)
    drive(core, clock, backend, sawtooth())
    times = {}
    for t in core.transitions:
        if t.kind in (UPGRADE, DOWNGRADE):
            times.setdefault(t.expert, []).append(t.time_s)
    assert times, "the sawtooth must cause precision changes"
    window_s = 5.0
    # Upgrades wait min_dwell_s after any change; downgrades may follow an upgrade at once, so
    # a window holds at most two changes per dwell period, plus the one it starts in.
    bound = 2 * (window_s / dwell_s) + 2
    for expert, ts in times.items():
        ts = np.array(ts)
        worst = max(np.sum((ts >= t) & (ts < t + window_s)) for t in ts)
        assert worst <= bound, (expert, ts)


def test_paper_greedy_follows_kv_both_ways():
    core, clock, backend = make_core("paper-greedy")
    drive(core, clock, backend, sawtooth(num_cycles=2))
    kinds = {t.kind for t in core.transitions}
    assert {DOWNGRADE, UPGRADE} <= kinds


@pytest.mark.parametrize("policy", ["static-fp16", "static-int4", "static-mixed", "kv-swap"])
def test_static_policies_never_change_precision(policy):
    core, clock, backend = make_core(policy)
    start = core.page_table.precision_ids.copy()
    drive(core, clock, backend, [30] + [0] * 200)
    assert core.controller is None and not core.transitions
    assert (core.page_table.precision_ids == start).all()


def test_routing_drift_moves_precision_to_the_experts_now_in_use():
    core, clock, backend = make_core(rescale_interval_s=1.0, min_dwell_s=0.0)
    # KV needs 900 more pages: every expert leaves bf16 and about half go down to int4. Then KV holds all but a few
    # pages beyond the low watermark, so the controller neither upgrades back (that needs the
    # high watermark) nor downgrades further on its own.
    core.scheduler.pressure_hook(900)
    low_pages = int(core.controller.settings.low_watermark * core.pool.num_pages)
    held = core.kv.allocate(core.kv.num_free_blocks - low_pages - 30)
    pt, table = core.page_table, core.controller.table
    lowered = np.flatnonzero(pt.precision_ids == PRECISION_ID["int4"])
    assert 0 < len(lowered) < pt.num_experts
    # Traffic now goes only to the experts that were lowered (the offline table's least used).
    hot = np.zeros((MODEL.num_moe_layers, MODEL.num_experts))
    hot.reshape(-1)[lowered] = 1000.0
    bytes_before = pt.pages_by_id[pt.precision_ids[lowered]].sum()
    for i in range(5, 200):
        backend.step = i
        backend.land(core)
        core.observe_routing(hot)
        core.plan_step()
        clock.now_s += 0.1
    backend.step += 100
    backend.land(core)
    assert pt.pages_by_id[pt.precision_ids[lowered]].sum() > bytes_before
    assert core.controller.table is not table  # losses were re-scaled from the tracker
    core.kv.free(held)
    core.pool.check()


def test_paper_greedy_walks_the_papers_ladder_unless_configured():
    """paper-greedy, as published: full precision, INT8 and INT4 only, even when the scenario's
    ladder also has FP8 (pagedweight walks all of it); a configured ladder replaces it."""
    four = ("bf16", "fp8", "int8", "int4")
    core, clock, backend = make_core("paper-greedy", ladder=four)
    assert core.controller.table.ladder == core.ladder == ("bf16", "int8", "int4")
    drive(core, clock, backend, sawtooth(num_cycles=2))
    used = {t.to_precision for t in core.transitions}
    assert "int4" in used and "fp8" not in used
    assert make_core("pagedweight", ladder=four)[0].controller.table.ladder == four

    table = synthetic_table(MODEL, four, seed=1)

    def with_ladder(names):
        cfg = replace(core.config, paper_greedy_precisions=names)
        return RuntimeCore(cfg, "paper-greedy", table, DelayedCopies(), Clock())

    assert with_ladder(("bf16", "fp8", "int4")).controller.table.ladder == ("bf16", "fp8", "int4")
    with pytest.raises(ConfigError, match=r"\['int2'\] not in the precision ladder; allowed: bf16, fp8, int8, int4"):
        with_ladder(("bf16", "int2"))


def weight_bound_steps(core, fixed_s, all_top_s):
    """A step-time model where a step costs ``fixed_s`` plus time in proportion to the routed
    experts' pages: ``all_top_s`` more with every expert at the top of the ladder."""
    pt = core.page_table
    per_page_s = (all_top_s - fixed_s) / int(pt.pages_by_id[np.full(pt.num_experts, PRECISION_ID["bf16"])].sum())
    return lambda ids: fixed_s + int(pt.pages_by_id[ids].sum()) * per_page_s


def run_steps(core, clock, backend, model, num_steps, step_s=0.1):
    for _ in range(num_steps):
        clock.now_s += step_s
        backend.step += 1
        backend.land(core)
        core.controller.observe_step(model(core.page_table.precision_ids))
        core.plan_step()


def test_speed_downgrades_to_meet_the_tpot_slo_and_upgrades_stop_short_of_it():
    """No KV pressure at all: only speed moves precision. Every expert at bf16 makes an 80 ms
    step where the SLO is 50 ms; the controller downgrades until the step is predicted within
    it (and not much further), and the upgrades that memory would allow stop at 90% of it."""
    core, clock, backend = make_core(tpot_slo_s=0.05, min_dwell_s=0.0)
    model = weight_bound_steps(core, 0.01, 0.08)
    core.set_step_time_model(model)
    assert model(core.page_table.precision_ids) == pytest.approx(0.08)
    run_steps(core, clock, backend, model, 100)
    t_s = model(core.page_table.precision_ids)
    assert 0.04 <= t_s <= 0.05, t_s
    assert {t.kind for t in core.transitions} >= {DOWNGRADE}
    assert core.quality_proxy > 0 and not (core.page_table.precision_ids == PRECISION_ID["int4"]).all()
    run_steps(core, clock, backend, model, 100)  # memory is free the whole time
    assert model(core.page_table.precision_ids) <= 0.05
    # ... and no flapping once settled: the last 50 steps changed nothing.
    settled = len(core.transitions)
    run_steps(core, clock, backend, model, 50)
    assert len(core.transitions) == settled


def test_speed_leaves_precision_alone_when_no_precision_meets_the_slo():
    """A step of 300 ms of which weights are 70 ms cannot meet 50 ms at any precision: memory
    alone decides (here, nothing moves); paper-greedy never looks at speed."""
    for policy, fixed_s in (("pagedweight", 0.23), ("paper-greedy", 0.01)):
        core, clock, backend = make_core(policy, tpot_slo_s=0.05, min_dwell_s=0.0)
        model = weight_bound_steps(core, fixed_s, fixed_s + 0.07)
        core.set_step_time_model(model)
        run_steps(core, clock, backend, model, 50)
        assert not core.transitions, policy


def test_weight_read_model_prices_the_last_steps_active_experts():
    """The engine's step-time model: the bytes of the experts the last step used, at the map
    asked about, over the bandwidth; an unused expert's precision costs nothing."""
    core, clock, backend = make_core(tpot_slo_s=0.05, min_dwell_s=0.0)
    core.use_weight_read_model(1e9)
    model, pt = core.controller.step_time_s, core.page_table
    ids = pt.precision_ids.copy()
    assert model(ids) == 0.0  # no step seen yet
    routed = np.zeros((MODEL.num_moe_layers, MODEL.num_experts), dtype=np.int64)
    routed[0, :2] = 3
    core.observe_routing(routed)
    assert model(ids) == pytest.approx(2 * pt.bytes_by_id[ids[0]] / 1e9)
    cheaper = ids.copy()
    cheaper[:2] = PRECISION_ID["int4"]
    cheaper[5] = PRECISION_ID["int4"]  # not routed in the last step: no effect
    assert model(cheaper) == pytest.approx(2 * pt.bytes_by_id[PRECISION_ID["int4"]] / 1e9)
    assert model(cheaper) < model(ids)


def test_weight_read_model_puts_speed_in_the_objective_without_a_latency_model():
    """As in the simulator, a mean step past the SLO makes pagedweight downgrade the experts in
    use, with the engine's model (every expert routed every step, 2x the SLO at bf16)."""
    core, clock, backend = make_core(tpot_slo_s=0.05, min_dwell_s=0.0)
    pt = core.page_table
    all_bytes = float(pt.bytes_by_id[pt.precision_ids].sum())
    core.use_weight_read_model(all_bytes / 0.09)  # all experts at the top: 90 ms of reads
    routed = np.ones((MODEL.num_moe_layers, MODEL.num_experts), dtype=np.int64)
    for _ in range(100):
        clock.now_s += 0.1
        backend.step += 1
        backend.land(core)
        core.observe_routing(routed)
        core.controller.observe_step(0.01 + core.controller.step_time_s(pt.precision_ids))
        core.plan_step()
    assert any(t.kind == DOWNGRADE for t in core.transitions)
    assert 0.01 + core.controller.step_time_s(pt.precision_ids) <= 0.05 + 1e-9
