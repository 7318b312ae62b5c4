"""Where an expert-parallel replica's routed experts live: which experts of each MoE layer each
GPU ("rank") holds, and a rank's rows of the importance table. Both runtimes use it: the
simulator's EP replica (``pwsim.parallel``) and the engine's ranks (``pwgpu.ep``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedweight.errors import PagedWeightError
from pagedweight.policy.importance import ImportanceTable

PLACEMENTS = ("contiguous", "balanced", "file")
PLACEMENT_COLUMNS = ("layer", "expert", "gpu")


def place_experts(freqs: np.ndarray, ep: int, kind: str, path: str | Path | None = None) -> np.ndarray:
    """(ep, L, E / ep) expert indices (within their layer) each rank holds, ascending.

    ``contiguous``: rank r holds experts ``r * E/ep`` .. ``(r + 1) * E/ep - 1`` of every layer.
    ``balanced``: per layer, experts from the most to the least frequent (``freqs`` (L, E)) go
    to the rank with the least frequency so far among those with room (E / ep each): the
    longest-processing-time rule with equal counts, so each rank's expected traffic is close to
    1 / ep of the layer's. ``file``: as the CSV at ``path`` says (``read_placement``)."""
    num_layers, num_experts = freqs.shape
    if kind == "file":
        if path is None:
            raise PagedWeightError("placement 'file' needs the placement file's path")
        return read_placement(path, ep, num_layers, num_experts)
    if num_experts % ep:
        raise PagedWeightError(f"{num_experts} experts per layer do not split across ep={ep} GPUs")
    per_rank = num_experts // ep
    if kind == "contiguous":
        return np.broadcast_to(np.arange(num_experts).reshape(ep, 1, per_rank), (ep, num_layers, per_rank)).copy()
    if kind != "balanced":
        raise PagedWeightError(f"unknown placement {kind!r}; allowed: {', '.join(PLACEMENTS)}")
    out = np.zeros((ep, num_layers, per_rank), dtype=np.int64)
    for layer in range(num_layers):
        load = np.zeros(ep)
        count = np.zeros(ep, dtype=np.int64)
        for e in np.argsort(-freqs[layer], kind="stable").tolist():
            open_ranks = np.flatnonzero(count < per_rank)
            r = int(open_ranks[np.argmin(load[open_ranks])])
            out[r, layer, count[r]] = e
            count[r] += 1
            load[r] += freqs[layer, e]
        out[:, layer].sort(axis=1)
    return out


def read_placement(path: str | Path, ep: int, num_layers: int, num_experts: int) -> np.ndarray:
    """A placement from a CSV with a row per routed expert: ``layer,expert,gpu`` (0-based), every
    expert of every layer exactly once, ``num_experts / ep`` experts per GPU in each layer (a
    GPU's share of the model is the same size in every layer). Any other file is a one-line
    error naming the file, the line and the field."""
    import pandas as pd

    path = Path(path)
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (OSError, ValueError) as e:
        raise PagedWeightError(f"{path}: cannot read the placement: {e}") from None
    missing = [c for c in PLACEMENT_COLUMNS if c not in df.columns]
    if missing:
        have = ", ".join(PLACEMENT_COLUMNS)
        raise PagedWeightError(f"{path}: columns {', '.join(missing)} missing; a placement has {have}")
    limits = {"layer": num_layers, "expert": num_experts, "gpu": ep}
    values = {}
    for column, limit in limits.items():
        text = df[column].str.strip()
        ok = text.str.fullmatch(r"\d+")
        number = pd.to_numeric(text.where(ok, "0")).to_numpy()
        bad = np.flatnonzero(~ok.to_numpy() | (number >= limit))
        if len(bad):
            i = int(bad[0])
            raise PagedWeightError(f"{path}: line {i + 2}: {column} {df[column].iloc[i]!r}; allowed: 0 .. {limit - 1}")
        values[column] = number.astype(np.int64)
    flat = values["layer"] * num_experts + values["expert"]
    seen = np.zeros(num_layers * num_experts, dtype=np.int64)
    np.add.at(seen, flat, 1)
    twice = np.flatnonzero(seen[flat] > 1)
    if len(twice):
        i = int(twice[-1])
        raise PagedWeightError(
            f"{path}: line {i + 2}: layer {values['layer'][i]} expert {values['expert'][i]} is placed twice"
        )
    if (seen == 0).any():
        layer, expert = divmod(int(np.flatnonzero(seen == 0)[0]), num_experts)
        raise PagedWeightError(f"{path}: layer {layer} expert {expert} has no GPU; every routed expert needs a row")
    per_rank = num_experts // ep
    counts = np.zeros((num_layers, ep), dtype=np.int64)
    np.add.at(counts, (values["layer"], values["gpu"]), 1)
    if (counts != per_rank).any():
        layer, gpu = (int(x) for x in np.argwhere(counts != per_rank)[0])
        raise PagedWeightError(
            f"{path}: layer {layer}: gpu {gpu} holds {counts[layer, gpu]} experts; each GPU holds {per_rank} "
            f"({num_experts} experts over ep={ep})"
        )
    out = np.zeros((ep, num_layers, per_rank), dtype=np.int64)
    order = np.lexsort((values["expert"], values["gpu"], values["layer"]))
    for layer in range(num_layers):
        rows = order[values["layer"][order] == layer]
        out[:, layer] = values["expert"][rows].reshape(ep, per_rank)
    return out


def rank_table(table: ImportanceTable, experts: np.ndarray) -> ImportanceTable:
    """The importance table's rows of one rank's experts ((L, E_r) indices within each layer)."""
    rows = (np.arange(table.num_layers)[:, None] * table.num_experts + experts).ravel()
    return table.replace(
        num_experts=experts.shape[1],
        routing_freq=table.routing_freq[rows],
        routing_weight_mass=table.routing_weight_mass[rows],
        importance=table.importance[rows],
        dloss=table.dloss[rows],
        bytes=table.bytes[rows],
    )
