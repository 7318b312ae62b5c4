"""KV offload (``pagedweight`` with ``controller.kv_offload``): whether a victim of preemption is
swapped to host memory or recomputed, by what each costs in time. The scheduler asks for each
victim (its ``cost`` preemption mode, ``Scheduler.swap_preferred``) before the victim lets go
of anything.

A swap copies the KV of its computed tokens out and back (the runtime's copy-time model,
twice); a recompute prefills them again at the learnt seconds per prefill token. Under prefix
caching a recompute finds part of its prompt in the cache (its own blocks, registered as it let
go of them) if they are not evicted before it is readmitted: that part is discounted by the
share that recomputed victims have found on readmission (an EMA over ~10 readmissions, from 1:
the cache keeps what it holds). A copy's fixed cost makes short requests cheaper to recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedweight.core.kv_blocks import KvBlockAllocator
from pagedweight.core.scheduler import RUNNING, WAITING

if TYPE_CHECKING:
    from pagedweight.core.scheduler import Request

SURVIVAL_EMA_WEIGHT = 1 / 10


class KvOffload:
    """Swap-or-recompute for preemption victims (see the module docstring)."""

    def __init__(self, kv: KvBlockAllocator):
        self.kv = kv
        # The victims recomputed with a cached prefix, by their cacheable tokens, until
        # readmitted, and the share of that prefix the cache has still held on readmission.
        self.recomputed: dict[Request, int] = {}
        self.cache_survival = 1.0

    def prefer_swap(
        self,
        req: Request,
        prefill_token_s: float,
        copy_time_s: Callable[[int], float] | None,
        prefix_caching: bool,
    ) -> bool:
        """Swap ``req`` when copying its computed tokens' KV out and back takes less time than
        recomputing them at ``prefill_token_s``, less the share of its cacheable prefix expected
        from the cache (with ``prefix_caching``). Recompute while either time is unknown, or
        nothing is computed. A victim recomputed with a cacheable prefix is watched until it is
        readmitted (``observe_readmissions``)."""
        tokens = req.num_computed_tokens
        if copy_time_s is None or tokens <= 0 or prefill_token_s <= 0:
            return False
        kv = self.kv
        cacheable = 0
        if req.block_hashes is not None and prefix_caching:
            bt = kv.block_tokens
            cacheable = min(len(req.block_hashes), (req.prompt_tokens - 1) // bt, tokens // bt) * bt
        recompute_s = (tokens - self.cache_survival * cacheable) * prefill_token_s
        swap = 2 * copy_time_s(tokens * kv.block_bytes // kv.block_tokens) < recompute_s
        if not swap and cacheable:
            self.recomputed[req] = cacheable
        return swap

    def observe_readmissions(self) -> None:
        """After a schedule: a victim recomputed with a cacheable prefix that this schedule
        readmitted found its computed tokens (before the step computes) in the cache; their
        share of its cacheable prefix updates the estimate ``prefer_swap`` discounts by. A
        victim that left otherwise (aborted) is forgotten."""
        if not self.recomputed:
            return
        for req, cacheable in list(self.recomputed.items()):
            state = req.state
            if state is WAITING:
                continue
            del self.recomputed[req]
            if state is RUNNING:
                found = min(1.0, req.num_computed_tokens / cacheable)
                self.cache_survival += SURVIVAL_EMA_WEIGHT * (found - self.cache_survival)
