"""Rows of a CSV table joined by a compiled loop: the bytes pandas' ``to_csv`` writes, for the
big tables of a run (a row per step: an hour of long context is 250,000-800,000 steps per policy,
~30 columns each).

Joining cells in Python (``",".join`` per row over a string per cell) cost ~0.25 us a cell, and
the step tables of the 7 policies of one long-context hour are ~90 million cells: ~20 CPU s
that every ``pwsim run`` spent after its simulations. Here integer columns are printed by the
loop itself (digits, sign), the other columns are printed in Python as before (floats by
``repr``, the shortest text that reads back the same, which a loop cannot cheaply reproduce)
into one byte string per column with each cell's end, and a constant text column (the
``policy`` label of every row) is printed once. The loop lays the cells out row by row.
Without numba, or for cells that need quoting, the caller's Python path runs instead.
"""

from __future__ import annotations

import functools

import numpy as np

from pagedweight.compiled import available, numba_module  # noqa: F401 - available: the writer asks here

# How each column's cells reach the row loop: integers, printed there; or texts, each row's
# text given by a code (a cell per row; one text for every row; the text of its value among
# the column's distinct values).
INTS, TEXT, CONSTANT, VALUES = 0, 1, 2, 3
_INT64_WIDTH = 20  # the most characters an int64 prints as (its minimum, sign included)
_INT64_MIN_TEXT = np.frombuffer(str(-(2**63)).encode(), dtype=np.uint8)


def _rows_loop(kinds, index, ints, blob, starts, ends, codes, num_rows, out_size, min_text):  # pragma: no cover
    num_cols = kinds.shape[0]
    out = np.empty(out_size, dtype=np.uint8)
    pos = 0
    for r in range(num_rows):
        for c in range(num_cols):
            i = index[c]
            if kinds[c] == 0:
                v = ints[i, r]
                if v == -9223372036854775807 - 1:  # no positive counterpart
                    for b in range(min_text.shape[0]):
                        out[pos + b] = min_text[b]
                    pos += min_text.shape[0]
                else:
                    if v < 0:
                        out[pos] = 45  # "-"
                        pos += 1
                        v = -v
                    width = 1
                    t = v
                    while t >= 10:
                        t //= 10
                        width += 1
                    for b in range(width - 1, -1, -1):
                        out[pos + b] = 48 + v % 10
                        v //= 10
                    pos += width
            else:
                j = codes[i, r]
                for b in range(starts[i, j], ends[i, j]):
                    out[pos] = blob[b]
                    pos += 1
            out[pos] = 44 if c < num_cols - 1 else 10  # "," or "\n"
            pos += 1
    return out[:pos]


@functools.cache
def _rows_loop_compiled():
    return numba_module().njit(cache=True)(_rows_loop)


def join_rows(columns: list[tuple[int, object]], num_rows: int) -> bytes:
    """The CSV rows (each ending in a newline) of ``columns``, in order: ``(INTS, int64
    array)``, ``(TEXT, list of str)`` (a cell per row), ``(CONSTANT, str)`` or ``(VALUES,
    (list of str, int64 array))`` (the distinct texts, and each row's index among them). No
    text may need quoting."""
    if num_rows == 0:
        return b""
    rows_loop = _rows_loop_compiled()
    kinds = np.array([kind for kind, _ in columns], dtype=np.int64)
    index = np.zeros(len(columns), dtype=np.int64)
    int_cols = [values for kind, values in columns if kind == INTS]
    ints = np.stack(int_cols) if int_cols else np.zeros((0, num_rows), dtype=np.int64)
    num_text = len(columns) - len(int_cols)
    # Room enough (the loop returns what it wrote): the widest integers, each row's text cell
    # at its column's longest, and a separator or newline per cell.
    size = (_INT64_WIDTH * len(int_cols) + len(columns)) * num_rows
    texts: list[list[str]] = []
    row_codes: list[np.ndarray] = []
    for c, (kind, values) in enumerate(columns):
        if kind == INTS:
            index[c] = c - len(texts)
            continue
        index[c] = len(texts)
        if kind == TEXT:
            texts.append(values)
            row_codes.append(np.arange(num_rows, dtype=np.int64))
        elif kind == CONSTANT:
            texts.append([values])
            row_codes.append(np.zeros(num_rows, dtype=np.int64))
        else:
            texts.append(values[0])
            row_codes.append(np.asarray(values[1], dtype=np.int64))
    width = max((len(t) for t in texts), default=1)
    starts = np.zeros((max(num_text, 1), width), dtype=np.int64)
    ends = np.zeros_like(starts)
    codes = np.stack(row_codes) if row_codes else np.zeros((1, num_rows), dtype=np.int64)
    pieces: list[bytes] = []
    base = 0
    for i, cells in enumerate(texts):
        joined = "".join(cells)
        data = joined.encode()
        if len(data) == len(joined):  # ASCII: a character is a byte
            lengths = np.fromiter(map(len, cells), dtype=np.int64, count=len(cells))
        else:
            lengths = np.fromiter((len(v.encode()) for v in cells), dtype=np.int64, count=len(cells))
        np.cumsum(lengths, out=ends[i, : len(cells)])
        ends[i, : len(cells)] += base
        starts[i, : len(cells)] = ends[i, : len(cells)] - lengths
        size += int(lengths.max(initial=0)) * num_rows
        pieces.append(data)
        base += len(data)
    blob = np.frombuffer(b"".join(pieces), dtype=np.uint8) if pieces else np.zeros(0, dtype=np.uint8)
    return rows_loop(kinds, index, ints, blob, starts, ends, codes, num_rows, size, _INT64_MIN_TEXT).tobytes()
