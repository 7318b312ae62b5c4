"""What the cached prefix blocks next in line for eviction are worth: their observed reuse.

A ghost list, as in ARC: the keys of the blocks evicted last (``capacity`` to twice that, dropped
a generation at a time). When an admitted request's cached prefix ends at a key the ghost list
holds, the cache missed blocks it would have served had it kept that many more: each such block
is a *ghost hit* (counted once; its key leaves the list). Ghost hits per second per ghost block
is the hit rate of blocks just beyond the cache's least recently used end, so a lower bound for
the blocks that would be evicted next (younger, in LRU order) wherever reuse falls with idle
time. The rate is an exponentially decayed count over ``window_s`` seconds, so it follows the
traffic and, when nothing is evicted for a while, decays with the list's ageing keys: protection
that stops evictions lowers its own estimate, never raises it.

Cost: a dict store per evicted block, a dict look-up per admission past its cached prefix;
nothing per step. Only the ``pagedweight`` policy, which weighs the cache against downgrades
(``pagedweight.policy.controller``), turns it on (``KvBlockAllocator.track_reuse``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Seconds over which ghost hits are averaged: several multi-turn think times, yet short enough to
# follow a change of traffic within a minute.
REUSE_WINDOW_S = 30.0
MIN_GHOST_BLOCKS = 256


class GhostList:
    """Keys of recently evicted prefix blocks and the rate at which requests come back for them.

    Two generations of keys, each a plain dict filled up to ``capacity`` keys: when the newer is
    full it becomes the older and the older is dropped, so the list holds the last ``capacity``
    to ``2 * capacity`` evicted keys and an eviction costs one dict store (the simulator's hot
    path evicts a block for most new ones once the cache has filled the memory).

    A block evicted without a key (one retired by a request whose keys nobody else can hit)
    takes a slot that no lookup can hit, as its key would have: it is counted, not stored
    (``newer_anonymous``), so that the list's size, ageing and hit rate are those of keeping
    every key, at no cost per block."""

    def __init__(self, capacity: int, window_s: float = REUSE_WINDOW_S):
        self.capacity = max(1, capacity)
        self.window_s = window_s
        self.newer: dict[int, None] = {}  # the allocator stores evicted keys here
        self._older: dict[int, None] = {}
        self.newer_anonymous = 0  # slots of blocks evicted without a key, in the newer generation
        self._older_anonymous = 0
        self._count = 0.0  # ghost hits, decayed with time constant window_s, as of _count_s
        self._count_s = 0.0
        self.num_hits = 0  # every ghost hit of the run (results, tests)

    def __len__(self) -> int:
        return len(self.newer) + self.newer_anonymous + len(self._older) + self._older_anonymous

    def add(self, key: int) -> None:
        """An evicted block's key."""
        self.newer[key] = None
        if len(self.newer) + self.newer_anonymous >= self.capacity:
            self.age()

    def add_anonymous(self, num_blocks: int) -> None:
        """``num_blocks`` evicted blocks without a key, as ``add`` one at a time would take them
        (the generation ages exactly where it fills)."""
        while num_blocks > 0:
            take = self.capacity - len(self.newer) - self.newer_anonymous
            if take < 1:
                take = 1  # an overfull generation (never left so by the allocator): as ``add``
            if take > num_blocks:
                take = num_blocks
            self.newer_anonymous += take
            num_blocks -= take
            if len(self.newer) + self.newer_anonymous >= self.capacity:
                self.age()

    def age(self) -> None:
        """The newer generation is full: it becomes the older, the older is forgotten."""
        self._older, self.newer = self.newer, {}
        self._older_anonymous, self.newer_anonymous = self.newer_anonymous, 0

    def count_hits(self, keys: Sequence[int], start: int, limit: int, now_s: float) -> int:
        """An admitted request's blocks ``start``.. (up to ``limit``) were not cached: those of
        them, in a run from ``start``, that were evicted lately are ghost hits (each counted once:
        it leaves the list). Returns how many."""
        newer, older = self.newer, self._older
        n = 0
        j = start
        while j < limit:
            key = keys[j]
            if key in newer:
                del newer[key]
            elif key in older:
                del older[key]
            else:
                break
            n += 1
            j += 1
        if n:
            self._count = self._decayed(now_s) + n
            self._count_s = now_s
            self.num_hits += n
        return n

    def _decayed(self, now_s: float) -> float:
        dt = now_s - self._count_s
        return self._count * math.exp(-dt / self.window_s) if dt > 0 else self._count

    def hit_rate_per_block(self, now_s: float) -> float:
        """Ghost hits per second per ghost block (0 before any hit)."""
        if not self.num_hits or not len(self):
            return 0.0
        return self._decayed(now_s) / self.window_s / len(self)
