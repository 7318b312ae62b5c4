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


# ---- serving under the SLOs (pagedweight): backlog, batch limits, late requests ------------------
def step_with(core, clock, backend, duration_of, step_s=None):
    """One step through the core's own pieces; the step lasts ``duration_of(batch)`` seconds."""
    backend.step += 1
    backend.land(core)
    core.plan_step()
    batch = core.scheduler.schedule(clock.now_s)
    shape = batch.shape()
    duration_s = duration_of(batch, shape) if batch.requests else 0.01
    start_s = clock.now_s
    clock.now_s += duration_s
    if batch.requests:
        core.scheduler.finish_step(batch, clock.now_s)
        core.record_step(start_s, duration_s, batch, shape)
    return batch


def test_a_backlog_downgrades_for_speed_and_precision_comes_back_when_it_drains():
    """No KV pressure (a roomy budget), no TPOT at risk: only the queue. 60 prompts arrive at
    once; prefilling them takes seconds while the TTFT SLO is 2 s, so speed is worth more than
    precision: every expert goes to the fastest precision for the step (INT4, by a weight-bound
    step-time model) and none comes up while the queue lasts. Once it has drained and stayed
    calm for ``backlog_calm_s``, upgrades restore full precision. Each expert moves twice."""
    core, clock, backend = make_core(
        budget_mib=400, ttft_slo_s=2.0, backlog_calm_s=0.5, min_dwell_s=0.0, plan_interval_s=0.0
    )
    model = weight_bound_steps(core, 0.01, 0.08)
    core.set_step_time_model(model)
    ctl, pt = core.controller, core.page_table
    assert (pt.precision_ids == PRECISION_ID["bf16"]).all()
    for rid in range(60):
        core.add(Request(rid, clock.now_s, 400, 20))

    def duration(batch, shape):
        return model(pt.precision_ids) + 1e-4 * shape.num_prefill_tokens

    saw_backlog = False
    while core.scheduler.waiting:
        step_with(core, clock, backend, duration)
        if ctl.backlog:
            saw_backlog = True
            assert not pt.in_flight or all(t.to_id == PRECISION_ID["int4"] for t in pt.in_flight.values())
    assert saw_backlog and (pt.precision_ids == PRECISION_ID["int4"]).all()
    assert all(t.kind is DOWNGRADE for t in core.transitions)
    while core.scheduler.has_work():
        step_with(core, clock, backend, duration)
    for _ in range(40):  # idle: the controller still plans (RuntimeCore.idle_tick)
        clock.now_s += 0.05
        backend.step += 1
        backend.land(core)
        core.idle_tick()
    assert not ctl.backlog
    assert (pt.precision_ids == PRECISION_ID["bf16"]).all()
    moves = np.bincount([t.expert for t in core.transitions], minlength=pt.num_experts)
    assert (moves == 2).all()  # down once, up once
    assert all(r.state.value == "finished" for r in core.scheduler.running) and not core.scheduler.waiting


def test_a_backlog_picks_the_precision_that_computes_fastest_for_prefill():
    """Where a prefill-heavy step is fastest at FP8 (FP8 MMAs) rather than at the fewest bytes,
    the backlog takes FP8: INT4 reads fewer bytes but computes no faster."""
    four = ("bf16", "fp8", "int8", "int4")
    core, clock, backend = make_core(budget_mib=400, ladder=four, ttft_slo_s=2.0, min_dwell_s=0.0, plan_interval_s=0.0)
    pt = core.page_table
    speed = {PRECISION_ID["bf16"]: 1.0, PRECISION_ID["fp8"]: 0.55, PRECISION_ID["int8"]: 0.9, PRECISION_ID["int4"]: 0.8}
    lut = np.array([speed.get(i, 1.0) for i in range(int(max(PRECISION_ID.values())) + 1)])

    def model(ids):
        return 0.08 * float(lut[ids].mean())

    core.set_step_time_model(model)
    for rid in range(60):
        core.add(Request(rid, clock.now_s, 400, 20))
    for _ in range(20):
        step_with(core, clock, backend, lambda b, s: model(pt.precision_ids) + 1e-4 * s.num_prefill_tokens)
    assert core.controller.backlog
    assert (pt.precision_ids == PRECISION_ID["fp8"]).all()


def test_admission_is_capped_where_the_step_would_pass_the_tpot_slo():
    """Steps cost 5 ms + 1 ms per decoding request + 20 us per prefill token (learnt from the
    steps that ran); the TPOT SLO is 50 ms, so (at 90% of it, beside 256 prefill tokens) about
    35 requests may decode at once. 60 arrive: pagedweight keeps the running batch there and
    serves the rest as requests finish, every step within the SLO once the fit has its
    samples (a few more get in while it is still learning); a static policy admits all 60
    (vLLM's rule, max_num_seqs 64). Nobody is dropped."""

    def duration(batch, shape):
        return 0.005 + 0.001 * shape.num_decodes + 2e-5 * shape.num_prefill_tokens

    def serve(policy):
        core, clock, backend = make_core(policy, budget_mib=400, tpot_slo_s=0.05, min_dwell_s=0.0)
        reqs = [Request(rid, 0.0, 16, 200) for rid in range(60)]
        peak, slow_steps = 0, 0
        for i, r in enumerate(reqs):
            core.add(r)
            if i < 20:  # a few requests first: the fit learns from steps of several shapes
                step_with(core, clock, backend, duration)
        while core.scheduler.has_work():
            batch = step_with(core, clock, backend, duration)
            peak = max(peak, len(core.scheduler.running))
            slow_steps += duration(batch, batch.shape()) > 0.05
            if policy == "pagedweight" and core.controller.steps.shape_fit.num_steps > 60:
                # (45 ms - 5 ms - 256 x 20 us) / 1 ms: 34 requests, or those running already
                n = len(core.scheduler.running)
                assert core.controller.step_limits(clock.now_s)[1] == max(34, n)
        assert all(r.state.value == "finished" for r in reqs)
        return peak, slow_steps

    peak, slow_steps = serve("pagedweight")
    assert 30 <= peak <= 40 and slow_steps == 0, (peak, slow_steps)
    for policy in ("static-int8", "paper-greedy"):
        assert serve(policy)[0] == 60, policy


def serve_two_waves(policy, **settings):
    """Overload: 60 requests arrive at 0 s, 30 more at 1.5 s, the TTFT SLO is 1 s, 50 ms steps;
    every request finishes. Returns the two waves."""
    core, clock, backend = make_core(policy, budget_mib=400, ttft_slo_s=1.0, min_dwell_s=0.0, **settings)
    first = [Request(rid, 0.0, 400, 10) for rid in range(60)]
    second = [Request(60 + rid, 1.5, 400, 10) for rid in range(30)]
    for r in first:
        core.add(r)
    added = False
    while core.scheduler.has_work() or not added:
        if not added and clock.now_s >= 1.5:
            for r in second:
                core.add(r)
            added = True
        step_with(core, clock, backend, lambda b, s: 0.05)
    assert all(r.state.value == "finished" for r in first + second)
    return first, second


def test_requests_that_missed_the_ttft_slo_wait_behind_those_that_can_meet_it():
    """Once the first wave has missed the TTFT SLO, the second (which still can meet it) is
    admitted first; the late ones after them, FCFS, none dropped. Static policies serve FCFS."""
    first, second = serve_two_waves("pagedweight")
    late = [r for r in first if r.first_scheduled_s > 1.5]
    assert late, "the test needs requests still waiting when the second wave arrives"
    assert max(r.first_scheduled_s for r in second) <= min(r.first_scheduled_s for r in late)
    assert [r.request_id for r in sorted(late, key=lambda r: r.first_scheduled_s)] == [r.request_id for r in late]
    first, second = serve_two_waves("static-int8")
    assert max(r.first_scheduled_s for r in first) <= min(r.first_scheduled_s for r in second)


def test_static_policies_have_no_step_limits_and_paper_greedy_no_slo_serving():
    for policy in ("static-fp16", "static-int8", "static-int4", "static-mixed", "kv-swap", "paper-greedy"):
        core, _, _ = make_core(policy, budget_mib=400, tpot_slo_s=0.05, ttft_slo_s=1.0)
        assert core.scheduler.step_limits is None, policy
        if core.controller is not None:
            assert core.controller.scheduler is None and core.controller.steps.shape_fit is None
    core, _, _ = make_core("pagedweight", budget_mib=400, tpot_slo_s=0.05, ttft_slo_s=1.0)
    assert core.scheduler.step_limits == core.controller.step_limits
    core, _, _ = make_core("pagedweight", budget_mib=400, tpot_slo_s=0.05, slo_batching=False)
    assert core.scheduler.step_limits is None


def test_slo_serving_settings_are_checked():
    with pytest.raises(ConfigError, match=r"backlog_fraction\(=0\) must be in \(0, 1\]"):
        ControllerSettings(backlog_fraction=0)
    with pytest.raises(ConfigError, match=r"min_prefill_tokens\(=0\) must be >= 1"):
        ControllerSettings(min_prefill_tokens=0)
    with pytest.raises(ConfigError, match=r"backlog_calm_s\(=-1\) must be >= 0"):
        ControllerSettings(backlog_calm_s=-1)


def test_a_backlog_under_the_engines_weight_read_model_takes_the_fewest_bytes():
    """The engine's step-time model prices the bytes of the experts in use: a backlog there
    takes INT4, compared on whole steps (the measured step, plus the bytes each map changes)."""
    core, clock, backend = make_core(budget_mib=400, ttft_slo_s=2.0, min_dwell_s=0.0, plan_interval_s=0.0)
    pt = core.page_table
    core.use_weight_read_model(float(pt.bytes_by_id[pt.precision_ids].sum()) / 0.02)  # 20 ms at BF16
    routed = np.ones((MODEL.num_moe_layers, MODEL.num_experts), dtype=np.int64)
    for rid in range(60):
        core.add(Request(rid, clock.now_s, 400, 20))

    def duration(batch, shape):
        core.observe_routing(routed)
        return 0.03 + core.controller.step_time_s(pt.precision_ids) + 1e-4 * shape.num_prefill_tokens

    for _ in range(20):
        step_with(core, clock, backend, duration)
    assert core.controller.backlog
    assert (pt.precision_ids == PRECISION_ID["int4"]).all()


def test_the_step_fits_3x3_solve_agrees_with_lapack():
    """``solve_symmetric3`` (the fit's solve in Python floats) against numpy's LU solve on
    random symmetric positive definite systems, ill-conditioned ones included."""
    from pagedweight.policy.latency_cap import solve_symmetric3

    rng = np.random.default_rng(0)
    for _ in range(500):
        b = rng.normal(size=(3, 3)) * rng.uniform(0.01, 100)
        a = b @ b.T + 1e-3 * np.eye(3)
        rhs = rng.normal(size=3)
        x = solve_symmetric3((a[0, 0], a[0, 1], a[0, 2], a[1, 1], a[1, 2], a[2, 2]), tuple(rhs))
        np.testing.assert_allclose(x, np.linalg.solve(a, rhs), rtol=1e-7, atol=1e-12)
    assert solve_symmetric3((1.0, 1.0, 1.0, 1.0, 1.0, 1.0), (1.0, 2.0, 3.0)) is None  # singular


def test_step_shape_fit_learns_a_steps_time_from_its_shape():
    """Steps timed a + b * prefill + c * decodes (with noise) give back a, b and c; before
    ``MIN_STEPS`` steps there is no fit, and a later change of speed is followed."""
    from pagedweight.policy.latency_cap import StepShapeFit

    rng = np.random.default_rng(1)
    fit = StepShapeFit()
    for i in range(400):
        if i == StepShapeFit.MIN_STEPS - 1:
            assert fit.fit() is None
        p, d = int(rng.integers(0, 2048)), int(rng.integers(1, 128))
        fit.observe(0.010 + 2e-5 * p + 3e-4 * d + rng.normal(0, 1e-4), p, d)
    a, b, c = fit.fit()
    assert a == pytest.approx(0.010, rel=0.05) and b == pytest.approx(2e-5, rel=0.05)
    assert c == pytest.approx(3e-4, rel=0.05)
    for _ in range(600):  # twice as slow per decode: the forgetting fit follows
        p, d = int(rng.integers(0, 2048)), int(rng.integers(1, 128))
        fit.observe(0.010 + 2e-5 * p + 6e-4 * d, p, d)
    assert fit.fit()[2] == pytest.approx(6e-4, rel=0.05)


def test_a_cap_on_the_wait_of_late_requests_serves_them_again_in_arrival_order():
    """The same overload with ``late_wait_max_s``: a late request waits behind the on-time ones
    no longer than the cap since its arrival, then goes ahead of them; without the cap the
    first wave's late requests all wait for the second wave."""
    first, second = serve_two_waves("pagedweight")
    late = [r for r in first if r.first_scheduled_s > 1.5]
    assert late and max(r.first_scheduled_s for r in second) <= min(r.first_scheduled_s for r in late)
    # Past 1.6 s of waiting, the first wave goes ahead again.
    first, second = serve_two_waves("pagedweight", late_wait_max_s=1.6)
    late = [r for r in first if r.first_scheduled_s > 1.5]
    assert late, "the test needs first-wave requests waiting when the second wave arrives"
    # Once overdue, the first wave's rest goes ahead of the second wave still waiting.
    assert max(r.first_scheduled_s for r in first) < max(r.first_scheduled_s for r in second)
    order = [r.request_id for r in sorted(first, key=lambda r: r.first_scheduled_s)]
    assert order == sorted(order)  # the first wave itself stays in arrival order


def test_queue_watch_enters_a_backlog_at_once_and_leaves_it_only_after_a_calm_spell():
    """``QueueWatch``: a projected wait past ``enter_s`` starts a backlog; it ends only after
    the wait has stayed under half of ``enter_s`` for ``calm_s`` (a wait between the two lines
    restarts the calm spell), and ``update`` says when it ended. The pressure EMA moves toward 1
    while the queue presses and decays by exp(-dt / calm_s) toward 0 once it does not."""
    import math

    from pagedweight.policy.serving_order import QueueWatch

    q = QueueWatch(enter_s=1.0, calm_s=10.0)
    assert not q.update(0.0, 0.4) and not q.backlog and q.pressure == 0.0
    assert not q.update(1.0, 1.5) and q.backlog
    p = 1.0 - math.exp(-1 / 10)
    assert q.pressure == pytest.approx(p)
    assert not q.update(2.0, 0.2) and q.backlog  # calm from 2 s
    assert not q.update(8.0, 0.7) and q.backlog  # past the calm line: the spell restarts
    assert not q.update(9.0, 0.2) and not q.update(18.5, 0.2) and q.backlog  # calm since 9 s
    assert q.update(19.0, 0.2) and not q.backlog  # 10 s calm: ended, said once
    assert not q.update(20.0, 0.2) and not q.backlog
    before = q.pressure
    assert not q.update(30.0, 0.2) and q.pressure == pytest.approx(before * math.exp(-1.0))


def test_step_stats_keep_the_mean_step_and_the_seconds_per_prefill_token():
    """``StepStats``: the first step sets the mean, later ones move it by 1/256 of the gap;
    only prefill-heavy steps (>= 64 prefill tokens, no fewer than the decodes) give seconds
    per computed token; the shape fit's per-token slope is preferred once it has one."""
    from pagedweight.policy.latency_cap import StepShapeFit
    from pagedweight.policy.step_stats import StepStats

    st = StepStats()
    st.observe(0.020, prefill_tokens=0, decodes=8)
    assert st.step_ema_s == 0.020 and st.token_ema_s == 0.0 and st.prefill_token_s() == 0.0
    st.observe(0.276, prefill_tokens=32, decodes=8)  # too few prefill tokens to price a token
    assert st.step_ema_s == pytest.approx(0.021) and st.token_ema_s == 0.0
    st.observe(0.1, prefill_tokens=990, decodes=10)
    assert st.token_ema_s == pytest.approx(1e-4) and st.last_step_s == 0.1 and st.last_prefill_tokens == 990
    st.observe(0.1, prefill_tokens=90, decodes=110)  # more decodes than prefill: not a sample
    assert st.token_ema_s == pytest.approx(1e-4)
    st.refit()
    assert st.fit is None  # no shape fit kept
    fitted = StepStats(StepShapeFit())
    for i in range(StepShapeFit.MIN_STEPS):
        p, d = 256 * (i % 4), 1 + i
        fitted.observe(0.01 + 5e-5 * p + 1e-3 * d, p, d)
    fitted.refit()
    assert fitted.prefill_token_s() == pytest.approx(5e-5, rel=0.05)
