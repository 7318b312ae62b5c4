"""The prefix cache's map from a block's content key to the cached block holding it.

Keys come in two kinds (``pagedweight.core.prefix``): the simulator's trace keys, numbered
densely from 0 by ``TraceBlockKeys``, and everything else (the engine's 64-bit token hashes, a
request's own negative keys). Small non-negative keys live in an array indexed by key, so that a
prompt's few hundred keys are looked up, registered and forgotten in one numpy call each, where
a dict took a C-level step and a Python int per key (registering and evicting keys was half of
what prefix caching added to a Mooncake run). Every other key lives in a dict. A key's home
depends only on its value, never on the container it came in, so any mix of keys is exact.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from functools import partial
from itertools import islice, takewhile
from operator import is_not

import numpy as np

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


def _all_dense(arr: np.ndarray) -> bool:
    return bool(arr.min() >= 0) and bool(arr.max() < DENSE_KEYS)


def _none_dense(arr: np.ndarray) -> bool:
    return not ((arr >= 0) & (arr < DENSE_KEYS)).any()


class BlockKeyMap:
    """content key -> block id, for keys of any size; the bulk operations take a prompt's keys
    (a list, a range or an int64 array) at once."""

    __slots__ = ("_dense", "_num_dense", "_sparse")

    def __init__(self) -> None:
        self._dense = np.full(0, _NONE, dtype=np.int32)
        self._num_dense = 0
        self._sparse: dict[int, int] = {}

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

    def items(self) -> Iterator[tuple[int, int]]:
        """(key, block) pairs: the array's in key order, then the dict's."""
        dense = self._dense
        keys = np.flatnonzero(dense != _NONE)
        yield from zip(keys.tolist(), dense[keys].tolist(), strict=True)
        yield from self._sparse.items()

    def as_dict(self) -> dict[int, int]:
        return dict(self.items())
