"""Policies by name: how each one sets and changes expert precision.

| name           | what it does                                                                 |
|----------------|------------------------------------------------------------------------------|
| static-fp16    | every expert at full precision (vLLM-like); preempts when KV is full          |
|                | (full: the checkpoint's format, bf16/fp16 or FP8 blocks)                      |
| static-int8    | every expert at INT8, fixed                                                   |
| static-int4    | every expert at INT4, fixed                                                   |
| static-mixed   | one offline ``marginal`` plan at a fixed budget, never changed (MC-MoE-like)  |
| kv-swap        | full precision; KV of preempted requests swapped to host over PCIe (runtime)  |
| paper-greedy   | the paper's dynamic scheme: re-plan with ``paper-greedy`` on every KV change, |
|                | on the paper's ladder (full, INT8, INT4: ``PAPER_LADDER``) unless configured  |
| pagedweight    | per-precision losses, marginal knapsack, KV forecast, hysteresis, copy budget |
|                | (under SLOs: fastest precision in a backlog, SLO-aware batches; controller)   |

``setup_policy`` says, for a policy, the precision every expert starts at, the lowest the
policy will ever go (which bounds the KV a request can get), which controller runs and how the
scheduler preempts. ``policy_ladder`` says which precisions a policy may use. Both runtimes
call them; neither has its own idea of a policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedweight.core.spec import MASTER_PRECISIONS, PRECISION_ID
from pagedweight.errors import ConfigError, PagedWeightError
from pagedweight.policy.allocate import Problem
from pagedweight.policy.hull import MarginalPlanner
from pagedweight.policy.importance import ImportanceTable

POLICY_NAMES: tuple[str, ...] = (
    "static-fp16",
    "static-int8",
    "static-int4",
    "static-mixed",
    "kv-swap",
    "paper-greedy",
    "pagedweight",
)
DYNAMIC_POLICIES = ("paper-greedy", "pagedweight")
# The paper's formats below the checkpoint's own (FP16/BF16 or FP8 blocks): INT8 and INT4. A
# fair paper-greedy walks only these, as published; FP8, INT3 and INT2 are this project's.
PAPER_LADDER: tuple[str, ...] = ("int8", "int4")


def relative_run_cost(name: str) -> float:
    """How long a policy's simulation takes against a static policy's, roughly: the policies
    that change precision at run time plan every step (2-3x on the shipped scenarios). Only
    the order in which parallel runs start depends on it."""
    return 2.0 if name in DYNAMIC_POLICIES else 1.0


def policy_ladder(name: str, scenario_ladder: tuple[str, ...], paper_greedy_ladder: tuple[str, ...] | None = None):
    """The precisions ``name`` may use, most precise first. ``paper-greedy`` gets the paper's
    ladder (the scenario's top, then whichever of INT8 and INT4 the scenario has), or
    ``paper_greedy_ladder`` when one is configured (it must be part of the scenario's ladder);
    every other policy gets the scenario's ladder."""
    ladder = tuple(scenario_ladder)
    if name != "paper-greedy":
        return ladder
    if paper_greedy_ladder is None:
        return (ladder[0], *(p for p in ladder[1:] if p in PAPER_LADDER))
    missing = [p for p in paper_greedy_ladder if p not in ladder]
    if missing:
        raise ConfigError(
            f"paper_greedy_precisions: {missing} not in the precision ladder; allowed: {', '.join(ladder)}"
        )
    return tuple(p for p in ladder if p in paper_greedy_ladder)


class PolicyInfeasible(PagedWeightError):
    """The policy cannot run in this budget (e.g. static-fp16 weights alone exceed it)."""


@dataclass(frozen=True, eq=False)
class PolicySetup:
    name: str
    initial_ids: np.ndarray  # (N,) int8 PRECISION_ID per expert at start
    floor_ids: np.ndarray  # (N,) int8: the lowest precisions the policy may reach
    controller_mode: str | None  # "pagedweight", "paper-greedy" or None (static)
    preemption_mode: str  # "recompute" or "swap"


def setup_policy(
    name: str,
    table: ImportanceTable,
    pages_by_id: np.ndarray,
    page_bytes: int,
    expert_room_pages: int,
    static_mixed_fraction: float = 0.5,
) -> PolicySetup:
    """``expert_room_pages``: pool pages left for routed experts and KV once pinned weights
    (and the downgrade headroom of dynamic policies) are taken. A policy needs its experts
    plus at least one KV page in that room, or it is infeasible."""
    if name not in POLICY_NAMES:
        raise PagedWeightError(f"unknown policy {name!r}; allowed: {', '.join(POLICY_NAMES)}")
    n = table.num_rows
    top = table.ladder[0]
    # "Full precision" is the checkpoint's own format: bf16/fp16, or FP8 blocks for an FP8
    # checkpoint (whose host master holds nothing more precise to restore).
    top_id = PRECISION_ID[top if top in MASTER_PRECISIONS else "bf16"]
    ladder_ids = np.array([PRECISION_ID[p] for p in table.ladder], dtype=np.int8)

    def pages(ids: np.ndarray) -> int:
        return int(pages_by_id[ids].sum())

    def fixed(ids: np.ndarray, mode: str = "recompute") -> PolicySetup:
        need = pages(ids)
        if need + 1 > expert_room_pages:
            raise PolicyInfeasible(
                f"{name}: experts need {need * page_bytes / 2**30:.2f} GiB but only "
                f"{(expert_room_pages - 1) * page_bytes / 2**30:.2f} GiB is left after pinned weights and one KV page"
            )
        return PolicySetup(name, ids, ids, None, mode)

    if name in ("static-fp16", "kv-swap"):
        return fixed(np.full(n, top_id, dtype=np.int8), "swap" if name == "kv-swap" else "recompute")
    if name in ("static-int8", "static-int4"):
        return fixed(np.full(n, PRECISION_ID[name.removeprefix("static-")], dtype=np.int8))
    paged = table.replace(bytes=np.broadcast_to(pages_by_id[ladder_ids] * page_bytes, table.bytes.shape).copy())
    planner = MarginalPlanner(Problem.build(paged))
    floor = np.full(n, ladder_ids[-1], dtype=np.int8)
    if name == "static-mixed":
        budget_bytes = int(static_mixed_fraction * pages(np.full(n, ladder_ids[0])) * page_bytes)
        budget_bytes = max(budget_bytes, pages(floor) * page_bytes)
        return fixed(planner.plan(budget_bytes).precision_ids.astype(np.int8))
    if pages(floor) + 1 > expert_room_pages:
        raise PolicyInfeasible(f"{name}: even every expert at {table.ladder[-1]} leaves no page for KV")
    # Start at full precision if it leaves a tenth of the room for KV, else at the best plan
    # that does; the controller moves from there.
    start_pages = min(pages(np.full(n, ladder_ids[0])), max(pages(floor), int(0.9 * expert_room_pages)))
    initial = planner.plan(start_pages * page_bytes).precision_ids.astype(np.int8)
    return PolicySetup(name, initial, floor, name, "recompute")
