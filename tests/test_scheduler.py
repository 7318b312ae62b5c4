"""Continuous batching: hand-checked steps, then random workloads for thousands of steps."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.core.kv_blocks import KvBlockAllocator
from pagedweight.core.pool import OWNER_PINNED, PagePool
from pagedweight.core.scheduler import FINISHED, REJECTED, RUNNING, WAITING, Request, Scheduler, SchedulerConfig

PAGE = 1024


def make(num_pages, block_tokens=4, blocks_per_page=2, hook=None, **cfg):
    pool = PagePool(num_pages * PAGE, page_bytes=PAGE)
    kv = KvBlockAllocator(pool, block_tokens, PAGE // blocks_per_page // block_tokens)
    sched = Scheduler(SchedulerConfig(**cfg), kv, max_kv_blocks=num_pages * blocks_per_page, pressure_hook=hook)
    return pool, kv, sched


def step(sched, now):
    batch = sched.schedule(now)
    shape = batch.shape()
    done = sched.finish_step(batch, now + 1.0)
    return batch, shape, done


def test_prefill_is_chunked_and_decodes_go_first():
    _, _, s = make(64, max_num_batched_tokens=10)
    a, b = Request(0, 0.0, 12, 3), Request(1, 0.0, 5, 2)
    s.add(a), s.add(b)
    batch, shape, _ = step(s, 0.0)  # a gets 10 of its 12 prompt tokens; nothing left for b
    assert batch.num_new_tokens == [10] and shape.num_prefill_tokens == 10 and a.first_token_s is None
    batch, _, _ = step(s, 1.0)  # a finishes its prompt (2) and samples token 1; b starts (5 of 5)
    assert batch.num_new_tokens == [2, 5] and a.first_token_s == 2.0 and b.first_token_s == 2.0
    batch, shape, _ = step(s, 2.0)
    assert batch.num_new_tokens == [1, 1] and shape.num_decodes == 2  # both decode
    assert b.state == FINISHED and b.num_output_tokens == 2
    _, _, done = step(s, 3.0)
    assert done == [a] and a.num_output_tokens == 3 and list(a.token_times_s) == [2.0, 3.0, 4.0]


def test_running_prefill_chunk_between_decodes_keeps_its_place_and_tokens():
    """The batch lists the running requests in order, each with one token but a prefill chunk
    (at its own position), and the budget cut falls after the request that spent it."""
    _, _, s = make(256, max_num_batched_tokens=8)
    a, b, c, d = Request(0, 0.0, 2, 9), Request(1, 0.0, 12, 9), Request(2, 0.0, 2, 9), Request(3, 0.0, 2, 9)
    for r in (a, b, c, d):
        s.add(r)
    batch, _, _ = step(s, 0.0)  # a (2), b (6 of 12): the budget is spent
    assert batch.requests == [a, b] and batch.num_new_tokens == [2, 6]
    s.waiting.remove(c), s.waiting.remove(d)  # c and d join behind b as decodes
    for r in (c, d):
        r.state, r.num_computed_tokens, r.num_output_tokens = RUNNING, 2, 1
        r.block_ids = s.kv.allocate(1)
        s.running.append(r)
    batch, shape, _ = step(s, 1.0)  # a 1, b its last 6, then 1 token left: c, not d
    assert batch.requests == [a, b, c] and batch.num_new_tokens == [1, 6, 1]
    assert shape.prefill_tokens == [6] and shape.prefill_kv_lens == [12] and shape.decode_kv_lens == [3, 3]
    assert b.first_token_s == 2.0
    s.config = SchedulerConfig(max_num_batched_tokens=100)
    batch, shape, _ = step(s, 2.0)
    assert batch.requests == [a, b, c, d] and batch.num_new_tokens == [1, 1, 1, 1]
    assert shape.decode_kv_lens == [4, 13, 4, 3]  # b: 12 prompt tokens + its first output


def test_max_num_seqs_limits_admission():
    _, _, s = make(64, max_num_seqs=2)
    reqs = [Request(i, 0.0, 3, 5) for i in range(3)]
    for r in reqs:
        s.add(r)
    step(s, 0.0)
    assert [r.state for r in reqs] == [RUNNING, RUNNING, WAITING]


def test_requests_that_can_never_fit_are_rejected_with_a_reason():
    _, _, s = make(4, max_model_len=100)  # 4 pages x 2 blocks x 4 tokens = 32 tokens of KV
    too_long = Request(0, 0.0, 90, 20)
    too_big = Request(1, 0.0, 30, 5)
    empty = Request(2, 0.0, 0, 5)
    assert not s.add(too_long) and "exceeds the context limit of 100" in too_long.reject_reason
    assert not s.add(too_big) and "needs 9 KV blocks; at most 8" in too_big.reject_reason
    assert not s.add(empty) and empty.state == REJECTED
    assert not s.has_work()


def test_preemption_is_newest_first_and_keeps_generated_tokens():
    # 4 blocks of 4 tokens; vLLM's admission, which lets the second request in on its first chunk
    _, kv, s = make(4, block_tokens=4, blocks_per_page=1, admission="greedy")
    old, new = Request(0, 0.0, 4, 6), Request(1, 0.1, 4, 6)
    s.add(old), s.add(new)
    now = 0.0
    while new.num_preemptions == 0:
        batch, _, _ = step(s, now)
        now += 1
    assert old.num_preemptions == 0 and new.state == WAITING and new.block_ids == []
    assert len(new.preempted_at_s) == 1 and new.preempted_at_s[0] == now - 1
    assert new.num_output_tokens > 0  # kept: recompute covers prompt + generated tokens
    while s.has_work():
        step(s, now)
        now += 1
    assert old.num_output_tokens == new.num_output_tokens == 6 and kv.num_used_blocks == 0


def test_swap_preemption_resumes_without_recompute():
    _, kv, s = make(4, block_tokens=4, blocks_per_page=1, preemption_mode="swap", admission="greedy")
    old, new = Request(0, 0.0, 4, 6), Request(1, 0.1, 4, 6)
    s.add(old), s.add(new)
    now, swapped_out, swapped_in = 0.0, 0, 0
    while s.has_work():
        batch, _, _ = step(s, now)
        swapped_out += batch.swapped_out_tokens
        swapped_in += batch.swapped_in_tokens
        if batch.swapped_in_tokens:
            # resumed where it stopped: only the missing tokens are computed
            assert new in batch.requests and batch.num_new_tokens[batch.requests.index(new)] == 1
        now += 1
    assert new.num_preemptions == 1 and swapped_out == swapped_in > 0
    assert old.num_output_tokens == new.num_output_tokens == 6 and kv.num_used_blocks == 0


def test_pressure_hook_is_asked_before_any_preemption():
    pool, kv, s = make(8, block_tokens=4, blocks_per_page=1, admission="greedy")
    reserve = list(pool.alloc(OWNER_PINNED, 4))  # stands for expert pages a downgrade can free
    asked = []

    def hook(num_blocks_short):
        asked.append(num_blocks_short)
        give = reserve[:num_blocks_short]
        del reserve[:num_blocks_short]
        pool.free(give, OWNER_PINNED)

    s.pressure_hook = hook
    for i in range(2):
        s.add(Request(i, 0.0, 4, 12))
    now = 0.0
    while s.has_work():
        step(s, now)
        now += 1
    assert asked and s.num_preemptions == 0


def reference_forecast(s: Scheduler, horizon: int) -> int:
    """``forecast_kv_blocks`` written out: each running request's growth over the horizon
    (capped at its output) or, under forecast admission, its promise if larger; then the queue."""
    bt, reserve = s.kv.block_tokens, s.config.admission_reserve_tokens
    need = 0
    for r in s.running:
        grown = min(r.prompt_tokens + r.num_output_tokens + horizon, r.prompt_tokens + r.max_output_tokens - 1)
        blocks = -(-grown // bt)
        if s.config.admission == "forecast":
            ahead = min(r.max_output_tokens - r.num_output_tokens, reserve)
            blocks = max(blocks, -(-(r.prompt_tokens + r.num_output_tokens + ahead) // bt))
        need += max(0, blocks - len(r.block_ids))
    waiting = list(s.waiting)[: max(0, s.config.max_num_seqs - len(s.running))]
    return need + sum(-(-(r.prompt_tokens + r.num_output_tokens + horizon) // bt) for r in waiting)


def run_random_workload(
    seed,
    num_pages,
    blocks_per_page,
    block_tokens,
    max_batched,
    max_seqs,
    num_requests,
    with_hook,
    mode,
    admission,
    forecast=True,
    batches=None,
) -> int:
    """One random workload to the end, checking every invariant at every step; returns the steps.
    ``forecast``: ask for the KV forecast after every step, as the controller does before the
    next schedule (admission then reuses the promised blocks it counted); ``batches``: a list
    that gets each step's (request ids, tokens, preempted ids, each request's KV blocks)."""
    rng = np.random.default_rng(seed)
    pool, kv, s = make(
        num_pages,
        block_tokens=block_tokens,
        blocks_per_page=blocks_per_page,
        max_num_batched_tokens=max_batched,
        max_num_seqs=max_seqs,
        max_model_len=512,
        preemption_mode=mode,
        admission=admission,
        admission_reserve_tokens=int(rng.integers(1, 80)),
    )
    reserve = list(pool.alloc(OWNER_PINNED, num_pages // 4))
    if with_hook:

        def hook(short):
            give = reserve[: -(-short // blocks_per_page)]
            del reserve[: len(give)]
            pool.free(give, OWNER_PINNED)

        s.pressure_hook = hook
    s.max_kv_blocks = (num_pages - (0 if with_hook else len(reserve))) * blocks_per_page
    arrivals = np.sort(rng.exponential(3.0, num_requests).cumsum())
    reqs = [Request(i, float(t), int(rng.integers(1, 200)), int(rng.integers(1, 60))) for i, t in enumerate(arrivals)]
    now, nxt, steps = 0.0, 0, 0
    while nxt < len(reqs) or s.has_work():
        while nxt < len(reqs) and reqs[nxt].arrival_s <= now:
            s.add(reqs[nxt])
            nxt += 1
        batch = s.schedule(now)
        if not batch.requests:
            assert not s.running, "a stall with requests running"
            now = reqs[nxt].arrival_s if nxt < len(reqs) else now + 1.0
            assert nxt < len(reqs) or not s.waiting, "waiting requests that can never run"
            continue
        assert batch.num_tokens <= max_batched and len(s.running) <= max_seqs
        if batches is not None:
            ids = [r.request_id for r in batch.requests]
            blocks = [list(r.block_ids) for r in batch.requests]
            batches.append((ids, list(batch.num_new_tokens), [r.request_id for r in batch.preempted], blocks))
        s.finish_step(batch, now + 0.5)
        now += 0.5
        steps += 1
        pool.check()
        kv.check()
        reserve_tokens = s.config.admission_reserve_tokens
        for horizon in (1, reserve_tokens, reserve_tokens + 7) if forecast else ():
            assert s.forecast_kv_blocks(horizon) == reference_forecast(s, horizon)
        held = [b for r in s.running for b in r.block_ids]
        assert len(held) == len(set(held)) == kv.num_used_blocks
        assert not ({id(r) for r in s.running} & {id(r) for r in s.waiting})
    for r in reqs:
        if r.state == REJECTED:
            assert r.reject_reason
            continue
        assert r.state == FINISHED and r.num_output_tokens == r.max_output_tokens
        assert len(r.token_times_s) == r.max_output_tokens
        assert r.arrival_s <= r.first_scheduled_s <= r.first_token_s <= r.finish_s
        assert list(r.token_times_s) == sorted(r.token_times_s)
    assert kv.num_used_blocks == 0 and pool.num_owned(1) == 0  # no KV leaked
    return steps


def test_random_workloads_lose_nothing():
    """Random workloads keep every invariant; and together the examples must have driven the
    scheduler through thousands of steps, so that the property cannot shrink into trivia."""
    steps: list[int] = []

    @settings(max_examples=25, deadline=None)
    @given(
        seed=st.integers(0, 2**32 - 1),
        num_pages=st.integers(4, 64),
        blocks_per_page=st.integers(1, 4),
        block_tokens=st.sampled_from([1, 4, 16]),
        max_batched=st.integers(1, 256),
        max_seqs=st.integers(1, 32),
        num_requests=st.integers(1, 80),
        with_hook=st.booleans(),
        mode=st.sampled_from(["recompute", "swap"]),
        admission=st.sampled_from(["forecast", "greedy"]),
    )
    def workload(**kw):
        steps.append(run_random_workload(**kw))

    workload()
    assert sum(steps) >= 2000, steps


def seeded_workload(seed: int, pages: tuple[int, int], blocks_per_page: int | None = None, admission="forecast"):
    """``run_random_workload``'s arguments drawn from ``seed``: a hook on odd seeds, swap
    preemption on seeds divisible by 3."""
    rng = np.random.default_rng(seed)
    num_pages, drawn_blocks_per_page = int(rng.integers(*pages)), int(rng.integers(1, 4))
    return dict(
        seed=seed,
        num_pages=num_pages,
        blocks_per_page=drawn_blocks_per_page if blocks_per_page is None else blocks_per_page,
        block_tokens=int(rng.choice([1, 4, 16])),
        max_batched=int(rng.integers(16, 256)),
        max_seqs=int(rng.integers(2, 32)),
        num_requests=int(rng.integers(20, 80)),
        with_hook=bool(seed % 2),
        mode="recompute" if seed % 3 else "swap",
        admission=admission,
    )


def test_admission_decides_alike_with_the_forecasts_count_or_its_own():
    """Admission reuses the promised blocks the controller's forecast counted just before the
    schedule (updated for the blocks the running requests took meanwhile): every batch and
    preemption is what counting afresh gives."""
    total = 0
    for seed in range(12):
        kw = seeded_workload(seed, pages=(8, 48))
        with_memo: list = []
        fresh: list = []
        total += run_random_workload(**kw, forecast=True, batches=with_memo)
        run_random_workload(**kw, forecast=False, batches=fresh)
        assert with_memo == fresh
    assert total >= 500


def test_decodes_growing_a_block_together_get_what_one_by_one_gives(monkeypatch):
    """Decodes whose last block is full take their next blocks in one ``allocate_each`` while
    the allocator can hand them out one by one (``schedule``'s ``_grow``): every batch, KV block
    and preemption is what the general path, one ``_reserve`` each, gives; through pressure
    hooks, preemptions, swaps and the forecast's promised count."""
    total, grown = 0, []
    real = KvBlockAllocator.allocate_each

    def counted(kv, n):
        grown.append(n)
        return real(kv, n)

    for seed in range(10):
        # One block a page: where blocks grow together (with several, one ``_reserve`` each).
        kw = seeded_workload(seed, pages=(12, 64), blocks_per_page=1, admission="forecast" if seed % 4 else "greedy")
        together: list = []
        one_by_one: list = []
        with monkeypatch.context() as m:
            m.setattr(KvBlockAllocator, "allocate_each", counted)
            total += run_random_workload(**kw, batches=together)
        with monkeypatch.context() as m:
            m.setattr(KvBlockAllocator, "num_growable_blocks", lambda kv: 0)
            run_random_workload(**kw, batches=one_by_one)
        assert together == one_by_one
    assert total >= 500 and sum(grown) >= 200 and max(grown) >= 2, (total, sum(grown))


@pytest.mark.parametrize(
    "field", ["max_num_batched_tokens", "max_num_seqs", "max_model_len", "admission_reserve_tokens"]
)
def test_config_rejects_non_positive_limits(field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: 0})


def test_config_names_the_admission_rules():
    with pytest.raises(ValueError, match="admission.*'forecast' or 'greedy'"):
        SchedulerConfig(admission="eager")


def replay_long_prompts(admission: str, num_requests=12, prompt=100, output=60, **cfg):
    """Long prompts arriving faster than they finish, in KV for about two of them at a time, in
    chunks of 48 tokens. Returns (prefill tokens computed / prompt tokens, preemptions)."""
    _, kv, s = make(40, block_tokens=4, blocks_per_page=2, max_num_batched_tokens=48, admission=admission, **cfg)
    reqs = [Request(i, 0.1 * i, prompt, output) for i in range(num_requests)]
    now, nxt, prefill = 0.0, 0, 0
    while nxt < len(reqs) or s.has_work():
        while nxt < len(reqs) and reqs[nxt].arrival_s <= now:
            s.add(reqs[nxt])
            nxt += 1
        _, shape, _ = step(s, now)
        prefill += shape.num_prefill_tokens
        now += 1.0
    assert all(r.state is FINISHED and r.num_output_tokens == output for r in reqs)
    assert kv.num_used_blocks == 0
    return prefill / (num_requests * prompt), s.num_preemptions


def test_forecast_admission_stops_recompute_storms():
    """Under vLLM's rule each prompt admitted on its first chunk is preempted by the decodes
    that grow into its blocks and recomputed again and again (4.7x the prompt tokens here);
    admission by forecast KV demand computes each prompt once."""
    greedy_ratio, greedy_preemptions = replay_long_prompts("greedy")
    assert greedy_ratio > 2.0 and greedy_preemptions > 20
    ratio, preemptions = replay_long_prompts("forecast")
    assert ratio == 1.0 and preemptions == 0


def test_forecast_admission_reserves_at_most_the_configured_outputs():
    """A promise covers the next ``admission_reserve_tokens`` outputs, not a long max_tokens:
    two requests whose whole outputs would not fit side by side still run together, and the
    one that outgrows the promise is preempted the vLLM way, then finishes."""
    _, _, s = make(40, block_tokens=4, blocks_per_page=2, admission_reserve_tokens=8)  # 80 blocks
    a, b = Request(0, 0.0, 40, 200), Request(1, 0.0, 40, 200)  # 60 blocks each in the end
    s.add(a), s.add(b)
    step(s, 0.0)
    assert a.state is RUNNING and b.state is RUNNING
    now = 1.0
    while s.has_work():
        step(s, now)
        now += 1
    assert a.num_output_tokens == b.num_output_tokens == 200 and s.num_preemptions >= 1
