"""Where a simulated step's routing comes from: tokens per expert per MoE layer.

``RoutingSampler`` (``pwsim.routing``) draws them from frequencies; ``ReplayRouting`` plays back
counts recorded elsewhere, e.g. the real engine's router choices step by step, so that the
simulator's controller sees exactly the routing the engine's saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pagedweight.errors import PagedWeightError


class RoutingSource(Protocol):
    def sample(self, num_tokens: int) -> np.ndarray:
        """(MoE layers, experts) int64 tokens each expert receives in a step of ``num_tokens``."""


class ReplayRouting:
    """Recorded per-step counts, one array per step, in order. A step whose token count does not
    match the recording (each layer's counts sum to ``num_tokens * top_k``) is an error: the
    replay has left the run it was recorded from."""

    def __init__(self, counts: Sequence[np.ndarray], top_k: int):
        self.counts = [np.asarray(c, dtype=np.int64) for c in counts]
        self.top_k = top_k
        self.num_replayed = 0

    def sample(self, num_tokens: int) -> np.ndarray:
        i = self.num_replayed
        if i >= len(self.counts):
            raise PagedWeightError(f"routing replay: step {i} asked for, only {len(self.counts)} recorded")
        counts = self.counts[i]
        sums = counts.sum(axis=1)
        if (sums != num_tokens * self.top_k).any():
            raise PagedWeightError(
                f"routing replay: step {i} has {num_tokens} tokens; the recording routed "
                f"{int(sums[0]) // self.top_k} (top_k {self.top_k})"
            )
        self.num_replayed += 1
        return counts
