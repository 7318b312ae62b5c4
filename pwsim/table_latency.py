"""The table latency model: measured kernel times from ``pwgpu profile`` (``pagedweight.config.kernel_table``).

At build time each op's long-format rows (per precision for ``moe_ffn`` and ``quantize``)
become a rectilinear grid; cells the profiler skipped are filled by interpolation along each
axis, and (``monotone``, the default) the grid is fitted to be non-decreasing along each key by
isotonic regression, which pools the dips that timing noise leaves between neighbours.
``moe_ffn``, looked up once per layer and precision class, is then resampled into one dense
array ``[precision, e, m]`` so that a step's look-ups for every layer are one vectorised
gather; the other ops are a few scalar look-ups per step. Interpolation is *linear* (bilinear
in two keys): log-space interpolation biased a published simulator by 9-14% (LLMServingSim 2.0,
ANCHORS.md). Resampling a bilinear interpolant at points that include the measured ones leaves
it unchanged, so the dense array reproduces every (fitted) measurement and every value between.

How a step maps onto the table's keys (all ops are per layer, times ``num_layers``):
- ``moe_ffn(precision, m, e)``: per layer and precision class, ``e`` = active experts of that
  class and ``m`` = their mean tokens (one fused call per class, as the GPU kernels launch;
  imbalance inside a class is not modelled beyond the mean). A table whose meta says
  ``moe_calls: per layer`` (the CPU engine: one call for a layer's experts whatever their
  precisions) is read as one call per layer: ``e`` = the layer's active experts, ``m`` = their
  mean tokens, each precision class's share of the call timed by its own rows at that (m, e),
  weighted by its experts. Read per class instead, a layer of two classes paid the call's fixed
  cost twice (the cost of the first touch of a call's data, 0.6 ms of a 0.8 ms one-expert call
  on the CPU VM).
- ``attn_prefill(m, kv_len)`` per prefill chunk; ``attn_decode(batch, kv_len)`` at the decode
  count and mean context (decode attention is bound by the total KV read, which the mean keeps).
- ``dense(m)`` per MoE layer, ``lm_head(m)`` once for the step's sequences; the leading dense
  FFN layers of DeepSeek-style models, and the per-step overhead, come from the fallback.

A CPU table with ``decode_step`` rows (whole decode steps timed warm, as consecutive steps of
one batch run) times a pure decode step by the ops above scaled by ``decode_step / ops`` at its
decode count and mean context, where ``ops`` is the sum of the same rows for the profiler's
step (every request of that context, routing spread evenly over the experts, the rows'
precision): the ops' cold rows overstate a small batch of a small model, whose weights and KV
the next step still finds in the CPU's caches, and not a large one (benchmarks/RESULTS.md,
2026-12-03). Steps with a prefill chunk, and steps outside the rows' grid, are not scaled.

What a CPU table adds (``pwsim.engine`` charges it): ``dequantize(precision, n, k)`` for each
matrix of an expert on its first use after a precision change (the CPU engine's fp32 copy of the
expert is made again), and, with meta ``upgrades: synchronous``, an upgrade's ``quantize`` time
in the step that starts it instead of a copy overlapped with compute.

An expert-parallel replica (``pwsim.parallel``) times its all-to-all from the ``all_to_all``
rows of its EP size when the table has them (``a2a_grids``, keyed by the number of ranks; rows
under any model, since the exchange depends on bytes only): each MoE layer's dispatch and combine
at the busiest rank's bytes, linear between the measured sizes and the smallest size's time below
them (a call of a few KiB is latency-bound; the engine makes its calls however few rows cross).

A point outside the measured range (or an op or precision the table lacks) is timed by the
analytic fallback (for the all-to-all: the GPU spec's interconnect), warned about once per op,
and counted in ``out_of_grid``.
"""

from __future__ import annotations

import warnings
from bisect import bisect_right
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from pagedweight.config.kernel_table import decode_step_counts, read_kernel_table
from pagedweight.config.latency import TableLatencyConfig
from pagedweight.core.spec import PRECISION_ID, PRECISION_NAMES, GpuSpec, ModelSpec
from pagedweight.core.step import StepShape
from pagedweight.errors import SpecError
from pwsim.roofline import AnalyticLatencyModel

# (first key, second key or None) of each op in the table.
OP_KEYS: dict[str, tuple[str, str | None]] = {
    "moe_ffn": ("m", "e"),
    "attn_prefill": ("m", "kv_len"),
    "attn_decode": ("batch", "kv_len"),
    "dense": ("m", None),
    "lm_head": ("m", None),
    "quantize": ("n", "k"),
    "dequantize": ("n", "k"),
    "h2d_copy": ("bytes", None),
    "decode_step": ("batch", "kv_len"),
}
PER_PRECISION_OPS = ("moe_ffn", "quantize", "dequantize")
# Marks dense-grid cells outside a precision's measured range. Any query with weight on such a
# cell comes out above OUT_OF_GRID_S, so one sum tells whether a step left the grid; a
# multiplication by 0 keeps a query exactly on the boundary in the grid (a NaN would not).
OUTSIDE_S = 1.0e30
OUT_OF_GRID_S = 1.0e20


def _fill_along(values: np.ndarray, axis_vals: np.ndarray, axis: int) -> np.ndarray:
    """Fill NaN cells by linear interpolation along one axis, inside the measured range only."""
    out = np.moveaxis(values.copy(), axis, 0)
    for j in np.ndindex(out.shape[1:]):
        col = out[(slice(None), *j)]
        known = ~np.isnan(col)
        if known.sum() >= 2:
            xs = axis_vals[known]
            inside = (axis_vals >= xs[0]) & (axis_vals <= xs[-1]) & ~known
            col[inside] = np.interp(axis_vals[inside], xs, col[known])
    return np.moveaxis(out, 0, axis)


def monotone_grid(values: np.ndarray) -> np.ndarray:
    """The least-squares fit to ``values`` [x, y] that is non-decreasing along both axes: 1-D
    isotonic regression along x for every column, then along y for every row. Isotonic
    regression preserves elementwise order between its inputs, so the second pass keeps the
    first pass's monotonicity (rows that were ordered stay ordered)."""
    from scipy.optimize import isotonic_regression

    out = np.array([isotonic_regression(col).x for col in values.T]).T
    return np.array([isotonic_regression(row).x for row in out])


class Grid:
    """One op's (and precision's) measured latencies in seconds on a rectilinear grid; scalar
    bilinear look-ups in plain Python (a few per step: ~1 us each, where a numpy call on a
    one-element array costs about as much per operation)."""

    def __init__(self, xs: np.ndarray, ys: np.ndarray, values: np.ndarray):
        self.xs, self.ys = xs.tolist(), ys.tolist()
        self.values = values.tolist()  # [i][j] at (xs[i], ys[j])

    @classmethod
    def from_rows(cls, rows: pd.DataFrame, xcol: str, ycol: str | None, where: str, monotone: bool = False) -> Grid:
        x = rows[xcol].to_numpy(np.float64)
        y = rows[ycol].to_numpy(np.float64) if ycol else np.zeros(len(rows))
        own = pd.DataFrame({"x": x, "y": y, "v": rows["latency_us_p50"].to_numpy(np.float64) * 1e-6})
        xs, ys = np.unique(x), np.unique(y)
        table = own.pivot_table(index="x", columns="y", values="v", aggfunc="mean")
        values = _fill_along(_fill_along(table.reindex(index=xs, columns=ys).to_numpy(), xs, 0), ys, 1)
        if np.isnan(values).any():
            i, j = np.argwhere(np.isnan(values))[0]
            raise SpecError(
                f"{where}: no measurement near {xcol}={xs[i]:g}"
                + (f", {ycol}={ys[j]:g}" if ycol else "")
                + " to interpolate from; the profiler writes full grids"
            )
        return cls(xs, ys, monotone_grid(values) if monotone else values)

    @staticmethod
    def _cell(axis: list[float], q: float) -> tuple[int, float]:
        if len(axis) == 1:
            return 0, 0.0
        i = min(max(bisect_right(axis, q) - 1, 0), len(axis) - 2)
        return i, (q - axis[i]) / (axis[i + 1] - axis[i])

    def lookup(self, x: float, y: float = 0.0) -> float | None:
        """Linear interpolation at (x, y); None outside the measured range."""
        xs, ys, v = self.xs, self.ys, self.values
        if not (xs[0] <= x <= xs[-1] and ys[0] <= y <= ys[-1]):
            return None
        i, tx = self._cell(xs, x)
        j, ty = self._cell(ys, y)
        j1 = j + 1 if len(ys) > 1 else j
        row0 = v[i][j] + ty * (v[i][j1] - v[i][j])
        if len(xs) == 1:
            return row0
        row1 = v[i + 1][j] + ty * (v[i + 1][j1] - v[i + 1][j])
        return row0 + tx * (row1 - row0)


class MoeGrid:
    """``moe_ffn`` resampled once onto a dense grid ``[precision, e, m]`` for every integer e in
    1..E and the union of the measured m values, so a step's look-ups for all layers and
    precisions are one vectorised linear interpolation along m. The per-precision bilinear
    interpolant is linear in m between its measured points at any fixed e, so the resampling
    is exact. Cells outside a precision's measured range hold OUTSIDE_S; two sentinel columns
    beyond the m range make queries past it land on them."""

    def __init__(self, grids: dict[int, Grid], num_experts: int):
        ms = np.unique(np.concatenate([np.asarray(g.xs) for g in grids.values()]))
        lo, hi = ms[0], ms[-1]
        self.ms = np.concatenate([[lo - max(1.0, lo)], ms, [2 * hi + 1]])
        self.num_experts = num_experts
        values = np.full((len(PRECISION_NAMES), num_experts, len(self.ms)), OUTSIDE_S)
        for pid, grid in grids.items():
            for e in range(1, num_experts + 1):
                for c, m in enumerate(self.ms.tolist()):
                    v = grid.lookup(m, e)
                    if v is not None:
                        values[pid, e - 1, c] = v
        self.flat = values.ravel()
        self.interior = self.ms[1:-1]
        self.inv_dm = 1.0 / np.diff(self.ms)

    def lookup(self, precision_ids: np.ndarray, m: np.ndarray, e: np.ndarray) -> np.ndarray:
        """Seconds per (precision, e, m) query; above OUT_OF_GRID_S where outside the grid."""
        c = np.searchsorted(self.interior, m, side="right")  # cell index, already within [0, len - 2]
        t = (m - self.ms[c]) * self.inv_dm[c]
        base = (precision_ids * self.num_experts + (e - 1)) * len(self.ms) + c
        v0 = self.flat[base]
        return v0 + t * (self.flat[base + 1] - v0)


class A2aGrid:
    """The ``all_to_all`` rows of one group size: seconds per call by bytes per rank, fitted
    non-decreasing when the table is (``monotone``) and scaled by the table's ``scale``."""

    def __init__(self, num_bytes: np.ndarray, seconds: np.ndarray):
        self.num_bytes, self.seconds = num_bytes, seconds
        self.max_bytes = float(num_bytes[-1])

    @classmethod
    def from_rows(cls, rows: pd.DataFrame, monotone: bool, scale: float) -> A2aGrid:
        per_size = rows.groupby("bytes")["latency_us_p50"].mean()  # sorted by bytes
        seconds = per_size.to_numpy(np.float64) * 1e-6
        if monotone and len(seconds) > 1:
            from scipy.optimize import isotonic_regression

            seconds = isotonic_regression(seconds).x
        return cls(per_size.index.to_numpy(np.float64), seconds * scale)

    def layer_s(self, num_bytes: np.ndarray) -> np.ndarray:
        """Seconds of one call at each size: linear between measured sizes, the smallest
        size's time below them, NaN above the largest (the caller's fallback)."""
        v = np.interp(num_bytes, self.num_bytes, self.seconds)
        if num_bytes.max(initial=0.0) > self.max_bytes:
            v[num_bytes > self.max_bytes] = np.nan
        return v


class TableLatencyModel:
    name = "table"

    def __init__(self, cfg: TableLatencyConfig, model: ModelSpec, gpu: GpuSpec, base_dir: str | Path):
        self.cfg, self.model = cfg, model
        self.path = cfg.resolved_path(base_dir)
        self.fallback = AnalyticLatencyModel(cfg.fallback, model, gpu)
        df, self.meta = read_kernel_table(self.path)
        table_model = cfg.model or model.name
        mine = df[df["model"] == table_model]
        if mine.empty:
            known = ", ".join(sorted(df["model"].unique()))
            raise SpecError(f"{self.path}: no rows for model {table_model!r}; the table has: {known}")
        # op -> Grid for single-channel ops; (op, precision id) -> Grid for per-precision ops.
        self.grids: dict[str | tuple[str, int], Grid] = {}
        for op, (xcol, ycol) in OP_KEYS.items():
            rows = mine[mine["op"] == op]
            if rows.empty and op == "h2d_copy":
                rows = df[df["op"] == op]  # copy bandwidth does not depend on the model measured
            if rows.empty:
                continue
            if op not in PER_PRECISION_OPS:  # one grid whatever the precision column says
                self.grids[op] = Grid.from_rows(rows, xcol, ycol, f"{self.path}: op {op}", cfg.monotone)
                continue
            for prec, part in rows.groupby("precision"):
                if prec in PRECISION_ID:
                    grid = Grid.from_rows(part, xcol, ycol, f"{self.path}: op {op}, precision {prec}", cfg.monotone)
                    self.grids[(op, PRECISION_ID[prec])] = grid
        # The all-to-all per number of ranks (``batch``); the exchange depends on bytes, not the model.
        a2a = mine[mine["op"] == "all_to_all"]
        if a2a.empty:
            a2a = df[df["op"] == "all_to_all"]
        bad = (a2a["batch"] < 2) | (a2a["bytes"] <= 0)
        if bad.any():
            row = a2a[bad].iloc[0]
            raise SpecError(
                f"{self.path}: line {int(a2a[bad].index[0]) + 2}: op all_to_all needs batch (ranks) >= 2 and "
                f"bytes > 0 (got batch={row['batch']}, bytes={row['bytes']})"
            )
        self.a2a_grids: dict[int, A2aGrid] = {
            int(world): A2aGrid.from_rows(part, cfg.monotone, cfg.scale) for world, part in a2a.groupby("batch")
        }
        moe = {key[1]: g for key, g in self.grids.items() if isinstance(key, tuple) and key[0] == "moe_ffn"}
        self.moe_grid = MoeGrid(moe, model.num_experts) if moe else None
        # CPU tables (kernel_table.py): experts dequantised into an fp32 copy on first use after a
        # change, and upgrades written inside the step that starts them.
        self.has_dequantize = any(isinstance(key, tuple) and key[0] == "dequantize" for key in self.grids)
        self.synchronous_upgrades = self.meta.get("upgrades") == "synchronous"
        moe_calls = self.meta.get("moe_calls", "per precision class")
        if moe_calls not in ("per layer", "per precision class"):
            raise SpecError(f"{self.path}: meta moe_calls: {moe_calls!r}; allowed: 'per layer', 'per precision class'")
        self.moe_per_layer = moe_calls == "per layer"
        self.out_of_grid: Counter[str] = Counter()
        self._warned: set[str] = set()
        self._num_precisions = len(PRECISION_NAMES)
        self._layer_base = (np.arange(model.num_moe_layers) * self._num_precisions)[:, None]
        self.decode_scale: Grid | None = None
        whole = self.grids.pop("decode_step", None)
        if whole is not None:
            precs = mine.loc[mine["op"] == "decode_step", "precision"].unique()
            if len(precs) != 1 or precs[0] not in PRECISION_ID:
                raise SpecError(f"{self.path}: op decode_step needs rows of one precision (got {', '.join(precs)})")
            self.decode_scale = self._decode_scale(whole, PRECISION_ID[precs[0]])

    def _decode_scale(self, whole: Grid, precision_id: int) -> Grid:
        """``decode_step`` over the sum of the other rows for the profiler's step at each of its
        points (``pwgpu.profile.Profiler.decode_step``: ``decode_step_counts`` on every MoE
        layer, every expert at ``precision_id``)."""
        md = self.model
        ids = np.full((md.num_moe_layers, md.num_experts), precision_id, dtype=np.int64)
        values = []
        for b, row in zip(whole.xs, whole.values, strict=True):
            b = int(b)
            counts = decode_step_counts(b, md.top_k, md.num_experts).astype(np.float64)
            tokens = np.repeat(counts[None, :], md.num_moe_layers, axis=0)
            out = []
            for kv, measured_s in zip(whole.ys, row, strict=True):
                kv = int(kv)
                ops_s = self._kernels_s(StepShape([], [], [kv] * b, 0, kv * b), tokens, ids)
                out.append(measured_s / ops_s)
            values.append(out)
        return Grid(np.asarray(whole.xs), np.asarray(whole.ys), np.asarray(values))

    # ---- out-of-grid bookkeeping ---------------------------------------------------------
    def miss(self, key: str, count: int, example: str) -> None:
        """Points of ``key`` timed by the fallback: counted, and warned about once."""
        self._miss(key, count, example)

    def _miss(self, key: str, count: int, example: str) -> None:
        self.out_of_grid[key] += count
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(
                f"latency table {self.cfg.path}: {key} at {example} is outside the measured grid; "
                "timing such points with the analytic fallback (counts in out_of_grid)",
                stacklevel=3,
            )

    def _one(self, op: str, key: str | tuple[str, int], x: float, y: float, analytic) -> float:
        """One look-up: table seconds in the grid, else ``analytic()`` (counted and warned once)."""
        grid = self.grids.get(key)
        if grid is not None:
            v = grid.lookup(x, y)
            if v is not None:
                return v
            xcol, ycol = OP_KEYS[op]
            name = op if isinstance(key, str) else f"{op}/{PRECISION_NAMES[key[1]]}"
            self._miss(name, 1, f"{xcol}={x:g}" + (f", {ycol}={y:g}" if ycol else ""))
        else:
            name = op if isinstance(key, str) else f"{op}/{PRECISION_NAMES[key[1]]}"
            self._miss(f"{name} (not in table)", 1, "every point")
        return float(analytic())

    # ---- the LatencyModel interface ------------------------------------------------------
    def moe_s(self, tokens_per_expert: np.ndarray, precision_ids: np.ndarray) -> float:
        """One ``moe_ffn`` call per (layer, precision class) with active experts; per layer with
        a ``moe_calls: per layer`` table (see the module docstring)."""
        active = tokens_per_expert > 0
        key = (self._layer_base + precision_ids)[active]
        size = self.model.num_moe_layers * self._num_precisions
        num_active = np.bincount(key, minlength=size)
        present = np.flatnonzero(num_active)
        e = num_active[present]
        m = np.bincount(key, weights=tokens_per_expert[active], minlength=size)[present] / e
        prec = present % self._num_precisions
        share = None
        if self.moe_per_layer:
            layer = present // self._num_precisions  # sorted: a layer's classes sit side by side
            if len(layer) > 1 and (layer[1:] == layer[:-1]).any():  # a layer of several classes
                e_layer = np.bincount(layer, weights=e)
                m_layer = np.bincount(layer, weights=e * m) / np.maximum(e_layer, 1)
                share = e / e_layer[layer]
                e, m = e_layer[layer].astype(np.int64), m_layer[layer]
        if self.moe_grid is None:
            vals = self.fallback.moe_class_s(prec, m, e)
            for pid in np.unique(prec).tolist():
                self._miss(f"moe_ffn/{PRECISION_NAMES[pid]} (not in table)", int((prec == pid).sum()), "every point")
        else:
            vals = self.moe_grid.lookup(prec, m, e)
            if share is None:
                total = float(vals.sum())
                if total < OUT_OF_GRID_S:
                    return total
            bad = vals >= OUT_OF_GRID_S
            if bad.any():
                vals[bad] = self.fallback.moe_class_s(prec[bad], m[bad], e[bad])
                for pid in np.unique(prec[bad]).tolist():
                    sel = bad & (prec == pid)
                    example = f"m={m[sel][0]:g}, e={e[sel][0]}"
                    self._miss(f"moe_ffn/{PRECISION_NAMES[pid]}", int(sel.sum()), example)
        return float((vals * share).sum() if share is not None else vals.sum())

    def step_time_s(self, shape: StepShape, tokens_per_expert: np.ndarray, precision_ids: np.ndarray) -> float:
        kernels_s = self._kernels_s(shape, tokens_per_expert, precision_ids)
        scale = self.decode_scale
        num_decodes = len(shape.decode_kv_lens)
        if scale is not None and shape.num_prefill_tokens == 0 and num_decodes:
            mean_kv = shape.decode_kv_tokens / num_decodes
            r = scale.lookup(num_decodes, mean_kv)
            if r is None:
                self._miss("decode_step", 1, f"batch={num_decodes}, kv_len={mean_kv:g}")
            else:
                kernels_s *= r
        return self.cfg.scale * kernels_s + self.cfg.fallback.step_overhead_s

    def _kernels_s(self, shape: StepShape, tokens_per_expert: np.ndarray, precision_ids: np.ndarray) -> float:
        """The step's ops from their rows, unscaled, without the per-step overhead."""
        md, fb = self.model, self.fallback
        num_decodes = len(shape.decode_kv_lens)
        num_chunks = len(shape.prefill_tokens)
        num_tokens = shape.num_prefill_tokens + num_decodes
        if num_tokens == 0:
            return 0.0
        attn_s = 0.0
        if num_chunks:
            for q, kv in zip(shape.prefill_tokens, shape.prefill_kv_lens, strict=True):
                attn_s += self._one("attn_prefill", "attn_prefill", q, kv, lambda q=q, kv=kv: fb.attn_prefill_s(q, kv))
        if num_decodes:
            total_kv = float(shape.decode_kv_tokens)
            mean_kv = total_kv / num_decodes
            attn_s += self._one(
                "attn_decode", "attn_decode", num_decodes, mean_kv, lambda: fb.attn_decode_s(num_decodes, total_kv)
            )
        dense_s = self._one("dense", "dense", num_tokens, 0.0, lambda: fb.dense_s(num_tokens))
        num_seqs = num_chunks + num_decodes
        head_s = self._one("lm_head", "lm_head", num_seqs, 0.0, lambda: fb.lm_head_s(num_seqs))
        dense_layers_s = md.num_dense_layers * float(fb.dense_layer_s(num_tokens)) if md.num_dense_layers else 0.0
        kernels_s = (
            md.num_layers * attn_s
            + md.num_moe_layers * dense_s
            + dense_layers_s
            + head_s
            + self.moe_s(tokens_per_expert, precision_ids)
        )
        return kernels_s

    def quantize_time_s(self, n: int, k: int, precision_id: int) -> float:
        key = ("quantize", int(precision_id))
        return self.cfg.scale * self._one(
            "quantize", key, n, k, lambda: self.fallback.quantize_time_s(n, k, precision_id)
        )

    def dequantize_time_s(self, n: int, k: int, precision_id: int) -> float:
        """One ``[n, k]`` matrix into the CPU engine's fp32 copy; 0 for a table without
        ``dequantize`` rows (a GPU kernel reads the packed pages itself)."""
        if not self.has_dequantize:
            return 0.0
        key = ("dequantize", int(precision_id))
        return self.cfg.scale * self._one("dequantize", key, n, k, lambda: 0.0)

    def h2d_time_s(self, num_bytes: int) -> float:
        if num_bytes <= 0:
            return 0.0
        return self.cfg.scale * self._one(
            "h2d_copy", "h2d_copy", num_bytes, 0.0, lambda: self.fallback.h2d_time_s(num_bytes)
        )

    def describe(self) -> str:
        return (
            f"table {self.cfg.path} ({self.meta.get('device')}, {self.meta.get('date')}"
            f"{', fitted non-decreasing' if self.cfg.monotone else ''}"
            f"{f', times x{self.cfg.scale:.4g}' if self.cfg.scale != 1.0 else ''}); "
            f"outside the grid: {self.cfg.fallback.describe()}"
        )
