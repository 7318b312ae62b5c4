"""Prefix caching in the core: the allocator's cached blocks, the scheduler's hits, private
keys, and random workloads with shared prefixes checked at every step (the keys themselves, the
multi-turn generator and the simulator's hits by trace keys: test_prefix_keys.py)."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.core.kv_blocks import KvBlockAllocator
from pagedweight.core.pool import OWNER_KV, OWNER_KV_CACHED, OWNER_PINNED, PagePool, weight_owner
from pagedweight.core.prefix import own_block_keys, token_block_keys
from pagedweight.core.scheduler import FINISHED, REJECTED, Request, Scheduler, SchedulerConfig
from pagedweight.errors import PoolError, PoolExhausted

PAGE = 1024


def make(num_pages, block_tokens=4, blocks_per_page=2, caching=True, **cfg):
    pool = PagePool(num_pages * PAGE, page_bytes=PAGE)
    kv = KvBlockAllocator(pool, block_tokens, PAGE // blocks_per_page // block_tokens)
    sched = Scheduler(SchedulerConfig(**cfg), kv, num_pages * blocks_per_page, prefix_caching=caching)
    return pool, kv, sched


def run_all(sched, reqs, now=0.0):
    """Add ``reqs`` and step until done; returns the prefill tokens computed per step."""
    for r in reqs:
        sched.add(r)
    prefill = []
    while sched.has_work():
        batch = sched.schedule(now)
        prefill.append(batch.shape().num_prefill_tokens)
        sched.finish_step(batch, now + 1)
        sched.kv.pool.check()
        sched.kv.check()
        sched.check_prefix_cache()
        now += 1
    return prefill


# ---- keys ------------------------------------------------------------------------------------


def test_private_tails_change_nothing_but_the_work_of_keeping_keys():
    """Requests sharing a prefix, each with a tail of its own marked private: the newest is
    preempted and finds its own tail again; the same prefill, hits, evictions and LRU order as
    registering every block, with the tail of the one never preempted never registered."""

    def run(private: bool):
        _, kv, s = make(8, block_tokens=4, blocks_per_page=1, max_num_batched_tokens=64, admission="greedy")
        shared = list(range(8))  # two blocks
        reqs = [Request(0, 0.0, 8, 1), Request(1, 0.0, 12, 6), Request(2, 0.0, 16, 8)]
        tails = [[], [100, 101, 102, 103], list(range(200, 208))]
        for r, tail in zip(reqs, tails, strict=True):
            r.block_hashes = token_block_keys(shared + tail, 4)
            r.private_from = 2 if private else None
        return kv, s, reqs, run_all(s, reqs)

    kv, s, reqs, prefill = run(True)
    assert [r.num_preemptions for r in reqs] == [0, 0, 1]
    assert s.prefix_hit_tokens == 20  # newest: the shared 8 tokens, then 12 of its own on readmission
    assert not set(reqs[1].block_hashes[2:]) & set(kv._block_of_key.as_dict())  # never registered
    kv_ref, s_ref, _, prefill_ref = run(False)
    assert prefill == prefill_ref and s.prefix_hit_tokens == s_ref.prefix_hit_tokens
    assert kv.num_evicted_blocks == kv_ref.num_evicted_blocks
    assert kv.num_cached_blocks == kv_ref.num_cached_blocks > 0
    assert kv.evictable_blocks() == kv_ref.evictable_blocks()  # the same blocks, in the same LRU order


# ---- the allocator ---------------------------------------------------------------------------


def test_cached_blocks_outlive_their_request_and_are_taken_back():
    pool = PagePool(8 * PAGE, PAGE)
    kv = KvBlockAllocator(pool, 1, PAGE // 2)  # two blocks per page
    blocks = kv.allocate(3)
    assert all(kv.cache_block(b, k) for b, k in zip(blocks[:2], (10, 11), strict=True))
    assert not kv.cache_block(blocks[2], 10)  # the key is taken: this block stays private
    kv.free(blocks)
    kv.check()
    # The first page holds only cached blocks now: its own owner; the other page went back.
    assert pool.num_owned(OWNER_KV_CACHED) == 1 and pool.num_owned(OWNER_KV) == 0
    assert kv.num_used_blocks == 0 and kv.num_cached_blocks == 2
    assert kv.lookup([10, 11, 12], 3) == (2, 2)
    again = kv.acquire([10, 11, 12], 3)
    assert again == blocks[:2] and pool.num_owned(OWNER_KV) == 1 and kv.num_cached_blocks == 0
    assert kv.acquire([10], 1) == blocks[:1] and kv.holders(blocks[0]) == 2
    kv.free(again)
    assert kv.holders(blocks[0]) == 1 and kv.num_cached_blocks == 1
    kv.check()


def test_kv_allocation_evicts_least_recently_used_cached_blocks_last():
    pool = PagePool(4 * PAGE, PAGE)
    kv = KvBlockAllocator(pool, 1, PAGE)  # one block per page
    blocks = kv.allocate(4)
    for i, b in enumerate(blocks):
        kv.cache_block(b, 100 + i)
    kv.free(blocks[:2])
    kv.free(blocks[2:])
    assert kv.num_free_blocks == 4 and pool.num_free == 0
    # The least recently used first: blocks[1] (a request's last block goes first), then blocks[0].
    assert kv.allocate(1) == [blocks[1]]
    assert kv.key_of(blocks[1]) is None and kv.num_evicted_blocks == 1
    assert kv.lookup([100, 101], 2) == (1, 1)
    kv.check()


def test_weights_reclaim_cached_pages_but_never_held_ones():
    pool = PagePool(6 * PAGE, PAGE)
    kv = KvBlockAllocator(pool, 1, PAGE // 2)
    held = kv.allocate(2)  # page 0, held
    cached = kv.allocate(4)  # pages 1 and 2, cached then let go
    for i, b in enumerate(held + cached):
        kv.cache_block(b, i)
    kv.free(cached)
    assert pool.num_free == 3 and pool.num_available == 5
    pages = pool.alloc(weight_owner(0), 5)  # two more than free: cached pages are reclaimed
    assert len(pages) == 5 and pool.num_owned(OWNER_KV_CACHED) == 0 and kv.num_cached_blocks == 0
    assert kv.lookup([0, 1], 2) == (2, 0)  # held blocks untouched
    kv.check()
    pool.check()
    with pytest.raises(PoolExhausted):
        pool.alloc(weight_owner(0), 1)
    kv.check()


def test_release_of_a_block_nobody_holds_is_an_error():
    pool = PagePool(4 * PAGE, PAGE)
    kv = KvBlockAllocator(pool, 1, PAGE)
    [b] = kv.allocate(1)
    kv.cache_block(b, 1)
    kv.free([b])
    with pytest.raises(PoolError, match="not a cached block held"):
        kv.release([b])


@settings(max_examples=60, deadline=None)
@given(
    num_pages=st.integers(1, 24),
    blocks_per_page=st.integers(1, 4),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "cache", "acquire", "weights", "wfree", "reserve", "protect", "all"]),
            st.integers(0, 7),
        ),
        max_size=150,
    ),
)
def test_random_sharing_and_eviction_keep_every_invariant(num_pages, blocks_per_page, ops):
    """Holders as lists of blocks; a shared block is never freed while one still holds it, and
    a key always names the block it was registered with. With a downgrade reserve and protected
    blocks: a KV allocation never leaves fewer free and cached pages than the reserve (unless
    there were fewer already), and every free block counted can be allocated. With one block
    per page, the evictable blocks as keyed runs (the default there) go through the same states
    as a block each: the keys here are no chain, so hits take blocks out of their runs'
    middles too. The key map's compiled passes go through the same states as its numpy form."""
    states = play_sharing(num_pages, blocks_per_page, ops)
    if blocks_per_page == 1:
        assert play_sharing(num_pages, blocks_per_page, ops, keyed_runs=False) == states
    assert play_sharing(num_pages, blocks_per_page, ops, compiled=False) == states


def play_sharing(num_pages, blocks_per_page, ops, keyed_runs=None, compiled=None):
    """The ops of the test above, every invariant checked after each; returns the allocator's
    state after each (LRU order, keys, pool owners, counts)."""
    pool = PagePool(num_pages * PAGE, PAGE)
    kv = KvBlockAllocator(pool, 1, PAGE // blocks_per_page)
    if keyed_runs is not None:
        kv.keyed_runs = keyed_runs
    if compiled is not None:
        kv._block_of_key.compiled = compiled
    states = []
    holders: list[list[int]] = []
    weights: list[np.ndarray] = []
    registered: dict[int, int] = {}  # key -> block, as registered
    next_key = 0
    for op, n in ops:
        reclaimable = pool.num_free + pool.num_owned(OWNER_KV_CACHED)
        try:
            if op == "alloc":
                holders.append(kv.allocate(n + 1))
            elif op == "all" and kv.num_free_blocks:
                holders.append(kv.allocate(kv.num_free_blocks))  # never refused
            elif op == "reserve":
                kv.reserve_pages = n % 4
            elif op == "protect":
                kv.protected_blocks = n if n < 6 else 10**9
                if n == 0:
                    kv.unprotect(1)
            elif op == "free" and holders:
                kv.free(holders.pop(n % len(holders)))
            elif op == "cache" and holders:
                h = holders[n % len(holders)]
                block = h[n % len(h)]
                if kv.cache_block(block, next_key):
                    registered[next_key] = block
                next_key += 1
            elif op == "acquire" and registered:
                key = list(registered)[n % len(registered)]
                if kv.key_of(registered[key]) != key:
                    del registered[key]  # evicted meanwhile
                else:
                    got = kv.acquire([key], 1)
                    assert got == [registered[key]]
                    holders.append(got)
            elif op == "weights":
                weights.append(pool.alloc(weight_owner(0), n % 3 + 1))
            elif op == "wfree" and weights:
                pool.free(weights.pop(n % len(weights)), weight_owner(0))
        except PoolExhausted:
            assert op != "all"
        if op in ("alloc", "all"):
            assert pool.num_free + pool.num_owned(OWNER_KV_CACHED) >= min(reclaimable, kv.reserve_pages)
        assert kv.num_free_blocks >= 0 and kv.num_protected_blocks <= kv.num_cached_blocks
        pool.check()
        kv.check()
        counts: dict[int, int] = {}
        for h in holders:
            for b in h:
                counts[b] = counts.get(b, 0) + 1
        for b, c in counts.items():
            # Held blocks are never free, never evictable, and their count is every holder.
            assert pool.owner_of(b // kv.blocks_per_page) == OWNER_KV
            assert c == (kv.holders(b) if kv.key_of(b) is not None else 1)
        assert len(counts) == kv.num_used_blocks
        for key, block in registered.items():
            if kv.key_of(block) == key:
                assert kv.lookup([key], 1)[0] == 1
        states.append(
            (kv.evictable_blocks(), kv._block_of_key.as_dict(), pool._owner_of.tolist(), kv.num_evicted_blocks)
        )
    for h in holders:
        kv.free(h)
    for w in weights:
        pool.free(w, weight_owner(0))
    kv.check()
    assert pool.num_owned(OWNER_KV) == 0
    return states


# ---- the scheduler ---------------------------------------------------------------------------


def prompt_request(i, tokens, output=2, block_tokens=4):
    r = Request(i, 0.0, len(tokens), output)
    r.block_hashes = token_block_keys(tokens, block_tokens)
    return r


def test_a_shared_prefix_is_computed_once():
    _, kv, s = make(64)
    system = list(range(40))
    a = prompt_request(0, system + [100, 101, 102])
    run_all(s, [a])
    b = prompt_request(1, system + [200, 201])
    prefill = run_all(s, [b])
    # 40 shared tokens are 10 full blocks; b computes only its 2 own tokens.
    assert prefill[0] == 2 and b.cached_tokens == 40 and b.state is FINISHED
    assert s.prefix_hit_tokens == 40 and s.prefix_query_tokens == 43 + 42


def test_a_whole_prompt_hit_still_computes_its_last_token():
    _, _, s = make(64)
    tokens = list(range(16))
    run_all(s, [prompt_request(0, tokens)])
    again = prompt_request(1, tokens)
    prefill = run_all(s, [again])
    assert again.cached_tokens == 12  # 3 of 4 blocks: the last block is computed for the logits
    assert prefill[0] == 4


def test_without_caching_or_keys_nothing_is_shared():
    for caching, keyed in ((False, True), (True, False)):
        _, kv, s = make(64, caching=caching)
        reqs = [prompt_request(i, list(range(40))) for i in range(2)]
        if not keyed:
            for r in reqs:
                r.block_hashes = None
        run_all(s, reqs[:1])
        prefill = run_all(s, reqs[1:])
        assert prefill[0] == 40 and s.prefix_hit_tokens == 0
        assert kv.num_cached_blocks == 0


def test_concurrent_requests_share_blocks_while_running():
    _, kv, s = make(64, max_num_batched_tokens=64)
    system = list(range(32))
    first = prompt_request(0, system + [1], output=20)
    s.add(first)
    for now in range(3):
        s.finish_step(s.schedule(now), now + 1)
    second = prompt_request(1, system + [2], output=5)
    s.add(second)
    s.finish_step(s.schedule(3), 4)
    shared = set(first.block_ids) & set(second.block_ids)
    assert len(shared) == 8 and all(kv.holders(b) == 2 for b in shared)
    s.check_prefix_cache()


def run_shared_workload(
    seed,
    num_pages,
    blocks_per_page,
    block_tokens,
    max_batched,
    num_requests,
    with_hook,
    mode,
    protect=False,
    private_every=0,
    private_as_shared=False,
    private_tails=False,
    coverage=None,
    admission="forecast",
    keyed_runs=None,
):
    """Requests whose prompts extend a few shared prefixes, to the end; every invariant at every
    step. With ``protect`` (and the hook), every cached block is protected before each step and
    the hook lifts protection for what the weights it gives back do not cover, as
    ``RuntimeCore`` does. Every ``private_every``-th request (0: none) has keys of its own, as
    the simulator gives requests of a trace without block ids; with ``private_tails`` the others
    are marked private from their first key no other request has, as the simulator marks a
    trace's (``private_as_shared``: the same keys, none marked private). Returns the steps
    taken, the prompt tokens served from the cache, the evicted blocks, the evictable blocks in
    LRU order and the preemptions. ``keyed_runs``: set on the allocator (None: its default)."""
    rng = np.random.default_rng(seed)
    pool, kv, s = make(
        num_pages,
        block_tokens=block_tokens,
        blocks_per_page=blocks_per_page,
        max_num_batched_tokens=max_batched,
        max_model_len=512,
        preemption_mode=mode,
        admission=admission,
    )
    if keyed_runs is not None:
        kv.keyed_runs = keyed_runs
    weights = list(pool.alloc(OWNER_PINNED, num_pages // 4))
    if with_hook:

        def hook(short):
            before = kv.num_free_blocks
            give = weights[: -(-short // blocks_per_page)]
            del weights[: len(give)]
            pool.free(give, OWNER_PINNED)
            still_short = short - (kv.num_free_blocks - before)
            if kv.protected_blocks and still_short > 0:
                kv.unprotect(still_short)

        s.pressure_hook = hook
    s.max_kv_blocks = (num_pages - (0 if with_hook else len(weights))) * blocks_per_page
    prefixes = [rng.integers(0, 50, int(rng.integers(1, 120))).tolist() for _ in range(3)]
    reqs = []
    for i in range(num_requests):
        tokens = prefixes[int(rng.integers(0, 3))] + rng.integers(0, 50, int(rng.integers(1, 60))).tolist()
        r = Request(i, float(i), len(tokens), int(rng.integers(1, 30)))
        if private_every and i % private_every == 0:
            r.block_hashes = own_block_keys(i, len(tokens), block_tokens)
            r.private_from = None if private_as_shared else 0
        else:
            r.block_hashes = token_block_keys(tokens, block_tokens)
        reqs.append(r)
    if private_tails and not private_as_shared:
        holders = Counter(k for r in reqs if r.private_from is None for k in set(r.block_hashes))
        for r in reqs:
            if r.private_from is None:
                keys = r.block_hashes
                r.private_from = next((j for j, k in enumerate(keys) if holders[k] < 2), len(keys))
    now, nxt, steps = 0.0, 0, 0
    while nxt < len(reqs) or s.has_work():
        while nxt < len(reqs) and reqs[nxt].arrival_s <= now:
            s.add(reqs[nxt])
            nxt += 1
        if protect and with_hook:
            kv.protected_blocks = 10**9
        batch = s.schedule(now)
        if not batch.requests:
            assert not s.running, "a stall with requests running"
            now = reqs[nxt].arrival_s if nxt < len(reqs) else now + 1.0
            assert nxt < len(reqs) or not s.waiting, "waiting requests that can never run"
            continue
        s.finish_step(batch, now + 0.5)
        now += 0.5
        steps += 1
        if with_hook and steps % 7 == 0 and pool.num_available > pool.num_free:
            # Weights take cached pages back (the pressure hook returns them when KV needs them).
            weights.extend(pool.alloc(OWNER_PINNED, pool.num_free + 1))
        pool.check()
        kv.check()
        s.check_prefix_cache()
    for r in reqs:
        assert r.state in (FINISHED, REJECTED)
        if r.state is FINISHED:
            assert r.num_output_tokens == r.max_output_tokens
    assert kv.num_used_blocks == 0 and pool.num_owned(OWNER_KV) == 0
    if coverage is not None:  # requests private from a key past their first, and those preempted
        tails = [r for r in reqs if r.private_from and r.private_from < len(r.block_hashes)]
        coverage.append((len(tails), sum(r.num_preemptions > 0 for r in tails)))
    # A request never preempted never registered one of its private keys.
    unregistered = {
        k
        for r in reqs
        if r.private_from is not None and not r.num_preemptions
        for k in r.block_hashes[r.private_from :]
    }
    assert not unregistered & set(kv._block_of_key.as_dict())
    return steps, s.prefix_hit_tokens, kv.num_evicted_blocks, kv.evictable_blocks(), s.num_preemptions


def test_protection_never_keeps_a_hit_waiting_for_ever():
    """Found by the property below: a waiting request whose hit took protected blocks shifted
    protection onto other blocks, so it stayed short by what the hook's lifting could not free
    and, with nothing running, waited for ever. A hit now uses up protection as it takes the
    blocks (``KvBlockAllocator.acquire`` / ``free_after_acquire``)."""
    steps, *_ = run_shared_workload(
        seed=0, num_pages=8, blocks_per_page=3, block_tokens=4, max_batched=16, num_requests=17,
        with_hook=True, mode="recompute", protect=True,
    )  # fmt: skip
    assert steps > 0


# ``run_shared_workload``'s arguments but the blocks per page, drawn by the properties below.
SHARED_WORKLOADS = dict(
    seed=st.integers(0, 2**32 - 1),
    num_pages=st.integers(8, 48),
    block_tokens=st.sampled_from([1, 4, 16]),
    max_batched=st.integers(16, 256),
    num_requests=st.integers(5, 40),
    with_hook=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    protect=st.booleans(),
    private_every=st.sampled_from([0, 1, 3]),
    private_tails=st.booleans(),
    admission=st.sampled_from(["forecast", "greedy"]),  # greedy admission preempts more
)


def test_random_shared_prefix_workloads_keep_every_invariant():
    results: list[tuple[int, int]] = []
    tails: list[tuple[int, int]] = []

    @settings(
        max_examples=40, deadline=None, derandomize=True
    )  # fixed examples: the coverage check below is deterministic
    @given(**SHARED_WORKLOADS, blocks_per_page=st.integers(1, 4))
    def workload(**kw):
        out = run_shared_workload(**kw, coverage=tails if kw["private_tails"] else None)
        results.append(out)
        if kw["private_every"] or kw["private_tails"]:  # private keys change no decision, only their upkeep
            assert run_shared_workload(**kw, private_as_shared=True) == out

    workload()
    # Together the examples must have run long and hit often, or the property says little.
    assert sum(r[0] for r in results) >= 400
    assert sum(r[1] > 0 for r in results) >= 5
    # Shared prefixes with private tails, some of those requests preempted (their tails then
    # registered), in several examples.
    assert sum(n > 0 for n, _ in tails) >= 5 and sum(p > 0 for _, p in tails) >= 2, tails


@settings(max_examples=25, deadline=None)
@given(**SHARED_WORKLOADS)
def test_keyed_runs_are_a_block_each_in_one_entry(**kw):
    """With one block per page a request's released blocks enter the LRU set as one keyed run
    (``KvBlockAllocator.keyed_runs``), and hits take them back off its end: every decision,
    hit, eviction and the LRU order at the end are those of a block per entry."""
    assert run_shared_workload(**kw, blocks_per_page=1) == run_shared_workload(
        **kw, blocks_per_page=1, keyed_runs=False
    )


def private_pair_run(private: bool):
    _, kv, s = make(6, block_tokens=4, blocks_per_page=1, max_num_batched_tokens=64, admission="greedy")
    first = Request(0, 0.0, 8, 6)  # grows to 4 blocks
    newest = Request(1, 0.0, 12, 8)  # 3 prompt blocks; preempted when the 6 blocks run out
    for r in (first, newest):
        r.block_hashes = own_block_keys(r.request_id, r.prompt_tokens, 4)
        r.private_from = 0 if private else None
    prefill = run_all(s, [first, newest])
    return kv, s, first, newest, prefill


def test_private_keys_change_nothing_but_the_work_of_keeping_keys():
    """Keys of one's own are registered only at a first preemption, and a request never
    preempted retires its prompt blocks unkeyed: the same hits, evictions, cached blocks and
    steps as registering everything."""
    kv, s, first, newest, prefill = private_pair_run(True)
    assert newest.num_preemptions == 1 and first.num_preemptions == 0
    assert s.prefix_hit_tokens == 8  # readmitted: 2 of its 3 prompt blocks were still cached
    assert not set(first.block_hashes) & set(kv._block_of_key.as_dict())  # never registered
    kv_ref, s_ref, *_, prefill_ref = private_pair_run(False)
    assert prefill == prefill_ref
    assert s.prefix_hit_tokens == s_ref.prefix_hit_tokens
    assert kv.num_evicted_blocks == kv_ref.num_evicted_blocks
    assert kv.num_cached_blocks == kv_ref.num_cached_blocks > 0
    assert kv.evictable_blocks() == kv_ref.evictable_blocks()  # the same blocks, in the same LRU order


def test_the_downgrade_reserve_holds_back_cached_pages_too():
    """One block a page: KV may take free and cached pages only down to the reserve, so that a
    downgrade still finds pages for its new copy (by reclaiming cached ones)."""
    pool = PagePool(5 * PAGE, PAGE)
    kv = KvBlockAllocator(pool, 1, PAGE)
    blocks = kv.allocate(4)
    for i, b in enumerate(blocks):
        kv.cache_block(b, i)
    kv.free(blocks)
    kv.reserve_pages = 2
    assert pool.num_free == 1 and kv.num_cached_blocks == 4 and kv.num_free_blocks == 3
    with pytest.raises(PoolExhausted):
        kv.allocate(4)
    kv.allocate(3)
    assert pool.num_available == 2 and kv.num_free_blocks == 0
    assert len(pool.alloc(weight_owner(0), 2)) == 2  # a downgrade's pages: reclaimed
    kv.check()


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["retire", "release"]), st.integers(1, 6)), min_size=1, max_size=12),
    compiled=st.booleans(),
)
def test_one_block_reuse_is_the_general_eviction(ops, compiled):
    """``KvBlockAllocator._reuse_one`` (a decode's one new block once memory is full) against
    ``_evict_for_reuse(1)`` on a twin allocator: the same block, and the same evictable set,
    ghosts and counts after each, through retired runs and keyed blocks in any order."""
    import copy

    _, kv, _ = make(64, block_tokens=4, blocks_per_page=1)
    kv.track_reuse(capacity_blocks=5)  # small: the ghost list ages along the way
    kv._block_of_key.compiled = compiled
    key = 0
    for kind, n in ops:
        blocks = kv.allocate(n)
        if kind == "retire":
            kv.retire(blocks, n)
        else:
            kv.cache_blocks(blocks, np.arange(key, key + n))  # a trace's keys: an int64 array
            key += n
            kv.release(blocks)
    twin = copy.deepcopy(kv)
    while kv.num_cached_blocks:
        assert kv._reuse_one() == twin._evict_for_reuse(1)[0]
        assert kv.evictable_blocks() == twin.evictable_blocks()
        assert (kv.num_evicted_blocks, kv.num_used_blocks, kv._num_runs) == (
            twin.num_evicted_blocks,
            twin.num_used_blocks,
            twin._num_runs,
        )
        assert kv.ghosts.newer == twin.ghosts.newer and len(kv.ghosts) == len(twin.ghosts)
        assert kv.pool.counts() == twin.pool.counts()
        assert kv._block_of_key.as_dict() == twin._block_of_key.as_dict()
        kv.check()
        twin.check()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["retire", "release", "hold"]), st.integers(1, 6)), min_size=1, max_size=12),
    reserve=st.integers(0, 6),
    protected=st.integers(0, 12),
    blocks_per_page=st.sampled_from([1, 1, 2]),
)
def test_blocks_one_by_one_in_one_call(ops, reserve, protected, blocks_per_page):
    """``allocate_each(n)`` against ``n`` calls of ``allocate(1)`` on a twin allocator: the same
    blocks in the same order, and the same pool, evictable set, ghosts and counts, for every
    ``n`` up to ``num_growable_blocks``: free pages first, then evictions, past the downgrade
    reserve and protected blocks. Each of those calls finds a block free, as the scheduler's
    pressure hook would have asked; one more would not (with one block per page)."""
    import copy

    _, kv, _ = make(24, block_tokens=4, blocks_per_page=blocks_per_page)
    kv.track_reuse(capacity_blocks=5)  # small: the ghost list ages along the way
    key = 0
    for kind, n in ops:
        if n > kv.num_free_blocks:
            break
        blocks = kv.allocate(n)
        if kind == "retire":
            kv.retire(blocks, n)
        elif kind == "release":
            kv.cache_blocks(blocks, list(range(key, key + n)))
            key += n
            kv.release(blocks)
    kv.reserve_pages = reserve
    kv.protected_blocks = protected
    room = kv.num_growable_blocks()
    if blocks_per_page > 1:
        assert room == 0
        return
    assert room == kv.num_free_blocks
    for n in range(room + 1):
        twin, each = copy.deepcopy(kv), copy.deepcopy(kv)
        one_by_one = []
        for _ in range(n):
            assert twin.num_free_blocks >= 1
            one_by_one += twin.allocate(1)
        assert each.allocate_each(n) == one_by_one
        assert each.evictable_blocks() == twin.evictable_blocks()
        assert (each.num_evicted_blocks, each.num_used_blocks, each.num_free_blocks, each.num_protected_blocks) == (
            twin.num_evicted_blocks,
            twin.num_used_blocks,
            twin.num_free_blocks,
            twin.num_protected_blocks,
        )
        assert each.ghosts.newer == twin.ghosts.newer and len(each.ghosts) == len(twin.ghosts)
        assert each.pool.counts() == twin.pool.counts() and list(each.pool._owner_of) == list(twin.pool._owner_of)
        assert each._block_of_key.as_dict() == twin._block_of_key.as_dict()
        each.check()
    assert twin.num_free_blocks == 0  # each call took exactly one block off the free count
    with pytest.raises(PoolExhausted):
        copy.deepcopy(kv).allocate_each(room + 1)


@pytest.mark.parametrize(
    "policy, sets",
    [
        ("static-fp16", ["scheduler.admission=greedy", "memory.budget=90 GiB"]),  # ~40 preemptions
        ("pagedweight", []),  # its ghost list counts evicted keys
    ],
)
def test_simulated_private_tails_change_no_result(policy, sets, monkeypatch):
    """The simulator on the shipped multi-turn trace (conversations resend their prefix; ~95% of
    requests end in a tail of their own): every request's times and the summary are the same
    with the trace's private tails as with every key shared, preemptions included."""
    from pathlib import Path

    from pagedweight.config.run import scenario_run
    from pagedweight.config.scenario import load_scenario
    from pagedweight.core import prefix
    from pagedweight.results.writer import policy_summary
    from pwsim.latency import build_latency_model
    from pwsim.run import scenario_engine

    root = Path(__file__).resolve().parents[1]

    def run():
        loaded = load_scenario(root / "scenarios" / "multiturn.yaml", ["workload.max_requests=400", *sets])
        run = scenario_run(loaded, [policy])
        lat = build_latency_model(loaded.scenario.latency, loaded.model, loaded.gpu, loaded.base_dir)
        eng = scenario_engine(run, policy, lat, loaded.scenario.routing)
        eng.run()
        summary = policy_summary(eng.requests, eng.core, run.slo, 1.0, eng.bytes_h2d)
        times = [(r.first_token_s, r.finish_s, r.num_preemptions, r.cached_tokens) for r in eng.requests]
        tails = sum(0 < r.private_from < len(r.block_hashes) for r in eng.requests)
        return summary, times, tails, sum(r.num_preemptions for r in eng.requests)

    summary, times, tails, preemptions = run()
    assert tails > 300 and (preemptions > 0) == (policy == "static-fp16")
    monkeypatch.setattr(prefix.TraceBlockKeys, "private_from", lambda self, r, p, b: len(self.keys(r, p, b)))
    shared_summary, shared_times, shared_tails, _ = run()
    assert shared_tails == 0 and shared_times == times
    assert {k: v for k, v in shared_summary.items() if "wall" not in k} == {
        k: v for k, v in summary.items() if "wall" not in k
    }


@pytest.mark.parametrize("form", ["list", "array", "array in numpy"])  # the trace's keys: an int64 array
@pytest.mark.parametrize("keyed_block", [1, 5])  # a block of the call keyed already, or none
@pytest.mark.parametrize("keys", [[10, 11, 12, 13], [10, 11, 10, 13], [10, 5, 12, 13], [10, 11, 12, 12]])
def test_registering_many_blocks_is_registering_each(keys, keyed_block, form):
    """``cache_blocks`` (the bulk path, and its way back when a key repeats) leaves the maps
    ``cache_block`` pair by pair would: a key already cached or listed twice, and a block
    already keyed, stay out; with keys in a list or an array, compiled or in numpy."""
    _, bulk, _ = make(8, blocks_per_page=1)
    _, each, _ = make(8, blocks_per_page=1)
    bulk._block_of_key.compiled = form != "array in numpy"
    for kv in (bulk, each):
        held = kv.allocate(6)
        assert kv.cache_block(held[4], 5)  # a key cached already
        assert kv.cache_block(held[keyed_block], 99)
    blocks = held[:4]
    bulk.cache_blocks(blocks, keys if form == "list" else np.asarray(keys, dtype=np.int64))
    for b, k in zip(blocks, keys, strict=True):
        each.cache_block(b, k)
    assert bulk._block_of_key.as_dict() == each._block_of_key.as_dict()
    assert [bulk.key_of(b) for b in range(8)] == [each.key_of(b) for b in range(8)]
    bulk.check()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["trace keys", "token keys", "retire", "take", "reclaim"]), st.integers(1, 24)),
        min_size=1,
        max_size=14,
    ),
    ghosts=st.booleans(),
)
def test_evictions_of_many_blocks_compiled_and_in_numpy(ops, ghosts):
    """Evicting many cached blocks at once (a prefill's allocation, a weight's reclaim) forgets
    their keys in one pass of the key map (compiled where numba is installed) or in numpy calls:
    twin allocators go through the same states, with trace keys (the array) and token keys (the
    dict) alike, and the ghost list (which reads the keys) kept or not."""
    twins = []
    for compiled in (True, False):
        _, kv, _ = make(64, blocks_per_page=1)
        kv._block_of_key.compiled = compiled
        if ghosts:
            kv.track_reuse(capacity_blocks=16)
        twins.append(kv)
    key = 0
    for kind, n in ops:
        states = []
        for kv in twins:
            n_now = min(n, kv.num_free_blocks)
            if kind == "reclaim":
                kv._reclaim_pages(n)
            elif n_now and kind == "take":
                kv.allocate(n_now)  # held for good: the evictions are what matters
            elif n_now:
                blocks = kv.allocate(n_now)
                if kind == "retire":
                    kv.retire(blocks, n_now)
                else:
                    keys = (
                        np.arange(key, key + n_now)
                        if kind == "trace keys"
                        else [-(1 << 40) - key - i for i in range(n_now)]
                    )
                    kv.cache_blocks(blocks, keys)
                    kv.release(blocks)
            kv.check()
            states.append(
                (kv.evictable_blocks(), kv._block_of_key.as_dict(), kv._keyed.tolist(), kv.num_evicted_blocks,
                 kv.pool.counts(), None if kv.ghosts is None else (list(kv.ghosts.newer), len(kv.ghosts)))
            )  # fmt: skip
        assert states[0] == states[1]
        key += n
