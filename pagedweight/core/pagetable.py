"""The expert page table: each routed expert's current precision and the pages that hold it.

A precision change is a page-table edit, not a data reshuffle: fill new pages (owned by
``OWNER_TRANSITION`` while in flight), flip the entry, free the old pages. Until the flip the
old pages keep serving, so a forward pass never reads a half-written expert. Both runtimes use
this table: ``pwgpu`` also writes bytes into the pages, ``pwsim`` only times the transfer.

Experts are indexed flat: ``index = moe_layer * num_experts + expert``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedweight.core.pool import OWNER_TRANSITION, PagePool, weight_owner
from pagedweight.core.spec import PRECISION_NAMES, PRECISIONS, ModelSpec
from pagedweight.errors import PoolError


@dataclass(slots=True)
class Transition:
    expert: int
    from_id: int
    to_id: int
    pages: np.ndarray  # new pages, owned by OWNER_TRANSITION until commit
    num_bytes: int  # bytes of the expert at the new precision


def matrix_pages_by_id(model: ModelSpec, page_bytes: int) -> np.ndarray:
    """(precision ids, matrices) pages each matrix of one expert occupies, in the order of
    ``model.expert_matrices`` (w1, w3, w2). The matrices are paged separately so that a kernel
    can address each through its own entries."""
    return np.array(
        [[-(-PRECISIONS[name].matrix_bytes(n, k) // page_bytes) for _, n, k in model.expert_matrices]
         for name in PRECISION_NAMES],
        dtype=np.int64,
    )  # fmt: skip


def expert_pages_by_id(model: ModelSpec, page_bytes: int) -> np.ndarray:
    """Pages one expert occupies at each precision id (its matrices' pages summed)."""
    return matrix_pages_by_id(model, page_bytes).sum(axis=1)


class ExpertPageTable:
    def __init__(self, pool: PagePool, model: ModelSpec, initial_ids: np.ndarray):
        initial_ids = np.asarray(initial_ids, dtype=np.int8).reshape(-1)
        if len(initial_ids) != model.num_experts_total:
            raise PoolError(f"initial precisions for {len(initial_ids)} experts; model has {model.num_experts_total}")
        self.pool = pool
        self.model = model
        self.matrix_pages_by_id = matrix_pages_by_id(model, pool.page_bytes)
        self.pages_by_id = self.matrix_pages_by_id.sum(axis=1)
        self._matrix_splits = np.cumsum(self.matrix_pages_by_id, axis=1)[:, :-1]
        self.bytes_by_id = np.array([model.expert_bytes(name) for name in PRECISION_NAMES], dtype=np.int64)
        self.precision_ids = initial_ids.copy()
        self.pages: list[np.ndarray] = []
        for pid in initial_ids.tolist():
            self.pages.append(pool.alloc(weight_owner(pid), int(self.pages_by_id[pid])))
        self.in_flight: dict[int, Transition] = {}
        self.version = 0  # bumped by every flip: lets readers cache what depends on precision_ids

    @property
    def num_experts(self) -> int:
        return len(self.precision_ids)

    def matrix_pages(self, precision_id: int, pages: np.ndarray) -> list[np.ndarray]:
        """An expert's ``pages`` at ``precision_id`` split into its matrices' pages (w1, w3, w2)."""
        return np.split(pages, self._matrix_splits[precision_id])

    def begin(self, expert: int, to_id: int) -> Transition:
        """Reserve the new pages of a change. Raises ``PoolExhausted`` if the pool is short."""
        if expert in self.in_flight:
            raise PoolError(f"expert {expert} already has a change in flight")
        from_id = int(self.precision_ids[expert])
        if from_id == to_id:
            raise PoolError(f"expert {expert} is already at {PRECISION_NAMES[to_id]}")
        pages = self.pool.alloc(OWNER_TRANSITION, int(self.pages_by_id[to_id]))
        t = Transition(expert, from_id, to_id, pages, int(self.bytes_by_id[to_id]))
        self.in_flight[expert] = t
        return t

    def begin_many(self, experts: list[int], to_ids: list[int]) -> list[Transition]:
        """``begin`` for the longest leading part of (expert, to_id) pairs whose pages the pool's
        free pages cover without reclaiming cached ones, in one allocation: the same pages in the
        same order as one ``begin`` after another. Returns those begun; the caller begins the
        rest one by one (each may reclaim, or find no room, or raise ``begin``'s error)."""
        # paper-greedy begins ~1,300 upgrades of a 6,144-expert model at every re-plan, so the
        # checks run in numpy and C-level set and dict operations, not pair by pair.
        to_arr = np.asarray(to_ids, dtype=np.intp)
        counts = self.pages_by_id[to_arr]
        ends = np.cumsum(counts)  # the leading pairs fit while their running sum of pages does
        num = int(np.searchsorted(ends, self.pool.num_free, side="right"))
        same = np.flatnonzero(self.precision_ids[experts[:num]] == to_arr[:num])
        if len(same):
            num = int(same[0])
        lead = experts[:num]
        if self.in_flight and not self.in_flight.keys().isdisjoint(lead):
            num = next(i for i, e in enumerate(lead) if e in self.in_flight)
            lead = experts[:num]
        if len(set(lead)) < num:  # an expert twice: stop at its second change
            first_at: dict[int, int] = {}
            for i, e in enumerate(lead):
                if first_at.setdefault(e, i) != i:
                    num = i
                    break
            lead = experts[:num]
        if not num:
            return []
        pages = self.pool.alloc(OWNER_TRANSITION, int(ends[num - 1]))
        first = int(counts[0])
        # One page count (the usual plan): each change's pages are a row of the allocation.
        parts = list(pages.reshape(num, first)) if (counts[:num] == first).all() else np.split(pages, ends[: num - 1])
        from_ids = self.precision_ids[lead].tolist()
        out = list(map(Transition, lead, from_ids, to_ids[:num], parts, self.bytes_by_id[to_arr[:num]].tolist()))
        self.in_flight.update(zip(lead, out, strict=True))
        return out

    def commit(self, expert: int) -> Transition:
        """Flip the entry to the new pages and free the old ones."""
        t = self.in_flight.pop(expert)
        self.pool.free(self.pages[expert], weight_owner(t.from_id))
        self.pool.transfer(t.pages, OWNER_TRANSITION, weight_owner(t.to_id))
        self.pages[expert] = t.pages
        self.precision_ids[expert] = t.to_id
        self.version += 1
        return t

    def abort(self, expert: int) -> None:
        t = self.in_flight.pop(expert)
        self.pool.free(t.pages, OWNER_TRANSITION)

    def abort_many(self, experts: list[int]) -> list[Transition]:
        """``abort`` for each expert in order (each must be in flight), freeing their pages in one
        call: the free stack ends as one ``abort`` after another leaves it."""
        done = [self.in_flight.pop(e) for e in experts]
        if done:
            # ``free`` pushes its pages reversed: the last abort's pages go in first.
            self.pool.free(np.concatenate([t.pages for t in reversed(done)]), OWNER_TRANSITION)
        return done

    def check(self) -> None:
        owned = sum(len(p) for p in self.pages)
        if owned != self.pool.num_weight_pages():
            raise PoolError(f"page table holds {owned} weight pages; pool counts {self.pool.num_weight_pages()}")
        for e, pages in enumerate(self.pages):
            want = weight_owner(int(self.precision_ids[e]))
            if len(pages) != self.pages_by_id[self.precision_ids[e]] or any(
                self.pool.owner_of(int(p)) != want for p in pages
            ):
                raise PoolError(
                    f"expert {e}: pages do not match its precision {PRECISION_NAMES[self.precision_ids[e]]}"
                )
