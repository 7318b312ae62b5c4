"""The unified page pool: KV blocks and expert weight pages draw from one budget.

At start the engine takes one arena of ``total_bytes`` and cuts it into fixed pages. Every page
has exactly one owner at any time; owners are small integer codes so that the accounting is a
numpy array, cheap enough to check on every step of a property test:

- ``OWNER_FREE``: not in use.
- ``OWNER_KV``: carved into KV blocks by ``KvBlockAllocator``.
- ``OWNER_PINNED``: weights that never change precision (attention, embeddings, routers,
  shared experts, dense layers).
- ``OWNER_TRANSITION``: pages being filled for a precision change that has not completed.
- ``OWNER_KV_CACHED``: KV pages whose every block in use is a cached prefix block that no
  request holds (prefix caching): memory that holds something worth keeping but can be taken
  back at once. The pool's ``reclaim`` hook evicts such pages when an allocation finds too few
  free pages, so to every other claimant they are as good as free (``num_available``).
- ``weight_owner(precision_id)``: routed-expert weights at that precision.

A page freed by a downgrade is immediately a page the KV allocator can take on the next step:
that is the whole point of one pool rather than two.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from pagedweight.core.spec import PRECISION_NAMES
from pagedweight.errors import PoolError, PoolExhausted

MiB = 2**20
DEFAULT_PAGE_BYTES = 2 * MiB

OWNER_FREE = 0
OWNER_KV = 1
OWNER_PINNED = 2
OWNER_TRANSITION = 3
OWNER_KV_CACHED = 4
_WEIGHT_BASE = 8
NUM_OWNERS = _WEIGHT_BASE + len(PRECISION_NAMES)
# Lists up to this long are checked for repeats with a set (cheaper than numpy calls below ~500).
_SET_CHECK_MAX = 256


def weight_owner(precision_id: int) -> int:
    """Owner code of routed-expert pages stored at ``PRECISION_NAMES[precision_id]``."""
    return _WEIGHT_BASE + precision_id


def owner_name(owner: int) -> str:
    if owner >= _WEIGHT_BASE:
        return f"weight:{PRECISION_NAMES[owner - _WEIGHT_BASE]}"
    return {
        OWNER_FREE: "free",
        OWNER_KV: "kv",
        OWNER_PINNED: "pinned",
        OWNER_TRANSITION: "transition",
        OWNER_KV_CACHED: "kv_cached",
    }[owner]


class PagePool:
    """Fixed-size pages with one owner each. Never over budget, no double free, no leak."""

    def __init__(self, total_bytes: int, page_bytes: int = DEFAULT_PAGE_BYTES):
        if page_bytes <= 0:
            raise PoolError(f"page_bytes(={page_bytes}) must be > 0")
        if total_bytes < page_bytes:
            raise PoolError(f"total_bytes(={total_bytes}) must hold at least one page of {page_bytes} bytes")
        self.page_bytes = page_bytes
        self.num_pages = total_bytes // page_bytes
        self.total_bytes = self.num_pages * page_bytes
        self._owner_of = np.zeros(self.num_pages, dtype=np.int16)
        # Pages per owner as Python ints: updated on every allocation of a step, where a numpy
        # element update costs ~10x a list one. Weight pages are also kept as one total.
        self._count = [0] * NUM_OWNERS
        self._count[OWNER_FREE] = self.num_pages
        self._num_weight = 0
        # Free pages as a stack; the low page ids are handed out first (top of the stack).
        self._free_stack = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = self.num_pages
        # Called with the number of pages missing when an allocation finds too few free: the KV
        # allocator evicts cached prefix pages there (``OWNER_KV_CACHED``). None: nothing to reclaim.
        self.reclaim: Callable[[int], None] | None = None
        self._scratch: np.ndarray | None = None  # page -> position, for the duplicate check
        self._positions = np.arange(64, dtype=np.int64)
        # Check every page list that ``free`` and ``transfer`` are given (in range, held by the
        # owner, listed once). A runtime whose callers are its own allocators may turn it off:
        # the simulator does (``pwsim.engine.pool_checks``), where it was 16-21% of a cluster
        # replica's time; the tests keep it on there, and ``check`` verifies the whole pool.
        self.validate = True

    # ---- queries --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_available(self) -> int:
        """Free pages plus cached prefix pages an allocation would reclaim."""
        return self._num_free + self._count[OWNER_KV_CACHED]

    def num_owned(self, owner: int) -> int:
        return self._count[owner]

    def num_weight_pages(self) -> int:
        return self._num_weight

    def counts(self) -> list[int]:
        """Pages per owner code (index = owner); the pool's own list: read, never change it."""
        return self._count

    def usage(self) -> dict[str, int]:
        """Pages per owner name, free included; sums to ``num_pages``."""
        return {owner_name(o): c for o, c in enumerate(self._count) if c or o <= OWNER_TRANSITION}

    def pages_for_bytes(self, num_bytes: int) -> int:
        return math.ceil(num_bytes / self.page_bytes)

    def owner_of(self, page: int) -> int:
        return int(self._owner_of[page])

    # ---- changes --------------------------------------------------------------------------
    def alloc(self, owner: int, num_pages: int) -> np.ndarray:
        """Take ``num_pages`` free pages for ``owner``; raises ``PoolExhausted`` if too few."""
        if owner == OWNER_FREE or not 0 < owner < NUM_OWNERS:
            raise PoolError(f"cannot allocate for owner {owner}")
        if num_pages < 0:
            raise PoolError(f"num_pages(={num_pages}) must be >= 0")
        if num_pages > self._num_free and self.reclaim is not None and owner != OWNER_KV:
            self.reclaim(num_pages - self._num_free)
        if num_pages > self._num_free:
            raise PoolExhausted(
                f"{owner_name(owner)} asked for {num_pages} pages; only {self._num_free} of {self.num_pages} free"
            )
        start = self._num_free - num_pages
        pages = self._free_stack[start : self._num_free][::-1].copy()
        self._num_free = start
        self._owner_of[pages] = owner
        self._count[owner] += num_pages
        self._count[OWNER_FREE] -= num_pages
        if owner >= _WEIGHT_BASE:
            self._num_weight += num_pages
        return pages

    def alloc_list(self, owner: int, num_pages: int) -> list[int]:
        """``alloc`` for a few pages as a list of ints (the same pages): the KV allocator's path,
        taken for about one decode in 16 every step, where numpy's per-call costs dominate."""
        if num_pages > 4 or owner == OWNER_FREE or not 0 < owner < NUM_OWNERS or num_pages < 0:
            return self.alloc(owner, num_pages).tolist()
        if num_pages > self._num_free and self.reclaim is not None and owner != OWNER_KV:
            self.reclaim(num_pages - self._num_free)
        if num_pages > self._num_free:
            raise PoolExhausted(
                f"{owner_name(owner)} asked for {num_pages} pages; only {self._num_free} of {self.num_pages} free"
            )
        start = self._num_free - num_pages
        pages = self._free_stack[start : self._num_free].tolist()[::-1]
        self._num_free = start
        owner_of = self._owner_of
        for page in pages:
            owner_of[page] = owner
        self._count[owner] += num_pages
        self._count[OWNER_FREE] -= num_pages
        if owner >= _WEIGHT_BASE:
            self._num_weight += num_pages
        return pages

    def free(self, pages: np.ndarray | list[int], owner: int) -> None:
        """Return ``pages`` held by ``owner``. A page not held by ``owner`` (already free,
        someone else's, or listed twice) is an error and nothing is freed."""
        pages = self._checked(pages, owner) if self.validate else np.asarray(pages, dtype=np.int64)
        n = len(pages)
        self._owner_of[pages] = OWNER_FREE
        self._free_stack[self._num_free : self._num_free + n] = pages[::-1]
        self._num_free += n
        self._count[owner] -= n
        self._count[OWNER_FREE] += n
        if owner >= _WEIGHT_BASE:
            self._num_weight -= n

    def transfer(self, pages: np.ndarray | list[int], from_owner: int, to_owner: int) -> None:
        """Hand pages from one owner to another without freeing them (e.g. a completed
        transition becomes the expert's weight pages)."""
        if to_owner == OWNER_FREE:
            raise PoolError("use free() to release pages")
        pages = self._checked(pages, from_owner) if self.validate else np.asarray(pages, dtype=np.int64)
        n = len(pages)
        self._owner_of[pages] = to_owner
        self._count[from_owner] -= n
        self._count[to_owner] += n
        self._num_weight += n * ((to_owner >= _WEIGHT_BASE) - (from_owner >= _WEIGHT_BASE))

    def transfer_list(self, pages: list[int], from_owner: int, to_owner: int) -> None:
        """``transfer`` for a few pages given as ints (the prefix cache's path, a page or two per
        allocation, where numpy's per-call costs dominate); the same checks."""
        owner_of = self._owner_of
        if len(pages) > 4 or to_owner == OWNER_FREE or len(set(pages)) != len(pages):
            self.transfer(pages, from_owner, to_owner)
            return
        for page in pages:
            if not 0 <= page < self.num_pages or owner_of[page] != from_owner:
                self.transfer(pages, from_owner, to_owner)  # raises, naming the page
                return
        for page in pages:
            owner_of[page] = to_owner
        n = len(pages)
        self._count[from_owner] -= n
        self._count[to_owner] += n
        self._num_weight += n * ((to_owner >= _WEIGHT_BASE) - (from_owner >= _WEIGHT_BASE))

    def transfer_one(self, page: int, from_owner: int, to_owner: int) -> None:
        """``transfer`` of one page (the KV allocator's per-decode path), with its checks."""
        if to_owner == OWNER_FREE:
            raise PoolError("use free() to release pages")
        if not 0 <= page < self.num_pages or self._owner_of[page] != from_owner:
            self.transfer([page], from_owner, to_owner)  # raises, naming the page
            return
        self._owner_of[page] = to_owner
        self._count[from_owner] -= 1
        self._count[to_owner] += 1
        if (to_owner >= _WEIGHT_BASE) != (from_owner >= _WEIGHT_BASE):
            self._num_weight += 1 if to_owner >= _WEIGHT_BASE else -1

    def _checked(self, pages: np.ndarray | list[int], owner: int) -> np.ndarray:
        """``pages`` as an int64 array, each in range, held by ``owner`` and listed once; else
        ``PoolError`` naming the first bad page. For a list of up to ``_SET_CHECK_MAX`` pages
        (the KV allocator's usual call, ~100 pages) that is four numpy calls and a set, where a
        numpy call costs ~1 us whatever its size (~5 us a call of 64 pages, ~10 us before)."""
        listed_once = False
        if type(pages) is list:
            n = len(pages)
            if 1 < n <= _SET_CHECK_MAX:
                if len(set(pages)) != n:
                    raise PoolError("a page is listed twice in one call (double free)")
                listed_once = True
        pages = np.asarray(pages, dtype=np.int64)
        if pages.ndim != 1:
            raise PoolError("pages must be a 1-D list of page ids")
        n = len(pages)
        if n == 0:
            return pages
        try:  # an index past the end raises; a negative one would wrap, so it is looked for
            held = self._owner_of[pages]
            if pages.min() < 0:
                raise IndexError
        except IndexError:
            raise PoolError(f"page ids must be in [0, {self.num_pages}); got {pages.min()}..{pages.max()}") from None
        wrong = held != owner
        if np.count_nonzero(wrong):  # (faster than ``wrong.any()`` on short arrays)
            bad = int(pages[np.argmax(wrong)])
            raise PoolError(
                f"page {bad} is owned by {owner_name(int(self._owner_of[bad]))}, not {owner_name(owner)} "
                "(double free or wrong owner)"
            )
        if n > 1 and not listed_once:
            # A page listed twice: write each position into a scratch array at its page and read
            # back; a repeated page holds its last position, so an earlier one reads another.
            # Four numpy calls: ~4 us for 640 pages, where a set of them costs ~20 us.
            if self._scratch is None:
                self._scratch = np.zeros(self.num_pages, dtype=np.int64)
            if len(self._positions) < n:
                self._positions = np.arange(max(n, 2 * len(self._positions)), dtype=np.int64)
            positions = self._positions[:n]
            self._scratch[pages] = positions
            if (self._scratch[pages] != positions).any():
                raise PoolError("a page is listed twice in one call (double free)")
        return pages

    # ---- invariants -----------------------------------------------------------------------
    def check(self) -> None:
        """Raise ``PoolError`` if any invariant is broken: counts match the owner array, the
        free stack holds exactly the free pages, and nothing is over budget."""
        counts = np.bincount(self._owner_of, minlength=NUM_OWNERS)
        if not np.array_equal(counts, self._count) or self._num_weight != int(counts[_WEIGHT_BASE:].sum()):
            raise PoolError(f"owner counts {self._count} disagree with pages {counts.tolist()}")
        free = self._free_stack[: self._num_free]
        if len(np.unique(free)) != self._num_free or (self._owner_of[free] != OWNER_FREE).any():
            raise PoolError("free stack does not hold exactly the free pages")
        if self._num_free != counts[OWNER_FREE] or sum(self._count) != self.num_pages:
            raise PoolError("pages were created or lost")
