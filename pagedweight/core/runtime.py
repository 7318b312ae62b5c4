"""What both runtimes hold for one policy: pool, page table, KV allocator, scheduler and
controller, built the same way, plus the code that applies precision changes and records steps.

A runtime supplies only a clock and a ``TransitionBackend`` that does the physical part of a
precision change: ``pwsim``'s backend adds quantise time to the step and queues upgrades on
its simulated copy engine; ``pwgpu``'s quantises on the device and copies from the host master
on a side stream. Everything else, including the order of operations within a change
(reserve new pages, fill them, flip, free the old), lives here once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from pagedweight.core.pagetable import ExpertPageTable, Transition, expert_pages_by_id
from pagedweight.core.pool import OWNER_PINNED, KvBlockAllocator, PagePool
from pagedweight.core.scheduler import Batch, Scheduler, SchedulerConfig
from pagedweight.core.spec import PRECISION_ID, PRECISION_NAMES, ModelSpec
from pagedweight.core.step import StepShape
from pagedweight.errors import PoolExhausted
from pagedweight.policy.controller import ABORT, DOWNGRADE, Change, Controller, ControllerSettings
from pagedweight.policy.importance import ImportanceTable
from pagedweight.policy.policies import DYNAMIC_POLICIES, setup_policy
from pagedweight.results.metrics import StepRecorder

TRANSITION_COLUMNS = ("time_s", "expert", "layer", "from_precision", "to_precision", "kind", "bytes")


class TransitionBackend(Protocol):
    def downgrade(self, t: Transition) -> None:
        """Fill ``t.pages`` with expert ``t.expert`` at ``t.to_id`` before the flip (synchronous)."""

    def start_upgrade(self, t: Transition) -> None:
        """Start filling ``t.pages`` from the host master; call ``RuntimeCore.complete_upgrade``
        when the bytes have landed."""

    def abort_upgrade(self, t: Transition) -> None:
        """Stop an upgrade; its pages are released right after."""


@dataclass(frozen=True)
class CoreConfig:
    """Everything ``RuntimeCore`` needs, independent of where it came from (scenario or CLI)."""

    model: ModelSpec
    budget_bytes: int
    page_bytes: int
    kv_block_tokens: int
    scheduler: SchedulerConfig
    controller: ControllerSettings = ControllerSettings()
    static_mixed_fraction: float = 0.5
    # Keep only the newest this many steps and transitions (a server runs for days); None: all.
    history_window: int | None = None


def quality_matrix(table: ImportanceTable) -> np.ndarray:
    """(N, num precision ids) loss per expert per precision; fp16 counts as bf16; NaN where the
    table has no estimate (a static precision outside the table's ladder)."""
    out = np.full((table.num_rows, len(PRECISION_NAMES)), np.nan)
    for j, name in enumerate(table.ladder):
        out[:, PRECISION_ID[name]] = table.dloss[:, j]
    for a, b in (("fp16", "bf16"), ("bf16", "fp16")):
        if np.isnan(out[:, PRECISION_ID[a]]).all():
            out[:, PRECISION_ID[a]] = out[:, PRECISION_ID[b]]
    return out


class RuntimeCore:
    def __init__(
        self,
        cfg: CoreConfig,
        policy: str,
        table: ImportanceTable,
        backend: TransitionBackend,
        clock: Callable[[], float],
    ):
        model = cfg.model
        self.model, self.policy, self.backend, self.clock = model, policy, backend, clock
        self.pool = pool = PagePool(cfg.budget_bytes, cfg.page_bytes)
        pool.alloc(OWNER_PINNED, pool.pages_for_bytes(model.pinned_bytes()))
        pages_by_id = expert_pages_by_id(model, cfg.page_bytes)
        ladder_ids = [PRECISION_ID[p] for p in table.ladder]
        dynamic = policy in DYNAMIC_POLICIES and len(ladder_ids) > 1
        # Dynamic policies keep headroom for one downgrade's new pages (see KvBlockAllocator).
        reserve = int(pages_by_id[ladder_ids[1:]].max()) if dynamic else 0
        self.setup = setup = setup_policy(
            policy, table, pages_by_id, cfg.page_bytes, pool.num_free - reserve, cfg.static_mixed_fraction
        )
        self.page_table = ExpertPageTable(pool, model, setup.initial_ids)
        self.kv = KvBlockAllocator(pool, cfg.kv_block_tokens, model.kv_bytes_per_token())
        self.kv.reserve_pages = reserve
        floor_pages = int(pages_by_id[setup.floor_ids].sum())
        max_kv_pages = pool.num_pages - pool.num_owned(OWNER_PINNED) - floor_pages - reserve
        sched_cfg = replace(cfg.scheduler, preemption_mode=setup.preemption_mode)
        self.scheduler = Scheduler(sched_cfg, self.kv, max_kv_pages * self.kv.blocks_per_page)
        self.controller: Controller | None = None
        if setup.controller_mode:
            self.controller = Controller(
                setup.controller_mode,
                cfg.controller,
                table,
                self.page_table,
                self.kv,
                self.scheduler.forecast_kv_blocks,
            )
            self.scheduler.pressure_hook = self._on_pressure
        self._quality = quality_matrix(table)
        self.quality_proxy = self._compute_quality()
        self.precision_grid = self.page_table.precision_ids.reshape(model.num_moe_layers, model.num_experts)
        self.steps = StepRecorder(max_rows=cfg.history_window)
        self.transitions: list[tuple] | deque[tuple] = deque(maxlen=cfg.history_window) if cfg.history_window else []
        self.num_transitions = {"downgrade": 0, "upgrade": 0, "abort": 0}  # all of them, beyond the window
        self._counters = [0, 0, 0, 0]  # downgrades, upgrades, bytes down, bytes up since the last step

    # ---- precision changes --------------------------------------------------------------------
    def _on_pressure(self, blocks_short: int) -> None:
        self.apply(self.controller.on_pressure(blocks_short, self.clock()))

    def plan_step(self) -> None:
        if self.controller is not None:
            self.apply(self.controller.plan_step(self.clock()))

    def observe_routing(self, tokens_per_expert: np.ndarray) -> None:
        """Feed one step's routing counts (layers, experts) to the controller's drift tracker."""
        if self.controller is not None:
            self.controller.observe_routing(tokens_per_expert)

    def apply(self, changes: list[Change]) -> None:
        pt = self.page_table
        for c in changes:
            if c.kind == ABORT:
                t = pt.in_flight.get(c.expert)
                if t is not None:
                    self.backend.abort_upgrade(t)
                    pt.abort(c.expert)
                    self._log(t, "abort", 0)
                continue
            try:
                t = pt.begin(c.expert, c.to_id)
            except PoolExhausted:
                continue  # no room this step; the controller plans again next step
            if c.kind == DOWNGRADE:
                self.backend.downgrade(t)
                pt.commit(c.expert)
                self._flipped(t)
                self._log(t, "downgrade", t.num_bytes)
                self._counters[0] += 1
                self._counters[2] += t.num_bytes
            else:
                self.backend.start_upgrade(t)

    def complete_upgrade(self, t: Transition) -> bool:
        """The copy of ``t`` has landed: flip, unless it was aborted meanwhile."""
        if self.page_table.in_flight.get(t.expert) is not t:
            return False
        self.page_table.commit(t.expert)
        self._flipped(t)
        self._log(t, "upgrade", t.num_bytes)
        self._counters[1] += 1
        self._counters[3] += t.num_bytes
        return True

    def _flipped(self, t: Transition) -> None:
        # One expert changed: update the quality proxy by its difference (a sum over every
        # expert after each upgrade cost 8% of a 6,144-expert run).
        self.quality_proxy += float(self._quality[t.expert, t.to_id] - self._quality[t.expert, t.from_id])

    def _log(self, t: Transition, kind: str, num_bytes: int) -> None:
        e = t.expert
        layer = e // self.model.num_experts
        self.num_transitions[kind] += 1
        self.transitions.append(
            (self.clock(), e, layer, PRECISION_NAMES[t.from_id], PRECISION_NAMES[t.to_id], kind, num_bytes)
        )

    def _compute_quality(self) -> float:
        pt = self.page_table
        return float(self._quality[np.arange(pt.num_experts), pt.precision_ids].sum())

    # ---- steps ----------------------------------------------------------------------------------
    def record_step(
        self, start_s: float, duration_s: float, batch: Batch, shape: StepShape, bytes_swapped: int = 0
    ) -> None:
        """One row of steps.csv. ``bytes_swapped``: KV bytes the step moved between host and
        device (the kv-swap policy)."""
        sched, c = self.scheduler, self._counters
        self.steps.record(
            start_s=start_s,
            duration_s=duration_s,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_prefill_tokens=shape.num_prefill_tokens,
            num_decodes=shape.num_decodes,
            num_preempted=len(batch.preempted),
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_free=self.kv.num_free_blocks,
            pool=self.pool,
            num_downgrades=c[0],
            num_upgrades=c[1],
            bytes_downgraded=c[2],
            bytes_upgraded=c[3],
            bytes_swapped=bytes_swapped,
            quality_proxy=self.quality_proxy,
        )
        self._counters = [0, 0, 0, 0]


def core_config(loaded) -> CoreConfig:
    """A ``CoreConfig`` from a ``LoadedScenario``."""
    sc = loaded.scenario
    c = sc.controller
    return CoreConfig(
        model=loaded.model,
        budget_bytes=loaded.budget_bytes,
        page_bytes=sc.memory.page_bytes,
        kv_block_tokens=sc.memory.kv_block_tokens,
        scheduler=SchedulerConfig(sc.scheduler.max_num_batched_tokens, sc.scheduler.max_num_seqs, loaded.max_model_len),
        # By name, so that every controller setting of the scenario reaches the controller.
        controller=ControllerSettings(
            **c.model_dump(exclude={"static_mixed_fraction", "max_in_flight"}), max_in_flight_bytes=c.max_in_flight
        ),
        static_mixed_fraction=c.static_mixed_fraction,
    )
