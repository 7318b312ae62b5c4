"""Request traces: one frozen ``RequestTrace`` and a loader per published format.

Formats (the columns each loader reads; other columns are ignored):

- ``azure``: Azure LLM inference CSV (Patel et al., Splitwise, ISCA 2024):
  ``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS.fffffff``), ``ContextTokens``, ``GeneratedTokens``.
- ``mooncake``: Mooncake JSONL (Qin et al., FAST 2025): ``timestamp`` (ms), ``input_length``,
  ``output_length``, and, when present, ``hash_ids`` (one id per 512-token prompt block; equal
  ids mean a reusable prefix block), which prefix caching uses (``pagedweight.core.prefix``).
- ``burstgpt``: BurstGPT CSV (Wang et al., 2024): ``Timestamp`` (s), ``Model``, ``Request tokens``,
  ``Response tokens``; a row with zero response tokens is a failed request.
- ``sharegpt``: ShareGPT-style lengths CSV without timestamps: ``num_prefill_tokens``,
  ``num_decode_tokens`` (see ``load_lengths``); arrivals come from a process.
- ``generic``: CSV, or JSONL when the name ends in .jsonl/.ndjson/.json, with named columns.

Loaders are vectorised (pandas parse, numpy checks): the 19,366-row Azure conversation trace
loads in about 20 ms. A malformed value raises ``TraceError`` naming the file, line and column:
a missing or non-numeric value, a boolean where a number belongs, a token count that is not a
whole number from 0 to ``MAX_TOKENS``, a negative or non-finite time, and a time earlier than
the row before it. A file out of time order is replayed sorted only when the caller opts in
(``sort=True``; a scenario's ``workload.sort: true``), and the trace's notes say so.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from pagedweight.errors import ConfigError, TraceError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
# pandas < 3 turns epoch-like numbers under keys such as "timestamp" or "*_time" into datetimes
# even with dtype=False; pandas 3 does not, and deprecates the switches.
_NO_DATE_GUESSING = (
    {"convert_dates": False, "keep_default_dates": False} if int(pd.__version__.split(".")[0]) < 3 else {}
)
TIME_UNIT_S = {"s": 1.0, "ms": 1e-3}
# Largest token count a trace may give: far beyond any context, and exact in float64 and int64
# (a JSON 1e30 would otherwise wrap around in the int64 cast and become a 1-token prompt).
MAX_TOKENS = 2**31 - 1


@dataclass(frozen=True, eq=False)  # eq on numpy arrays is ambiguous; compare the arrays instead
class RequestTrace:
    """Requests in arrival order. ``arrival_s`` is seconds relative to the trace's start."""

    arrival_s: np.ndarray  # float64, sorted
    prompt_tokens: np.ndarray  # int64 >= 1
    output_tokens: np.ndarray  # int64 >= 1
    source: str
    notes: list[str] = field(default_factory=list)
    # Per request, the ids of its prompt's blocks of 512 tokens (Mooncake's ``hash_ids``), as an
    # object array of int64 arrays; None when the trace does not say which prompts share prefixes.
    hash_ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        arrival = np.asarray(self.arrival_s, dtype=np.float64)
        prompt = np.asarray(self.prompt_tokens, dtype=np.int64)
        output = np.asarray(self.output_tokens, dtype=np.int64)
        if not (arrival.ndim == prompt.ndim == output.ndim == 1 and len(arrival) == len(prompt) == len(output)):
            raise ConfigError(
                f"arrival_s, prompt_tokens and output_tokens must be 1-D of equal length "
                f"(got {arrival.shape}, {prompt.shape}, {output.shape})"
            )
        if len(arrival) and (not np.all(np.isfinite(arrival)) or np.any(np.diff(arrival) < 0)):
            raise ConfigError("arrival_s must be finite and sorted")
        if np.any(prompt < 1) or np.any(output < 1):
            raise ConfigError("prompt_tokens and output_tokens must be >= 1")
        for name, arr in (("arrival_s", arrival), ("prompt_tokens", prompt), ("output_tokens", output)):
            arr = arr.copy() if arr is getattr(self, name) else arr
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        if self.hash_ids is not None and len(self.hash_ids) != len(arrival):
            raise ConfigError(f"hash_ids has {len(self.hash_ids)} entries for {len(arrival)} requests")

    def select(self, rows, note: str | None = None, **changes) -> RequestTrace:
        """The requests at ``rows`` (an index array, mask or slice), every per-request array alike."""
        hash_ids = None if self.hash_ids is None else self.hash_ids[rows]
        picked = {
            "arrival_s": self.arrival_s[rows],
            "prompt_tokens": self.prompt_tokens[rows],
            "output_tokens": self.output_tokens[rows],
            "hash_ids": hash_ids,
        }
        return self.with_changes(note, **(picked | changes))

    def __len__(self) -> int:
        return len(self.arrival_s)

    def with_changes(self, note: str | None = None, **changes) -> RequestTrace:
        """A copy with some arrays replaced and ``note`` appended to the notes."""
        notes = [*self.notes, note] if note else list(self.notes)
        return dataclasses.replace(self, notes=notes, **changes)

    def span_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) else 0.0


# ---------------------------------------------------------------------------------------------
# Reading tables with line numbers
# ---------------------------------------------------------------------------------------------


class _Table:
    """A parsed file plus the 1-based line number of every row, for error messages."""

    def __init__(self, path: Path, df: pd.DataFrame, line_no: np.ndarray):
        self.path, self.df, self.line_no = path, df, line_no

    def require(self, columns: Sequence[str]) -> None:
        missing = [c for c in columns if c not in self.df.columns]
        if missing:
            found = ", ".join(map(str, self.df.columns)) or "none"
            raise TraceError(f"{self.path}: missing column(s) {', '.join(missing)}; found: {found}")

    def fail(self, row: int, column: str, problem: str) -> TraceError:
        raw = self.df[column].iloc[row]
        raw = raw.item() if isinstance(raw, np.generic) else raw
        got = "an empty value" if _is_missing(raw) else repr(raw)
        return TraceError(f"{self.path}:{self.line_no[row]}: column {column!r}: {problem} (got {got})")

    def numbers(self, column: str) -> np.ndarray:
        """The column as float64; a missing, boolean, non-numeric or non-finite value is an
        error naming its line."""
        raw = self.df[column]
        if raw.dtype == bool or raw.dtype == object:
            # pandas reads JSON true/false as booleans and would count true as 1.
            is_bool = raw.map(lambda v: isinstance(v, (bool, np.bool_))).to_numpy(dtype=bool)
            if is_bool.any():
                raise self.fail(int(np.argmax(is_bool)), column, "expected a number, not a boolean")
        values = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        bad = ~np.isfinite(values)
        if bad.any():
            row = int(np.argmax(bad))
            raise self.fail(row, column, "expected a number" if np.isnan(values[row]) else "expected a finite number")
        return values

    def counts(self, column: str) -> np.ndarray:
        """The column as int64 token counts: whole numbers from 0 to ``MAX_TOKENS``."""
        values = self.numbers(column)
        bad = (values < 0) | (values > MAX_TOKENS) | (values != np.floor(values))
        if bad.any():
            row = int(np.argmax(bad))
            raise self.fail(row, column, f"expected a whole number from 0 to {MAX_TOKENS:,}")
        return values.astype(np.int64)

    def times(self, column: str, unit_s: float) -> np.ndarray:
        """The column as seconds: finite numbers >= 0 in units of ``unit_s`` seconds."""
        values = self.numbers(column)
        bad = values < 0
        if bad.any():
            raise self.fail(int(np.argmax(bad)), column, "expected a time >= 0")
        return values * unit_s


def _is_missing(value) -> bool:
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _check_exists(path: Path) -> None:
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")


def read_csv_table(path: str | Path) -> _Table:
    path = Path(path)
    _check_exists(path)
    try:
        df = pd.read_csv(path, skip_blank_lines=False, skipinitialspace=True)
    except pd.errors.EmptyDataError:
        raise TraceError(f"{path}: empty file (expected a CSV header)") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        found = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", str(e))
        if found:
            want, line, got = found.groups()
            raise TraceError(f"{path}:{line}: expected {want} comma-separated fields, found {got}") from None
        raise TraceError(f"{path}: malformed CSV: {e}") from None
    line_no = np.arange(len(df), dtype=np.int64) + 2  # line 1 is the header
    blank = df.isna().all(axis=1).to_numpy()
    if blank.any():
        df, line_no = df[~blank].reset_index(drop=True), line_no[~blank]
    return _Table(path, df, line_no)


def read_jsonl_table(path: str | Path) -> _Table:
    path = Path(path)
    _check_exists(path)
    text = path.read_text(encoding="utf-8").rstrip()
    if not text:
        raise TraceError(f"{path}: empty file (expected one JSON object per line)")
    if re.search(r"(^|\n)[ \t\r]*\n", text) is None:
        body, line_no = text, np.arange(1, text.count("\n") + 2, dtype=np.int64)
    else:  # blank lines: drop them but keep every row's line number
        lines = text.split("\n")
        keep = [i for i, line in enumerate(lines) if line.strip()]
        body, line_no = "\n".join(lines[i] for i in keep), np.asarray(keep, dtype=np.int64) + 1
    try:
        df = pd.read_json(io.StringIO(body), lines=True, dtype=False, **_NO_DATE_GUESSING)
    except ValueError:
        df = None
    if df is None or len(df) != len(line_no):
        # pandas does not say which line broke; find it.
        for i, line in zip(line_no.tolist(), body.split("\n"), strict=True):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{i}: not valid JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{path}:{i}: expected a JSON object per line, got {type(row).__name__}")
        raise TraceError(f"{path}: could not read as JSON Lines")
    return _Table(path, df, line_no)


def read_table(path: str | Path) -> _Table:
    return read_jsonl_table(path) if Path(path).suffix.lower() in JSONL_SUFFIXES else read_csv_table(path)


# ---------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------


def load_azure(path: str | Path, sort: bool = False) -> RequestTrace:
    """Azure LLM inference trace (2023 code/conversation, 2024 week-long files)."""
    t = read_csv_table(path)
    t.require(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
    # ISO8601 takes the 7 fractional digits (100 ns) the files carry, and whole seconds.
    stamps = pd.to_datetime(t.df["TIMESTAMP"], format="ISO8601", errors="coerce")
    bad = stamps.isna().to_numpy()
    if bad.any():
        raise t.fail(int(np.argmax(bad)), "TIMESTAMP", "expected a time like 2023-11-16 18:15:46.6805900")
    ns = stamps.to_numpy(dtype="datetime64[ns]").astype(np.int64)
    arrival_s = (ns - ns.min()) / 1e9 if len(ns) else ns.astype(np.float64)
    prompt, output = t.counts("ContextTokens"), t.counts("GeneratedTokens")
    return _assemble(t, arrival_s, prompt, output, "azure", time_column="TIMESTAMP", sort=sort)


def load_mooncake(path: str | Path, time_unit: str = "ms", sort: bool = False) -> RequestTrace:
    """Mooncake trace JSONL; timestamps are in ms (the real conversation trace's come in ~3 s buckets)."""
    t = read_jsonl_table(path)
    t.require(["timestamp", "input_length", "output_length"])
    arrival_s = t.times("timestamp", _unit(time_unit))
    prompt, output = t.counts("input_length"), t.counts("output_length")
    trace = _assemble(t, arrival_s, prompt, output, "mooncake", time_column="timestamp", sort=sort)
    if "hash_ids" not in t.df.columns:
        return trace
    hash_ids = _hash_ids(t)
    if sort:
        hash_ids = hash_ids[np.argsort(arrival_s, kind="stable")]
    return dataclasses.replace(trace, hash_ids=hash_ids)


def _hash_ids(t: _Table) -> np.ndarray:
    """The ``hash_ids`` column as an object array of int64 arrays; a row without a list of whole
    numbers within 64 bits is an error naming its line."""
    out = np.empty(len(t.df), dtype=object)
    for row, ids in enumerate(t.df["hash_ids"].tolist()):
        if not isinstance(ids, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63) for v in ids
        ):
            raise t.fail(row, "hash_ids", "expected a list of whole numbers within 64 bits, one per 512-token block")
        out[row] = np.asarray(ids, dtype=np.int64)
    return out


def load_burstgpt(
    path: str | Path, model: str | None = None, drop_failed: bool = True, time_unit: str = "s", sort: bool = False
) -> RequestTrace:
    """BurstGPT CSV. Rows with zero response tokens are failed requests: dropped (and counted),
    or with ``drop_failed=False`` kept as 1-output-token requests (their prefill still ran)."""
    t = read_csv_table(path)
    t.require(["Timestamp", "Request tokens", "Response tokens"] + (["Model"] if model else []))
    notes = []
    if model is not None:
        keep = (t.df["Model"].astype(str).str.strip() == model).to_numpy()
        models = sorted(t.df["Model"].dropna().astype(str).str.strip().unique())
        if not keep.any():
            raise TraceError(f"{t.path}: no rows with Model {model!r}; models present: {', '.join(models)}")
        notes.append(f"kept {int(keep.sum())} of {len(keep)} rows with Model {model!r}")
        t = _Table(t.path, t.df[keep].reset_index(drop=True), t.line_no[keep])
    arrival_s = t.times("Timestamp", _unit(time_unit))
    prompt, output = t.counts("Request tokens"), t.counts("Response tokens")
    rows = np.arange(len(arrival_s))
    failed = output == 0
    if failed.any() and drop_failed:
        notes.append(f"dropped {int(failed.sum())} failed rows (zero response tokens)")
        arrival_s, prompt, output, rows = arrival_s[~failed], prompt[~failed], output[~failed], rows[~failed]
    elif failed.any():
        notes.append(f"kept {int(failed.sum())} failed rows (zero response tokens) as 1-output-token requests")
        output = np.maximum(output, 1)
    if len(arrival_s) == 0:
        raise TraceError(f"{t.path}: no requests left after dropping failed rows")
    return _assemble(t, arrival_s, prompt, output, "burstgpt", notes, "Timestamp", sort, rows)


def load_generic(
    path: str | Path, arrival: str, prompt_tokens: str, output_tokens: str, time_unit: str = "s", sort: bool = False
) -> RequestTrace:
    """A CSV or JSONL trace with named columns; arrival times are numbers in ``time_unit``."""
    t = read_table(path)
    t.require([arrival, prompt_tokens, output_tokens])
    arrival_s = t.times(arrival, _unit(time_unit))
    prompt, output = t.counts(prompt_tokens), t.counts(output_tokens)
    return _assemble(t, arrival_s, prompt, output, "generic", time_column=arrival, sort=sort)


def load_lengths(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_tokens, output_tokens) from a ShareGPT-style lengths CSV (no timestamps)."""
    t = read_csv_table(path)
    t.require(["num_prefill_tokens", "num_decode_tokens"])
    prompt, output = t.counts("num_prefill_tokens"), t.counts("num_decode_tokens")
    if len(prompt) == 0:
        raise TraceError(f"{t.path}: no rows")
    return np.maximum(prompt, 1), np.maximum(output, 1)


def detect_format(path: str | Path) -> str:
    """Guess a file's format from its header (CSV) or first record (JSONL)."""
    path = Path(path)
    _check_exists(path)
    with path.open(encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    if path.suffix.lower() in JSONL_SUFFIXES:
        try:
            keys = set(json.loads(first))
        except (json.JSONDecodeError, TypeError):
            keys = set()
        if {"timestamp", "input_length", "output_length"} <= keys:
            return "mooncake"
        return "generic"
    header = {c.strip() for c in first.strip().split(",")}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= header:
        return "azure"
    if {"Timestamp", "Request tokens", "Response tokens"} <= header:
        return "burstgpt"
    if {"num_prefill_tokens", "num_decode_tokens"} <= header:
        return "sharegpt"
    return "generic"


def _unit(time_unit: str) -> float:
    if time_unit not in TIME_UNIT_S:
        raise TraceError(f"time_unit must be one of {', '.join(TIME_UNIT_S)} (got {time_unit!r})")
    return TIME_UNIT_S[time_unit]


def _assemble(
    t: _Table,
    arrival_s: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
    fmt: str,
    notes: list[str] | None = None,
    time_column: str = "",
    sort: bool = False,
    rows: np.ndarray | None = None,
) -> RequestTrace:
    """Check time order (or, with ``sort``, sort stably: same-time requests keep file order),
    start at 0, clamp zero lengths. ``rows``: each request's row in ``t`` (default: all rows)."""
    notes = list(notes or [])
    if len(arrival_s) == 0:
        raise TraceError(f"{t.path}: no requests")
    backwards = np.diff(arrival_s) < 0
    if backwards.any():
        if not sort:
            k = int(np.argmax(backwards)) + 1
            row = int(rows[k]) if rows is not None else k
            raise t.fail(
                row,
                time_column,
                "earlier than the row before it; sort the file by time, or opt in to sorting it on load "
                "(workload sort: true in a scenario; pwsim trace stats --sort)",
            )
        order = np.argsort(arrival_s, kind="stable")
        arrival_s, prompt, output = arrival_s[order], prompt[order], output[order]
        notes.append(f"sorted by time ({int(backwards.sum())} rows were out of order)")
    for name, arr in (("prompt", prompt), ("output", output)):
        zeros = int(np.sum(arr == 0))
        if zeros:
            notes.append(f"{zeros} requests had 0 {name} tokens; counted as 1")
    return RequestTrace(
        arrival_s=arrival_s - arrival_s[0],
        prompt_tokens=np.maximum(prompt, 1),
        output_tokens=np.maximum(output, 1),
        source=f"{fmt}:{t.path}",
        notes=notes,
    )


def write_jsonl(trace: RequestTrace, path: str | Path) -> None:
    """Write Mooncake-format JSONL (``timestamp`` in integer ms, ``input_length``, ``output_length``,
    and ``hash_ids`` when the trace has them) that ``load_mooncake`` reads back; rounding to 1 ms
    is the only loss."""
    ms = np.round(trace.arrival_s * 1000).astype(np.int64)
    lines = [
        f'{{"timestamp": {t}, "input_length": {p}, "output_length": {o}}}'
        for t, p, o in zip(ms.tolist(), trace.prompt_tokens.tolist(), trace.output_tokens.tolist(), strict=True)
    ]
    if trace.hash_ids is not None:  # Mooncake's prefix block ids, after the lengths as in its files
        lines = [f'{line[:-1]}, "hash_ids": {ids.tolist()}}}' for line, ids in zip(lines, trace.hash_ids, strict=True)]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
