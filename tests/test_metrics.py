"""Summary figures checked by hand on a scripted run."""

import math
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.core.kv_blocks import KvBlockAllocator
from pagedweight.core.pool import OWNER_KV, PagePool, weight_owner
from pagedweight.core.scheduler import FINISHED, REJECTED, Request
from pagedweight.results.metrics import REQUEST_COLUMNS, Slo, StepRecorder, request_table, summarize


def finished(rid, arrival, token_times, prompt=10):
    r = Request(rid, arrival, prompt, len(token_times))
    r.state = FINISHED
    r.first_scheduled_s = arrival
    r.num_output_tokens = len(token_times)
    r.token_times_s.extend(token_times)
    r.first_token_s = token_times[0]
    r.finish_s = token_times[-1]
    return r


def test_summary_by_hand():
    a = finished(0, 0.0, [0.5, 0.6, 0.7])  # ttft 500, e2el 700, tpot 100
    b = finished(1, 1.0, [1.2, 1.6])  # ttft 200, e2el 600, tpot 400
    c = Request(2, 1.5, 99, 1)
    c.state, c.reject_reason = REJECTED, "too long"
    s = summarize([a, b, c], Slo(ttft_ms=300))
    assert s["completed"] == 2 and s["rejected"] == 1 and s["unfinished"] == 0
    assert s["duration_s"] == pytest.approx(1.6)
    assert s["request_throughput"] == pytest.approx(2 / 1.6)
    assert s["output_throughput"] == pytest.approx(5 / 1.6)
    assert s["total_token_throughput"] == pytest.approx(25 / 1.6)
    assert s["mean_ttft_ms"] == pytest.approx(350) and s["median_ttft_ms"] == pytest.approx(350)
    assert s["mean_tpot_ms"] == pytest.approx(250) and s["mean_e2el_ms"] == pytest.approx(650)
    assert s["mean_itl_ms"] == pytest.approx((100 + 100 + 400) / 3)
    assert s["p99_itl_ms"] == pytest.approx(np.percentile([100, 100, 400], 99))
    assert s["request_goodput"] == pytest.approx(1 / 1.6)  # only b meets TTFT <= 300 ms


def test_single_token_requests_have_no_tpot():
    s = summarize([finished(0, 0.0, [0.1])])
    assert math.isnan(s["mean_tpot_ms"]) and s["mean_ttft_ms"] == pytest.approx(100)


def test_request_table_has_every_column_and_each_requests_own_figures():
    a = finished(0, 0.25, [0.5, 0.6, 0.95])  # ttft 250, e2el 700, tpot 225
    a.num_preemptions, a.preempted_at_s, a.cached_tokens = 2, [0.3, 0.4125], 16
    b = Request(1, 0.5, 99, 4)
    b.state, b.reject_reason = REJECTED, "needs 9 blocks, at most 8 can ever be free"
    c = Request(2, 0.75, 10, 4)  # running: one token so far, no finish
    c.first_scheduled_s, c.first_token_s, c.num_output_tokens = 0.8, 0.9, 1
    df = request_table([a, b, c])
    assert tuple(df.columns) == REQUEST_COLUMNS and list(df.request_id) == [0, 1, 2]
    assert list(df.state) == [a.state.value, b.state.value, c.state.value]
    assert df.ttft_ms[0] == (0.5 - 0.25) * 1e3 and df.e2el_ms[0] == (0.95 - 0.25) * 1e3
    assert df.tpot_ms[0] == ((0.95 - 0.25) * 1e3 - (0.5 - 0.25) * 1e3) / 2
    assert df.preempted_at_s[0] == "0.300000;0.412500" and df.cached_tokens[0] == 16
    assert math.isnan(df.ttft_ms[1]) and math.isnan(df.first_scheduled_s[1]) and df.reject_reason[1] == b.reject_reason
    assert df.ttft_ms[2] == (0.9 - 0.75) * 1e3 and math.isnan(df.e2el_ms[2]) and math.isnan(df.tpot_ms[2])
    assert df.preempted_at_s[1] == df.reject_reason[2] == ""


def test_step_recorder_reads_the_pool():
    pool = PagePool(10 * 4096, 4096)
    kv = KvBlockAllocator(pool, 1, 1024)
    kv.allocate(5)  # two pages of KV
    pool.alloc(weight_owner(4), 3)
    rec = StepRecorder()
    rec.record(
        start_s=0.0, duration_s=0.02, num_running=1, num_waiting=0, num_prefill_tokens=5, num_decodes=0,
        num_preempted=0, kv_blocks_used=kv.num_used_blocks, kv_blocks_free=kv.num_free_blocks, pool=pool,
    )  # fmt: skip
    cols = rec.columns()
    assert set(cols) == set(StepRecorder.COLUMNS)
    assert cols["kv_pages"][0] == pool.num_owned(OWNER_KV) == 2
    assert cols["weight_pages_int4"][0] == 3 and cols["free_pages"][0] == 5
    assert cols["kv_usage"][0] == pytest.approx(5 / (5 + 3 + 5 * 4))


def test_step_recorder_keeps_rows_exact_across_blocks():
    """Rows cross several float64 blocks; integer columns come back as int64, floats exact."""
    pool = PagePool(64 * 4096, 4096)
    rec = StepRecorder()
    n = 2 * StepRecorder.CHUNK_ROWS + 7
    for i in range(n):
        rec.record(
            start_s=i * 0.1, duration_s=0.1 + i * 1e-9, num_running=i % 300, num_waiting=3, num_prefill_tokens=i,
            num_decodes=1, num_preempted=0, kv_blocks_used=0, kv_blocks_free=0, pool=pool,
            bytes_downgraded=2**40 + i, quality_proxy=1 / (i + 3),
        )  # fmt: skip
    cols = rec.columns()
    assert len(rec) == n and len(cols["step"]) == n
    assert cols["step"].dtype == np.int64 and cols["bytes_downgraded"].dtype == np.int64
    assert cols["start_s"].dtype == np.float64 and cols["quality_proxy"].dtype == np.float64
    i = np.arange(n)
    assert (cols["step"] == i).all() and (cols["bytes_downgraded"] == 2**40 + i).all()
    assert (cols["duration_s"] == 0.1 + i * 1e-9).all() and (cols["quality_proxy"] == 1 / (i + 3)).all()
    assert (cols["free_pages"] == 64).all()


def test_step_recorder_takes_numpy_scalars_and_counts_given_as_floats():
    """A runtime may hand numpy scalars, or a count as a float: stored as the int64 cast of the
    value (truncated), as before rows were packed; a value that is not a number names its column."""
    pool = PagePool(8 * 4096, 4096)
    rec = StepRecorder()
    common = dict(num_waiting=0, num_decodes=1, num_preempted=0, kv_blocks_used=1, kv_blocks_free=3, pool=pool)
    rec.record(start_s=np.float64(0.5), duration_s=0.25, num_running=np.int64(7), num_prefill_tokens=4, **common)
    rec.record(start_s=1, duration_s=0.25, num_running=2, num_prefill_tokens=4.0, bytes_swapped=3.9, **common)
    cols = rec.columns()
    assert cols["num_running"].tolist() == [7, 2] and cols["num_prefill_tokens"].tolist() == [4, 4]
    assert cols["bytes_swapped"].tolist() == [0, 3] and cols["start_s"].tolist() == [0.5, 1.0]
    with pytest.raises(TypeError, match="num_waiting"):
        rec.record(start_s=2.0, duration_s=0.25, num_running=1, num_prefill_tokens=0,
                   **{**common, "num_waiting": "many"})  # fmt: skip
    assert len(rec.columns()["step"]) == 2


@pytest.mark.parametrize("window", [1, 10, StepRecorder.CHUNK_ROWS, StepRecorder.CHUNK_ROWS + 3])
def test_step_recorder_window_keeps_the_newest_rows_across_blocks(window):
    """A server's history window: only the newest ``window`` steps, numbered as recorded, and
    whole blocks before the window are dropped as they fill (memory stays bounded)."""
    pool = PagePool(64 * 4096, 4096)
    rec = StepRecorder(max_rows=window)
    n = 3 * StepRecorder.CHUNK_ROWS + 11
    for i in range(n):
        rec.record(
            start_s=float(i), duration_s=1.0, num_running=i % 7, num_waiting=0, num_prefill_tokens=i,
            num_decodes=0, num_preempted=0, kv_blocks_used=0, kv_blocks_free=0, pool=pool,
        )  # fmt: skip
        if i == 2 * StepRecorder.CHUNK_ROWS:
            assert rec.columns()["step"][-1] == i  # reading mid-run does not disturb what follows
        assert rec._num_held <= window + 2 * StepRecorder.CHUNK_ROWS  # a block before the window, one filling
    cols = rec.columns()
    assert rec.num_recorded == n and len(rec) == window
    assert (cols["step"] == np.arange(n - window, n)).all()
    assert (cols["num_prefill_tokens"] == np.arange(n - window, n)).all()


def test_step_table_written_in_slices_is_the_whole_table(tmp_path):
    import pandas as pd

    from pagedweight.results.writer import _write_columns

    pool = PagePool(64 * 4096, 4096)
    rec = StepRecorder()
    for i in range(50):
        rec.record(
            start_s=i / 3, duration_s=1 / 3, num_running=i, num_waiting=0, num_prefill_tokens=0, num_decodes=i,
            num_preempted=0, kv_blocks_used=i, kv_blocks_free=100, pool=pool, quality_proxy=i / 7,
        )  # fmt: skip
    _write_columns(tmp_path / "sliced.csv", "p", rec.columns(), rows_per_write=7)
    whole = pd.DataFrame(rec.columns())
    whole.insert(0, "policy", "p")
    whole.to_csv(tmp_path / "whole.csv", index=False)
    assert (tmp_path / "sliced.csv").read_bytes() == (tmp_path / "whole.csv").read_bytes()
    _write_columns(tmp_path / "empty.csv", "p", StepRecorder().columns())
    assert (tmp_path / "empty.csv").read_text().strip() == ",".join(("policy", *StepRecorder.COLUMNS))


def test_request_table_written_in_slices_is_the_whole_table(tmp_path):
    """``_write_requests`` (our CSV writer, a slice at a time) writes the bytes of pandas'
    ``to_csv`` of the whole table, quoting included."""
    from pagedweight.results.writer import _write_requests

    reqs = [finished(i, i * 0.1, [i * 0.1 + 0.5, i * 0.1 + 0.75]) for i in range(9)]
    for i in (2, 3, 4):  # a slice of only rejected requests: its time columns are all missing
        reqs[i] = Request(i, i * 0.1, 99, 1)
        reqs[i].state, reqs[i].reject_reason = REJECTED, "too long"
    reqs[5].reject_reason = 'a reason, with a comma and "quotes"'
    _write_requests(tmp_path / "sliced.csv", "p", reqs, rows_per_write=3)
    whole = request_table(reqs)
    whole.insert(0, "policy", "p")
    whole.to_csv(tmp_path / "whole.csv", index=False)
    assert (tmp_path / "sliced.csv").read_bytes() == (tmp_path / "whole.csv").read_bytes()


def test_summary_from_arrays_matches_the_request_table():
    reqs = [finished(i, i * 0.37, [i * 0.37 + 0.1 * k + 0.013 for k in range(1, 2 + i % 4)]) for i in range(20)]
    s = summarize(reqs)
    table = request_table(reqs)
    ttft = table["ttft_ms"].to_numpy()
    tpot = table["tpot_ms"].to_numpy()
    assert s["mean_ttft_ms"] == float(ttft.mean()) and s["p99_ttft_ms"] == float(np.percentile(ttft, 99))
    assert s["mean_tpot_ms"] == float(tpot[~np.isnan(tpot)].mean())
    itl = np.concatenate([np.diff(np.asarray(r.token_times_s)) * 1e3 for r in reqs])
    assert s["mean_itl_ms"] == float(itl.mean()) and s["std_itl_ms"] == float(itl.std())


def test_inter_token_gaps_pool_each_requests_own_gaps_in_order():
    """Joined a chunk of requests at a time, the gaps are each request's own, in request order,
    bit for bit the per-request difference: whatever the chunk, with one-token and empty
    requests between, and with token times held as a list (the scheduler's) or an array."""
    from pagedweight.results.metrics import inter_token_ms

    rng = np.random.default_rng(3)
    reqs = []
    for i in range(300):
        times = np.cumsum(rng.exponential(0.05, int(rng.integers(0, 9)))) + i
        reqs.append(finished(i, float(i), times.tolist()) if len(times) else Request(i, float(i), 10, 4))
    reqs[7].token_times_s = array("d", reqs[7].token_times_s)
    reqs[8].token_times_s = array("d", reqs[8].token_times_s)
    expected = np.concatenate([np.diff(np.asarray(r.token_times_s, dtype=np.float64)) * 1e3 for r in reqs])
    for chunk in (1, 2, 7, 64, 16_384):
        np.testing.assert_array_equal(inter_token_ms(reqs, chunk=chunk), expected)
    assert len(inter_token_ms([])) == 0


@settings(max_examples=60, deadline=None)
@given(
    ints=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=30),
    floats=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), min_size=30, max_size=30),
    text=st.lists(st.one_of(st.none(), st.text(alphabet=st.sampled_from('ab ,"\n\r;é'), max_size=6)), min_size=30),
    chunk=st.integers(1, 8),
    header=st.booleans(),
)
def test_csv_writer_writes_what_pandas_writes(ints, floats, text, chunk, header):
    """``write_csv_rows`` against pandas' ``to_csv``, byte for byte, compiled and in Python:
    integers of the whole int64 range, floats of any exponent (NaN, infinities, subnormals,
    -0.0), text needing quotes, missing values, booleans, a constant column."""
    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch:
        _csv_writer_writes_what_pandas_writes(ints, floats, text, chunk, header, monkeypatch)


def test_csv_writer_compiled_rows_of_plain_text():
    """The compiled path with text that needs no quotes (non-ASCII included), repeated and
    distinct floats, a constant column and int64's extremes: pandas' bytes."""
    import io

    import pandas as pd

    from pagedweight.results.writer import write_csv_rows

    n = 50
    df = pd.DataFrame(
        {
            "policy": pd.Series(["pagedweight"] * n, dtype=object),
            "i": np.asarray([-(2**63), 2**63 - 1, 0, -1, 10] * 10, dtype=np.int64),
            "t": pd.Series(["é", "ab", "", None, "x y"] * 10, dtype=object),
            "f": np.asarray([0.1, 0.1, -0.5, 1e300, 3.0] * 10),
            "g": np.linspace(0.0, 1.0, n),
        }
    )
    ours = io.StringIO()
    write_csv_rows(ours, df, rows_per_chunk=16)
    assert ours.getvalue() == df.to_csv(index=False, lineterminator="\n")


def _csv_writer_writes_what_pandas_writes(ints, floats, text, chunk, header, monkeypatch):
    import io

    import pandas as pd

    from pagedweight.results import csv_rows
    from pagedweight.results.writer import write_csv_rows

    n = len(ints)
    df = pd.DataFrame(
        {
            "i": np.asarray(ints, dtype=np.int64),
            "f": np.asarray(floats[:n], dtype=np.float64),
            "t": pd.Series(text[:n], dtype=object),
            "b": np.asarray([x % 2 == 0 for x in ints], dtype=bool),
            "u": np.asarray([abs(x) % 2**16 for x in ints], dtype=np.uint16),
            "same": pd.Series([text[0] or "x"] * n, dtype=object),  # printed once when compiled
            "tail": np.asarray(ints[::-1], dtype=np.int64),
        }
    )
    ours = io.StringIO()
    write_csv_rows(ours, df, header=header, rows_per_chunk=chunk)
    theirs = df.to_csv(index=False, header=header, lineterminator="\n")
    assert ours.getvalue() == theirs
    if csv_rows.available():  # the Python path too
        monkeypatch.setattr(csv_rows, "available", lambda: False)
        python = io.StringIO()
        write_csv_rows(python, df, header=header, rows_per_chunk=chunk)
        assert python.getvalue() == theirs
