"""Result records and the run summary, with vLLM ``benchmark_serving`` field names.

Both runtimes write the same three tables, so one report reads either:
- requests: one row per request (``request_table``),
- steps: one row per engine step (``StepRecorder``),
- summary: one dict per policy (``summarize``).

Definitions (as vLLM's benchmark): TTFT = first token - arrival; E2EL = finish - arrival;
TPOT = (E2EL - TTFT) / (output_len - 1), only for requests with more than one output token;
ITL = gaps between consecutive tokens of a request, pooled over requests. Throughputs divide
by ``duration_s`` = last finish - first arrival. Goodput counts completed requests meeting
every SLO that is set.
"""

from __future__ import annotations

import dataclasses
import struct
from array import array
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from pagedweight.core.pool import (
    NUM_OWNERS,
    OWNER_FREE,
    OWNER_KV,
    OWNER_KV_CACHED,
    OWNER_PINNED,
    OWNER_TRANSITION,
    PagePool,
    weight_owner,
)
from pagedweight.core.scheduler import FINISHED, REJECTED, Request
from pagedweight.core.spec import PRECISION_NAMES
from pagedweight.results.backlog import queue_growth

if TYPE_CHECKING:
    import pandas as pd

_WEIGHT_OWNERS = slice(weight_owner(0), NUM_OWNERS)
PERCENTILES = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))

REQUEST_COLUMNS = (
    "request_id",
    "state",
    "arrival_s",
    "prompt_tokens",
    "max_output_tokens",
    "output_tokens",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "ttft_ms",
    "tpot_ms",
    "e2el_ms",
    "num_preemptions",
    "preempted_at_s",
    "reject_reason",
    "cached_tokens",
)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput; ``None`` means not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None


def request_table(requests: list[Request], columns: RequestColumns | None = None) -> pd.DataFrame:
    """One row per request (``REQUEST_COLUMNS``), built column by column (a dict per request
    cost ~14 us: 0.65 s for a replica's 48,000 requests). ``columns``:
    ``RequestColumns.of(requests)`` if the caller has them already. Missing times are NaN
    (printed empty); the latencies are ``RequestColumns.latencies_ms``, the summary's."""
    import pandas as pd  # here: the runtimes import this module, only tables need pandas

    cols = RequestColumns.of(requests) if columns is None else columns
    ttft, e2el, tpot = cols.latencies_ms()
    n = len(requests)
    return pd.DataFrame(
        {
            "request_id": cols.request_id,
            "state": [r.state.value for r in requests],
            "arrival_s": cols.arrival_s,
            "prompt_tokens": cols.prompt_tokens,
            "max_output_tokens": np.fromiter((r.max_output_tokens for r in requests), dtype=np.int64, count=n),
            "output_tokens": cols.num_output_tokens,
            "first_scheduled_s": _floats(r.first_scheduled_s for r in requests),
            "first_token_s": cols.first_token_s,
            "finish_s": cols.finish_s,
            "ttft_ms": ttft,
            "tpot_ms": tpot,
            "e2el_ms": e2el,
            "num_preemptions": cols.num_preemptions,
            "preempted_at_s": [";".join(f"{t:.6f}" for t in r.preempted_at_s) for r in requests],
            "reject_reason": [r.reject_reason or "" for r in requests],
            "cached_tokens": np.fromiter((r.cached_tokens for r in requests), dtype=np.int64, count=n),
        },
        columns=list(REQUEST_COLUMNS),
    )


def _stats(name: str, values: np.ndarray, out: dict) -> None:
    missing = np.isnan(values)
    if missing.any():  # a copy only when there is something to drop (the ITL of an hour: 4M values)
        values = values[~missing]
    if len(values) == 0:
        out[f"mean_{name}_ms"] = out[f"std_{name}_ms"] = float("nan")
        for label, _ in PERCENTILES:
            out[f"{label}_{name}_ms"] = float("nan")
        return
    out[f"mean_{name}_ms"] = float(values.mean())
    out[f"std_{name}_ms"] = float(values.std())
    # Percentiles last, partitioning ``values`` in place (a percentile depends only on the
    # values, not their order): no copy of the array. The caller's arrays are spent here.
    for label, q in PERCENTILES:
        out[f"{label}_{name}_ms"] = float(np.percentile(values, q, overwrite_input=True))


def _floats(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def inter_token_ms(requests: list[Request], chunk: int = 4096) -> np.ndarray:
    """Gaps between consecutive tokens of each request, pooled in request order, into one array.
    ``chunk`` requests at a time are joined and differenced in a few numpy calls (a few calls
    per request cost a second an hour of a busy replica), the gaps across two requests dropped."""
    times = [t for t in (r.token_times_s for r in requests) if len(t) > 1]
    lengths = np.fromiter(map(len, times), dtype=np.int64, count=len(times))
    out = np.empty(int(lengths.sum()) - len(times))
    pos = 0
    for start in range(0, len(times), chunk):
        part = times[start : start + chunk]
        if all(isinstance(t, array) and t.typecode == "d" for t in part):
            flat = np.frombuffer(b"".join(part), dtype=np.float64)
        else:  # lists (the scheduler's): one pass over them all, 15 ns a value
            count = int(lengths[start : start + chunk].sum())
            flat = np.fromiter(chain.from_iterable(part), dtype=np.float64, count=count)
        gaps = np.diff(flat)
        keep = np.ones(len(gaps), dtype=bool)
        keep[np.cumsum(lengths[start : start + chunk])[:-1] - 1] = False  # last token -> next request
        k = len(gaps) - len(part) + 1
        out[pos : pos + k] = gaps[keep]  # (np.compress into ``out`` was 3x slower)
        out[pos : pos + k] *= 1e3
        pos += k
    return out


@dataclass
class RequestColumns:
    """What the summary needs of each request, one array per field, in request order: how a
    cluster's replicas hand their requests to the parent process (a Request object each cost
    ~1 s of pickling per 50,000 requests at each end)."""

    request_id: np.ndarray  # int64
    finished: np.ndarray  # bool
    rejected: np.ndarray  # bool
    arrival_s: np.ndarray  # float64
    first_token_s: np.ndarray  # float64; NaN where none
    finish_s: np.ndarray  # float64; NaN where none
    prompt_tokens: np.ndarray  # int64
    num_output_tokens: np.ndarray  # int64
    num_preemptions: np.ndarray  # int64

    @classmethod
    def of(cls, requests: list[Request]) -> RequestColumns:
        n = len(requests)

        def ints(attr: str) -> np.ndarray:
            return np.fromiter((getattr(r, attr) for r in requests), dtype=np.int64, count=n)

        return cls(
            request_id=ints("request_id"),
            finished=np.fromiter((r.state is FINISHED for r in requests), dtype=bool, count=n),
            rejected=np.fromiter((r.state is REJECTED for r in requests), dtype=bool, count=n),
            arrival_s=_floats(r.arrival_s for r in requests),
            first_token_s=_floats(r.first_token_s for r in requests),
            finish_s=_floats(r.finish_s for r in requests),
            prompt_tokens=ints("prompt_tokens"),
            num_output_tokens=ints("num_output_tokens"),
            num_preemptions=ints("num_preemptions"),
        )

    def rows(self, start: int, stop: int) -> RequestColumns:
        """Requests ``start`` to ``stop`` (views, not copies)."""
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name)[start:stop] for f in dataclasses.fields(self)}
        )

    def latencies_ms(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """TTFT, E2EL and TPOT of every request, NaN where it has none (E2EL and TPOT only for
        finished requests, TPOT only past their first token); vLLM's definitions (module
        docstring), element by element, so each figure is the float per-request arithmetic gives."""
        arrival, finished, n = self.arrival_s, self.finished, self.num_output_tokens
        ttft = (self.first_token_s - arrival) * 1e3
        e2el = np.where(finished, (self.finish_s - arrival) * 1e3, np.nan)
        tpot = np.full(len(arrival), np.nan)
        many = finished & (n > 1)
        tpot[many] = (e2el[many] - ttft[many]) / (n[many] - 1)
        return ttft, e2el, tpot

    @classmethod
    def concat(cls, parts: list[RequestColumns]) -> RequestColumns:
        """The parts' requests together, ordered by ``request_id``."""
        fields = [f.name for f in dataclasses.fields(cls)]
        joined = {f: np.concatenate([getattr(p, f) for p in parts]) for f in fields}
        order = np.argsort(joined["request_id"], kind="stable")
        return cls(**{f: a[order] for f, a in joined.items()})


def summarize(
    requests: list[Request],
    slo: Slo = Slo(),
    steps: dict[str, np.ndarray] | None = None,
    columns: RequestColumns | None = None,
) -> dict:
    """The run's summary. ``steps`` (``StepRecorder.columns()``) adds KV usage figures;
    ``columns``: ``RequestColumns.of(requests)`` if the caller has them already."""
    done = [r for r in requests if r.state is FINISHED]
    if columns is None:
        columns = RequestColumns.of(requests)
    return summarize_columns(columns, slo, inter_token_ms(done), steps)


def summarize_columns(
    cols: RequestColumns, slo: Slo, itl_ms: np.ndarray, steps: dict[str, np.ndarray] | None = None
) -> dict:
    """``summarize`` of requests given as columns, with their pooled inter-token gaps."""
    done = cols.finished
    ttft, e2el, tpot = (values[done] for values in cols.latencies_ms())
    n = cols.num_output_tokens[done]
    num_requests, completed = len(cols.arrival_s), int(done.sum())
    start_s = float(cols.arrival_s.min()) if num_requests else 0.0
    end_s = float(cols.finish_s[done].max()) if completed else start_s
    duration_s = max(end_s - start_s, 1e-9)
    input_tokens = int(cols.prompt_tokens[done].sum())
    output_tokens = int(n.sum())
    good = np.ones(completed, dtype=bool)
    for limit, values in ((slo.ttft_ms, ttft), (slo.tpot_ms, tpot), (slo.e2el_ms, e2el)):
        if limit is not None:
            good &= np.nan_to_num(values, nan=0.0) <= limit
    rejected = int(cols.rejected.sum())
    out = {
        "num_requests": num_requests,
        "completed": completed,
        "rejected": rejected,
        "unfinished": num_requests - completed - rejected,
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": completed / duration_s,
        "request_goodput": int(good.sum()) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "num_preemptions": int(cols.num_preemptions.sum()),
    }
    out.update(queue_growth(cols.arrival_s, cols.finish_s, cols.rejected))
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl_ms), ("e2el", e2el)):
        _stats(name, values, out)
    if steps is not None and len(steps["kv_usage"]):
        out["mean_kv_cache_usage_perc"] = float(steps["kv_usage"].mean() * 100)
        out["max_kv_cache_usage_perc"] = float(steps["kv_usage"].max() * 100)
    return out


_STEP_FLOAT_COLUMNS = frozenset(("start_s", "duration_s", "kv_usage", "quality_proxy"))


class StepRecorder:
    """One row per engine step, appended on the hot path of a run (~110,000 rows for an hour of
    simulated chat traffic, ~250,000 for an hour of long context).

    Rows are held column by column in blocks of ``CHUNK_ROWS`` steps (8 bytes a value: int64
    counts, float64 times and ratios), not as Python objects: a tuple per step cost ~700 bytes
    and a conversion at the end. The block being filled is a buffer each row is packed into
    (``struct``, 0.6 us a row), and a full block becomes two arrays by reinterpreting its bytes;
    a list of tuples cost 0.5 us a row to build and 0.8 us to convert (``np.array``, 4% of a
    static policy's step). ``columns()`` joins the blocks once and hands out views."""

    BASE_COLUMNS = (
        "step",
        "start_s",
        "duration_s",
        "num_running",
        "num_waiting",
        "num_prefill_tokens",
        "num_decodes",
        "num_preempted",
        "kv_blocks_used",
        "kv_usage",
        "kv_pages",
        "pinned_pages",
        "transition_pages",
        "free_pages",
        "num_downgrades",
        "num_upgrades",
        "bytes_downgraded",
        "bytes_upgraded",
        "bytes_swapped",
        "quality_proxy",
        "kv_cached_pages",
        "prefix_hit_tokens",
        "kv_evicted_blocks",
    )
    WEIGHT_COLUMNS = tuple(f"weight_pages_{p}" for p in PRECISION_NAMES)
    COLUMNS = BASE_COLUMNS + WEIGHT_COLUMNS
    FLOAT_COLUMNS = _STEP_FLOAT_COLUMNS
    CHUNK_ROWS = 4096
    _FLOAT_IDX = [i for i, c in enumerate(COLUMNS) if c in _STEP_FLOAT_COLUMNS]
    _INT_IDX = [i for i, c in enumerate(COLUMNS) if c not in _STEP_FLOAT_COLUMNS]
    _FLOAT_NAMES = [c for c in COLUMNS if c in _STEP_FLOAT_COLUMNS]
    _INT_NAMES = [c for c in COLUMNS if c not in _STEP_FLOAT_COLUMNS]
    # One row as packed bytes: each value 8 bytes, in column order, native byte order (as
    # numpy's float64 and int64 read them back), no padding.
    _ROW = struct.Struct("=" + "".join("d" if c in _STEP_FLOAT_COLUMNS else "q" for c in COLUMNS))

    def __init__(self, max_rows: int | None = None) -> None:
        """``max_rows``: keep only the newest rows (a long-running server); None keeps all."""
        # Full blocks: (float columns, int columns), each (columns, rows), C order.
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []
        # The block being filled: ``_num_rows`` packed rows (``_ROW``) at the start of ``_buf``.
        self._buf = bytearray(self._ROW.size * self.CHUNK_ROWS)
        self._num_rows = 0
        self._max_rows = max_rows or None
        self._num_held = 0  # rows in the blocks and the block being filled
        self.num_recorded = 0  # every step, beyond the window too
        self._columns: dict[str, np.ndarray] | None = None  # cached until the next row

    def record(
        self,
        start_s: float,
        duration_s: float,
        num_running: int,
        num_waiting: int,
        num_prefill_tokens: int,
        num_decodes: int,
        num_preempted: int,
        kv_blocks_used: int,
        kv_blocks_free: int,
        pool: PagePool,
        num_downgrades: int = 0,
        num_upgrades: int = 0,
        bytes_downgraded: int = 0,
        bytes_upgraded: int = 0,
        bytes_swapped: int = 0,
        quality_proxy: float = 0.0,
        prefix_hit_tokens: int = 0,
        kv_evicted_blocks: int = 0,
    ) -> None:
        """One step's row. The runtime core passes the values by position, in this order: 18
        keywords cost 0.7 us a call to bind (2% of a static policy's step), positions 0.1."""
        counts = pool.counts()
        capacity = kv_blocks_used + kv_blocks_free
        row = (
            self.num_recorded,
            start_s,
            duration_s,
            num_running,
            num_waiting,
            num_prefill_tokens,
            num_decodes,
            num_preempted,
            kv_blocks_used,
            kv_blocks_used / capacity if capacity else 0.0,
            counts[OWNER_KV],
            counts[OWNER_PINNED],
            counts[OWNER_TRANSITION],
            counts[OWNER_FREE],
            num_downgrades,
            num_upgrades,
            bytes_downgraded,
            bytes_upgraded,
            bytes_swapped,
            quality_proxy,
            counts[OWNER_KV_CACHED],
            prefix_hit_tokens,
            kv_evicted_blocks,
            *counts[_WEIGHT_OWNERS],
        )
        try:
            self._ROW.pack_into(self._buf, self._num_rows * self._ROW.size, *row)
        except struct.error:  # a count given as a float (or numpy float): stored as int64 casts it
            self._ROW.pack_into(self._buf, self._num_rows * self._ROW.size, *self._coerced(row))
        self._num_rows += 1
        self.num_recorded += 1
        self._num_held += 1
        self._columns = None
        if self._num_rows == self.CHUNK_ROWS:
            self._chunks.append(self._block())
            self._trim()

    @classmethod
    def _coerced(cls, row: tuple) -> list:
        """``row`` with each int column's value truncated to an int, as a cast to int64 does;
        any value that is not a real number raises a clear error naming its column."""
        out = []
        for name, v in zip(cls.COLUMNS, row, strict=True):
            try:
                out.append(float(v) if name in _STEP_FLOAT_COLUMNS else int(v))
            except (TypeError, ValueError) as e:
                raise TypeError(f"steps column {name}: {v!r} is not a number") from e
        return out

    def _trim(self) -> None:
        """Drops whole blocks that lie entirely before the window (``columns`` cuts the rest)."""
        if self._max_rows is None:
            return
        while self._chunks and self._num_held - self._chunks[0][0].shape[1] >= self._max_rows:
            self._num_held -= self._chunks.pop(0)[0].shape[1]

    def _block(self) -> tuple[np.ndarray, np.ndarray]:
        """The packed rows as (float columns, int columns), each (columns, rows), C order; the
        buffer is then free for the next block."""
        n, ncols = self._num_rows, len(self.COLUMNS)
        words = np.frombuffer(self._buf, dtype=np.float64, count=n * ncols).reshape(n, ncols)
        floats = np.ascontiguousarray(words[:, self._FLOAT_IDX].T)
        ints = np.ascontiguousarray(words.view(np.int64)[:, self._INT_IDX].T)  # fancy indexing copies
        self._num_rows = 0
        return floats, ints

    def __len__(self) -> int:
        return min(self._num_held, self._max_rows or self._num_held)

    def columns(self) -> dict[str, np.ndarray]:
        if self._columns is not None:
            return self._columns
        if not self._num_held:
            return {c: np.zeros(0) for c in self.COLUMNS}
        if self._num_rows:
            self._chunks.append(self._block())
        if len(self._chunks) > 1:  # joined once: the blocks are replaced, not kept beside
            floats = np.concatenate([f for f, _ in self._chunks], axis=1)
            ints = np.concatenate([i for _, i in self._chunks], axis=1)
            self._chunks = [(floats, ints)]
        floats, ints = self._chunks[0]
        if self._max_rows is not None and floats.shape[1] > self._max_rows:  # the newest rows only
            floats, ints = floats[:, -self._max_rows :].copy(), ints[:, -self._max_rows :].copy()
            self._chunks, self._num_held = [(floats, ints)], self._max_rows
        out = {name: floats[k] for k, name in enumerate(self._FLOAT_NAMES)}
        out |= {name: ints[k] for k, name in enumerate(self._INT_NAMES)}
        self._columns = {name: out[name] for name in self.COLUMNS}
        return self._columns
