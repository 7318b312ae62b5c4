"""The latency-table format: what ``pwgpu profile`` writes and ``pwsim``'s latency model reads.

One long CSV per device, ``traces/kernels/<gpu>.csv``, one row per measured point, plus a
``<gpu>.meta.yaml`` beside it (device, torch/triton/CUDA versions, date, grid, models; optional
``upgrades``: ``synchronous`` where the engine writes an upgrade inside the step that starts it,
as the CPU engine does without a copy stream, so the step pays its ``quantize`` time instead of
a copy overlapped with compute; ``asynchronous``, the default, on a GPU; optional ``moe_calls``:
``per layer`` where the engine runs a layer's routed experts in one call whatever their
precisions, as the CPU engine does (its dense copies share one dtype), so a step is timed as one
``moe_ffn`` call per layer with every active expert; ``per precision class``, the default, where
each precision's experts are a call of their own, as the GPU kernels are launched).

Columns (unused keys are 0 for an op):

| column          | meaning                                                                 |
|-----------------|-------------------------------------------------------------------------|
| model           | ModelSpec name whose shapes were measured (``pagedweight.core.spec``)        |
| op              | one of ``OPS`` below                                                    |
| precision       | weight precision name (``pagedweight.core.spec.PRECISIONS``), or ``-``       |
| m               | tokens (per expert for ``moe_ffn``; total for ``dense``/``lm_head``/``attn_prefill``) |
| e               | active experts in the call (``moe_ffn``)                                |
| batch           | sequences (``attn_decode``); ranks in the group (``all_to_all``)        |
| kv_len          | context length in tokens (attention ops)                                |
| n, k            | matrix shape: output rows, input columns (``moe_ffn``: n = F, k = H; ``quantize``) |
| bytes           | bytes moved (``h2d_copy``); per rank to the other ranks (``all_to_all``) |
| latency_us_p50  | median latency in microseconds; ``_p20`` and ``_p80`` give the spread   |
| samples         | timed repetitions behind the percentiles                                |

Ops, all *per layer* where the model has layers:
- ``moe_ffn``: one fused expert FFN call (gate+up, SiLU*mul, down, routing-weight epilogue)
  for ``e`` experts of one precision with ``m`` tokens each.
- ``attn_prefill``: attention for ``m`` new tokens attending to ``kv_len`` tokens.
- ``attn_decode``: paged decode attention for ``batch`` sequences of ``kv_len`` tokens each.
- ``dense``: everything else in a layer for ``m`` tokens (norms, QKV/O projections, router,
  shared experts).
- ``lm_head``: embedding, final norm, LM head and sampling for ``m`` tokens (once per step).
- ``quantize``: quantise one ``[n, k]`` bf16 matrix to ``precision`` on the device.
- ``dequantize`` (CPU tables only): read one ``[n, k]`` matrix of ``precision`` from its pages
  into the dense copy the CPU engine's MoE path multiplies by. The engine keeps that copy per
  expert, makes every expert's when it is built and makes it again on the expert's first use
  after each precision change, so a precision change costs this besides its ``quantize``. A table
  without these rows (a GPU's, whose MoE kernel reads the packed pages) charges nothing.
- ``h2d_copy``: copy ``bytes`` from pinned host memory to the device.
- ``decode_step`` (CPU tables): a whole decode step, every layer and the LM head, for ``batch``
  sequences of ``kv_len`` tokens each, experts of ``precision``, timed warm (right after the same
  step), not per layer. The other rows are timed with cold caches, as a step's ops are where the
  model and the KV outgrow the caches; on a CPU a small batch of a small model finds them still
  cached from the step before. ``pwsim`` times a pure decode step by the other rows scaled by
  this over their sum at the same shape (``pwsim.table_latency``).
- ``all_to_all`` (``pwgpu profile --ep N``): one ``all_to_all_single`` among ``batch`` = N ranks
  (processes, one GPU each, or gloo on a CPU) in which every rank sends ``bytes`` to the other
  ranks in equal shares (its input also holds its own share) and receives as much; the slowest
  rank's time. Not per layer and not per model: the simulator charges it twice per MoE layer
  (dispatch, combine) at the busiest rank's bytes, from the rows of its replica's EP size, for
  any model (the rows are written under the first model profiled). Meta ``all_to_all``: the
  ranks and the backend (``gloo``, ``nccl``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from pagedweight.core.spec import PRECISIONS
from pagedweight.errors import SpecError, read_yaml_mapping

OPS = ("moe_ffn", "attn_prefill", "attn_decode", "dense", "lm_head", "quantize", "dequantize", "h2d_copy",
       "all_to_all", "decode_step")  # fmt: skip
# The op groups ``pwgpu profile --ops`` measures (``attention`` writes both attention ops, ``dense``
# also ``lm_head``), in the order it measures them.
OP_GROUPS = ("moe_ffn", "attention", "dense", "quantize", "dequantize", "h2d_copy", "decode_step")
KEY_COLUMNS = ("model", "op", "precision", "m", "e", "batch", "kv_len", "n", "k", "bytes")
VALUE_COLUMNS = ("latency_us_p50", "latency_us_p20", "latency_us_p80", "samples")
COLUMNS = KEY_COLUMNS + VALUE_COLUMNS
META_REQUIRED = ("device", "date", "torch", "triton", "cuda", "models", "grid")


def decode_step_routing(num_tokens: int, top_k: int, num_experts: int) -> np.ndarray:
    """The experts of each token [T, k] in the step a ``decode_step`` row times: token i routed to
    experts i*k .. i*k+k-1 (mod E), every expert as busy as the others, so that ``pwsim`` can
    time the same step again from the op rows."""
    return (np.arange(num_tokens)[:, None] * top_k + np.arange(top_k)[None, :]) % num_experts


def decode_step_counts(num_tokens: int, top_k: int, num_experts: int) -> np.ndarray:
    """Tokens per expert [E] of ``decode_step_routing``."""
    return np.bincount(decode_step_routing(num_tokens, top_k, num_experts).ravel(), minlength=num_experts)


def meta_path(csv_path: str | Path) -> Path:
    p = Path(csv_path)
    return p.with_name(p.stem + ".meta.yaml")


def read_kernel_table(path: str | Path) -> tuple[pd.DataFrame, dict]:
    """Load and validate a latency table and its meta file; errors name the file, row and column."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"latency table {path} does not exist")
    try:
        df = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: not a CSV latency table ({e})") from None
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise SpecError(f"{path}: missing columns {missing}; expected {list(COLUMNS)}")
    bad_op = ~df["op"].isin(OPS)
    if bad_op.any():
        row = int(bad_op.idxmax())
        raise SpecError(f"{path}: line {row + 2}: op {df['op'][row]!r} unknown; allowed: {', '.join(OPS)}")
    bad_prec = ~df["precision"].isin(list(PRECISIONS) + ["-"])
    if bad_prec.any():
        row = int(bad_prec.idxmax())
        raise SpecError(
            f"{path}: line {row + 2}: precision {df['precision'][row]!r} unknown; allowed: {', '.join(PRECISIONS)}, -"
        )
    for col in VALUE_COLUMNS + KEY_COLUMNS[3:]:
        vals = pd.to_numeric(df[col], errors="coerce")
        bad = vals.isna() | (vals < 0)
        if bad.any():
            row = int(bad.idxmax())
            raise SpecError(f"{path}: line {row + 2}: column {col} must be a number >= 0 (got {df[col][row]!r})")
    mp = meta_path(path)
    if not mp.is_file():
        raise SpecError(f"{path}: its meta file {mp} is missing (device, versions, date, grid)")
    meta = read_yaml_mapping(mp, SpecError, META_REQUIRED)
    absent = [k for k in META_REQUIRED if k not in meta]
    if absent:
        raise SpecError(f"{mp}: missing keys {absent}; required: {', '.join(META_REQUIRED)}")
    return df, meta


def write_kernel_table(df: pd.DataFrame, path: str | Path, meta: dict) -> None:
    """Write the CSV (columns in the documented order) and its meta file."""
    absent = [k for k in META_REQUIRED if k not in meta]
    if absent:
        raise SpecError(f"latency table meta is missing {absent}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = df.copy()
    for c in KEY_COLUMNS[3:]:
        if c not in out:
            out[c] = 0
    out[list(COLUMNS)].to_csv(path, index=False)
    with open(meta_path(path), "w") as f:
        yaml.safe_dump(meta, f, sort_keys=False)


def median_of_tables(paths: list[str | Path]) -> tuple[pd.DataFrame, dict]:
    """One table from several profiles of the same grid: each row's percentiles the median of
    its profiles' (``samples`` their sum), rows in the first table's order. On a shared CPU an
    op's time drifts by tens of percent over minutes, and not alike for every op (small,
    memory-bound calls move more than large matmuls), so profiles interleaved with the runs a
    table is compared with time the machine as those runs found it. Meta: the first table's,
    with ``profiles`` (how many) and ``dates`` (first and last)."""
    if not paths:
        raise SpecError("median_of_tables: no tables given")
    tables = [read_kernel_table(p) for p in paths]
    keys = list(KEY_COLUMNS)
    first, meta = tables[0]
    rows = list(first[keys].itertuples(index=False, name=None))
    if len(set(rows)) != len(rows):
        raise SpecError(f"{paths[0]}: a row repeats the keys of another ({', '.join(keys)})")
    for path, (df, _) in zip(paths[1:], tables[1:], strict=True):
        other = list(df[keys].itertuples(index=False, name=None))
        if len(other) != len(rows) or set(other) != set(rows):
            missing, extra = sorted(set(rows) - set(other))[:3], sorted(set(other) - set(rows))[:3]
            raise SpecError(
                f"{path}: not the grid of {paths[0]} (rows missing: {missing or 'none'}; "
                f"rows not in it: {extra or 'none'}); profile both with the same scenario and ops"
            )
    how = {col: "median" for col in VALUE_COLUMNS[:3]} | {"samples": "sum"}
    merged = pd.concat([df for df, _ in tables]).groupby(keys, sort=False).agg(how)
    out = first.copy()
    out[list(how)] = merged.loc[rows, list(how)].to_numpy()
    dates = [m.get("date") for _, m in tables]
    return out, {**meta, "profiles": len(tables), "dates": [str(dates[0]), str(dates[-1])]}
