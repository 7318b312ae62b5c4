"""Cached prefixes against precision: the downgrade reserve holds back cached pages whatever the
blocks per page, protected blocks are not counted free, the ghost list measures reuse, and the
pagedweight controller keeps a hot cache (downgrading cheap experts instead) while it lets a
cold one go first, as every other policy always does."""

import math
from pathlib import Path

import numpy as np
import pytest

from pagedweight.core.kv_blocks import KvBlockAllocator
from pagedweight.core.pool import OWNER_KV_CACHED, PagePool, weight_owner
from pagedweight.core.reuse import GhostList
from pagedweight.core.runtime import CoreConfig, RuntimeCore
from pagedweight.core.scheduler import SchedulerConfig
from pagedweight.core.spec import load_model
from pagedweight.errors import ConfigError, PoolExhausted
from pagedweight.policy.controller import DOWNGRADE, ControllerSettings
from pagedweight.policy.importance import synthetic_table

ROOT = Path(__file__).resolve().parents[1]
PAGE = 1024
MODEL = load_model("tiny-moe")


def cached_allocator(num_pages, blocks_per_page, cached_pages):
    """An allocator whose first ``cached_pages`` pages hold only evictable cached blocks."""
    pool = PagePool(num_pages * PAGE, PAGE)
    kv = KvBlockAllocator(pool, 1, PAGE // blocks_per_page)
    blocks = kv.allocate(cached_pages * blocks_per_page)
    for i, b in enumerate(blocks):
        kv.cache_block(b, i)
    kv.free(blocks)
    return pool, kv


# ---- the downgrade reserve -------------------------------------------------------------------


@pytest.mark.parametrize("blocks_per_page", [1, 2, 4])
def test_the_reserve_holds_back_cached_pages_whatever_the_blocks_per_page(blocks_per_page):
    """Four cached pages and one free page, a reserve of two: KV may take three pages' worth of
    blocks and no more, so that a downgrade still finds two pages (reclaiming cached ones)."""
    pool, kv = cached_allocator(5, blocks_per_page, 4)
    kv.reserve_pages = 2
    assert pool.num_free == 1 and pool.num_owned(OWNER_KV_CACHED) == 4
    assert kv.num_free_blocks == 3 * blocks_per_page
    with pytest.raises(PoolExhausted):
        kv.allocate(3 * blocks_per_page + 1)
    kv.allocate(3 * blocks_per_page)
    assert pool.num_available == 2 and kv.num_free_blocks == 0
    assert len(pool.alloc(weight_owner(0), 2)) == 2  # a downgrade's pages: reclaimed
    pool.check()
    kv.check()


def test_the_reserve_keeps_whole_cached_pages_when_partly_used_pages_have_room():
    """Several blocks a page, fewer free pages than the reserve: free slots and evictable blocks
    of pages requests hold are taken before a cached page is broken into."""
    pool = PagePool(4 * PAGE, PAGE)
    kv = KvBlockAllocator(pool, 1, PAGE // 4)
    cached = kv.allocate(4)  # page 0: cached below
    for i, b in enumerate(cached):
        kv.cache_block(b, 100 + i)
    kv.free(cached)
    shared = kv.allocate(4)  # page 1: one block cached and idle, three held
    kv.cache_block(shared[0], 7)
    kv.free(shared[:1])
    held = kv.allocate(2)  # page 2: two held, two free slots
    kv.reserve_pages = 2  # one free page (3) + one cached page (0): nothing to spare
    assert pool.num_free == 1 and pool.num_owned(OWNER_KV_CACHED) == 1
    assert kv.num_free_blocks == 3  # the idle block of page 1, two free slots of page 2
    got = kv.allocate(3)
    assert sorted(b // 4 for b in got) == [1, 2, 2]
    assert pool.num_owned(OWNER_KV_CACHED) == 1 and pool.num_free == 1
    assert kv.key_of(cached[0]) == 100  # the cached page is intact
    kv.check()
    kv.free(held + got + shared[1:])
    kv.check()


# ---- protection and the ghost list ------------------------------------------------------------


@pytest.mark.parametrize("blocks_per_page", [1, 3])
def test_protected_blocks_are_not_counted_free_until_unprotected(blocks_per_page):
    pool, kv = cached_allocator(6, blocks_per_page, 4)
    free_all = kv.num_free_blocks
    assert free_all == 6 * blocks_per_page
    kv.protected_blocks = 10**9  # every evictable block
    assert kv.num_protected_blocks == 4 * blocks_per_page
    assert kv.num_free_blocks == 2 * blocks_per_page
    assert kv.num_protected_pages == 4
    with pytest.raises(PoolExhausted):
        kv.allocate(2 * blocks_per_page + 1)
    # A prefix hit taking idle protected blocks leaves the free count as it was.
    assert kv.free_after_acquire(3) == kv.num_free_blocks
    kv.unprotect(blocks_per_page)
    assert kv.num_free_blocks == 3 * blocks_per_page
    got = kv.allocate(3 * blocks_per_page)
    assert kv.num_evicted_blocks == blocks_per_page  # the least recently used, in place
    kv.unprotect(10**9)
    assert kv.protected_blocks == 0 and kv.num_free_blocks == 3 * blocks_per_page
    kv.check()
    kv.free(got)
    kv.check()


def test_ghost_list_counts_requests_coming_back_for_evicted_blocks_once():
    pool, kv = cached_allocator(4, 1, 4)
    ghosts = kv.track_reuse(capacity_blocks=2)
    held = [b for _ in range(4) for b in kv.allocate(1)]  # evicts all four, least recently used first
    # Blocks were released last-first, so keys 3 and 2 went first, and with the second
    # generation of two (keys 1 and 0) they were forgotten.
    assert kv.num_evicted_blocks == 4 and len(ghosts) == 2
    assert ghosts.count_hits([0, 1, 2, 3], 0, 4, now_s=10.0) == 2
    assert ghosts.count_hits([0, 1, 2, 3], 0, 4, now_s=10.0) == 0  # counted once
    assert ghosts.num_hits == 2
    kv.free(held)


def test_ghost_hit_rate_decays_with_time_and_is_per_block():
    g = GhostList(capacity=100, window_s=10.0)
    for key in range(100):
        g.add(key)
    assert g.hit_rate_per_block(0.0) == 0.0
    g.count_hits(list(range(20)), 0, 20, now_s=5.0)
    r0 = g.hit_rate_per_block(5.0)
    assert r0 == pytest.approx(20 / 10.0 / 80)  # per ghost left
    assert g.hit_rate_per_block(15.0) == pytest.approx(r0 * np.exp(-1.0))


def test_recompute_weight_must_not_be_negative():
    with pytest.raises(ConfigError, match="recompute_weight"):
        ControllerSettings(recompute_weight=-0.5)


# ---- the controller's decision ------------------------------------------------------------------


def make_core(policy="pagedweight", page_kib=16, budget_mib=40, **settings):
    table = synthetic_table(MODEL, ("bf16", "int8", "int4"), seed=1)
    cfg = CoreConfig(
        model=MODEL,
        budget_bytes=budget_mib * 2**20,
        page_bytes=page_kib * 1024,
        kv_block_tokens=8,
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=2048),
        controller=ControllerSettings(plan_interval_s=0.0, min_dwell_s=0.0, **settings),
    )
    now = [0.0]

    class Backend:
        def downgrade(self, t):
            pass

        def start_upgrade(self, t):
            raise AssertionError("no upgrade expected")

        def abort_upgrade(self, t):
            pass

        def poll(self):
            pass

    return RuntimeCore(cfg, policy, table, Backend(), lambda: now[0]), now


def fill_cache(core, cached_blocks, hot):
    """``cached_blocks`` evictable cached blocks, then KV held until only they and the reserve
    are left; with ``hot``, requests came back for evicted blocks (ghost hits) and prefill steps
    taught the controller what a token costs."""
    kv = core.kv
    blocks = kv.allocate(cached_blocks)
    for i, b in enumerate(blocks):
        kv.cache_block(b, 10_000 + i)
    kv.free(blocks)
    if kv.ghosts is not None and hot:
        for key in range(64):
            kv.ghosts.add(key)
        kv.ghosts.count_hits(list(range(60)), 0, 60, now_s=1.0)
    if core.controller is not None:
        for _ in range(40):
            core.controller.observe_step(0.2, 2048, 0)  # ~0.1 ms a token
    held = kv.allocate(kv.num_free_blocks - kv.num_cached_blocks)
    assert kv.num_free_blocks == kv.num_cached_blocks == cached_blocks
    return held


def take_free(core):
    """Hold every block that is free beside the cached ones (the plan may have freed some)."""
    kv = core.kv
    return kv.allocate(kv.num_free_blocks - (kv.num_cached_blocks - kv.num_protected_blocks))


def shortage(core, num_blocks):
    """What the scheduler does when a request needs ``num_blocks`` more blocks than are free."""
    kv = core.kv
    short = num_blocks - kv.num_free_blocks
    if short > 0:
        core.scheduler.pressure_hook(short)
    assert kv.num_free_blocks >= num_blocks, "protection must never leave KV short"
    return kv.allocate(num_blocks)


@pytest.mark.parametrize("page_kib", [16, 64])
def test_a_hot_cache_is_kept_and_cheap_experts_are_downgraded_instead(page_kib):
    core, now = make_core(page_kib=page_kib)
    kv = core.kv
    cached = 40 * kv.blocks_per_page
    fill_cache(core, cached, hot=True)
    before = core.page_table.precision_ids.copy()
    now[0] = 2.0
    core.plan_step()  # may already downgrade, to keep room for KV growth beside the kept cache
    assert core.controller.cache_page_value(now[0]) > 0
    assert kv.num_protected_blocks == cached, "a hot cache worth more than the cheapest downgrades is protected"
    take_free(core)
    shortage(core, 8 * kv.blocks_per_page)
    assert kv.num_cached_blocks == cached and kv.num_evicted_blocks == 0, "the hot cache was kept"
    lowered = np.flatnonzero(core.page_table.precision_ids != before)
    assert len(lowered) > 0, "experts were downgraded instead"
    # The cheapest: every expert lowered loses less per freed byte than any expert left alone.
    t = core.controller.table
    slope = (t.dloss[:, 1] - t.dloss[:, 0]) / (t.bytes[:, 0] - t.bytes[:, 1])
    untouched = np.setdiff1d(np.arange(len(before)), lowered)
    assert slope[lowered].max() <= slope[untouched].min()
    core.pool.check()
    kv.check()


@pytest.mark.parametrize("page_kib", [16, 64])
def test_a_cold_cache_is_evicted_first(page_kib):
    """No request ever came back for an evicted block: the cache is worth nothing measurable,
    so it gives way first and no expert is downgraded (vLLM's order)."""
    core, now = make_core(page_kib=page_kib)
    kv = core.kv
    cached = 40 * kv.blocks_per_page
    fill_cache(core, cached, hot=False)
    now[0] = 2.0
    core.plan_step()  # the low watermark's downgrades, as without a cache
    assert kv.num_protected_blocks == 0
    take_free(core)
    before = core.page_table.precision_ids.copy()
    shortage(core, 8 * kv.blocks_per_page)
    assert kv.num_evicted_blocks == 8 * kv.blocks_per_page
    assert (core.page_table.precision_ids == before).all()


def test_downgrades_stop_where_they_cost_more_than_the_cache():
    """A shortage larger than the cheap downgrades can cover: they are made, and the rest comes
    from the protected cache, not from expensive downgrades and never from a preemption."""
    core, now = make_core()
    kv = core.kv
    fill_cache(core, 60, hot=True)
    now[0] = 2.0
    core.plan_step()
    take_free(core)
    ctl = core.controller
    weights = core.pool.num_weight_pages()
    ctl._weights_over_cache_pages = weights - 10  # only 10 pages of downgrades are cheaper
    shortage(core, 50)
    # Cheap downgrades were made (the plan frees whole expert steps, so up to one step more) ...
    pt = core.page_table
    step_pages = int((pt.pages_by_id[ctl.ladder_ids[:-1]] - pt.pages_by_id[ctl.ladder_ids[1:]]).max())
    assert weights - 10 - step_pages <= core.pool.num_weight_pages() < weights
    # ... and the rest of the 50 blocks came from the cache.
    assert kv.num_evicted_blocks > 0


def test_recompute_weight_zero_keeps_vllms_order():
    core, now = make_core(recompute_weight=0.0)
    assert core.kv.ghosts is None
    fill_cache(core, 40, hot=True)
    now[0] = 2.0
    core.plan_step()
    assert core.kv.protected_blocks == 0


def test_under_a_ttft_slo_the_cache_is_weighed_by_how_hard_the_queue_has_pressed_lately():
    """Under a TTFT SLO, recompute time is worth quality only as far as it can cost a first
    token its SLO: a hot cache with a calm queue gives way first (nothing protected); while the
    queue's projected wait stays past half the backlog threshold the cache's value rises to its
    full weight (an EMA over ``backlog_calm_s``) and the cache is kept; once calm, it decays."""
    from pagedweight.core.scheduler import Request

    core, now = make_core(ttft_slo_s=2.0, backlog_calm_s=20.0)  # backlog at 1 s of wait, the cache from 0.5 s
    ctl = core.controller
    ctl.step_time_s = lambda ids: 0.01  # a runtime's step-time model turns the SLO machinery on
    kv = core.kv
    cached = 40 * kv.blocks_per_page
    fill_cache(core, cached, hot=True)
    now[0] = 2.0
    core.plan_step()
    assert ctl.cache_page_value(now[0]) == 0.0 and kv.num_protected_blocks == 0

    def plan_with_a_request_waiting_for(wait_s):
        core.scheduler.waiting.clear()
        core.scheduler.waiting.append(Request(0, arrival_s=now[0] - wait_s, prompt_tokens=16, max_output_tokens=4))
        core.plan_step()
        assert 0.5 < ctl.queue_wait_s(now[0]) < 1.0 and not ctl.backlog
        return ctl.queue_pressure

    # A minute with the wait past the calm line, never a backlog: the pressure rises as an EMA
    # with a 20 s time constant, and the cache is weighed in proportion.
    pressure = []
    for _ in range(60):
        now[0] += 1.0
        pressure.append(plan_with_a_request_waiting_for(0.6))
    assert math.isclose(pressure[0], 1 - math.exp(-1 / 20), rel_tol=1e-9), "a moment past the line adds little"
    assert math.isclose(pressure[-1], 1 - math.exp(-60 / 20), rel_tol=1e-9)
    assert ctl.cache_page_value(now[0]) > 0
    assert kv.num_protected_blocks == cached, "after a minute of pressure the hot cache is kept"
    # Two minutes calm: it decays the same way, and the cache gives way first again.
    core.scheduler.waiting.clear()
    for _ in range(120):
        now[0] += 1.0
        core.plan_step()
    assert math.isclose(ctl.queue_pressure, pressure[-1] * math.exp(-120 / 20), rel_tol=1e-9)
    assert kv.num_protected_blocks == 0


@pytest.mark.parametrize("policy", ["static-fp16", "static-int4", "kv-swap", "paper-greedy"])
def test_other_policies_still_evict_cached_prefixes_first(policy):
    core, now = make_core(policy)
    kv = core.kv
    assert kv.ghosts is None
    fill_cache(core, 40, hot=True)
    now[0] = 2.0
    core.plan_step()
    assert kv.protected_blocks == 0
    before = core.page_table.precision_ids.copy()
    kv.allocate(8)
    assert kv.num_evicted_blocks == 8 and (core.page_table.precision_ids == before).all()


# ---- end to end ---------------------------------------------------------------------------------


def multiturn(policy, *sets):
    from pagedweight.config.run import scenario_run
    from pagedweight.config.scenario import load_scenario
    from pwsim.latency import build_latency_model
    from pwsim.run import scenario_engine

    loaded = load_scenario(ROOT / "scenarios" / "multiturn.yaml", ["workload.max_requests=400", *sets])
    run = scenario_run(loaded, [policy])
    lat = build_latency_model(loaded.scenario.latency, loaded.model, loaded.gpu, loaded.base_dir)
    eng = scenario_engine(run, policy, lat, loaded.scenario.routing)
    eng.run()
    eng.core.pool.check()
    eng.core.kv.check()
    return eng.core


def test_pagedweight_keeps_a_multiturn_cache_that_vllms_order_gives_away():
    """Conversations come back for their history: pagedweight measures it (ghost hits), keeps
    more of the cache than with recompute_weight 0 (which is vLLM's order), hits more often and
    pays in downgrades; nobody is preempted either way. Without a TTFT SLO: under the
    scenario's own, the queue stays calm at this load and the cache gives way first (below)."""
    kept = multiturn("pagedweight", "slo.ttft_ms=null")
    plain = multiturn("pagedweight", "slo.ttft_ms=null", "controller.recompute_weight=0")
    assert kept.kv.ghosts.num_hits > 0
    assert kept.scheduler.prefix_hit_tokens > plain.scheduler.prefix_hit_tokens
    assert kept.num_transitions[DOWNGRADE] >= plain.num_transitions[DOWNGRADE]
    assert kept.scheduler.num_preemptions == plain.scheduler.num_preemptions == 0
    # summary.json reports the ghost hits the policy priced the cache by (0 without a list).
    from pagedweight.results.writer import prefix_summary

    steps = {"kv_pages": np.array([1]), "kv_cached_pages": np.array([0])}
    assert prefix_summary(kept, steps)["prefix_ghost_hits"] == kept.kv.ghosts.num_hits > 0
    assert prefix_summary(plain, steps)["prefix_ghost_hits"] == 0


def test_under_the_scenarios_ttft_slo_a_calm_multiturn_queue_lets_the_cache_go_first():
    """The shipped multi-turn scenario at its own load, its first 400 requests: the queue never
    presses, so pagedweight keeps the hits of vLLM's order (recompute_weight 0) and makes no
    downgrade for the cache."""
    slo = multiturn("pagedweight")
    plain = multiturn("pagedweight", "controller.recompute_weight=0")
    assert slo.kv.ghosts.num_hits > 0, "reuse is still measured"
    assert slo.scheduler.prefix_hit_tokens == plain.scheduler.prefix_hit_tokens
    assert slo.num_transitions[DOWNGRADE] == plain.num_transitions[DOWNGRADE]
