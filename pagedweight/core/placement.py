"""Where an expert-parallel replica's routed experts live: which experts of each MoE layer each
GPU ("rank") holds, and a rank's rows of the importance table. Both runtimes use it: the
simulator's EP replica (``pwsim.parallel``) and the engine's ranks (``pwgpu.ep``)."""

from __future__ import annotations

import numpy as np

from pagedweight.errors import PagedWeightError
from pagedweight.policy.importance import ImportanceTable

PLACEMENTS = ("contiguous", "balanced")


def place_experts(freqs: np.ndarray, ep: int, kind: str) -> np.ndarray:
    """(ep, L, E / ep) expert indices (within their layer) each rank holds, ascending.

    ``contiguous``: rank r holds experts ``r * E/ep`` .. ``(r + 1) * E/ep - 1`` of every layer.
    ``balanced``: per layer, experts from the most to the least frequent (``freqs`` (L, E)) go
    to the rank with the least frequency so far among those with room (E / ep each): the
    longest-processing-time rule with equal counts, so each rank's expected traffic is close to
    1 / ep of the layer's."""
    num_layers, num_experts = freqs.shape
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
