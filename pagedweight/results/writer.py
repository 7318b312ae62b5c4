"""The results directory both runtimes write and the report reads.

    <out>/
      requests.csv            one row per request and policy (lifecycle timestamps, TTFT, TPOT, ...)
      steps.csv               one row per engine step and policy (batch, KV/weight/free pages, quality)
      transitions.csv         one row per precision change (time, expert, from, to, bytes)
      initial_precisions.csv  one row per policy and routed expert: its precision at the start
                              (with transitions.csv this gives every expert's precision over time)
      summary.json            run facts + per policy: vLLM benchmark names, weight bytes by precision
      scenario.resolved.yaml  the scenario with every default filled in (when run from a scenario)
      tokens.jsonl            engine runs with real-text prompts only (pwgpu.served): token ids and
                              the precision changes in force for every computed chunk

Every file is written atomically (temporary file + rename): an interrupted run never leaves a
half-written table that a later reader would take for a result.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from pagedweight.core.runtime import RuntimeCore
from pagedweight.core.scheduler import Request
from pagedweight.core.spec import PRECISION_NAMES, ladder
from pagedweight.core.transition_log import TRANSITION_COLUMNS, TransitionLog
from pagedweight.results import csv_rows
from pagedweight.results.metrics import RequestColumns, Slo, request_table, summarize
from pagedweight.results.report_data import report_step_arrays, save_step_arrays

_CSV_SPECIAL = (",", '"', "\n", "\r")  # a field holding one is quoted


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_write_csv(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)


def trace_meta(trace) -> dict:
    """What summary.json says about a ``RequestTrace``."""
    return {"source": trace.source, "num_requests": len(trace), "notes": list(trace.notes)}


def run_meta(
    *,
    runtime: str,
    scenario: str,
    model: str,
    gpu: str,
    budget_bytes: int,
    page_bytes: int,
    latency_model: str,
    importance: str,
    trace: dict,
    seed: int | None = None,
    **extra,
) -> dict:
    """The run facts at the top of summary.json, in one order for both runtimes. ``extra``
    (runtime-specific facts) comes before the trace; ``seed`` is left out when there is none
    (a live server)."""
    meta = {
        "runtime": runtime,
        "scenario": scenario,
        "model": model,
        "gpu": gpu,
        "budget_bytes": budget_bytes,
        "page_bytes": page_bytes,
        "latency_model": latency_model,
        "importance": importance,
        **extra,
        "trace": trace,
    }
    if seed is not None:
        meta["seed"] = seed
    return meta


def weight_summary(steps: dict[str, np.ndarray], page_bytes: int) -> dict:
    """Time-weighted mean and final weight bytes per precision, from the step table."""
    dur = steps["duration_s"]
    total = float(dur.sum()) or 1.0
    out = {}
    for name in PRECISION_NAMES:
        pages = steps[f"weight_pages_{name}"]
        if len(pages) and pages.any():
            out[name] = {
                "mean_bytes": float((pages * dur).sum() / total * page_bytes),
                "final_bytes": int(pages[-1] * page_bytes),
            }
    return out


def policy_summary(
    requests: list[Request],
    core: RuntimeCore,
    slo: Slo,
    wall_s: float,
    h2d_bytes: int,
    columns: RequestColumns | None = None,
) -> dict:
    """``summarize`` plus what only a run with precision changes has to say."""
    steps = core.steps.columns()
    s = summarize(requests, slo, steps, columns)
    # Prefill work against the prompts it served: above 1 by what preemption made it recompute
    # (prompt and generated tokens alike). 1.0 when nothing was preempted and every prompt ran.
    prefill = int(steps["num_prefill_tokens"].sum())
    prompts = sum(r.prompt_tokens for r in requests if r.first_scheduled_s is not None)
    s.update(prefill_tokens_computed=prefill, prefill_recompute_ratio=prefill / prompts if prompts else 0.0)
    n = len(core.steps)
    dur = steps["duration_s"]
    sim_s = float(steps["start_s"][-1] + dur[-1]) if n else 0.0
    s.update(
        num_steps=n,
        weight_bytes=weight_summary(steps, core.pool.page_bytes),
        mean_quality_proxy=float((steps["quality_proxy"] * dur).sum() / max(dur.sum(), 1e-12)) if n else 0.0,
        max_quality_proxy=float(steps["quality_proxy"].max()) if n else 0.0,
        num_downgrades=int(steps["num_downgrades"].sum()),
        num_upgrades=int(steps["num_upgrades"].sum()),
        transitions_per_request=int(steps["num_downgrades"].sum() + steps["num_upgrades"].sum())
        / max(1, s["completed"]),
        precision_ladder=_precisions_used(core),
        **prefix_summary(core, steps),
        h2d_bytes=int(h2d_bytes),
        simulated_s=sim_s,
        wall_s=wall_s,
        sim_s_per_wall_s=sim_s / wall_s if wall_s > 0 else float("inf"),
    )
    return s


def _precisions_used(core: RuntimeCore) -> list[str]:
    """The ladder a dynamic policy walks; the precisions a static one holds, most precise first."""
    if core.controller is not None:
        return list(core.ladder)
    ids = np.unique(np.asarray(core.setup.initial_ids))
    return [p.name for p in ladder([PRECISION_NAMES[i] for i in ids])]


def prefix_summary(core: RuntimeCore, steps: dict[str, np.ndarray]) -> dict:
    """Prefix caching's figures: the share of prompt tokens looked up that were found cached
    (vLLM's prefix cache hit rate), the prefill tokens that saved, the cached blocks evicted, the
    ghost hits (evicted blocks asked for again, which is what pagedweight prices the cache by;
    0 where no ghost list is kept) and the peak KV memory held by requests and by the cache."""
    sched, page_bytes = core.scheduler, core.pool.page_bytes
    kv, cached = steps["kv_pages"], steps["kv_cached_pages"]
    ghosts = getattr(core.kv, "ghosts", None)  # an expert-parallel replica's combined view has none
    return {
        "prefix_caching": bool(sched.prefix_caching),
        "prefix_cache_hit_rate": sched.prefix_hit_tokens / sched.prefix_query_tokens
        if sched.prefix_query_tokens
        else 0.0,
        "prefill_tokens_saved": int(sched.prefix_hit_tokens),
        "num_evicted_blocks": int(core.kv.num_evicted_blocks),
        "prefix_ghost_hits": int(ghosts.num_hits) if ghosts is not None else 0,
        "peak_kv_bytes": int(kv.max()) * page_bytes if len(kv) else 0,
        "peak_kv_cached_bytes": int(cached.max()) * page_bytes if len(cached) else 0,
    }


TABLES = ("requests", "steps", "transitions", "initial_precisions")
# The tables a run without step tables leaves out (``pwsim bench`` by default): a row per step,
# per rank and step, or per precision change; an hour of paper-greedy on a 6,144-expert model
# logs ~13 million changes.
STEP_TABLES = ("steps", "transitions", "initial_precisions", "steps_by_rank", "ep_steps")
# A part's step table as arrays too (a folder, ``report_data.save_step_arrays``), for the report
# of the run that wrote it.
STEP_ARRAYS = "step_arrays"
# Tables only some runs have (an expert-parallel replica's, ``pwsim.parallel``): joined when present.
OPTIONAL_TABLES = ("steps_by_rank", "ep_steps")


def write_policy_tables(
    parts_dir: Path,
    policy: str,
    requests: list[Request],
    core: RuntimeCore,
    replica: int | None = None,
    columns: RequestColumns | None = None,
    step_tables: bool = True,
    step_arrays: bool = False,
) -> None:
    """One policy's rows of the four tables, as CSV files (with header) in ``parts_dir``; with
    ``replica`` (a cluster's), a ``replica`` column after ``policy``; without ``step_tables``,
    the request table alone (``STEP_TABLES`` are the large ones: a row per step or change).
    ``step_arrays``: the step table as arrays too (``STEP_ARRAYS``), for the run's report.

    A run writes each policy's tables as soon as the policy is done and the writer joins them
    at the end, so no process holds more than one policy's rows (an hour of long context is
    ~250,000 steps per policy), and policies run in other processes hand over files."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    _write_requests(parts_dir / "requests.csv", policy, requests, replica, columns=columns)
    if not step_tables:
        return
    ids = np.asarray(core.setup.initial_ids)
    experts = np.arange(len(ids))
    steps = core.steps.columns()
    _write_columns(parts_dir / "steps.csv", policy, steps, replica)
    arrays = report_step_arrays(steps) if step_arrays and replica is None else None
    if arrays is not None:  # the same rows for the run's report, read back without parsing text
        save_step_arrays(parts_dir / STEP_ARRAYS, arrays)
    write_transitions(parts_dir / "transitions.csv", policy, core.transitions, replica)
    df = pd.DataFrame(
        {"expert": experts, "layer": experts // core.model.num_experts, "precision": np.asarray(PRECISION_NAMES)[ids]}
    )
    label_rows(df, policy, replica)
    df.to_csv(parts_dir / "initial_precisions.csv", index=False)


def transition_frame(log: TransitionLog) -> pd.DataFrame:
    """A run's transitions as a table (``TRANSITION_COLUMNS``)."""
    return pd.DataFrame(log.columns(), columns=list(TRANSITION_COLUMNS))


def write_transitions(
    path: Path, policy: str, log: TransitionLog, replica: int | None = None, rows_per_write: int = 100_000
) -> None:
    """The transition table in slices: paper-greedy on a 6,144-expert model logs ~13 million
    changes an hour (upgrades begun, then abandoned), and pandas' writer took ~1 us a cell."""
    _write_columns(path, policy, log.columns(), replica, rows_per_write)


def label_rows(df: pd.DataFrame, policy: str, replica: int | None = None) -> None:
    """The leading columns of every table: ``policy``, and a cluster's ``replica``."""
    if replica is not None:
        df.insert(0, "replica", replica)
    df.insert(0, "policy", policy)


def write_csv_rows(f, df: pd.DataFrame, header: bool = True, rows_per_chunk: int | None = None) -> None:
    """``df.to_csv(f, index=False, header=header)``, the same bytes, faster on the big tables:
    each column is formatted as pandas prints it (floats by ``repr``, the shortest string that
    reads back the same; NaN and None empty) and the rows are joined, by a compiled loop where
    numba is (``csv_rows``: integers printed there, a constant column once); only where a text
    field needs quoting does the csv module (which pandas uses) write them. pandas spent ~1 us
    on each float (0.4 s of a cluster replica's 48,000-request table). ``rows_per_chunk`` rows
    are formatted at a time (16,384 compiled, 2,048 in Python: a string per cell of a
    100,000-step slice would hold ~200 MB)."""
    names = [str(c) for c in df.columns]
    columns = [df[name].to_numpy() for name in df.columns]
    if header:
        if _needs_quotes(names):
            csv.writer(f, lineterminator="\n").writerow(names)
        else:
            f.write(",".join(names) + "\n")
    compiled = csv_rows.available()
    chunk = rows_per_chunk or (16_384 if compiled else 2_048)
    for start in range(0, len(df), chunk):
        stop = min(start + chunk, len(df))
        if compiled:
            spec = _compiled_columns([values[start:stop] for values in columns])
            if spec is not None:
                _write_bytes(f, csv_rows.join_rows(spec, stop - start))
                continue
        cells = [_csv_text(values[start:stop]) for values in columns]
        if any(_needs_quotes(text) for text, v in zip(cells, columns, strict=True) if v.dtype.kind == "O"):
            csv.writer(f, lineterminator="\n").writerows(zip(*cells, strict=True))
        else:
            f.write("\n".join(map(",".join, zip(*cells, strict=True))))
            f.write("\n")


def _compiled_columns(chunks: list[np.ndarray]) -> list[tuple[int, object]] | None:
    """``csv_rows.join_rows``' column specs for one chunk; None if a text cell needs quotes."""
    spec: list[tuple[int, object]] = []
    for values in chunks:
        kind = values.dtype.kind
        if kind == "i" or (kind == "u" and values.dtype.itemsize < 8):
            spec.append((csv_rows.INTS, values.astype(np.int64, copy=False)))
            continue
        if kind == "O" and len(values) and isinstance(values[0], str):
            first = values[0]
            try:
                constant = bool((values == first).all())
            except (TypeError, ValueError):  # pd.NA and the like: not comparable, so not constant
                constant = False
            if constant:
                if _needs_quotes([first]):
                    return None
                spec.append((csv_rows.CONSTANT, first))
                continue
        if kind == "f" and not (np.signbit(values) & (values == 0)).any():  # -0.0 == 0.0 to unique
            # Printed once per distinct value: repr is ~0.35 us a float, and some step columns
            # repeat theirs (KV usage: ~45,000 values in 820,000 steps; a static policy's
            # quality proxy: one). Where every value differs (times) it adds a sort, a fraction
            # of the repr it cannot save.
            distinct, inverse = np.unique(values, return_inverse=True)
            spec.append((csv_rows.VALUES, (_csv_text(distinct), inverse)))
            continue
        text = _csv_text(values)
        if kind == "O" and _needs_quotes(text):
            return None
        spec.append((csv_rows.TEXT, text))
    return spec


def _write_bytes(f, data: bytes) -> None:
    """``data`` (UTF-8) to a text file ``f``: to its byte stream where it has one."""
    buffer = getattr(f, "buffer", None)
    if buffer is None:
        f.write(data.decode())
    else:
        f.flush()
        buffer.write(data)


def _needs_quotes(text: list[str]) -> bool:
    joined = "\0".join(text)  # one scan in C per special character, not one per cell
    return any(c in joined for c in _CSV_SPECIAL)


def _csv_text(values: np.ndarray) -> list[str]:
    """One column's cells as pandas' ``to_csv`` prints them."""
    kind = values.dtype.kind
    if kind == "f":
        text = list(map(repr, values.tolist()))
        for i in np.flatnonzero(np.isnan(values)).tolist():
            text[i] = ""
        return text
    if kind in "iub":
        return list(map(str, values.tolist()))
    # text (and anything else pandas prints by str), missing values empty
    return ["" if v is None or v is pd.NA or (isinstance(v, float) and v != v) else str(v) for v in values]


def _write_columns(
    path: Path, policy: str, columns: dict[str, np.ndarray], replica: int | None = None, rows_per_write: int = 100_000
) -> None:
    """A table held as columns (steps, transitions), written in slices: a DataFrame of every
    row would copy the whole table again."""
    num_rows = len(next(iter(columns.values())))
    with path.open("w", newline="") as f:
        for start in range(0, max(num_rows, 1), rows_per_write):
            df = pd.DataFrame({c: a[start : start + rows_per_write] for c, a in columns.items()})
            label_rows(df, policy, replica)
            write_csv_rows(f, df, header=start == 0)


def _write_requests(
    path: Path,
    policy: str,
    requests: list[Request],
    replica: int | None = None,
    rows_per_write: int = 100_000,
    columns: RequestColumns | None = None,
) -> None:
    """The request table in slices, so that a million requests never make one frame. Every
    column has one type in every slice (missing times are NaN, printed empty), so the file is
    the one a single table would give."""
    with path.open("w", newline="") as f:
        for start in range(0, max(len(requests), 1), rows_per_write):
            stop = start + rows_per_write
            df = request_table(requests[start:stop], columns.rows(start, stop) if columns is not None else None)
            label_rows(df, policy, replica)
            write_csv_rows(f, df, header=start == 0)


def join_csv_parts(parts: list[Path], out: Path) -> None:
    """Concatenate CSV files with the same header into ``out`` (atomically), keeping the first
    header. The bytes are those of one ``to_csv`` over the concatenated tables: every column has
    the same type in every part (integers never hold missing values), so no part's numbers
    would be printed differently together."""
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with tmp.open("wb") as dst:
        for i, part in enumerate(parts):
            with part.open("rb") as src:
                header = src.readline()
                if i == 0:
                    dst.write(header)
                shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, out)


@dataclass
class ResultsWriter:
    """Collects one run's policies, then writes the directory. Each policy's tables go to a
    hidden parts folder as it is added; ``write`` joins them and removes the folder."""

    out_dir: Path
    meta: dict
    _parts: list[Path] = field(default_factory=list)
    _part_policy: dict[Path, str] = field(default_factory=dict)
    _parts_root: Path | None = None

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.meta.setdefault("policies", {})

    @property
    def parts_root(self) -> Path:
        """Where policies' part files go until ``write`` (workers write there too)."""
        if self._parts_root is None:
            self._parts_root = Path(tempfile.mkdtemp(prefix=".parts-", dir=self.out_dir))
        return self._parts_root

    def add_error(self, policy: str, message: str) -> None:
        self.meta["policies"][policy] = {"error": message}

    def add(self, policy: str, requests: list[Request], core: RuntimeCore, summary: dict) -> None:
        parts = self.parts_root / f"{len(self._parts)}"
        write_policy_tables(parts, policy, requests, core)
        self.add_parts(policy, parts, summary)

    def add_parts(self, policy: str, parts_dir: Path | list[Path], summary: dict) -> None:
        """A policy whose tables ``write_policy_tables`` wrote to ``parts_dir`` (or to each of
        a list of folders, joined in that order: a cluster's replicas)."""
        self.meta["policies"][policy] = summary
        dirs = [Path(d) for d in parts_dir] if isinstance(parts_dir, list) else [Path(parts_dir)]
        self._parts += dirs
        self._part_policy |= dict.fromkeys(dirs, policy)

    def step_arrays(self) -> list[tuple[str, Path]] | None:
        """Each part's policy and its step arrays (``STEP_ARRAYS``), in order; None unless every
        part has them (a cluster's parts have a replica column and no arrays). Valid until
        ``write``."""
        out = []
        for part in self._parts:
            path = part / STEP_ARRAYS
            if not path.is_dir():
                return None
            out.append((self._part_policy[part], path))
        return out

    def write(self, scenario_yaml: str | None = None) -> dict:
        out = self.out_dir
        if self._parts:
            # Every policy has the request table; the others where the run wrote step tables
            # and, for the optional ones, where the policy had them.
            for name in TABLES + OPTIONAL_TABLES:
                files = [p / f"{name}.csv" for p in self._parts]
                if name != "requests":
                    files = [f for f in files if f.is_file()]
                if files:
                    join_csv_parts(files, out / f"{name}.csv")
        atomic_write_text(out / "summary.json", json.dumps(self.meta, indent=2, default=_json_default) + "\n")
        if scenario_yaml is not None:
            atomic_write_text(out / "scenario.resolved.yaml", scenario_yaml)
        self.discard_parts()
        return self.meta

    def discard_parts(self) -> None:
        """Remove the parts folder (after ``write``, or when a run stops early)."""
        if self._parts_root is not None:
            shutil.rmtree(self._parts_root, ignore_errors=True)
            self._parts_root = None
        self._parts = []
        self._part_policy = {}


def _json_default(v):
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")


def markdown_table(df: pd.DataFrame) -> str:
    """A data frame as a Markdown table: floats to 4 significant digits, '-' where not finite."""
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, r in df.iterrows():
        cells = []
        for c in cols:
            v = r[c]
            if isinstance(v, float):
                cells.append("-" if not np.isfinite(v) else f"{v:.4g}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
