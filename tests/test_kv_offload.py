"""KV offload under pagedweight (``controller.kv_offload``): the scheduler's ``cost`` preemption
mode asks, per victim, whether to swap its KV to host memory or recompute it, and the
controller answers by comparing the two in time (``Controller.prefer_swap``)."""

from types import SimpleNamespace

import pytest
from backends import NullBackend

from pagedweight.core.kv_blocks import KvBlockAllocator
from pagedweight.core.pool import PagePool
from pagedweight.core.runtime import CoreConfig, RuntimeCore
from pagedweight.core.scheduler import REJECTED, RUNNING, WAITING, Request, Scheduler, SchedulerConfig
from pagedweight.core.spec import load_model
from pagedweight.errors import ConfigError
from pagedweight.policy.controller import ControllerSettings
from pagedweight.policy.importance import synthetic_table

MODEL = load_model("tiny-moe")


def make_core(policy="pagedweight", **settings):
    cfg = CoreConfig(model=MODEL, budget_bytes=40 << 20, page_bytes=16 << 10, kv_block_tokens=8,
                     controller=ControllerSettings(**settings))  # fmt: skip
    return RuntimeCore(
        cfg, policy, synthetic_table(MODEL, ("bf16", "int8", "int4"), seed=1), NullBackend(), lambda: 0.0
    )


def computed(tokens: int) -> Request:
    req = Request(0, 0.0, tokens, 8)
    req.num_computed_tokens = tokens
    return req


def test_long_requests_swap_and_short_ones_recompute():
    """Swap costs two copies, each a fixed latency plus its bytes over the bandwidth; recompute
    costs the tokens at the learnt seconds per prefill token: the copies' fixed cost makes
    recompute cheaper below a crossover length, swap above it."""
    core = make_core(kv_offload=True)
    ctl = core.controller
    assert core.scheduler.config.preemption_mode == "cost" and core.scheduler.swap_preferred == ctl.prefer_swap
    per_token_bytes = core.kv.block_bytes // core.kv.block_tokens
    assert per_token_bytes == MODEL.kv_bytes_per_token()
    assert not ctl.prefer_swap(computed(4000)), "no copy-time model yet: recompute"
    latency_s, bandwidth = 1e-3, 1e10
    core.set_copy_time_model(lambda num_bytes: latency_s + num_bytes / bandwidth)
    assert not ctl.prefer_swap(computed(4000)), "no prefill measured yet: recompute"
    ctl.observe_step(0.5, prefill_tokens=5000)  # 100 us a prefill token
    per_token_s = 1e-4
    # 2 (latency + T b / bandwidth) < T per_token_s  <=>  T > 2 latency / (per_token_s - 2 b / bandwidth)
    crossover = 2 * latency_s / (per_token_s - 2 * per_token_bytes / bandwidth)
    short, long = int(crossover) - 1, int(crossover) + 2
    assert not ctl.prefer_swap(computed(short)) and ctl.prefer_swap(computed(long))
    assert not ctl.prefer_swap(computed(0))
    # Copies slower than recompute at any length: recompute.
    core.set_copy_time_model(lambda num_bytes: num_bytes / 1e3)
    assert not ctl.prefer_swap(computed(100_000))


def test_a_cached_prefix_is_discounted_by_what_readmitted_victims_found():
    """Under prefix caching a recompute finds its prompt's blocks in the cache if they survive
    until it is readmitted: recompute is priced by the tokens left to compute, with the
    cacheable prefix discounted by the share recomputed victims found on readmission."""
    core = make_core(kv_offload=True)
    ctl, bt = core.controller, core.kv.block_tokens
    assert core.scheduler.prefix_caching
    core.set_copy_time_model(lambda num_bytes: num_bytes / 1e9)
    ctl.observe_step(0.5, prefill_tokens=5000)  # 100 us a prefill token
    per_token_bytes = core.kv.block_bytes // bt
    swap_s = 2 * 1000 * per_token_bytes / 1e9
    assert swap_s < 1000 * 1e-4 / 2, "without a cache the swap is the cheaper by far"
    plain = computed(1000)
    assert ctl.prefer_swap(plain) and not ctl.offload.recomputed
    keyed = computed(1000)
    keyed.prompt_tokens, keyed.num_output_tokens = 990, 10
    keyed.block_hashes = list(range(990 // bt))
    cacheable = min(990 // bt, 989 // bt) * bt
    assert not ctl.prefer_swap(keyed), "all but the last blocks' tokens are expected from the cache"
    assert ctl.offload.recomputed == {keyed: cacheable}
    # Readmitted: it found 10% of its prefix (its computed tokens before the step computes).
    keyed.state, keyed.num_computed_tokens = RUNNING, cacheable // 10
    ctl.observe_readmissions()
    survival = pytest.approx(1 + 0.1 * ((cacheable // 10) / cacheable - 1))
    assert not ctl.offload.recomputed and ctl.offload.cache_survival == survival
    keyed.state, keyed.num_computed_tokens = WAITING, 1000
    assert ctl.prefer_swap(keyed) and not ctl.offload.recomputed  # 9% of the prefix less: swap now
    for _ in range(30):  # every readmitted victim finds 10%: the estimate follows
        ctl.offload.recomputed[keyed] = cacheable
        keyed.state, keyed.num_computed_tokens = RUNNING, cacheable // 10
        ctl.observe_readmissions()
    assert 0.1 <= ctl.offload.cache_survival < 0.15
    # A victim aborted while waiting is forgotten without a sample.
    gone = computed(1000)
    gone.prompt_tokens, gone.block_hashes = 990, list(range(990 // bt))
    ctl.offload.recomputed[gone] = cacheable
    gone.state, before = REJECTED, ctl.offload.cache_survival
    ctl.observe_readmissions()
    assert not ctl.offload.recomputed and ctl.offload.cache_survival == before


@pytest.mark.parametrize("policy", ["static-fp16", "static-int4", "static-mixed", "paper-greedy", "kv-swap"])
def test_other_policies_preempt_as_before(policy):
    core = make_core(policy, kv_offload=True)
    want = "swap" if policy == "kv-swap" else "recompute"
    assert core.scheduler.config.preemption_mode == want and core.scheduler.swap_preferred is None


def test_pagedweight_recomputes_unless_kv_offload_is_on():
    core = make_core()
    assert core.scheduler.config.preemption_mode == "recompute" and core.scheduler.swap_preferred is None


def test_cost_mode_swaps_the_victims_the_rule_picks_and_recomputes_the_others():
    """Four requests in 8 blocks of 4 tokens under greedy admission: the decodes outgrow the
    blocks and preempt newest first. The rule here swaps victims with more than 8 tokens
    computed; a swapped victim resumes where it stopped, a recomputed one from the start, and
    every request still gets all its tokens."""
    pool = PagePool(8 * 1024, page_bytes=1024)
    kv = KvBlockAllocator(pool, 4, 1024 // 4)
    sched = Scheduler(SchedulerConfig(preemption_mode="cost", admission="greedy"), kv, max_kv_blocks=8)
    asked = []

    def rule(req):
        asked.append((req.request_id, req.num_computed_tokens))
        return req.num_computed_tokens > 8

    sched.swap_preferred = rule
    hooked = []
    sched.swap_out_hook = lambda req: hooked.append((req.request_id, len(req.block_ids), req.num_computed_tokens))
    reqs = [Request(i, 0.0, 8, 12) for i in range(4)]
    for r in reqs:
        sched.add(r)
    now, swapped, recomputed, out = 0.0, 0, 0, {}
    while sched.has_work():
        batch = sched.schedule(now)
        resumed = 0
        for req in batch.requests:
            if req.request_id in out:  # back after a preemption: where it stopped, or from 0
                resumed += req.num_computed_tokens
                assert req.num_computed_tokens == out.pop(req.request_id)
        assert batch.swapped_in_tokens == resumed
        for victim in batch.preempted:
            assert victim.state is WAITING and victim.block_ids == []
            out[victim.request_id] = victim.swapped_tokens
            if victim.swapped_tokens:
                swapped += 1
            else:
                recomputed += 1
        assert batch.swapped_out_tokens == sum(v.swapped_tokens for v in batch.preempted)
        sched.finish_step(batch, now + 1.0)
        now += 1.0
    assert swapped and recomputed, (asked, swapped, recomputed)
    assert all(r.num_output_tokens == r.max_output_tokens for r in reqs) and kv.num_used_blocks == 0
    # The hook saw each swapped victim while it still held the blocks of its computed tokens.
    assert len(hooked) == swapped and all(blocks * 4 >= tokens > 8 for _, blocks, tokens in hooked)


def test_an_expert_parallel_follower_replays_rank_0s_choice():
    """A follower's own controller could price a victim otherwise (its clock, its step times):
    it takes rank 0's choice, swap or recompute, from the batch it replays."""
    from pwgpu.ep_agree import EpFollower

    for swapped in (True, False):
        core = make_core(kv_offload=True)
        sched = core.scheduler
        sched.swap_preferred = lambda req, swapped=swapped: not swapped  # its own rule says the opposite
        req = Request(7, 0.0, 20, 4)
        sched.add(req)
        sched.finish_step(sched.schedule(0.0), 1.0)
        follower = object.__new__(EpFollower)
        follower.sched, follower.kv = sched, core.kv
        follower.engine = SimpleNamespace(_by_req={7: SimpleNamespace(req=req)})
        batch = follower._replay([(7, swapped)], [], 1.0)
        assert batch.preempted == [req] and req.swapped_tokens == (20 if swapped else 0)


def test_bad_preemption_mode_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="'recompute', 'swap' or 'cost'"):
        SchedulerConfig(preemption_mode="offload")
