"""The transition log: typed columns that read back as the records written, a window that keeps
the newest, and the CSV pandas would write from the records."""

from __future__ import annotations

import io

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.core.spec import PRECISION_NAMES
from pagedweight.core.transition_log import KINDS, TRANSITION_COLUMNS, TransitionLog, TransitionRecord
from pagedweight.results.writer import transition_frame, write_csv_rows, write_transitions

changes = st.lists(
    st.tuples(
        st.floats(0, 1e6, allow_nan=False, allow_subnormal=False),
        st.integers(0, 20_000),
        st.integers(0, len(PRECISION_NAMES) - 1),
        st.integers(0, len(PRECISION_NAMES) - 1),
        st.sampled_from(KINDS),
        st.integers(0, 2**40),
    ),
    max_size=40,
)


def _records(rows, per_layer: int = 128) -> list[TransitionRecord]:
    return [
        TransitionRecord(t, e, e // per_layer, PRECISION_NAMES[f], PRECISION_NAMES[to], k, b)
        for t, e, f, to, k, b in rows
    ]


def _fill(log: TransitionLog, rows, per_layer: int = 128) -> None:
    for i, (t, e, f, to, k, b) in enumerate(rows):
        if i % 3 == 2:  # some through extend, as a plan's aborts go
            log.extend(t, [e], [e // per_layer], [f], [to], k, [b])
        else:
            log.append(t, e, e // per_layer, f, to, k, b)


@settings(max_examples=60, deadline=None)
@given(changes, st.sampled_from([None, 1, 3, 7]))
def test_the_log_reads_back_the_newest_records_in_order(rows, window):
    log = TransitionLog(max_rows=window)
    _fill(log, rows)
    want = _records(rows)
    if window is not None:
        want = want[-window:] if want else []
    assert list(log) == want
    assert len(log) == len(want) and bool(log) == bool(want)
    if want:
        assert log[0] == want[0] and log[-1] == want[-1]
    with pytest.raises(IndexError):
        log[len(want)]


@settings(max_examples=60, deadline=None)
@given(changes)
def test_the_csv_is_the_one_pandas_writes_from_the_records(rows):
    log = TransitionLog()
    _fill(log, rows)
    reference = pd.DataFrame([r.row() for r in _records(rows)], columns=list(TRANSITION_COLUMNS))
    reference.insert(0, "policy", "p")
    want = reference.to_csv(index=False)
    got = io.StringIO()
    frame = transition_frame(log)
    frame.insert(0, "policy", "p")
    write_csv_rows(got, frame)
    assert got.getvalue() == want


def test_the_table_is_written_in_slices_with_one_header(tmp_path):
    rows = [(float(i), i, 0, 3, KINDS[i % len(KINDS)], 1000 + i) for i in range(25)]
    log = TransitionLog()
    _fill(log, rows)
    write_transitions(tmp_path / "t.csv", "p", log, rows_per_write=7)
    back = pd.read_csv(tmp_path / "t.csv")
    assert list(back.columns) == ["policy", *TRANSITION_COLUMNS] and len(back) == 25
    assert back["expert"].tolist() == list(range(25))
    assert back["kind"].tolist() == [KINDS[i % len(KINDS)].value for i in range(25)]
    write_transitions(tmp_path / "empty.csv", "p", TransitionLog())
    assert (tmp_path / "empty.csv").read_text() == "policy," + ",".join(TRANSITION_COLUMNS) + "\n"
