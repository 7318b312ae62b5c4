"""KV blocks carved from the page pool's pages, and the prefix cache kept in them.

``KvBlockAllocator`` hands out fixed-size KV blocks, several to a pool page, and keeps the
prefix cache: blocks registered under the content key of the prompt they hold, shared by the
requests that hit them, evictable in least-recently-used order when nobody holds them, and
optionally protected from eviction by the ``pagedweight`` controller (see the class docstring).
The pool (``pagedweight.core.pool``) owns the pages; this module owns what is inside KV pages.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import compress, islice, repeat
from operator import add, not_

import numpy as np

from pagedweight.core.key_map import BlockKeyMap
from pagedweight.core.pool import OWNER_KV, OWNER_KV_CACHED, PagePool
from pagedweight.core.reuse import MIN_GHOST_BLOCKS, GhostList
from pagedweight.errors import PoolError, PoolExhausted


class _Run:
    """Blocks one request made evictable together, in eviction order from ``start`` to the end
    of ``blocks``: one entry of the LRU set for all of them, so making a 10,000-token prompt's
    blocks evictable and evicting them costs slices, not an entry per block. Used with one
    block per page, where a block's page needs no bookkeeping of its own (it is a cached page
    exactly when the block is evictable).

    Unkeyed (``retire``: private blocks nobody can ask for) or keyed (``release``: a request's
    cached blocks nobody holds any more, its last block first). Evictions take a run's first
    blocks; a prefix hit takes back a keyed run's last ones (``_unidle_runs``): the run lists a
    prompt's blocks from its end back to its start, and a hit takes the blocks of a prompt's
    first keys, which are the run's last."""

    __slots__ = ("blocks", "start", "keyed")

    def __init__(self, blocks: list[int], keyed: bool = False):
        self.blocks = blocks
        self.start = 0
        self.keyed = keyed


class KvBlockAllocator:
    """KV blocks of ``block_tokens`` tokens carved from pool pages, several per page.

    Block id = page * blocks_per_page + slot, so a runtime finds a block's bytes at
    ``page * page_bytes + slot * block_bytes`` in the arena. A page goes back to the pool as
    soon as its last block is freed, so KV never sits on pages a downgrade could reuse.
    New blocks come from partly used pages first, which keeps fragmentation low.

    Prefix caching (``cache_block``, ``acquire``, ``release``): a block whose KV a request has
    computed for a full block of its prompt may be registered under the key of its content (a
    hash chain: the key of block j stands for every token of blocks 0..j). A cached block counts
    the requests holding it; when none does it stays filled, *evictable*, in least-recently-used
    order, and a request with the same prefix takes it back instead of computing it. Evictable
    blocks are evicted (their key forgotten) only when an allocation needs them: KV allocations
    take free slots and free pages first, then reuse the least recently used evictable blocks in
    place; a weight allocation that finds too few free pages reclaims whole ``OWNER_KV_CACHED``
    pages (the pool's ``reclaim`` hook). A page is owned by ``OWNER_KV`` while any of its blocks
    is held by a request, by ``OWNER_KV_CACHED`` while all its used blocks are evictable. With
    one block per page, the blocks a request lets go of together are one entry of the LRU set
    (``_Run``; ``keyed_runs``), and a block is evictable exactly when its page is a cached page.

    Protection (``protected_blocks``, set by the ``pagedweight`` controller when the cache is
    worth more than the downgrades that would spare it): that many evictable blocks are not
    counted as free, so that a KV shortage reaches the scheduler's pressure hook (and the
    controller) before the cache is evicted; the controller lifts it (``unprotect``) where a
    downgrade would cost more. Evictions still take the least recently used blocks first.
    """

    def __init__(self, pool: PagePool, block_tokens: int, kv_bytes_per_token: int):
        if block_tokens < 1:
            raise PoolError(f"kv_block_tokens(={block_tokens}) must be >= 1")
        self.pool = pool
        self.block_tokens = block_tokens
        self.block_bytes = block_tokens * kv_bytes_per_token
        if self.block_bytes > pool.page_bytes:
            raise PoolError(
                f"a KV block of {block_tokens} tokens x {kv_bytes_per_token} B = {self.block_bytes} B "
                f"does not fit in a {pool.page_bytes} B page; use fewer tokens per block or larger pages"
            )
        self.blocks_per_page = pool.page_bytes // self.block_bytes
        self._used_in_page = np.zeros(pool.num_pages, dtype=np.int32)  # blocks held or evictable
        self._free_slots: dict[int, list[int]] = {}  # partly used KV page -> free block ids
        self._num_free_in_pages = 0
        self.num_used_blocks = 0  # blocks held by requests (evictable cached blocks are not)
        # Free pool pages KV may not take: headroom a downgrade needs for its new (smaller)
        # pages before it frees the old ones. Set by the controller; 0 for static policies.
        self.reserve_pages = 0
        # Prefix cache: content key <-> block, requests holding each cached block, and the
        # cached blocks nobody holds, least recently used first. A block's key is in arrays
        # indexed by block id (``_keyed``: whether it has one), and a key's block in a
        # ``BlockKeyMap``, each read and written for a whole list of blocks in one numpy call
        # where a dict took a step per block.
        self._block_of_key = BlockKeyMap()
        num_blocks = pool.num_pages * self.blocks_per_page
        self._key_of = np.zeros(num_blocks, dtype=np.int64)
        self._keyed = np.zeros(num_blocks, dtype=bool)
        self._refs: dict[int, int] = {}  # cached blocks held by two or more: how many (one: absent)
        # Entries: a block (cached under a key, or retired with no key where pages hold several
        # blocks) or a ``_Run`` of blocks; ``_num_evictable`` counts the blocks.
        self._evictable: OrderedDict[int | _Run, None] = OrderedDict()
        self._num_evictable = 0
        self._num_runs = 0  # ``_Run`` entries: with none, evictions are taken in bulk
        # With one block per page, released blocks go in as keyed runs, found by their last
        # block when a hit takes them back (tests turn this off to compare with a block each).
        self.keyed_runs = self.blocks_per_page == 1
        self._run_by_tail: dict[int, _Run] = {}  # keyed run's last block -> the run
        # Evictable blocks per page, kept only with several blocks a page (with one, a page is
        # evictable exactly when its block is).
        self._evictable_in_page = np.zeros(pool.num_pages, dtype=np.int32)
        self.num_evicted_blocks = 0  # cached blocks whose key was forgotten to make room
        # Evictable blocks not counted as free (the pagedweight controller's; 0: vLLM's rule).
        self.protected_blocks = 0
        # Keys of the blocks evicted last and how often requests come back for them
        # (``track_reuse``; None: not tracked, nothing is spent on it).
        self.ghosts: GhostList | None = None
        pool.reclaim = self._reclaim_pages

    def track_reuse(self, capacity_blocks: int | None = None) -> GhostList:
        """Keep a ghost list of evicted keys (``pagedweight.core.reuse``): by default 1/16 of the
        pool's blocks, at least ``MIN_GHOST_BLOCKS``."""
        if capacity_blocks is None:
            capacity_blocks = max(MIN_GHOST_BLOCKS, self.pool.num_pages * self.blocks_per_page // 16)
        self.ghosts = GhostList(capacity_blocks)
        return self.ghosts

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    @property
    def num_free_blocks(self) -> int:
        """Blocks available now: free slots and evictable blocks of pages a request holds a block
        of, and the blocks of free pages and of cached pages (``OWNER_KV_CACHED``) beyond the
        downgrade reserve; less the protected evictable blocks. The reserve holds back free and
        cached pages alike, whatever the blocks per page: a downgrade's new pages reclaim a
        cached page as readily as they take a free one. Protected blocks and the reserve are
        both subtracted (protection is lifted under pressure before anything is preempted)."""
        pool, evictable = self.pool, self._num_evictable
        cached_pages = pool._count[OWNER_KV_CACHED]
        spare_pages = pool._num_free + cached_pages - self.reserve_pages
        bpp = self.blocks_per_page
        # Free slots and evictable blocks outside cached pages (a cached page's blocks are all
        # evictable or free: bpp of them).
        n = self._num_free_in_pages + evictable - cached_pages * bpp if bpp > 1 else 0
        if spare_pages > 0:
            n += spare_pages * bpp
        if self.protected_blocks:
            n -= self.protected_blocks if self.protected_blocks < evictable else evictable
            return n if n > 0 else 0
        return n

    def free_after_acquire(self, idle_blocks: int) -> int:
        """``num_free_blocks`` once ``idle_blocks`` evictable blocks are taken by a request (a
        prefix hit): they no longer count as free, and protection shrinks by as many (a hit on
        the cache is what protecting it was for; ``acquire`` does the same), so taking them
        never shifts protection onto other blocks and leaves the request short."""
        free = self.num_free_blocks - idle_blocks
        protected = self.protected_blocks
        if protected and idle_blocks:
            evictable = self._num_evictable
            kept = protected - idle_blocks if protected > idle_blocks else 0
            free += min(protected, evictable) - min(kept, evictable - idle_blocks)
        return free

    @property
    def num_protected_blocks(self) -> int:
        """Evictable blocks protection holds back now."""
        return min(self.protected_blocks, self._num_evictable)

    @property
    def num_protected_pages(self) -> int:
        """Pages of the protected blocks, at most the cached pages: what an upgrade must leave."""
        pages = -(-self.num_protected_blocks // self.blocks_per_page)
        cached = self.pool._count[OWNER_KV_CACHED]
        return pages if pages < cached else cached

    def unprotect(self, num_blocks: int) -> None:
        """Count ``num_blocks`` more protected blocks as free (evictable) again."""
        held = self.num_protected_blocks
        self.protected_blocks = held - num_blocks if num_blocks < held else 0

    @property
    def num_cached_blocks(self) -> int:
        """Evictable cached blocks: prefix KV kept although no request holds it."""
        return self._num_evictable

    def evictable_blocks(self) -> list[int]:
        """The evictable blocks, least recently used first (tests, checks)."""
        out: list[int] = []
        for entry in self._evictable:
            if type(entry) is _Run:
                out.extend(entry.blocks[entry.start :])
            else:
                out.append(entry)
        return out

    def num_growable_blocks(self) -> int:
        """How many ``allocate(1)`` calls in a row succeed now, each without a shortage (so
        without the scheduler's pressure hook), and ``allocate_each`` hands out in one call:
        ``num_free_blocks`` with one block per page, where each such call takes one block off
        it; 0 with several, where a call's blocks depend on the pages' free slots."""
        return self.num_free_blocks if self.blocks_per_page == 1 else 0

    def allocate_each(self, num_blocks: int) -> list[int]:
        """The blocks of ``num_blocks`` calls of ``allocate(1)`` in a row, in their order, with
        the same evictions and ghosts (at most ``num_growable_blocks``): free pages popped off the
        pool's stack first, as one ``allocate``, then evictable blocks reused one at a time."""
        if num_blocks > self.num_growable_blocks():
            raise PoolExhausted(f"asked for {num_blocks} KV blocks one by one; {self.num_growable_blocks()} can be")
        direct = self.pool._num_free - self.reserve_pages
        out = self.allocate(direct if direct < num_blocks else num_blocks) if direct > 0 else []
        if len(out) < num_blocks:
            reuse_one = self._reuse_one
            out.extend([reuse_one() for _ in range(num_blocks - len(out))])
        return out

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise PoolExhausted(f"asked for {num_blocks} KV blocks; {self.num_free_blocks} free")
        if self.blocks_per_page > 1 and self.pool.num_free < self.reserve_pages:
            return self._allocate_within_reserve(num_blocks)
        reused: list[int] = []
        if self._evictable:
            spare_pages = self.pool.num_free - self.reserve_pages
            direct = self._num_free_in_pages + (spare_pages * self.blocks_per_page if spare_pages > 0 else 0)
            if num_blocks > direct:
                if num_blocks == 1 and self.blocks_per_page == 1:
                    return [self._reuse_one()]
                reused = self._evict_for_reuse(num_blocks - direct)
                num_blocks -= len(reused)
                if not num_blocks:
                    return reused
        if self.blocks_per_page == 1:  # one block per page (e.g. Mixtral: 16 x 128 KiB = 2 MiB)
            pages = self.pool.alloc_list(OWNER_KV, num_blocks)
            used = self._used_in_page
            for page in pages:
                used[page] = 1
            self.num_used_blocks += num_blocks
            return reused + pages if reused else pages
        out: list[int] = reused
        want = len(reused) + num_blocks
        owner_of = self.pool._owner_of
        while len(out) < want and self._free_slots:
            page, slots = next(iter(self._free_slots.items()))
            take = min(want - len(out), len(slots))
            out.extend(slots[len(slots) - take :])
            del slots[len(slots) - take :]
            if owner_of[page] == OWNER_KV_CACHED:  # a request holds a block of it again
                self.pool.transfer([page], OWNER_KV_CACHED, OWNER_KV)
            self._used_in_page[page] += take
            self._num_free_in_pages -= take
            if not slots:
                del self._free_slots[page]
        missing = want - len(out)
        if missing:
            bpp = self.blocks_per_page
            pages = self.pool.alloc(OWNER_KV, -(-missing // bpp))
            for page in pages.tolist():
                take = min(missing, bpp)
                base = page * bpp
                out.extend(range(base, base + take))
                self._used_in_page[page] = take
                if take < bpp:
                    self._free_slots[page] = list(range(base + bpp - 1, base + take - 1, -1))
                    self._num_free_in_pages += bpp - take
                missing -= take
        self.num_used_blocks += num_blocks
        return out

    def free(self, block_ids: list[int]) -> None:
        """Give back a request's blocks: cached ones lose a holder (and become evictable when
        none is left), the others are freed."""
        cached, private = self._split_cached(block_ids)
        if cached:
            self.release(cached)
        self._free_unkeyed(private)

    def _split_cached(self, block_ids: list[int], at: np.ndarray | None = None) -> tuple[list[int], list[int]]:
        """``block_ids`` as (cached blocks, the others), each in order (``at``: the same as an
        int64 array, when the caller has it)."""
        if not self._block_of_key or not block_ids:
            return [], block_ids
        is_cached = self._keyed[np.asarray(block_ids, dtype=np.int64) if at is None else at].tolist()
        cached = list(compress(block_ids, is_cached))
        if len(cached) == len(block_ids):
            return cached, []
        return cached, list(compress(block_ids, map(not_, is_cached))) if cached else block_ids

    def retire(self, block_ids: list[int], num_dead: int, num_shared: int = 0) -> None:
        """Give back the blocks of a request whose private prompt blocks were never registered
        (``Request.private_from``: nobody else can ask for them): blocks ``num_shared`` to
        ``num_dead`` (its computed private prompt blocks) become evictable with no key, exactly
        where ``free`` would have put them had they been registered, so the cache's memory and
        eviction order are unchanged; the first ``num_shared`` go back as ``free`` gives them
        back (cached ones released, the others freed); the rest are freed after those, in the
        order ``free`` frees them."""
        head = block_ids[:num_shared] if num_shared > 0 else []
        # One conversion for the pool's calls below (a long prompt's list costs ~50 us each).
        at = np.asarray(block_ids, dtype=np.int64)
        if num_dead > num_shared:
            # ``release`` makes a request's last block idle first: the private ones, which
            # come after its shared ones, are older in the LRU order than the shared ones.
            stop = num_shared - 1 if num_shared > 0 else None
            idle = block_ids[num_dead - 1 : stop : -1]
            if self.blocks_per_page == 1:
                self._evictable[_Run(idle)] = None
                self._num_runs += 1
                self._num_evictable += len(idle)
                self.num_used_blocks -= len(idle)
                self.pool.transfer(at[num_shared:num_dead], OWNER_KV, OWNER_KV_CACHED)
            else:
                self._make_idle(idle)
        first_rest = max(num_dead, num_shared)
        if head:
            cached, private = self._split_cached(head, at[:num_shared])
            if cached:
                self.release(cached)
            if private:
                self._free_unkeyed(private + block_ids[first_rest:])
                return
        # With several blocks a page, freed blocks go back to per-page lists: Python ints.
        self._free_unkeyed(at[first_rest:] if self.blocks_per_page == 1 else block_ids[first_rest:])

    def _free_unkeyed(self, block_ids: list[int] | np.ndarray) -> None:
        bpp = self.blocks_per_page
        if bpp == 1:
            pages = np.asarray(block_ids, dtype=np.int64)
            if len(pages) and (self._used_in_page[pages] != 1).any():
                raise PoolError("a KV block is not allocated (double free?)")
            self.pool.free(pages, OWNER_KV)  # checks ownership and duplicates
            self._used_in_page[pages] = 0
            self.num_used_blocks -= len(pages)
            return
        released: list[int] = []
        evictable_in_page = self._evictable_in_page
        for block in block_ids:
            page = block // bpp
            if self.pool._owner_of[page] != OWNER_KV or self._used_in_page[page] <= 0:
                raise PoolError(f"KV block {block} is not allocated (double free?)")
            self._used_in_page[page] -= 1
            if self._used_in_page[page] == 0:
                if page in self._free_slots:
                    self._num_free_in_pages -= len(self._free_slots.pop(page))
                released.append(page)
            else:
                slots = self._free_slots.setdefault(page, [])
                slots.append(block)
                self._num_free_in_pages += 1
                if evictable_in_page[page] and evictable_in_page[page] == self._used_in_page[page]:
                    self.pool.transfer([page], OWNER_KV, OWNER_KV_CACHED)  # only cached blocks left
        self.num_used_blocks -= len(block_ids)
        if released:
            self.pool.free(released, OWNER_KV)

    # ---- prefix caching -----------------------------------------------------------------------
    def cache_block(self, block: int, key: int) -> bool:
        """Register a block a request holds, whose KV is computed, under its content ``key``.
        False (and nothing changes) if the key is cached already (another request computed the
        same prefix meanwhile: this block stays private) or the block is cached under a key."""
        if key in self._block_of_key or self._keyed[block]:
            return False
        self._block_of_key[key] = block
        self._key_of[block] = key
        self._keyed[block] = True
        return True

    def cache_blocks(self, blocks: Sequence[int], keys: Sequence[int]) -> None:
        """``cache_block`` for each pair, in one call (a request's newly computed blocks)."""
        if len(blocks) != len(keys):
            raise PoolError(f"{len(blocks)} blocks for {len(keys)} keys")
        if not len(blocks):
            return
        # Usually none is cached yet: one bulk registration (a long prompt has ~1,000 blocks)
        # and two array writes.
        at = np.asarray(blocks, dtype=np.int64)
        if self._block_of_key.register_blocks(keys, at, self._keyed, self._key_of):
            return
        for block, key in zip(blocks, keys, strict=True):
            self.cache_block(block, key)

    def _cached_run(self, keys: Sequence[int], limit: int) -> list[int]:
        """The cached blocks of the leading ``keys`` (at most ``limit``), up to the first key not
        cached: looked up in one call (``BlockKeyMap.leading``), not a Python step per block (a
        multi-turn prompt hits hundreds)."""
        return self._block_of_key.leading(keys, limit)

    def lookup(self, keys: Sequence[int], limit: int) -> tuple[int, int]:
        """How many of the leading ``keys`` (at most ``limit``) are cached, and how many of those
        are evictable (taking them leaves that many fewer free blocks), without taking them."""
        blocks = self._cached_run(keys, limit)
        if not blocks:
            return 0, 0
        return len(blocks), sum(self._idle_flags(blocks)) if self._num_evictable else 0

    def _idle_flags(self, blocks: list[int]) -> list[bool]:
        """Whether each of ``blocks`` (cached ones) is evictable: in the LRU set, or with keyed
        runs, on a cached page (one block per page: the page is cached exactly then)."""
        if not self.keyed_runs:
            return list(map(self._evictable.__contains__, blocks))
        owner_of = self.pool._owner_of
        return (owner_of[np.asarray(blocks, dtype=np.int64)] == OWNER_KV_CACHED).tolist()

    def acquire(self, keys: Sequence[int], limit: int) -> list[int]:
        """The cached blocks of the longest cached run of leading ``keys`` (at most ``limit``),
        each now held once more (an evictable one is held again, not evicted)."""
        out = self._cached_run(keys, limit)
        if not out:
            return out
        evictable, refs = self._evictable, self._refs
        is_idle = self._idle_flags(out) if self._num_evictable else [False] * len(out)
        idle = list(compress(out, is_idle))
        held = list(compress(out, map(not_, is_idle))) if len(idle) < len(out) else []
        if held:  # one more holder each (a block held once has no count: 1 -> 2)
            refs.update(zip(held, map(add, map(refs.get, held, repeat(1)), repeat(1)), strict=True))
        if idle:
            if self.keyed_runs:
                self._unidle_runs(idle)
            else:
                deque(map(evictable.__delitem__, idle), maxlen=0)
            self.num_used_blocks += len(idle)
            self._num_evictable -= len(idle)
            self._held_again(idle)
            if self.protected_blocks:  # see free_after_acquire
                n = len(idle)
                self.protected_blocks = self.protected_blocks - n if self.protected_blocks > n else 0
        return out

    def _move_pages(self, pages: list[int], from_owner: int, to_owner: int) -> None:
        """Hand ``pages``, already marked ``to_owner`` in the owner array, over in the pool's
        counts: one pool call for many pages (a call per page cost ~5 us each)."""
        if pages:
            owner_of = self.pool._owner_of
            for page in pages:
                owner_of[page] = from_owner
            self.pool.transfer_list(pages, from_owner, to_owner)

    def release(self, blocks: list[int]) -> None:
        """Cached blocks lose one holder each; a block nobody holds becomes evictable, as the
        most recently used, a request's last block ahead of its first: so its last block, the
        prefix least likely to be shared, is evicted first (as vLLM does)."""
        refs, evictable = self._refs, self._evictable
        # Callers pass cached blocks held by a request (``free`` sorts them out). With keyed runs
        # that is checked as the pool checks its pages, only while ``pool.validate`` is on (the
        # simulator turns it off in runs and checks the whole state at the end, ``check``).
        if self.keyed_runs:
            idle_now = self._idle_flags(blocks) if self.pool.validate and self._num_evictable else []
            if any(idle_now):
                block = next(compress(blocks, idle_now))
                raise PoolError(f"KV block {block} is not a cached block held by a request")
        elif not evictable.keys().isdisjoint(blocks):
            block = next(b for b in blocks if b in evictable)
            raise PoolError(f"KV block {block} is not a cached block held by a request")
        if not refs or refs.keys().isdisjoint(blocks):  # held by this request alone: all idle now
            idle = blocks[::-1] if isinstance(blocks, list) else list(reversed(blocks))
        else:
            idle = []
            for block in reversed(blocks):
                n = refs.get(block)
                if n is None:
                    idle.append(block)
                elif n > 2:
                    refs[block] = n - 1
                else:
                    del refs[block]
        if idle:
            self._make_idle(idle)

    def _make_idle(self, idle: list[int]) -> None:
        """Held blocks nobody holds any more become evictable, in this order (first: evicted
        first among them), and a page whose used blocks are all evictable a cached page."""
        if self.keyed_runs:  # one entry for all (``_Run``), found by its last block on a hit
            run = _Run(idle, keyed=True)
            self._evictable[run] = None
            self._num_runs += 1
            self._run_by_tail[idle[-1]] = run
        else:  # each appended in C (``update(dict.fromkeys(idle))`` built a dict first: 128 -> 72 ns a block)
            deque(map(self._evictable.__setitem__, idle, repeat(None)), maxlen=0)
        self._num_evictable += len(idle)
        self.num_used_blocks -= len(idle)
        bpp, owner_of = self.blocks_per_page, self.pool._owner_of
        if bpp == 1:  # page = block: each such page now holds only a cached block
            self.pool.transfer_list(idle, OWNER_KV, OWNER_KV_CACHED)
            return
        in_page, used_in_page = self._evictable_in_page, self._used_in_page
        to_cached: list[int] = []
        for block in idle:
            page = block // bpp
            in_page[page] += 1
            if in_page[page] == used_in_page[page]:
                owner_of[page] = OWNER_KV_CACHED
                to_cached.append(page)
        self._move_pages(to_cached, OWNER_KV, OWNER_KV_CACHED)

    def key_of(self, block: int) -> int | None:
        """The content key a block is cached under, or None."""
        return int(self._key_of[block]) if self._keyed[block] else None

    def holders(self, block: int) -> int:
        """Requests holding a cached block (0 when evictable)."""
        if not self._keyed[block] or self._idle_flags([block])[0]:
            return 0
        return self._refs.get(block, 1)

    def _allocate_within_reserve(self, num_blocks: int) -> list[int]:
        """``allocate`` with several blocks a page and fewer free pages than the reserve: take
        free slots and evictable blocks of pages a request holds first, and turn a cached page
        into a KV page only while free + cached pages stay above the reserve (a downgrade's new
        pages may need to reclaim it). Least recently used first among the blocks it may take;
        ``num_free_blocks`` counts exactly these, so the request is always met."""
        pool, bpp, owner_of = self.pool, self.blocks_per_page, self.pool._owner_of
        spare = pool.num_free + pool._count[OWNER_KV_CACHED] - self.reserve_pages
        out: list[int] = []
        for page in [p for p in self._free_slots if owner_of[p] == OWNER_KV] + [
            p for p in self._free_slots if owner_of[p] == OWNER_KV_CACHED
        ]:
            if len(out) == num_blocks:
                break
            if owner_of[page] == OWNER_KV_CACHED:
                if spare <= 0:
                    continue
                spare -= 1
                pool.transfer([page], OWNER_KV_CACHED, OWNER_KV)
            slots = self._free_slots[page]
            take = min(num_blocks - len(out), len(slots))
            out.extend(slots[len(slots) - take :])
            del slots[len(slots) - take :]
            self._used_in_page[page] += take
            self._num_free_in_pages -= take
            if not slots:
                del self._free_slots[page]
        self.num_used_blocks += len(out)
        if len(out) < num_blocks:
            victims: list[int] = []
            opened: set[int] = set()
            for block in self._evictable:  # least recently used first
                if len(out) + len(victims) == num_blocks:
                    break
                page = block // bpp
                if owner_of[page] == OWNER_KV_CACHED and page not in opened:
                    if spare <= 0:
                        continue
                    spare -= 1
                    opened.add(page)
                victims.append(block)
            if len(out) + len(victims) < num_blocks:
                raise PoolError(f"KV allocation of {num_blocks} blocks found only {len(out) + len(victims)}")
            for block in victims:
                del self._evictable[block]
            self._num_evictable -= len(victims)
            out.extend(self._reuse([(False, victims)]))
        return out

    def _forget(self, block: int) -> int:
        """Evict one evictable block: its key is forgotten; returns its page."""
        del self._evictable[block]
        self._num_evictable -= 1
        key = self._forget_key(block)
        if self.ghosts is not None:
            # A retired block takes a slot in the ghost list that no lookup can hit, as its key
            # would have: the list's contents are those of registering every block.
            if key is None:
                self.ghosts.add_anonymous(1)
            else:
                self.ghosts.add(key)
        page = block // self.blocks_per_page
        if self.blocks_per_page > 1:
            self._evictable_in_page[page] -= 1
        self.num_evicted_blocks += 1
        return page

    def _take_lru(self, num_blocks: int) -> list[tuple[bool, list[int]]]:
        """Take the ``num_blocks`` least recently used evictable blocks out of the evictable set,
        in order, as pieces ``(unkeyed, blocks)``: unkeyed when from a retired run (``_Run``
        with no keys). Usually one block (a decode crossing into a new block once the cache
        fills the memory), or a slice of a run. Blocks between runs (several blocks per page)
        are taken a stretch at a time in C (``islice``, and ``map`` over ``pop``), not a Python
        step each."""
        evictable = self._evictable
        if not self._num_runs:  # blocks only: one slice, popped in C
            head = list(islice(evictable, num_blocks))
            deque(map(evictable.pop, head), maxlen=0)
            self._num_evictable -= num_blocks
            return [(False, head)]
        pieces: list[tuple[bool, list[int]]] = []
        left = num_blocks
        while left:
            entry = next(iter(evictable))
            if type(entry) is _Run:
                blocks, start = entry.blocks, entry.start
                if start + left >= len(blocks):
                    evictable.popitem(last=False)
                    self._num_runs -= 1
                    if entry.keyed:
                        del self._run_by_tail[blocks[-1]]
                    taken = blocks[start:] if start else blocks
                else:
                    taken = blocks[start : start + left]
                    entry.start = start + left
                pieces.append((not entry.keyed, taken))
                left -= len(taken)
                continue
            head = list(islice(evictable, left))
            kinds = list(map(type, head))
            if _Run in kinds:  # the blocks before the next run
                head = head[: kinds.index(_Run)]
            deque(map(evictable.pop, head), maxlen=0)
            pieces.append((False, head))
            left -= len(head)
        self._num_evictable -= num_blocks
        return pieces

    def _evict_for_reuse(self, num_blocks: int) -> list[int]:
        """The ``num_blocks`` least recently used evictable blocks, evicted and handed out in
        place as blocks a request holds (their pages stay KV pages)."""
        return self._reuse(self._take_lru(num_blocks))

    def _reuse_one(self) -> int:
        """``_evict_for_reuse(1)`` with one block per page, without the lists: a decode crossing
        into a new block once the cache fills the memory, most of a long run's allocations
        (637,000 in a cluster replica's hour: 2.6 -> 1.7 us each, timed inside the run). Same
        evictions, ghosts and counts as the general path (a test runs both on twin allocators)."""
        evictable, ghosts = self._evictable, self.ghosts
        entry = next(iter(evictable))
        if type(entry) is _Run:
            block = entry.blocks[entry.start]
            entry.start += 1
            if entry.start == len(entry.blocks):
                evictable.popitem(last=False)
                self._num_runs -= 1
                if entry.keyed:
                    del self._run_by_tail[block]
        else:
            evictable.popitem(last=False)
            block = entry
        if type(entry) is _Run and not entry.keyed:
            if ghosts is not None:
                ghosts.newer_anonymous += 1
        else:
            key = self._forget_key(block)
            if ghosts is not None:
                if key is None:
                    ghosts.newer_anonymous += 1
                else:
                    ghosts.newer[key] = None
        if ghosts is not None and len(ghosts.newer) + ghosts.newer_anonymous >= ghosts.capacity:
            ghosts.age()
        self._num_evictable -= 1
        self.num_evicted_blocks += 1
        self.num_used_blocks += 1
        self.pool.transfer_one(block, OWNER_KV_CACHED, OWNER_KV)  # page = block
        return block

    def _reuse(self, pieces: list[tuple[bool, list[int]]]) -> list[int]:
        """Evict the blocks of ``pieces``, just taken out of the evictable set (``_take_lru``'s
        form), and hand them out in place, in order."""
        ghosts = self.ghosts
        out = pieces[0][1] if len(pieces) == 1 else [b for _, blocks in pieces for b in blocks]
        # One conversion for the key arrays and the pool (a list of hundreds costs ~50 us).
        at = np.asarray(out, dtype=np.int64) if len(out) > 8 else None
        start = 0
        for unkeyed, blocks in pieces:
            end = start + len(blocks)
            if unkeyed:  # retired blocks: no key, each a ghost slot no lookup can hit (see _forget)
                if ghosts is not None:
                    ghosts.newer_anonymous += len(blocks)
            else:
                keys = self._forget_keys(blocks, None if at is None else at[start:end])
                if ghosts is not None:  # they become ghosts (core/reuse.py), in eviction order
                    anonymous = keys.count(None)
                    ghosts.newer_anonymous += anonymous
                    ghosts.newer.update(dict.fromkeys([k for k in keys if k is not None] if anonymous else keys))
            start = end
        if ghosts is not None and len(ghosts.newer) + ghosts.newer_anonymous >= ghosts.capacity:
            ghosts.age()
        num_blocks = len(out)
        self.num_evicted_blocks += num_blocks
        self.num_used_blocks += num_blocks
        if at is not None and self.blocks_per_page == 1:  # page = block (see _held_again)
            self.pool.transfer(at, OWNER_KV_CACHED, OWNER_KV)
        else:
            self._held_again(out)
        return out

    def _unidle_runs(self, idle: list[int]) -> None:
        """Take ``idle`` (evictable blocks a hit holds again, in the order of its keys) out of
        their keyed runs. A hit's blocks are the prefix of a prompt, so each run loses its last
        blocks, starting at its last (``_Run``): a slice off its end. Any other case (keys
        that are not a chain, which no runtime makes) takes the blocks out one by one, in the
        same LRU order (``_unidle_scattered``)."""
        by_tail, evictable = self._run_by_tail, self._evictable
        i, n = 0, len(idle)
        while i < n:
            run = by_tail.pop(idle[i], None)
            if run is None:
                self._unidle_scattered(idle[i:])
                return
            blocks, start = run.blocks, run.start
            m = min(n - i, len(blocks) - start)
            if blocks[len(blocks) - m :] != idle[i : i + m][::-1]:  # the run goes on past the hit
                last, m = len(blocks) - 1, 1
                while m < n - i and last - m >= start and blocks[last - m] == idle[i + m]:
                    m += 1
            del blocks[len(blocks) - m :]
            if len(blocks) == start:
                del evictable[run]
                self._num_runs -= 1
            else:
                by_tail[blocks[-1]] = run
            i += m

    def _unidle_scattered(self, idle: list[int]) -> None:
        """``_unidle_runs`` for blocks anywhere in their runs: each run loses them and keeps
        its other blocks in order (a pass over the evictable set)."""
        wanted = set(idle)
        for run in list(self._evictable):
            live = run.blocks[run.start :]
            if wanted.isdisjoint(live):
                continue
            del self._run_by_tail[live[-1]]
            kept = [b for b in live if b not in wanted]
            wanted.difference_update(live)
            if kept:
                run.blocks, run.start = kept, 0
                self._run_by_tail[kept[-1]] = run
            else:
                del self._evictable[run]
                self._num_runs -= 1
            if not wanted:
                return
        raise PoolError(f"KV blocks {sorted(wanted)} are not evictable")

    def _held_again(self, blocks: list[int]) -> None:
        """Blocks just taken out of the evictable set are held by a request again: their pages
        count one evictable block fewer each, and a cached page among them is a KV page again."""
        bpp = self.blocks_per_page
        if bpp == 1:  # page = block, and a page whose one block is evictable is a cached page
            self.pool.transfer_list(blocks, OWNER_KV_CACHED, OWNER_KV)
            return
        in_page, owner_of = self._evictable_in_page, self.pool._owner_of
        to_kv: list[int] = []
        for block in blocks:
            page = block // bpp
            in_page[page] -= 1
            if owner_of[page] == OWNER_KV_CACHED:
                owner_of[page] = OWNER_KV  # marked now, so a page is listed once; moved below
                to_kv.append(page)
        self._move_pages(to_kv, OWNER_KV_CACHED, OWNER_KV)

    def _forget_key(self, block: int) -> int | None:
        """An evicted block's key is forgotten; returns it (None: a retired block has none)."""
        if not self._keyed[block]:
            return None
        self._keyed[block] = False
        key = int(self._key_of[block])
        self._block_of_key.pop(key)
        return key

    def _forget_keys(self, blocks: list[int], at: np.ndarray | None = None) -> list[int | None]:
        """``_forget_key`` for each of ``blocks``: a few one by one, more in numpy calls and one
        ``BlockKeyMap`` call, not a Python step per block (``at``: the blocks as an int64 array,
        when the caller has it). Returns their keys in order for the ghost list (an empty list
        when none is kept: nothing else reads them)."""
        if len(blocks) <= 8:
            return [self._forget_key(b) for b in blocks]
        if at is None:
            at = np.asarray(blocks, dtype=np.int64)
        if self.ghosts is None:  # nobody reads the keys
            self._block_of_key.forget_blocks(at, self._keyed, self._key_of)
            return []
        keyed, keys = self._keyed[at].tolist(), self._key_of[at].tolist()
        self._block_of_key.forget_blocks(at, self._keyed, self._key_of)
        return keys if all(keyed) else [k if f else None for k, f in zip(keys, keyed, strict=True)]

    def _reclaim_pages(self, num_pages: int) -> None:
        """Free up to ``num_pages`` whole ``OWNER_KV_CACHED`` pages for another claimant, the
        pages of the least recently used evictable blocks first."""
        bpp, owner_of, evictable = self.blocks_per_page, self.pool._owner_of, self._evictable
        if bpp == 1:  # page = block, and the page of an evictable block is a cached page
            self._reclaim_blocks(min(num_pages, self._num_evictable))
            return
        # The pages first, walking the LRU order only as far as needed (a copy of the whole
        # evictable set per call cost a sixth of a long-context run), then their blocks.
        freed, seen = [], set()
        for block in evictable:
            if len(freed) >= num_pages:
                break
            page = block // bpp
            if page not in seen and owner_of[page] == OWNER_KV_CACHED:
                seen.add(page)
                freed.append(page)
        for page in freed:
            for b in range(page * bpp, page * bpp + bpp):
                if b in evictable:
                    self._forget(b)
            self._used_in_page[page] = 0
            if page in self._free_slots:
                self._num_free_in_pages -= len(self._free_slots.pop(page))
        if freed:
            self.pool.free(freed, OWNER_KV_CACHED)

    def _reclaim_blocks(self, num_blocks: int) -> None:
        """``_reclaim_pages`` with one block per page: evict the ``num_blocks`` least recently
        used blocks (as ``_forget`` would, one after another) and free their pages."""
        if num_blocks <= 0:
            return
        ghosts = self.ghosts
        pieces = self._take_lru(num_blocks)
        freed = pieces[0][1] if len(pieces) == 1 else [b for _, blocks in pieces for b in blocks]
        at = np.asarray(freed, dtype=np.int64)  # one conversion for the key arrays and the pool
        start = 0
        for unkeyed, blocks in pieces:
            end = start + len(blocks)
            piece_at, start = at[start:end], end
            if unkeyed:
                if ghosts is not None:
                    ghosts.add_anonymous(len(blocks))
                continue
            keys = self._forget_keys(blocks, piece_at)
            if ghosts is not None:  # one at a time: the list ages exactly where it fills
                for key in keys:
                    if key is None:
                        ghosts.add_anonymous(1)
                    else:
                        ghosts.add(key)
        self.num_evicted_blocks += num_blocks
        self._used_in_page[at] = 0
        self.pool.free(at, OWNER_KV_CACHED)

    def check(self) -> None:
        """Invariants: used + free slots = blocks of the KV pages; every KV page has a use; a
        page is ``OWNER_KV_CACHED`` exactly when its used blocks are all evictable; every cached
        block is held by a request or evictable, never both, under one key."""
        pool, bpp = self.pool, self.blocks_per_page
        kv_pages = pool.num_owned(OWNER_KV) + pool.num_owned(OWNER_KV_CACHED)
        evictable = self.evictable_blocks()
        if len(evictable) != self._num_evictable or len(set(evictable)) != len(evictable):
            raise PoolError(f"{self._num_evictable} evictable blocks counted, {len(evictable)} listed (or one twice)")
        used = self.num_used_blocks + len(evictable)
        if used + self._num_free_in_pages != kv_pages * bpp:
            raise PoolError(
                f"KV blocks: {self.num_used_blocks} used + {len(evictable)} cached + "
                f"{self._num_free_in_pages} free != {kv_pages} pages x {bpp}"
            )
        if int(self._used_in_page.sum()) != used:
            raise PoolError("per-page block counts disagree with the used-block total")
        if sum(len(s) for s in self._free_slots.values()) != self._num_free_in_pages:
            raise PoolError("free-slot lists disagree with their count")
        evictable_in_page = self._evictable_in_page
        if bpp == 1:
            evictable_in_page = np.zeros(pool.num_pages, dtype=np.int32)
            evictable_in_page[evictable] = 1
        elif int(evictable_in_page.sum()) != len(evictable):
            raise PoolError("per-page evictable counts disagree with the evictable set")
        owners = pool._owner_of
        in_use = self._used_in_page > 0
        all_cached = in_use & (evictable_in_page == self._used_in_page)
        if (owners[all_cached] != OWNER_KV_CACHED).any() or (owners[in_use & ~all_cached] != OWNER_KV).any():
            raise PoolError("a KV page's owner disagrees with its blocks (held: kv; only evictable: kv_cached)")
        if ((owners == OWNER_KV) | (owners == OWNER_KV_CACHED))[~in_use].any():
            raise PoolError("a KV page without a block in use")
        if len(self._block_of_key) != int(self._keyed.sum()) or any(
            not self._keyed[b] or self._key_of[b] != k for k, b in self._block_of_key.items()
        ):
            raise PoolError("prefix cache: key and block maps disagree")
        if set(self._refs) & set(evictable) or not all(self._keyed[b] for b in self._refs):
            raise PoolError("prefix cache: a shared block is evictable or has no key")
        if any(n < 2 for n in self._refs.values()):
            raise PoolError("prefix cache: a shared block's count below two")
        keyed = [e for e in self._evictable if type(e) is _Run and e.keyed]
        if len(keyed) != len(self._run_by_tail) or any(self._run_by_tail.get(r.blocks[-1]) is not r for r in keyed):
            raise PoolError("prefix cache: a keyed run is not found by its last block")
        if any(type(e) is _Run and len(e.blocks) == e.start for e in self._evictable):
            raise PoolError("prefix cache: an empty run in the evictable set")
        if any(not self._keyed[b] for r in keyed for b in r.blocks[r.start :]):
            raise PoolError("prefix cache: a keyed run holds a block with no key")
