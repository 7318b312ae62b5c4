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
    """Chooses among ``targets``, each the cores of one engine (a GPU: one core; an
    expert-parallel replica: one per GPU, whose loads add up and whose KV usage is averaged)."""

    def __init__(self, kind: str, targets: list[list[RuntimeCore]]):
        if kind not in ROUTER_NAMES:
            raise ValueError(f"unknown router {kind!r}; allowed: {', '.join(ROUTER_NAMES)}")
        self.kind, self.targets = kind, targets
        self._next = 0

    def choose(self) -> int:
        targets = self.targets
        if self.kind == "round-robin":
            i = self._next
            self._next = (i + 1) % len(targets)
            return i
        if self.kind == "least-outstanding":
            loads = [sum(outstanding(c) for c in cores) for cores in targets]
        else:
            loads = [
                (sum(kv_usage(c) for c in cores) / len(cores), sum(outstanding(c) for c in cores)) for cores in targets
            ]
        return min(range(len(targets)), key=loads.__getitem__)
