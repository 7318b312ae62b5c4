"""The core's step loop and configuration on a fake backend: what every runtime relies on."""

import numpy as np
import pytest
from backends import NullBackend

from pagedweight.core.runtime import CoreConfig, Executed, RuntimeCore
from pagedweight.core.scheduler import Request, SchedulerConfig
from pagedweight.core.spec import PRECISION_ID, load_model
from pagedweight.errors import ConfigError, PagedWeightError
from pagedweight.policy.controller import ABORT, DOWNGRADE, UPGRADE, Change
from pagedweight.policy.importance import synthetic_table
from pwsim.routing_source import ReplayRouting

MODEL = load_model("tiny-moe")


def make_core(budget_mib=64, policy="static-fp16", **cfg):
    clock = [0.0]
    core = RuntimeCore(
        CoreConfig(model=MODEL, budget_bytes=budget_mib << 20, **cfg),
        policy,
        synthetic_table(MODEL, ("bf16", "int8", "int4")),
        NullBackend(),
        clock=lambda: clock[0],
    )
    return core, clock


def routed(step):
    counts = np.zeros((MODEL.num_moe_layers, MODEL.num_experts), dtype=np.int64)
    counts[:, : MODEL.top_k] = step.shape.num_tokens
    return counts


def test_for_model_derives_pages_and_context_and_checks_the_shape():
    cfg = CoreConfig(budget_bytes=1 << 30).for_model(MODEL)
    block_bytes = 16 * MODEL.kv_bytes_per_token()
    assert cfg.page_bytes == max(1 << 15, block_bytes) and cfg.scheduler.max_model_len == MODEL.max_context_tokens
    capped = CoreConfig(budget_bytes=1 << 30, scheduler=SchedulerConfig(max_model_len=10**6)).for_model(MODEL)
    assert capped.scheduler.max_model_len == MODEL.max_context_tokens
    other = MODEL.model_copy(update={"dtype_bytes": 4})
    with pytest.raises(ConfigError, match="KV bytes per token|pinned bytes"):
        CoreConfig(model=MODEL, budget_bytes=1 << 30).for_model(other)


def test_a_step_runs_the_sequence_once_and_records_it():
    core, clock = make_core()
    core.add(Request(0, 0.0, 20, 2))
    seen = []
    core.on_step = seen.append

    def execute(step):
        step.observe_routing(routed(step))
        clock[0] += 0.5
        return Executed()

    first = core.run_step(execute)
    assert first.index == 0 and first.shape.num_tokens == 20 and core.backend.polls == 1
    assert core.steps.columns()["duration_s"].tolist() == [0.5]
    assert core.run_step(execute).index == 1 and seen == [first, seen[1]]
    assert core.run_step(execute) is None  # the request is done: nothing to compute


def test_a_history_window_keeps_the_newest_steps_and_transitions_and_counts_them_all():
    core, clock = make_core(history_window=3)
    core.add(Request(0, 0.0, 20, 6))
    indices = []
    core.on_step = lambda step: indices.append(step.index)

    def execute(step):
        step.observe_routing(routed(step))
        clock[0] += 0.5
        return Executed()

    while core.run_step(execute) is not None:
        pass
    assert indices == list(range(6)) and core.steps.num_recorded == 6
    assert core.steps.columns()["step"].tolist() == [3, 4, 5]
    n = core.page_table.num_experts
    core.apply([Change(DOWNGRADE, e, PRECISION_ID["int8"]) for e in range(n)])
    assert len(core.transitions) == 3 and [t.expert for t in core.transitions] == [n - 3, n - 2, n - 1]
    assert core.num_transitions == {DOWNGRADE: n, UPGRADE: 0, ABORT: 0}


def test_a_step_must_report_its_routing_once_and_not_wait_when_run_directly():
    core, _ = make_core()
    core.add(Request(0, 0.0, 20, 5))
    with pytest.raises(PagedWeightError, match="without reporting its routing"):
        core.run_step(lambda step: Executed())

    def twice(step):
        step.observe_routing(routed(step))
        step.observe_routing(routed(step))
        return Executed()

    with pytest.raises(PagedWeightError, match="twice"):
        core.run_step(twice)

    def waits(step):
        step.observe_routing(routed(step))
        return Executed(duration_s=1.0, wait="a timeout")

    with pytest.raises(PagedWeightError, match="drive core.step"):
        core.run_step(waits)


def test_stall_check_raises_only_when_nothing_can_change():
    core, _ = make_core()
    core.check_stall(requests_coming=False)  # nothing waits: no stall
    core.scheduler.add(Request(0, 0.0, 10, 10))  # waits, and nothing runs or is in flight
    core.check_stall(requests_coming=True)
    with pytest.raises(PagedWeightError, match="stalled at t=0.000s with 1 requests waiting"):
        core.check_stall(requests_coming=False)


def test_a_rejected_arrival_finishes_on_arrival():
    core, clock = make_core()
    clock[0] = 3.0
    req = Request(0, 3.0, MODEL.max_context_tokens, 10)
    assert not core.add(req) and req.finish_s == 3.0 and "context limit" in req.reject_reason


def test_replayed_routing_must_match_the_step():
    counts = np.full((2, 4), 3)
    replay = ReplayRouting([counts], top_k=2)  # 3 * 4 / 2 = 6 tokens per step
    with pytest.raises(PagedWeightError, match="step 0 has 5 tokens; the recording routed 6"):
        replay.sample(5)
    assert replay.sample(6) is not None
    with pytest.raises(PagedWeightError, match="only 1 recorded"):
        replay.sample(6)


def test_runs_of_aborts_and_upgrades_apply_as_one_change_after_another():
    """``apply`` sends runs of aborts and upgrades to the pool in one call each: the pages,
    the log and the changes applied are those of one change at a time, repeats included."""
    from pagedweight.core.pool import OWNER_TRANSITION
    from pagedweight.core.spec import PRECISION_ID
    from pagedweight.policy.controller import ABORT, DOWNGRADE, UPGRADE, Change

    int4, bf16 = PRECISION_ID["int4"], PRECISION_ID["bf16"]
    cores = [make_core(budget_mib=64)[0] for _ in range(2)]
    n = cores[0].page_table.num_experts
    down = [Change(DOWNGRADE, e, int4) for e in range(6)]
    up = [Change(UPGRADE, e, bf16) for e in (4, 1, 3, 0)]
    aborts = [Change(ABORT, e, int4) for e in (3, 4, 3, n - 1, 1)]  # a repeat, one not in flight
    for i, core in enumerate(cores):
        core._step_changes = []
        for batch in (down, up, aborts, up[:2]):
            if i == 0:
                core.apply(batch)
            else:
                core._apply_each(batch)
    a, b = cores
    assert a._step_changes == b._step_changes
    assert list(a.transitions) == list(b.transitions)
    assert {e: t.pages.tolist() for e, t in a.page_table.in_flight.items()} == {
        e: t.pages.tolist() for e, t in b.page_table.in_flight.items()
    }
    assert a.pool._free_stack[: a.pool.num_free].tolist() == b.pool._free_stack[: b.pool.num_free].tolist()
    assert a.pool.num_owned(OWNER_TRANSITION) == b.pool.num_owned(OWNER_TRANSITION) > 0
    assert [c.expert for c in a._step_changes if c.kind is ABORT] == [3, 4, 1]
