"""Which of several engines takes an arriving request: the GPUs of an expert-parallel replica
(data-parallel attention, ``pwsim.parallel``) and the replicas of a cluster (``pwsim.cluster``)
choose the same way.

- ``round-robin``: in turn, whatever their load;
- ``least-outstanding``: the one with the fewest requests waiting or running;
- ``least-kv``: the one whose KV cache is the least used (blocks in use over blocks it could
  hold now), then the fewest outstanding requests.

Ties go to the lowest index, so a run is reproducible.
"""

from __future__ import annotations

from pagedweight.core.runtime import RuntimeCore

ROUTER_NAMES = ("round-robin", "least-outstanding", "least-kv")


def outstanding(core: RuntimeCore) -> int:
    sched = core.scheduler
    return len(sched.waiting) + len(sched.running)


def kv_usage(core: RuntimeCore) -> float:
    kv = core.kv
    capacity = kv.num_used_blocks + kv.num_free_blocks
    return kv.num_used_blocks / capacity if capacity else 1.0


class RequestRouter:
    def __init__(self, kind: str, cores: list[RuntimeCore]):
        if kind not in ROUTER_NAMES:
            raise ValueError(f"unknown router {kind!r}; allowed: {', '.join(ROUTER_NAMES)}")
        self.kind, self.cores = kind, cores
        self._next = 0

    def choose(self) -> int:
        cores = self.cores
        if self.kind == "round-robin":
            i = self._next
            self._next = (i + 1) % len(cores)
            return i
        if self.kind == "least-outstanding":
            loads = [outstanding(c) for c in cores]
        else:
            loads = [(kv_usage(c), outstanding(c)) for c in cores]
        return min(range(len(cores)), key=loads.__getitem__)
