"""Every precision change of a run, held column by column.

A run logs each change it makes (downgrades, upgrades, and upgrades abandoned): a few thousand
for most policies in an hour, but paper-greedy on a 6,144-expert model begins and abandons
hundreds of upgrades a step, ~13 million an hour. As Python objects (a named tuple of seven
fields and their boxed numbers, ~250 bytes) that held ~3 GB; as typed columns it is 35 bytes a
change. Reading it back yields ``TransitionRecord``s, in order.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from pagedweight.core.spec import PRECISION_NAMES
from pagedweight.policy.controller import ChangeKind

KINDS = tuple(ChangeKind)  # kind code = its index here
_KIND_CODE = {k: i for i, k in enumerate(KINDS)}
_NAMES = np.asarray(PRECISION_NAMES, dtype=object)
_KIND_VALUES = np.asarray([k.value for k in KINDS], dtype=object)
TRANSITION_COLUMNS = ("time_s", "expert", "layer", "from_precision", "to_precision", "kind", "bytes")


class TransitionRecord(NamedTuple):
    """One row of transitions.csv: a precision change that happened (``kind`` ABORT: an upgrade
    abandoned, which changed nothing)."""

    time_s: float
    expert: int  # flat index: moe_layer * num_experts + expert
    layer: int  # MoE layer
    from_precision: str
    to_precision: str
    kind: ChangeKind
    num_bytes: int  # bytes of the expert at ``to_precision`` (0 for ABORT)

    def row(self) -> tuple:
        """The values in ``TRANSITION_COLUMNS`` order."""
        return (*self[:5], self.kind.value, self.num_bytes)


class TransitionLog:
    """Changes in the order they happened. ``max_rows``: keep only the newest (a server runs
    for days; ``RuntimeCore.num_transitions`` counts them all)."""

    __slots__ = ("_time_s", "_expert", "_layer", "_from", "_to", "_kind", "_bytes", "_max_rows")

    def __init__(self, max_rows: int | None = None) -> None:
        self._time_s = array("d")
        self._expert, self._layer, self._bytes = array("q"), array("q"), array("q")
        self._from, self._to, self._kind = array("b"), array("b"), array("b")
        self._max_rows = max_rows or None

    def append(
        self, time_s: float, expert: int, layer: int, from_id: int, to_id: int, kind: ChangeKind, num_bytes: int
    ) -> None:
        self._time_s.append(time_s)
        self._expert.append(expert)
        self._layer.append(layer)
        self._from.append(from_id)
        self._to.append(to_id)
        self._kind.append(_KIND_CODE[kind])
        self._bytes.append(num_bytes)
        if self._max_rows is not None and len(self._time_s) >= 2 * self._max_rows:
            self._trim()

    def extend(
        self, time_s: float, experts: list[int], layers: list[int], from_ids: list[int], to_ids: list[int],
        kind: ChangeKind, num_bytes: list[int],
    ) -> None:  # fmt: skip
        """Changes made at one time, all of one kind (a plan's aborts)."""
        n = len(experts)
        self._time_s.extend([time_s] * n)
        self._expert.extend(experts)
        self._layer.extend(layers)
        self._from.extend(from_ids)
        self._to.extend(to_ids)
        self._kind.extend([_KIND_CODE[kind]] * n)
        self._bytes.extend(num_bytes)
        if self._max_rows is not None and len(self._time_s) >= 2 * self._max_rows:
            self._trim()

    def _trim(self) -> None:
        # Trimmed to the window once it holds twice as many: each change is moved at most once.
        drop = len(self._time_s) - self._max_rows
        for col in (self._time_s, self._expert, self._layer, self._from, self._to, self._kind, self._bytes):
            del col[:drop]

    def __len__(self) -> int:
        n = len(self._time_s)
        return n if self._max_rows is None else min(n, self._max_rows)

    def _start(self) -> int:
        return len(self._time_s) - len(self)

    def __iter__(self) -> Iterator[TransitionRecord]:
        return (self._record(i) for i in range(self._start(), len(self._time_s)))

    def __getitem__(self, index: int) -> TransitionRecord:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"transition {index} of {n}")
        return self._record(self._start() + index % n)

    def _record(self, i: int) -> TransitionRecord:
        return TransitionRecord(
            self._time_s[i], self._expert[i], self._layer[i], PRECISION_NAMES[self._from[i]],
            PRECISION_NAMES[self._to[i]], KINDS[self._kind[i]], self._bytes[i],
        )  # fmt: skip

    def columns(self) -> dict[str, np.ndarray]:
        """The table's columns (``TRANSITION_COLUMNS``; precisions and kinds as text)."""
        start = self._start()

        def col(a: array, dtype) -> np.ndarray:
            return np.frombuffer(a, dtype=dtype)[start:].copy() if len(a) else np.zeros(0, dtype=dtype)

        return {
            "time_s": col(self._time_s, np.float64),
            "expert": col(self._expert, np.int64),
            "layer": col(self._layer, np.int64),
            "from_precision": _NAMES[col(self._from, np.int8)],
            "to_precision": _NAMES[col(self._to, np.int8)],
            "kind": _KIND_VALUES[col(self._kind, np.int8)],
            "bytes": col(self._bytes, np.int64),
        }
