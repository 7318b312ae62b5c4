"""Importance tables: how much each routed expert's precision matters, and what it costs.

One row per (layer, expert) of the routed experts; ``layer`` counts MoE layers from 0 (dense
leading layers are not in the table). Columns, in this order:

- ``layer``, ``expert``: integers, every pair of ``range(num_layers) x range(num_experts)`` once.
- ``routing_freq``: fraction of the layer's tokens routed to the expert, in [0, 1]; a layer's
  values sum to ``top_k`` when measured on the full calibration set.
- ``routing_weight_mass``: mean over the layer's tokens of the gate weight given to the expert
  (0 for tokens not routed to it), so ``routing_weight_mass / routing_freq`` is the mean gate
  weight when the expert is used.
- ``importance``: the paper's score ``I_i = E_x[Var(dL/dE_i(x))]``. For one calibration token x,
  ``g = dL(x)/dy_i(x)`` is the gradient of that token's loss with respect to expert i's output
  vector ``y_i(x)`` (H values, before the gate weight multiplies it); ``Var`` is the variance
  of g over its H hidden components. ``E_x`` averages over *all* calibration tokens; g is zero
  for tokens not routed to i, so I_i grows with how often the expert is used. The measured
  tables (``pwgpu importance``) take L as the summed loss of a calibration window rather than
  each token's own loss: one backward pass per window instead of one per token.
- for every precision p of the table's ladder, most precise first: ``dloss_<p>``, the estimated
  mean loss increase per token (nats) when only this expert is stored at p, and ``bytes_<p>``,
  the expert's exact bytes at p (all three matrices, scales and zero points included). Bytes
  must not increase down the ladder (FP8 and INT8 may tie).

Header lines starting with ``#`` before the column line carry ``key: value`` metadata:
``model``, ``source`` (where the numbers come from) and ``synthetic`` (true/false). Every output
built from a synthetic table should print ``table.provenance``.
"""

from __future__ import annotations

import csv
import io
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedweight.core.spec import DEFAULT_LADDER, MASTER_PRECISIONS, PRECISIONS, ModelSpec, ladder
from pagedweight.errors import ImportanceError

FORMAT_TAG = "pagedweight-importance v1"
BASE_COLUMNS = ("layer", "expert", "routing_freq", "routing_weight_mass", "importance")


@dataclass(frozen=True, eq=False)
class ImportanceTable:
    """A loaded importance table. Shape legend: N = num_layers * num_experts rows in layer-major
    order (row ``layer * num_experts + expert``), P = len(ladder)."""

    model: str
    ladder: tuple[str, ...]  # most precise first
    num_layers: int
    num_experts: int
    routing_freq: np.ndarray  # (N,) float64
    routing_weight_mass: np.ndarray  # (N,) float64
    importance: np.ndarray  # (N,) float64
    dloss: np.ndarray  # (N, P) float64
    bytes: np.ndarray  # (N, P) int64
    source: str = ""
    synthetic: bool = False

    def __post_init__(self) -> None:
        n, p = self.num_layers * self.num_experts, len(self.ladder)
        for name, shape in (
            ("routing_freq", (n,)),
            ("routing_weight_mass", (n,)),
            ("importance", (n,)),
            ("dloss", (n, p)),
            ("bytes", (n, p)),
        ):
            arr = getattr(self, name)
            if arr.shape != shape:
                raise ImportanceError(f"importance table {name} has shape {arr.shape}, expected {shape}")
            # Tables are shared between allocators and the tracker: nobody may edit one in place.
            # The table owns the arrays it is given (they become read-only too).
            arr.flags.writeable = False

    @property
    def num_rows(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def provenance(self) -> str:
        """One line for every output that uses this table."""
        kind = "SYNTHETIC" if self.synthetic else "measured"
        return f"importance table: {self.model}, {kind} ({self.source or 'no source given'})"

    def grid(self, values: np.ndarray) -> np.ndarray:
        """View a per-row array as (L, E) or (L, E, P)."""
        return values.reshape(self.num_layers, self.num_experts, *values.shape[1:])

    def replace(self, **changes) -> ImportanceTable:
        kwargs = {k: getattr(self, k) for k in self.__dataclass_fields__}
        kwargs.update(changes)
        return ImportanceTable(**kwargs)


# --------------------------------------------------------------------------------------------
# Validation shared by files and in-memory tables
# --------------------------------------------------------------------------------------------


def validate(table: ImportanceTable, where=None) -> ImportanceTable:
    """Check values; ``where(row) -> str`` names a row in messages (a file line when read)."""
    where = where or (lambda row: f"row {row}")
    cols = {
        "routing_freq": table.routing_freq,
        "routing_weight_mass": table.routing_weight_mass,
        "importance": table.importance,
    }
    for j, p in enumerate(table.ladder):
        cols[f"dloss_{p}"] = table.dloss[:, j]
        cols[f"bytes_{p}"] = table.bytes[:, j]
    for name, values in cols.items():
        values = np.asarray(values, dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise ImportanceError(f"{where(bad[0])}, column {name}: {float(values[bad[0]])} is not a finite number")
        bad = np.flatnonzero(values < 0)
        if bad.size:
            raise ImportanceError(
                f"{where(bad[0])}, column {name}: {float(values[bad[0]])!r} is negative; must be >= 0"
            )
    bad = np.flatnonzero(table.routing_freq > 1)
    if bad.size:
        raise ImportanceError(
            f"{where(bad[0])}, column routing_freq: {float(table.routing_freq[bad[0]])!r} is a fraction of tokens, "
            "must be in [0, 1]"
        )
    bad = np.flatnonzero(table.bytes[:, 0] <= 0)
    if bad.size:
        raise ImportanceError(f"{where(bad[0])}, column bytes_{table.ladder[0]}: expert bytes must be > 0")
    if len(table.ladder) > 1:
        rising = np.diff(table.bytes, axis=1) > 0
        rows, steps = np.nonzero(rising)
        if rows.size:
            r, j = rows[0], steps[0]
            hi, lo = table.ladder[j], table.ladder[j + 1]
            raise ImportanceError(
                f"{where(r)}: bytes_{lo}={table.bytes[r, j + 1]} exceeds bytes_{hi}={table.bytes[r, j]}; bytes must "
                f"not increase down the ladder {' > '.join(table.ladder)}"
            )
    return table


# --------------------------------------------------------------------------------------------
# CSV read / write
# --------------------------------------------------------------------------------------------


def _allowed_columns_text() -> str:
    precs = "|".join(PRECISIONS)
    return f"{', '.join(BASE_COLUMNS)}, dloss_<p>, bytes_<p> with p in {precs}"


def read_table(path: str | Path) -> ImportanceTable:
    """Load and validate an importance table CSV; errors name the file, line and column."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ImportanceError(f"cannot read importance table {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ImportanceError(f"{path}: not a text (UTF-8) CSV file") from None
    lines = text.splitlines()
    meta: dict[str, str] = {}
    header_line = 0
    while header_line < len(lines) and (lines[header_line].startswith("#") or not lines[header_line].strip()):
        key, sep, value = lines[header_line].lstrip("#").partition(":")
        if sep:
            meta[key.strip()] = value.strip()
        header_line += 1
    if header_line == len(lines):
        raise ImportanceError(f"{path}: no column header line; expected columns {_allowed_columns_text()}")
    columns = [c.strip() for c in next(csv.reader([lines[header_line]]))]
    at = f"{path}:{header_line + 1}"  # 1-based line numbers, as editors show them

    unknown = [c for c in columns if c not in BASE_COLUMNS and not c.startswith(("dloss_", "bytes_"))]
    if unknown:
        raise ImportanceError(f"{at}: unknown column {unknown[0]!r}; allowed: {_allowed_columns_text()}")
    for c in columns:
        if c.startswith(("dloss_", "bytes_")) and c.split("_", 1)[1] not in PRECISIONS:
            raise ImportanceError(
                f"{at}: column {c!r} names unknown precision {c.split('_', 1)[1]!r}; allowed: {', '.join(PRECISIONS)}"
            )
    dupes = sorted({c for c in columns if columns.count(c) > 1})
    if dupes:
        raise ImportanceError(f"{at}: column {dupes[0]!r} appears more than once")
    missing = [c for c in BASE_COLUMNS if c not in columns]
    if missing:
        raise ImportanceError(f"{at}: missing column {missing[0]!r}; required: {', '.join(BASE_COLUMNS)}")
    dloss_precs = [c[len("dloss_") :] for c in columns if c.startswith("dloss_")]
    bytes_precs = [c[len("bytes_") :] for c in columns if c.startswith("bytes_")]
    if not dloss_precs:
        raise ImportanceError(f"{at}: no dloss_<p> columns; a table needs at least one precision")
    for a, b, kind in ((dloss_precs, bytes_precs, "bytes"), (bytes_precs, dloss_precs, "dloss")):
        lonely = [p for p in a if p not in b]
        if lonely:
            raise ImportanceError(f"{at}: precision {lonely[0]!r} has no {kind}_{lonely[0]} column")
    ladder_names = tuple(p.name for p in ladder(dloss_precs))

    data_lines = [(i, ln) for i, ln in enumerate(lines[header_line + 1 :], start=header_line + 2) if ln.strip()]
    if not data_lines:
        raise ImportanceError(f"{path}: no data rows after the header")
    rows = list(csv.reader(ln for _, ln in data_lines))
    line_of = [i for i, _ in data_lines]
    for r, row in enumerate(rows):
        if len(row) != len(columns):
            raise ImportanceError(f"{path}:{line_of[r]}: {len(row)} fields, the header has {len(columns)}")

    def column(name: str, dtype) -> np.ndarray:
        j = columns.index(name)
        cells = [row[j] for row in rows]
        try:
            values = np.array(cells, dtype=np.float64)
        except ValueError:
            for r, cell in enumerate(cells):
                try:
                    float(cell)
                except ValueError:
                    raise ImportanceError(f"{path}:{line_of[r]}, column {name}: {cell!r} is not a number") from None
            raise
        if dtype is np.int64:
            frac = np.flatnonzero(np.isfinite(values) & (values != np.round(values)))
            if frac.size:
                r = frac[0]
                raise ImportanceError(f"{path}:{line_of[r]}, column {name}: {cells[r]!r} must be an integer")
            nonfinite = np.flatnonzero(~np.isfinite(values))
            if nonfinite.size:
                r = nonfinite[0]
                raise ImportanceError(f"{path}:{line_of[r]}, column {name}: {cells[r]!r} is not a finite number")
            return values.astype(np.int64)
        return values

    layer, expert = column("layer", np.int64), column("expert", np.int64)
    for name, ids in (("layer", layer), ("expert", expert)):
        bad = np.flatnonzero(ids < 0)
        if bad.size:
            raise ImportanceError(f"{path}:{line_of[bad[0]]}, column {name}: {ids[bad[0]]} must be >= 0")
    num_layers, num_experts = int(layer.max()) + 1, int(expert.max()) + 1
    flat = (layer * num_experts + expert).tolist()
    # A dict, not an array of layers x experts: a typo like layer 100000000 must not allocate it.
    seen: dict[int, int] = {}
    for r, f in enumerate(flat):
        if f in seen:
            raise ImportanceError(
                f"{path}:{line_of[r]}: layer {layer[r]} expert {expert[r]} already given on line {line_of[seen[f]]}"
            )
        seen[f] = r
    num_absent = num_layers * num_experts - len(seen)
    if num_absent:
        absent = [a for a in itertools.islice(itertools.count(), len(seen) + 5) if a not in seen][:5]
        shown = ", ".join(f"(layer {a // num_experts}, expert {a % num_experts})" for a in absent)
        raise ImportanceError(
            f"{path}: {num_absent} expert(s) missing from a {num_layers} x {num_experts} table: {shown}"
            + (" ..." if num_absent > 5 else "")
        )
    order = np.array([seen[a] for a in range(len(seen))], dtype=np.int64)  # row of each layer-major position

    table = ImportanceTable(
        model=meta.get("model", path.stem),
        ladder=ladder_names,
        num_layers=num_layers,
        num_experts=num_experts,
        routing_freq=column("routing_freq", np.float64)[order],
        routing_weight_mass=column("routing_weight_mass", np.float64)[order],
        importance=column("importance", np.float64)[order],
        dloss=np.stack([column(f"dloss_{p}", np.float64)[order] for p in ladder_names], axis=1),
        bytes=np.stack([column(f"bytes_{p}", np.int64)[order] for p in ladder_names], axis=1),
        source=meta.get("source", ""),
        synthetic=meta.get("synthetic", "false").lower() in ("true", "1", "yes"),
    )
    return validate(table, where=lambda pos: f"{path}:{line_of[order[pos]]}")


def write_table(table: ImportanceTable, path: str | Path) -> None:
    """Write ``table`` so that ``read_table`` gives back identical arrays (floats as repr)."""
    out = io.StringIO()
    out.write(f"# {FORMAT_TAG}\n# model: {table.model}\n# source: {table.source}\n")
    out.write(f"# synthetic: {str(table.synthetic).lower()}\n")
    columns = [*BASE_COLUMNS, *(f"dloss_{p}" for p in table.ladder), *(f"bytes_{p}" for p in table.ladder)]
    out.write(",".join(columns) + "\n")
    layer = np.repeat(np.arange(table.num_layers), table.num_experts)
    expert = np.tile(np.arange(table.num_experts), table.num_layers)
    floats = np.column_stack([table.routing_freq, table.routing_weight_mass, table.importance, table.dloss])
    for i in range(table.num_rows):
        cells = [str(layer[i]), str(expert[i]), *map(repr, floats[i].tolist()), *map(str, table.bytes[i].tolist())]
        out.write(",".join(cells) + "\n")
    Path(path).write_text(out.getvalue())


# --------------------------------------------------------------------------------------------
# Synthetic tables for models we have no calibration run of
# --------------------------------------------------------------------------------------------

# Relative output-error variance of each format, normalised to INT4 g128 = 1. A uniform quantiser's
# error variance scales as 4**-b; the effective bits b assumed here are FP16/BF16 exact, INT8
# per-channel 7, FP8 E4M3 per-channel 6 (3 mantissa bits, but the exponent absorbs outliers),
# FP8 E4M3 with 128 x 128 block scales 6.5 (a block's scale fits its range better than a row's),
# INT4 g128 4, INT3 g128 3, INT2 g64 2. These are modelling assumptions, not measurements.
QUANT_NOISE = {
    "bf16": 0.0,
    "fp16": 0.0,
    "fp8-b128": 4.0**-2.5,
    "fp8": 4.0**-2,
    "int8": 4.0**-3,
    "int4": 1.0,
    "int3": 4.0,
    "int2": 16.0,
}


def _cap_at_one(freq: np.ndarray, top_k: int) -> np.ndarray:
    """No expert can see more than every token: cap each row at 1 and give the excess to the
    uncapped experts in proportion, until each row sums to ``top_k`` again."""
    freq = freq.copy()
    for _ in range(freq.shape[1]):
        capped = freq >= 1.0
        if not (freq > 1.0).any():
            break
        freq = np.minimum(freq, 1.0)
        free_total = np.where(capped, 0.0, freq).sum(axis=1, keepdims=True)
        want = top_k - capped.sum(axis=1, keepdims=True)
        freq = np.where(capped, 1.0, freq * want / np.where(free_total > 0, free_total, 1.0))
    return freq


def synthetic_table(
    model: ModelSpec,
    ladder_names: tuple[str, ...] | list[str] = DEFAULT_LADDER,
    seed: int = 0,
    *,
    zipf_exponent: float = 0.8,
    routing_jitter: float = 0.3,
    layer_sigma: float = 0.5,
    outlier_sigma: float = 0.7,
    noise_sigma: float = 0.2,
    int4_total_dloss: float = 0.1,
) -> ImportanceTable:
    """A table with realistic skew for a model we have not calibrated; marked synthetic.

    Per MoE layer l, expert popularity follows a Zipf law over a random permutation of the
    experts, ``w_e = rank_e**-zipf_exponent * LogNormal(0, routing_jitter)``, normalised to
    sum 1; ``routing_freq = top_k * w``, capped at 1 with the excess spread over the other
    experts. ``routing_weight_mass`` is ``routing_freq`` times a mean gate weight
    ``LogNormal(0, 0.2) / top_k``, renormalised so each layer's mass sums to 1 (top-k
    renormalising routers). Layers differ in sensitivity by
    ``s_l = LogNormal(0, layer_sigma)``. The gradient score is ``I = routing_freq * s_l``. The loss
    of quantising expert i to p is ``dloss_i(p) = c * I_i * o_i * QUANT_NOISE[p] * LogNormal(0,
    noise_sigma)``, where ``o_i = LogNormal(0, outlier_sigma)`` models how badly the expert's
    weights quantise (outliers); it is why I alone does not rank experts by loss. ``c`` makes the
    table's loss with every expert at INT4 equal ``int4_total_dloss`` nats per token.
    Bytes are the model's exact expert bytes at each precision.
    """
    names = tuple(p.name for p in ladder(list(ladder_names)))
    rng = np.random.default_rng(seed)
    n_layers, n_exp, k = model.num_moe_layers, model.num_experts, model.top_k
    ranks = np.argsort(rng.random((n_layers, n_exp)), axis=1) + 1.0
    w = ranks**-zipf_exponent * rng.lognormal(0.0, routing_jitter, (n_layers, n_exp))
    freq = _cap_at_one(k * w / w.sum(axis=1, keepdims=True), k)
    mass = freq * rng.lognormal(0.0, 0.2, (n_layers, n_exp)) / k
    mass /= mass.sum(axis=1, keepdims=True)
    importance = freq * rng.lognormal(0.0, layer_sigma, (n_layers, 1))
    outlier = rng.lognormal(0.0, outlier_sigma, (n_layers, n_exp))
    # Losses are against the model as its checkpoint stores it: for an FP8 checkpoint the FP8
    # experts are the reference (no loss) and INT4 adds only what it loses beyond them.
    reference = QUANT_NOISE[names[0]] if names[0] in MASTER_PRECISIONS else 0.0
    noise = np.array([max(QUANT_NOISE[p] - reference, 0.0) for p in names])
    dloss = (importance * outlier)[..., None] * noise * rng.lognormal(0.0, noise_sigma, (n_layers, n_exp, len(names)))
    int4_loss = (importance * outlier).sum()
    dloss *= int4_total_dloss / int4_loss
    bytes_per = np.array([model.expert_bytes(p) for p in names], dtype=np.int64)
    n = n_layers * n_exp
    params = (
        f"seed={seed} zipf={zipf_exponent} jitter={routing_jitter} layer_sigma={layer_sigma} "
        f"outlier_sigma={outlier_sigma} noise_sigma={noise_sigma} int4_total_dloss={int4_total_dloss}"
    )
    return ImportanceTable(
        model=model.name,
        ladder=names,
        num_layers=n_layers,
        num_experts=n_exp,
        routing_freq=freq.reshape(n),
        routing_weight_mass=mass.reshape(n),
        importance=importance.reshape(n),
        dloss=dloss.reshape(n, len(names)),
        bytes=np.broadcast_to(bytes_per, (n, len(names))).copy(),
        source=f"synthetic_table({params})",
        synthetic=True,
    )


# --------------------------------------------------------------------------------------------
# Online routing drift
# --------------------------------------------------------------------------------------------


class RoutingTracker:
    """Exponential moving average of observed routing, used to rescale an offline table.

    Per layer l the tracker keeps ``share[l, e]``, the EMA of the fraction of the layer's routed
    (token, expert) assignments that went to e; it starts at the offline table's share
    ``f0[l, e] = routing_freq / sum_e routing_freq``. One ``observe(counts)`` with ``n_l`` routed
    assignments in layer l (``counts[l].sum()``) moves it by
    ``share <- share + a_l * (counts[l] / n_l - share)``, ``a_l = 1 - 2**(-n_l / half_life_assignments)``,
    so the weight of old traffic halves every ``half_life_assignments`` assignments however the
    steps are sized (a 1-token decode step barely moves it; an 8k-token prefill does).

    A loss estimate is a mean per token, proportional to how often the expert runs, so under
    the new traffic ``dloss'_i(p) = dloss_i(p) * r_i`` and ``I'_i = I_i * r_i`` with
    ``r_i = (share_i + eps) / (f0_i + eps)``, ``eps = prior_share / num_experts``. The prior keeps
    experts the calibration never routed to (f0 = 0) from getting an infinite factor.
    """

    def __init__(self, table: ImportanceTable, half_life_assignments: float = 65536.0, prior_share: float = 0.05):
        if half_life_assignments <= 0:
            raise ImportanceError(f"half_life_assignments(={half_life_assignments}) must be > 0")
        if prior_share <= 0:
            raise ImportanceError(f"prior_share(={prior_share}) must be > 0")
        self.table = table
        self.half_life_assignments = half_life_assignments
        freq = table.grid(table.routing_freq)
        totals = freq.sum(axis=1, keepdims=True)
        uniform = np.full_like(freq, 1.0 / table.num_experts)
        self.offline_share = np.where(totals > 0, freq / np.where(totals > 0, totals, 1.0), uniform)
        self.share = self.offline_share.copy()
        self.eps = prior_share / table.num_experts
        self.num_assignments = 0

    def observe(self, tokens_per_expert: np.ndarray) -> None:
        """Fold in one step's routing: ``tokens_per_expert[l, e]`` tokens went to expert e of layer l."""
        counts = np.asarray(tokens_per_expert, dtype=np.float64)
        if counts.shape != self.share.shape:
            raise ImportanceError(f"tokens_per_expert has shape {counts.shape}, expected {self.share.shape}")
        if (counts < 0).any() or not np.isfinite(counts).all():
            raise ImportanceError("tokens_per_expert must be finite counts >= 0")
        n = counts.sum(axis=1, keepdims=True)
        alpha = 1.0 - np.exp2(-n / self.half_life_assignments)
        step_share = counts / np.where(n > 0, n, 1.0)
        self.share += alpha * (step_share - self.share)  # layers with n = 0 have alpha = 0
        self.num_assignments += int(n.sum())

    def scale(self) -> np.ndarray:
        """(L, E) factors ``r`` that the offline losses are multiplied by."""
        return (self.share + self.eps) / (self.offline_share + self.eps)

    def rescaled(self) -> ImportanceTable:
        """The offline table with losses, scores and frequencies moved to the observed traffic."""
        r = self.scale().reshape(-1)
        k = self.table.grid(self.table.routing_freq).sum(axis=1, keepdims=True)
        freq = np.minimum(self.share * k, 1.0).reshape(-1)
        return self.table.replace(
            routing_freq=freq,
            routing_weight_mass=self.table.routing_weight_mass * r,
            importance=self.table.importance * r,
            dloss=self.table.dloss * r[:, None],
            source=f"{self.table.source}; rescaled by routing EMA over {self.num_assignments} assignments",
        )


def on_ladder(table: ImportanceTable, ladder_names: tuple[str, ...] | list[str], where: str = "") -> ImportanceTable:
    """The table's columns for exactly these precisions, most precise first, so that every
    planner (simulator and engine alike) chooses among the same options."""
    missing = [p for p in ladder_names if p not in table.ladder]
    if missing:
        raise ImportanceError(
            f"{where or 'importance table'}: no dloss/bytes columns for {missing}; the table has {list(table.ladder)}"
        )
    cols = [table.ladder.index(p) for p in ladder_names]
    return table.replace(
        ladder=tuple(ladder_names), dloss=table.dloss[:, cols].copy(), bytes=table.bytes[:, cols].copy()
    )


__all__ = [
    "BASE_COLUMNS",
    "QUANT_NOISE",
    "ImportanceTable",
    "RoutingTracker",
    "on_ladder",
    "read_table",
    "synthetic_table",
    "validate",
    "write_table",
]
