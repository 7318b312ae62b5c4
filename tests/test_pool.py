"""The unified page pool and the KV block allocator: invariants under random use."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.core.kv_blocks import KvBlockAllocator
from pagedweight.core.pool import (
    OWNER_FREE,
    OWNER_KV,
    OWNER_PINNED,
    OWNER_TRANSITION,
    PagePool,
    owner_name,
    weight_owner,
)
from pagedweight.core.spec import PRECISION_ID
from pagedweight.errors import PoolError, PoolExhausted


def test_pages_are_cut_from_the_budget():
    pool = PagePool(total_bytes=10 * 2**20 + 5, page_bytes=2**20)
    assert pool.num_pages == 10 and pool.total_bytes == 10 * 2**20
    assert pool.usage() == {"free": 10, "kv": 0, "pinned": 0, "transition": 0}


def test_alloc_free_transfer_account_by_owner():
    pool = PagePool(8 * 4096, page_bytes=4096)
    w = weight_owner(PRECISION_ID["int4"])
    a = pool.alloc(OWNER_PINNED, 2)
    b = pool.alloc(OWNER_TRANSITION, 3)
    pool.transfer(b, OWNER_TRANSITION, w)
    assert pool.usage() == {"free": 3, "kv": 0, "pinned": 2, "transition": 0, "weight:int4": 3}
    assert owner_name(w) == "weight:int4"
    pool.free(a, OWNER_PINNED)
    assert pool.num_free == 5
    pool.check()


def test_over_budget_is_refused_and_changes_nothing():
    pool = PagePool(4 * 4096, page_bytes=4096)
    pool.alloc(OWNER_KV, 3)
    with pytest.raises(PoolExhausted, match="only 1 of 4 free"):
        pool.alloc(OWNER_PINNED, 2)
    assert pool.num_free == 1
    pool.check()


@pytest.mark.parametrize(
    "misuse, message",
    [
        (lambda p, pages: p.free(pages, OWNER_KV) or p.free(pages, OWNER_KV), "double free"),
        (lambda p, pages: p.free(pages, OWNER_PINNED), "owned by kv, not pinned"),
        (lambda p, pages: p.free([pages[0], pages[0]], OWNER_KV), "listed twice"),
        (lambda p, pages: p.free([99], OWNER_KV), r"must be in \[0, 4\)"),
        (lambda p, pages: p.free([int(pages[0]), -1], OWNER_KV), r"must be in \[0, 4\); got -1\.\."),
        (lambda p, pages: p.transfer(np.array([int(pages[0]), -3]), OWNER_KV, OWNER_PINNED), r"must be in"),
        (lambda p, pages: p.free(np.array([pages[1], pages[1]]), OWNER_KV), "listed twice"),
        (lambda p, pages: p.transfer([int(pages[1])] * 300, OWNER_KV, OWNER_PINNED), "listed twice"),
        (lambda p, pages: p.alloc(OWNER_FREE, 1), "cannot allocate"),
        (lambda p, pages: p.transfer(pages, OWNER_KV, OWNER_FREE), "use free"),
    ],
)
def test_misuse_gets_a_clear_error(misuse, message):
    pool = PagePool(4 * 4096, page_bytes=4096)
    pages = pool.alloc(OWNER_KV, 2)
    with pytest.raises(PoolError, match=message):
        misuse(pool, pages)
    pool.check()


def test_kv_block_that_does_not_fit_a_page_is_refused():
    pool = PagePool(4 * 4096, page_bytes=4096)
    with pytest.raises(PoolError, match="does not fit"):
        KvBlockAllocator(pool, block_tokens=16, kv_bytes_per_token=512)


def test_kv_pages_return_to_the_pool_when_their_last_block_is_freed():
    pool = PagePool(4 * 4096, page_bytes=4096)
    kv = KvBlockAllocator(pool, block_tokens=4, kv_bytes_per_token=256)  # 1 KiB blocks, 4 per page
    a = kv.allocate(3)
    b = kv.allocate(3)  # fills the first page, opens a second
    assert pool.num_owned(OWNER_KV) == 2 and kv.num_free_blocks == 2 + 2 * 4
    kv.free(b)
    kv.free(a)
    assert pool.num_owned(OWNER_KV) == 0 and pool.num_free == 4
    with pytest.raises(PoolError, match="not allocated"):
        kv.free(a[:1])
    kv.check()


@settings(max_examples=60, deadline=None)
@given(
    num_pages=st.integers(1, 40),
    blocks_per_page=st.integers(1, 5),
    ops=st.lists(
        st.tuples(st.sampled_from(["kv", "kvfree", "w", "wfree", "flip", "reserve", "kvall"]), st.integers(1, 6)),
        max_size=200,
    ),
)
def test_random_use_keeps_every_invariant(num_pages, blocks_per_page, ops):
    """Every owner count stays true; KV never takes the free pages below the downgrade reserve
    (unless there were fewer already), and every block it counts free can be allocated."""
    page = 1024
    pool = PagePool(num_pages * page, page_bytes=page)
    kv = KvBlockAllocator(pool, block_tokens=1, kv_bytes_per_token=page // blocks_per_page)
    kv_held: list[list[int]] = []
    w_held: list[tuple[int, np.ndarray]] = []
    for op, n in ops:
        free_before = pool.num_free
        try:
            if op == "kv":
                kv_held.append(kv.allocate(n))
            elif op == "kvall" and kv.num_free_blocks:
                kv_held.append(kv.allocate(kv.num_free_blocks))
            elif op == "reserve":
                kv.reserve_pages = n % 4
            elif op == "kvfree" and kv_held:
                kv.free(kv_held.pop(n % len(kv_held)))
            elif op == "w":
                owner = weight_owner(n % 4)
                w_held.append((owner, pool.alloc(owner, n)))
            elif op == "wfree" and w_held:
                owner, pages = w_held.pop(n % len(w_held))
                pool.free(pages, owner)
            elif op == "flip" and w_held:
                owner, pages = w_held[n % len(w_held)]
                new = pool.alloc(OWNER_TRANSITION, max(1, len(pages) // 2))
                w_held.pop(n % len(w_held))
                pool.free(pages, owner)
                pool.transfer(new, OWNER_TRANSITION, weight_owner(3))
                w_held.append((weight_owner(3), new))
        except PoolExhausted:
            assert op != "kvall"
        if op in ("kv", "kvall"):
            assert pool.num_free >= min(free_before, kv.reserve_pages)
        pool.check()
        kv.check()
        all_kv = [b for blocks in kv_held for b in blocks]
        assert len(all_kv) == len(set(all_kv)) == kv.num_used_blocks
        assert sum(len(p) for _, p in w_held) == pool.num_weight_pages()
    for blocks in kv_held:
        kv.free(blocks)
    for owner, pages in w_held:
        pool.free(pages, owner)
    assert pool.num_free == pool.num_pages  # no leak


def test_alloc_list_takes_the_pages_alloc_would():
    a, b = PagePool(64 * 4096, 4096), PagePool(64 * 4096, 4096)
    for n in (1, 3, 4, 2, 9, 1):
        assert a.alloc_list(OWNER_KV, n) == b.alloc(OWNER_KV, n).tolist()
    a.check()
    assert a.usage() == b.usage()
    a.alloc_list(OWNER_KV, a.num_free - 2)
    with pytest.raises(PoolExhausted):
        a.alloc_list(OWNER_KV, 3)


def test_without_per_call_checks_a_double_free_is_still_caught_by_the_whole_pool_check():
    """The simulator turns the per-call checks off (``PagePool.validate``); the end of every run
    checks the whole pool, which a double free breaks."""
    pool = PagePool(8 * 1024, 1024)
    pages = pool.alloc(OWNER_KV, 3)
    pool.validate = False
    pool.free(pages, OWNER_KV)
    pool.free(pages[:1], OWNER_KV)  # unchecked: accepted
    with pytest.raises(PoolError):
        pool.check()


def test_the_simulator_checks_each_call_only_when_asked(monkeypatch):
    from pwsim import engine

    monkeypatch.setenv(engine.POOL_CHECKS_ENV, "1")
    assert engine.pool_checks()
    monkeypatch.delenv(engine.POOL_CHECKS_ENV)
    assert not engine.pool_checks()


@settings(max_examples=120, deadline=None)
@given(
    spare_pages=st.integers(0, 400),
    pairs=st.lists(st.tuples(st.integers(0, 15), st.sampled_from(["bf16", "fp8", "int8", "int4"])), max_size=24),
    in_flight=st.lists(st.integers(0, 15), max_size=3, unique=True),
)
def test_begin_many_begins_what_one_begin_after_another_would(spare_pages, pairs, in_flight):
    """The leading pairs ``begin_many`` takes are those one ``begin`` after another would take
    before the first that lacks free pages, is in flight, repeats an expert or keeps its
    precision; with the same transitions, pages and pool state."""
    from pagedweight.core.pagetable import ExpertPageTable, expert_pages_by_id
    from pagedweight.core.spec import load_model

    model = load_model("tiny-moe")
    experts = [e % model.num_experts_total for e, _ in pairs]
    to_ids = [PRECISION_ID[name] for _, name in pairs]
    initial = np.array([PRECISION_ID["int4"], PRECISION_ID["fp8"]] * model.num_experts_total)[: model.num_experts_total]
    tables = []
    for _ in range(2):
        need = int(expert_pages_by_id(model, 16 << 10)[initial].sum())
        pool = PagePool((need + spare_pages) * (16 << 10), page_bytes=16 << 10)
        table = ExpertPageTable(pool, model, initial)
        for e in in_flight:
            e %= model.num_experts_total
            if e not in table.in_flight and pool.num_free >= table.pages_by_id[PRECISION_ID["bf16"]]:
                table.begin(e, PRECISION_ID["bf16"])
        tables.append(table)
    many, one = tables
    got = many.begin_many(experts, to_ids)
    want = []
    for e, to_id in zip(experts, to_ids, strict=True):
        if e in one.in_flight or to_id == one.precision_ids[e] or one.pages_by_id[to_id] > one.pool.num_free:
            break
        want.append(one.begin(e, to_id))
    assert [(t.expert, t.from_id, t.to_id, t.pages.tolist(), t.num_bytes) for t in got] == [
        (t.expert, t.from_id, t.to_id, t.pages.tolist(), t.num_bytes) for t in want
    ]
    assert many.in_flight.keys() == one.in_flight.keys()
    assert many.pool.num_free == one.pool.num_free
    assert np.array_equal(many.pool._owner_of, one.pool._owner_of)
    assert np.array_equal(many.pool._free_stack[: many.pool.num_free], one.pool._free_stack[: one.pool.num_free])
