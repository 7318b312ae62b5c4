"""The prefix cache's map from a block's content key to the cached block holding it.

Keys come in two kinds (``pagedweight.core.prefix``): the simulator's trace keys, numbered
densely from 0 by ``TraceBlockKeys``, and everything else (the engine's 64-bit token hashes, a
request's own negative keys). Small non-negative keys live in an array indexed by key, so that a
prompt's few hundred keys are looked up, registered and forgotten in one numpy call each, where
a dict took a C-level step and a Python int per key (registering and evicting keys was half of
what prefix caching added to a Mooncake run). Every other key lives in a dict. A key's home
depends only on its value, never on the container it came in, so any mix of keys is exact.

The allocator's two hot calls, registering a prompt's newly computed blocks and forgetting the
keys of evicted ones, also update its own block -> key arrays; with numba (``pagedweight.
compiled``) each is one compiled pass over the blocks (bounds-checked) instead of ~15 numpy calls
of ~1 us each, and the numpy form runs where numba is not installed. Both give the same state.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator, Sequence
from functools import partial
from itertools import islice, takewhile
from operator import is_not

import numpy as np

from pagedweight.compiled import numba_module

# Keys below this live in the array: at most 64 MiB of int32, grown only as far as the largest
# key registered (the Mooncake trace's keys reach 1.4M with 16-token blocks: 5.6 MB).
DENSE_KEYS = 1 << 24
_NONE = -1  # an array slot with no block
_IS_BLOCK = partial(is_not, None)  # a cached key's block, not a miss (dict.get's None)


def _as_keys(keys: Sequence[int]) -> np.ndarray | None:
    """``keys`` as an int64 array (no copy for one already), or None if one does not fit."""
    if type(keys) is np.ndarray:
        return keys
    try:
        return np.asarray(keys, dtype=np.int64)
    except OverflowError:
        return None


def _register_loop(keys, blocks, dense, keyed, key_of) -> int:
    """``register_blocks`` in one pass: 2 if a key is outside the array, 1 (nothing changed) if
    a block has a key or a key is registered or listed twice, else 0 (all registered)."""
    n = keys.shape[0]
    size = dense.shape[0]
    for i in range(n):
        k = keys[i]
        if k < 0 or k >= size:
            return 2
        if keyed[blocks[i]] or dense[k] != -1:
            return 1
    for i in range(n):
        k = keys[i]
        if dense[k] != -1:  # listed twice: undo what this call wrote
            for j in range(i):
                dense[keys[j]] = -1
            return 1
        dense[k] = blocks[i]
    for i in range(n):
        keyed[blocks[i]] = True
        key_of[blocks[i]] = keys[i]
    return 0


def _forget_loop(blocks, dense, keyed, key_of) -> int:
    """``forget_blocks`` in one pass; returns how many keys it forgot."""
    n = 0
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if keyed[b]:
            dense[key_of[b]] = -1
            keyed[b] = False
            n += 1
    return n


@functools.cache
def _loops() -> tuple | None:
    """The compiled passes, or None where numba is not installed."""
    numba = numba_module()
    if numba is None:
        return None
    njit = numba.njit(cache=True, boundscheck=True)  # an index out of range raises, never corrupts
    return njit(_register_loop), njit(_forget_loop)


def _all_dense(arr: np.ndarray) -> bool:
    return bool(arr.min() >= 0) and bool(arr.max() < DENSE_KEYS)


def _none_dense(arr: np.ndarray) -> bool:
    return not ((arr >= 0) & (arr < DENSE_KEYS)).any()


class BlockKeyMap:
    """content key -> block id, for keys of any size; the bulk operations take a prompt's keys
    (a list, a range or an int64 array) at once."""

    __slots__ = ("_dense", "_num_dense", "_sparse", "compiled")

    def __init__(self, compiled: bool | None = None) -> None:
        self._dense = np.full(0, _NONE, dtype=np.int32)
        self._num_dense = 0
        self._sparse: dict[int, int] = {}
        # The compiled passes where numba is installed (None: numba is imported at the first
        # bulk call, not here); False: the numpy form (tests compare both).
        self.compiled = compiled

    def __len__(self) -> int:
        return self._num_dense + len(self._sparse)

    def __contains__(self, key: int) -> bool:
        return self.get(key) is not None

    def get(self, key: int) -> int | None:
        if 0 <= key < DENSE_KEYS:
            if key >= len(self._dense):
                return None
            block = int(self._dense[key])
            return None if block == _NONE else block
        return self._sparse.get(key)

    def __setitem__(self, key: int, block: int) -> None:
        """Register ``key`` (not registered yet) for ``block``."""
        if 0 <= key < DENSE_KEYS:
            self._grow(key)
            if self._dense[key] != _NONE:
                raise KeyError(key)
            self._dense[key] = block
            self._num_dense += 1
        elif self._sparse.setdefault(int(key), block) != block:
            raise KeyError(key)

    def pop(self, key: int) -> int:
        """Forget ``key`` (KeyError if it is not registered); returns its block."""
        if 0 <= key < DENSE_KEYS:
            block = self.get(key)
            if block is None:
                raise KeyError(key)
            self._dense[key] = _NONE
            self._num_dense -= 1
            return block
        return self._sparse.pop(key)

    def _grow(self, max_key: int) -> None:
        size = len(self._dense)
        if max_key >= size:
            grown = np.full(min(DENSE_KEYS, max(2 * size, int(max_key) + 1, 1024)), _NONE, dtype=np.int32)
            grown[:size] = self._dense
            self._dense = grown

    def leading(self, keys: Sequence[int], limit: int) -> list[int]:
        """The blocks of the leading ``keys`` (at most ``limit``), up to the first key not
        registered."""
        if limit <= 0 or not len(keys) or self.get(keys[0]) is None:  # most lookups miss at once
            return []
        head = keys[:limit]
        arr = _as_keys(head)
        if arr is not None and _all_dense(arr):
            dense = self._dense
            inside = arr < len(dense)
            if not inside.all():  # a key past the array is not registered: the run ends there
                arr = arr[: int(inside.argmin())]
            blocks = dense[arr]
            missing = blocks == _NONE
            if missing.any():
                blocks = blocks[: int(missing.argmax())]
            return blocks.tolist()
        if arr is not None and _none_dense(arr):  # all in the dict: looked up in C
            return list(takewhile(_IS_BLOCK, map(self._sparse.get, islice(keys, limit))))
        return list(takewhile(_IS_BLOCK, map(self.get, islice(keys, limit))))

    def add_absent(self, keys: Sequence[int], blocks: Sequence[int]) -> bool:
        """Register each of ``keys`` for the block at its position (``blocks`` distinct), if no
        key is registered already and none is listed twice; otherwise change nothing and return
        False (the caller then registers them one by one)."""
        arr = _as_keys(keys)
        if arr is not None and _all_dense(arr):
            self._grow(int(arr.max()))
            dense = self._dense
            if (dense[arr] != _NONE).any():
                return False
            dense[arr] = blocks
            # A key listed twice kept only its last block: the other one reads back wrong.
            if not np.array_equal(dense[arr], np.asarray(blocks, dtype=np.int32)):
                dense[arr] = _NONE  # none was registered before
                return False
            self._num_dense += len(arr)
            return True
        if arr is not None and _none_dense(arr):
            sparse = self._sparse
            if type(keys) is np.ndarray:  # the dict holds Python ints
                keys = keys.tolist()
            if not sparse.keys().isdisjoint(keys):
                return False
            before = len(sparse)
            sparse.update(zip(keys, blocks, strict=True))
            if len(sparse) != before + len(keys):  # a key listed twice: take them out again
                deque(map(sparse.pop, keys, [None] * len(keys)), maxlen=0)
                return False
            return True
        return False

    def remove(self, keys: Sequence[int]) -> None:
        """Forget each of ``keys`` (distinct, each registered)."""
        if not len(keys):
            return
        arr = _as_keys(keys)
        if arr is not None and _all_dense(arr):
            if int(arr.max()) >= len(self._dense) or (self._dense[arr] == _NONE).any():
                raise KeyError("a key to forget is not registered")
            self._dense[arr] = _NONE
            self._num_dense -= len(arr)
        elif arr is not None and _none_dense(arr):
            deque(map(self._sparse.__delitem__, keys.tolist() if type(keys) is np.ndarray else keys), maxlen=0)
        else:
            deque(map(self.pop, keys), maxlen=0)

    def register_blocks(self, keys: Sequence[int], blocks: np.ndarray, keyed: np.ndarray, key_of: np.ndarray) -> bool:
        """``add_absent`` for ``blocks`` (an int64 array) that have no key yet (``keyed``, the
        allocator's flags), recording each block's key in ``key_of`` and its flag too; False,
        and nothing changed, where ``add_absent`` would refuse or a block has a key."""
        loops = _loops() if self.compiled is not False and type(keys) is np.ndarray else None
        if loops is not None and keys.dtype == np.int64:
            register = loops[0]
            status = register(keys, blocks, self._dense, keyed, key_of)
            if status == 2 and len(keys) and _all_dense(keys):  # past the array: grow, once
                self._grow(int(keys.max()))
                status = register(keys, blocks, self._dense, keyed, key_of)
            if status != 2:
                if status == 0:
                    self._num_dense += len(keys)
                return status == 0
        if keyed[blocks].any() or not self.add_absent(keys, blocks):
            return False
        key_of[blocks] = keys
        keyed[blocks] = True
        return True

    def forget_blocks(self, blocks: np.ndarray, keyed: np.ndarray, key_of: np.ndarray) -> None:
        """Forget the keys of those of ``blocks`` (an int64 array) that have one (``keyed``,
        the allocator's flags, cleared here; ``key_of``: their keys)."""
        loops = _loops() if self.compiled is not False and not self._sparse else None
        if loops is not None:  # every registered key is in the array
            self._num_dense -= loops[1](blocks, self._dense, keyed, key_of)
            return
        has = keyed[blocks]
        keys = key_of[blocks]
        keyed[blocks] = False
        self.forget(keys if has.all() else keys[has])

    def forget(self, keys: np.ndarray) -> None:
        """``remove`` for keys known to be registered (the allocator's own record of its blocks'
        keys): while every registered key is in the array, one store, nothing checked
        (``KvBlockAllocator.check`` compares the count with the blocks' keys)."""
        if self._sparse:
            self.remove(keys)
            return
        self._dense[keys] = _NONE
        self._num_dense -= len(keys)

    def items(self) -> Iterator[tuple[int, int]]:
        """(key, block) pairs: the array's in key order, then the dict's."""
        dense = self._dense
        keys = np.flatnonzero(dense != _NONE)
        yield from zip(keys.tolist(), dense[keys].tolist(), strict=True)
        yield from self._sparse.items()

    def as_dict(self) -> dict[int, int]:
        return dict(self.items())
