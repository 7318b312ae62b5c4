"""The run-time precision controller: when and how far to move each expert's precision.

Runs every engine step (``plan_step``) and inside the scheduler's memory-pressure hook
(``on_pressure``), in both runtimes. It returns ``Change`` lists; the runtime applies them:
downgrades at once (quantise into fresh pages, flip, free: bounded by HBM bandwidth, so the
step that needs the pages waits for them), upgrades through the copy engine (host master ->
device over PCIe, flipped only when complete), aborts by releasing an upgrade's new pages.

Rules, per policy (``pagedweight.policy.policies``):
- Downgrades happen as soon as KV needs pages, before any preemption.
- ``pagedweight``: the weight budget is the pool less pinned pages, KV held, the scheduler's
  KV forecast over ``horizon_steps`` and a ``low_watermark`` of free pages. Below it: downgrade
  to the ``marginal`` plan of the new budget (least loss per freed byte first). Upgrades only
  while more than ``high_watermark`` of the pool is free after the forecast (hysteresis), under
  a host-to-device byte budget (``copy_budget_bytes_per_s``, at most ``max_in_flight`` bytes in
  flight), and never for an expert changed less than ``min_dwell_s`` ago. Under a TPOT SLO (and
  a step-time model from the runtime) upgrades stop where the predicted step nears the SLO and
  a step predicted past it downgrades, if a cheaper map meets it (``latency_cap``).
- ``pagedweight`` under the SLOs (docs/DESIGN.md, "Serving under the SLOs"): a backlog (the
  queue's projected wait past ``backlog_fraction`` of the TTFT SLO) moves every expert to the
  ladder's fastest precision for a prefill step and holds upgrades there until the queue has
  been calm for ``backlog_calm_s``; ``step_limits`` (the scheduler's hook) caps each step's
  prefill tokens and running batch where the learnt step time (``StepShapeFit``) reaches the
  TPOT SLO, and puts requests that already missed the TTFT SLO behind those that can meet it.
- ``pagedweight`` and prefix caching: cached prefix blocks are weighed against downgrades by
  what each costs (``_protect``): evicting a block costs the prefill its expected reuse would
  have saved (the ghost list's observed hit rate, ``pagedweight.core.reuse``, times the recent
  seconds per computed token), priced in loss by ``recompute_weight``; a downgrade costs its
  loss per freed byte (the marginal planner's segments). The blocks worth more than the
  downgrades that would make room for them are protected: KV does not count them free, so a
  shortage reaches ``on_pressure``, which downgrades only as far as that is cheaper and then
  lifts protection. Under a TTFT SLO the cache's value is scaled by how hard the queue has
  pressed lately (an EMA over ``backlog_calm_s`` of its projected wait being past half the
  backlog threshold): recompute time that cannot cost a first token its SLO is not worth
  quality. Every other policy evicts cached blocks first, as vLLM does.
- ``paper-greedy``: the paper's scheme: every step, re-plan with ``paper-greedy`` for the memory
  KV leaves right now and apply every difference, with no forecast, budget or hysteresis.
- ``pagedweight`` with ``kv_offload``: a victim of preemption is swapped to host memory
  rather than recomputed when its copies cost less time (``prefer_swap``).
- Static policies never change anything; ``kv-swap`` swaps KV instead (scheduler).
The plan never exceeds the budget counting pages in flight: an expert with an upgrade in flight
is pinned at its target and its old pages still count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from itertools import repeat
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from pagedweight.core.kv_blocks import KvBlockAllocator
from pagedweight.core.pagetable import ExpertPageTable
from pagedweight.core.pool import OWNER_KV, OWNER_PINNED
from pagedweight.core.spec import PRECISION_ID, PRECISION_NAMES
from pagedweight.errors import ConfigError
from pagedweight.policy.allocate import Plan, Problem, paper_greedy
from pagedweight.policy.hull import MarginalPlanner
from pagedweight.policy.importance import ImportanceTable, RoutingTracker
from pagedweight.policy.kv_offload import KvOffload
from pagedweight.policy.latency_cap import StepShapeFit, StepTimeModel, largest_budget_within
from pagedweight.policy.serving_order import QueueWatch, defer_late, projected_wait_s
from pagedweight.policy.step_stats import StepStats

if TYPE_CHECKING:
    from pagedweight.core.scheduler import Request


class ChangeKind(Enum):
    """What a precision change does; ``value`` is the name written to transitions.csv."""

    DOWNGRADE = "downgrade"  # fewer bits: quantised into new pages and flipped at once
    UPGRADE = "upgrade"  # more bits: copied from the host master, flipped when it has landed
    ABORT = "abort"  # an upgrade in flight abandoned; its new pages are released


DOWNGRADE, UPGRADE, ABORT = ChangeKind.DOWNGRADE, ChangeKind.UPGRADE, ChangeKind.ABORT
ROUTED_BLOCK_STEPS = 256


class Change(NamedTuple):
    """One precision change a plan asks for (a named tuple: plans of a 6,144-expert model make
    hundreds a step, and a tuple is built several times faster than a frozen dataclass)."""

    kind: ChangeKind
    expert: int  # flat index: moe_layer * num_experts + expert
    to_id: int  # PRECISION_ID code (for ABORT: the precision it keeps)


def changes_of(kind: ChangeKind, experts: list[int], to_ids: list[int]) -> list[Change]:
    """``Change(kind, e, t)`` for each pair, built without a Python call per change (the
    named tuple's constructor is a Python function: ~0.4 us each, and paper-greedy's plans on a
    6,144-expert model make millions an hour)."""
    return list(map(tuple.__new__, repeat(Change), zip(repeat(kind), experts, to_ids)))


@dataclass(frozen=True)
class ControllerSettings:
    horizon_steps: int = 32
    low_watermark: float = 0.02
    high_watermark: float = 0.10
    copy_budget_bytes_per_s: float = 16 * 10**9
    max_in_flight_bytes: int = 2 * 2**30
    min_dwell_s: float = 2.0
    # Steps closer together than this share one plan (pressure is still handled at once by
    # on_pressure). Planning every ~25 ms decode step cost a third of the simulator's time.
    plan_interval_s: float = 0.05
    # Re-scale the offline losses by the routing EMA this often (0: never). Rebuilding the
    # planner costs ~1 ms for Mixtral, ~20 ms at DeepSeek-V3 scale.
    rescale_interval_s: float = 10.0
    # Speed in the objective (pagedweight, when the runtime gives a step-time model): no step
    # predicted past this TPOT when a cheaper precision map meets it (None: memory only). Set
    # from the scenario's slo.tpot_ms.
    tpot_slo_s: float | None = None
    # Upgrades only while their plan's step is predicted within (1 - margin) of the SLO.
    latency_margin: float = 0.1
    # Prefix caching under pagedweight: the exchange rate between recompute time and quality.
    # Keeping the GPU busy recomputing evicted prefixes all the time (1 s of recompute per
    # second) is counted as bad as this many times the loss of the whole precision ladder
    # (every expert at its lowest precision instead of its highest, the table's own units).
    # 1.0: the two worst cases of their axes weigh the same, so a cached page is kept while
    # the fraction of GPU time its reuse saves is larger than the fraction of the ladder's loss
    # the downgrade sparing it would cost. 0: cached blocks always give way first (vLLM's rule,
    # which every other policy keeps).
    recompute_weight: float = 1.0
    # Serving under the SLOs (pagedweight; see latency_cap.py and docs/DESIGN.md). Set from the
    # scenario's slo.ttft_ms: what a waiting request may wait for its first token (None: off).
    ttft_slo_s: float | None = None
    # Backlog: when the queue's projected wait (the oldest on-time request's wait so far plus the
    # queued prompts' prefill at the recent seconds per token) passes this fraction of the TTFT
    # SLO, speed is worth more than precision: the experts go to the precision whose step is
    # fastest for a step that prefills, and stay there (no upgrades) until the projected wait
    # has stayed under half of it for ``backlog_calm_s``.
    backlog_fraction: float = 0.5
    backlog_calm_s: float = 20.0
    # SLO-aware batches under a TPOT SLO: each step's prefill tokens and the running batch are
    # capped where the learnt step-time model predicts (1 - latency_margin) of the SLO (at least
    # ``min_prefill_tokens`` of prefill a step, so the queue always moves); under a TTFT SLO the
    # requests that have already missed it wait behind those that can still meet it.
    slo_batching: bool = True
    min_prefill_tokens: int = 256
    # A cap on how long a late request waits behind on-time ones: once it has waited this long
    # since its arrival it is served in arrival order ahead of them (None: no cap, goodput
    # first; a cap bounds the TTFT tail of the late ones, and under an overload that outlasts it
    # serves everyone late again, as FCFS does).
    late_wait_max_s: float | None = None
    # KV offload (pagedweight): a request preempted when even the downgrades leave KV short is
    # swapped to host memory instead of recomputed when copying its KV out and back costs less
    # time than recomputing it (``Controller.prefer_swap``; the scheduler's ``cost`` mode).
    kv_offload: bool = False

    def __post_init__(self) -> None:
        if not self.recompute_weight >= 0:
            raise ConfigError(f"controller.recompute_weight(={self.recompute_weight}) must be >= 0")
        if not 0 < self.backlog_fraction <= 1:
            raise ConfigError(f"controller.backlog_fraction(={self.backlog_fraction}) must be in (0, 1]")
        if not self.backlog_calm_s >= 0:
            raise ConfigError(f"controller.backlog_calm_s(={self.backlog_calm_s}) must be >= 0")
        if self.min_prefill_tokens < 1:
            raise ConfigError(f"controller.min_prefill_tokens(={self.min_prefill_tokens}) must be >= 1")
        if self.late_wait_max_s is not None and not self.late_wait_max_s > 0:
            raise ConfigError(f"controller.late_wait_max_s(={self.late_wait_max_s}) must be > 0 (or null: no cap)")


class Controller:
    """Dynamic precision for one run. ``mode`` is ``pagedweight`` or ``paper-greedy``."""

    def __init__(
        self,
        mode: str,
        settings: ControllerSettings,
        table: ImportanceTable,
        page_table: ExpertPageTable,
        kv: KvBlockAllocator,
        forecast_blocks=None,
    ):
        if mode not in ("pagedweight", "paper-greedy"):
            raise ConfigError(f"mode(={mode!r}) must be 'pagedweight' or 'paper-greedy'")
        self.mode = mode
        self.settings = settings
        self.page_table = page_table
        self.pool = page_table.pool
        self.kv = kv
        self.forecast_blocks = forecast_blocks or (lambda horizon_steps: 0)
        self.ladder_ids = np.array([PRECISION_ID[p] for p in table.ladder], dtype=np.int64)
        # Allocate in pages, not bytes: what a plan costs is the pages its experts occupy.
        page_bytes = self.pool.page_bytes
        self._page_bytes_grid = page_table.pages_by_id[self.ladder_ids][None, :].repeat(table.num_rows, 0) * page_bytes
        self._use_table(table)
        # Online drift (pagedweight only): routing counts accumulate here and are folded into
        # the tracker's EMA when the table is re-scaled, every ``rescale_interval_s``.
        self.tracker = RoutingTracker(table) if mode == "pagedweight" and settings.rescale_interval_s > 0 else None
        self._routed = np.zeros((table.num_layers, table.num_experts))
        self._routed_pending: list[np.ndarray] = []  # integer counts not yet added to _routed
        self._last_rescale_s = 0.0
        self._rebalance = False
        # Ladder level of each precision id (0 = most precise); ids outside the ladder count as
        # the top level, which only matters for experts a static start put there.
        self._level_of_id = np.zeros(len(PRECISION_NAMES), dtype=np.int64)
        self._level_of_id[self.ladder_ids] = np.arange(len(self.ladder_ids))
        self.last_change_s = np.full(page_table.num_experts, -np.inf)
        self._copy_credit_bytes = float(settings.max_in_flight_bytes)
        self._last_plan_s: float | None = None
        # Re-planning upgrades costs a solve (~30 us for Mixtral, ~0.3 ms at DeepSeek-V3 scale);
        # redo it only when memory moved by at least one expert's smallest step, or when the
        # last plan left upgrades waiting (for copy budget or for an expert's dwell time).
        self._planned_for: tuple[int, int] | None = None  # (room, weight pages) of the last upgrade plan
        steps = np.diff(np.sort(np.unique(page_table.pages_by_id[self.ladder_ids])))
        self._replan_pages = int(steps.min()) if len(steps) else 1
        self._upgrades_pending = False
        # No plan gives an expert more pages than the ladder's largest option: while every
        # expert has that many, an upgrade plan (a solve) can only come back empty.
        self._top_pages = int(page_table.pages_by_id[self.ladder_ids].max())
        self._at_top: tuple[int, bool] | None = None  # (page-table version, all experts at the top)
        self._pinned: tuple | None = None  # (table, pins, problem, planner, min bytes) of the last pinned plan
        # Set by the runtime (RuntimeCore.set_step_time_model): a step's predicted seconds for a
        # precision map. With settings.tpot_slo_s it puts speed in the objective (latency_cap.py).
        self.step_time_s: StepTimeModel | None = None
        self._floor_ids = np.full(page_table.num_experts, self.ladder_ids[-1], dtype=page_table.precision_ids.dtype)
        # What the steps that ran say: the recent mean step (a decoding request's TPOT), seconds
        # per computed token, the last step, and under a TPOT SLO the step time by shape.
        ok = mode == "pagedweight" and settings.slo_batching and settings.tpot_slo_s is not None
        self.steps = StepStats(StepShapeFit() if ok else None)
        # Prefix cache against downgrades (pagedweight; RuntimeCore turns on the allocator's
        # ghost list when prefix caching is on): the weight pages worth more than the cache's
        # pages at its current value (the lowest that protection may push the weights to; None
        # while nothing is protected).
        self._weights_over_cache_pages: int | None = None
        # Set by the runtime (RuntimeCore.set_copy_time_model): seconds to copy so many bytes
        # between host and device, for ``prefer_swap`` (None: never swap).
        self.copy_time_s: Callable[[int], float] | None = None
        self.offload = KvOffload(kv)
        # Serving under the SLOs (pagedweight): the scheduler whose queue and batch the controller
        # reads (set by RuntimeCore), and the queue's backlog and pressure (under a TTFT SLO).
        self.scheduler = None
        ttft_s = settings.ttft_slo_s
        self.queue: QueueWatch | None = None
        if ttft_s is not None:
            self.queue = QueueWatch(settings.backlog_fraction * ttft_s, settings.backlog_calm_s)
        self._deferring = False  # late requests were moved behind on-time ones
        self._speed_level: int | None = None  # the backlog's precision (ladder level), None: none
        self._speed_chosen_s = -np.inf

    def _use_table(self, table: ImportanceTable) -> None:
        self.table = table.replace(bytes=self._page_bytes_grid)
        self._problem = Problem.build(self.table)
        self._planner = MarginalPlanner(self._problem) if self.mode == "pagedweight" else None

    def observe_routing(self, tokens_per_expert: np.ndarray) -> None:
        """One step's routing, (layers, experts) token counts. Integer counts are kept and added
        up in blocks (one numpy call per step cost 2% of a simulated hour; integer sums are
        exact in any order); the caller must not change the array afterwards."""
        if self.tracker is None:
            return
        if tokens_per_expert.dtype.kind in "iu":
            self._routed_pending.append(tokens_per_expert)
            if len(self._routed_pending) >= ROUTED_BLOCK_STEPS:
                self._fold_routed()
        else:
            self._fold_routed()
            self._routed += tokens_per_expert

    def _fold_routed(self) -> None:
        pending = self._routed_pending
        if pending:
            if len(pending) == 1:
                self._routed += pending[0]
            else:  # joined by np.concatenate (C): np.stack checked each array in Python, 4x slower
                self._routed += np.add.reduce(np.concatenate(pending).reshape(len(pending), *pending[0].shape))
            pending.clear()

    def _maybe_rescale(self, now_s: float) -> None:
        if self.tracker is None or now_s - self._last_rescale_s < self.settings.rescale_interval_s:
            return
        self._last_rescale_s = now_s
        self._fold_routed()
        if self._routed.any():
            self.tracker.observe(self._routed)
            self._routed[:] = 0
            self._use_table(self.tracker.rescaled())
            self._planned_for = None  # losses moved: the next plan may move precision
            self._rebalance = True

    # ---- accounting -------------------------------------------------------------------------
    def weight_pages(self) -> int:
        """Pages held by routed experts, including upgrades in flight (old and new pages)."""
        return self.pool.num_weight_pages() + self._in_flight_pages()

    def _in_flight_pages(self) -> int:
        """New pages of the upgrades in flight."""
        return sum(len(t.pages) for t in self.page_table.in_flight.values())

    def _available_weight_pages(self, extra_kv_pages: int, headroom_pages: int) -> int:
        """Pages weights may hold: the pool less pinned weights, KV held, ``extra_kv_pages``,
        ``headroom_pages`` and the downgrade reserve. Cached prefix pages count as available."""
        pool = self.pool
        kv_pages = pool.num_owned(OWNER_KV) + extra_kv_pages
        return pool.num_pages - pool.num_owned(OWNER_PINNED) - kv_pages - headroom_pages - self.kv.reserve_pages

    # ---- prefix cache against downgrades (pagedweight) --------------------------------------------
    def cache_page_value(self, now_s: float) -> float:
        """What keeping one page of the cached blocks next in line for eviction is worth, in
        loss units: its blocks' expected reuse (ghost hits per second per block) times the
        seconds their tokens' prefill costs, priced by ``recompute_weight`` x the ladder's loss
        span, and under a TTFT SLO by how hard the queue has pressed lately
        (``QueueWatch.pressure``). 0 when nothing has been observed yet, or under a TTFT SLO
        before the queue has ever pressed: then the cache gives way first."""
        kv, ghosts = self.kv, self.kv.ghosts
        token_s = self.steps.token_ema_s
        if ghosts is None or token_s <= 0 or self._planner is None:
            return 0.0
        pressure = 1.0
        if self._backlog_on():
            # Under a TTFT SLO, recompute time is worth quality only as far as it can cost a
            # first token its SLO: in proportion to how hard the queue has pressed lately. With
            # the queue calm, a recomputed prefix delays an answer that is well inside the SLO
            # anyway, and the cache gives way first, as in vLLM's order.
            pressure = self.queue.pressure
            if pressure <= 0.0:
                return 0.0
        recompute_s_per_s = ghosts.hit_rate_per_block(now_s) * token_s * kv.block_tokens
        weight = pressure * self.settings.recompute_weight
        return weight * self._planner.loss_span * recompute_s_per_s * kv.blocks_per_page

    def _protect(self, room_pages: int, now_s: float) -> int:
        """Protect the cached blocks worth more than the downgrades that would make room for them,
        given ``room_pages`` for weights and cache together; returns the pages protected. The
        weights keep first every plan step that recovers more loss per byte than a cached page
        is worth; the cache gets what is left, up to its size; steps worth less come after it."""
        kv = self.kv
        evictable = kv.num_cached_blocks
        value = self.cache_page_value(now_s) if evictable else 0.0
        if value <= 0.0:
            kv.protected_blocks = 0
            self._weights_over_cache_pages = None
            return 0
        page_bytes = self.pool.page_bytes
        over = -(-self._planner.bytes_worth(value / page_bytes) // page_bytes)
        protected = min(evictable, max(0, room_pages - over) * kv.blocks_per_page)
        kv.protected_blocks = protected
        self._weights_over_cache_pages = over if protected else None
        return -(-protected // kv.blocks_per_page)

    def _pins(self) -> np.ndarray | None:
        if not self.page_table.in_flight:
            return None
        pins = np.full(self.page_table.num_experts, -1, dtype=np.int64)
        for e, t in self.page_table.in_flight.items():
            pins[e] = t.to_id
        return pins

    def _plan(self, budget_pages: int) -> Plan | None:
        """The plan for a weight budget, or None if even the floor does not fit. Experts with an
        upgrade in flight are pinned at its target."""
        in_flight = self.page_table.in_flight
        if not in_flight:
            return self._plan_without_in_flight(budget_pages)
        # Old pages of in-flight experts are still held: they come off the budget.
        budget_pages -= sum(len(self.page_table.pages[e]) for e in in_flight)
        budget_bytes = budget_pages * self.pool.page_bytes
        # The problem (and its planner: ~0.4 ms to build) depends only on the table and the pins,
        # which often stay the same while upgrades are in flight; a plan is a pure function of
        # the problem and the budget, so a kept planner gives the plan a new one would.
        pins = self._pins()
        key = pins.tobytes()
        cached = self._pinned
        if cached is None or cached[0] is not self.table or cached[1] != key:
            problem = Problem.build(self.table, pinned=pins)
            planner = MarginalPlanner(problem) if self.mode == "pagedweight" else None
            cached = self._pinned = (self.table, key, problem, planner, int(problem.min_bytes.sum()))
        _, _, problem, planner, min_bytes = cached
        if budget_bytes < min_bytes:
            return None
        if self.mode == "paper-greedy":
            return paper_greedy(problem, budget_bytes)
        return planner.plan(budget_bytes)

    # ---- the two entry points ---------------------------------------------------------------
    def on_pressure(self, blocks_short: int, now_s: float) -> list[Change]:
        """KV is ``blocks_short`` blocks short right now: free pages before anyone is preempted.
        Upgrades in flight are abandoned first (their new pages come back at once)."""
        kv = self.kv
        need_pages = -(-blocks_short // kv.blocks_per_page)
        in_flight_pages = self._in_flight_pages()
        margin = int(self.settings.low_watermark * self.pool.num_pages) if self.mode == "pagedweight" else 0
        weights = self.pool.num_weight_pages()
        floor = self._weights_over_cache_pages
        if floor is not None and kv.num_protected_blocks:
            # Downgrades below ``floor`` cost more than the protected cache they would spare:
            # that part of the shortage is met by evicting cached blocks instead. What is short
            # beyond the protected blocks still comes from downgrades, whatever they cost:
            # protection never makes the scheduler preempt.
            cheap_blocks = (max(0, weights - floor) + in_flight_pages) * kv.blocks_per_page
            if blocks_short > cheap_blocks:
                give = min(kv.num_protected_blocks, blocks_short - cheap_blocks)
                kv.unprotect(give)
                blocks_short -= give
                need_pages = -(-blocks_short // kv.blocks_per_page)
            if blocks_short <= 0:
                return []
            margin = min(margin, max(0, weights - max(0, need_pages - in_flight_pages) - floor))
        budget = weights - max(0, need_pages - in_flight_pages)
        changes = self._shrink_to(budget - margin, fallback_pages=budget)
        self._mark(changes, now_s)
        return changes

    def plan_step(self, now_s: float) -> list[Change]:
        """Once per step: downgrade ahead of forecast KV growth, upgrade when memory allows."""
        s = self.settings
        if self._last_plan_s is not None and now_s - self._last_plan_s < s.plan_interval_s:
            return []
        dt = 0.0 if self._last_plan_s is None else now_s - self._last_plan_s
        self._last_plan_s = now_s
        self._maybe_rescale(now_s)
        self._copy_credit_bytes = min(s.max_in_flight_bytes, self._copy_credit_bytes + dt * s.copy_budget_bytes_per_s)
        if self.mode == "paper-greedy":
            room = self._available_weight_pages(0, 0)
            if room < self.weight_pages():
                changes = self._shrink_to(room)
            elif self._all_at_top():
                changes = []
            else:
                plan = self._plan(room)
                changes = self._upgrades_to(plan, now_s, budgeted=False) if plan is not None else []
            self._mark(changes, now_s)
            return changes
        forecast_pages = -(-self.forecast_blocks(s.horizon_steps) // self.kv.blocks_per_page)
        low = int(s.low_watermark * self.pool.num_pages)
        high = int(s.high_watermark * self.pool.num_pages)
        room = self._available_weight_pages(forecast_pages, low)
        self.steps.refit()
        backlog = self._update_backlog(now_s)
        if self.kv.ghosts is not None:
            room -= self._protect(room, now_s)
        spare = room - self.weight_pages()
        if spare < 0:
            changes = self._shrink_to(room)
        elif spare > high - low and (self._memory_moved(room) or self._upgrades_pending):
            # Hysteresis: only memory beyond the high watermark goes back to weights.
            self._planned_for = (room, self.pool.num_weight_pages())
            if self._all_at_top():
                changes = []
            else:
                budget = self._speed_capped(room - (high - low), 1.0 - s.latency_margin)
                plan = self._plan(budget)
                if plan is not None and backlog:
                    # Speed is worth more than precision: upgrades only up to the backlog's
                    # precision (none before it is chosen).
                    ids = self._at_most_speed_level(plan.precision_ids)
                    plan = None if ids is None else replace(plan, precision_ids=ids)
                changes = self._upgrades_to(plan, now_s, budgeted=True) if plan is not None else []
        elif self._rebalance and not self.page_table.in_flight and not backlog:
            changes = self._rebalanced(now_s)
        else:
            changes = []
        if not changes and backlog and self.steps.last_prefill_tokens >= s.min_prefill_tokens:
            changes = self._backlog_downgrades(now_s)
        if not changes:
            changes = self._speed_downgrades()
        self._mark(changes, now_s)
        return changes

    # ---- speed in the objective (pagedweight; see latency_cap.py) -------------------------------
    def _speed_on(self) -> bool:
        return self.mode == "pagedweight" and self.step_time_s is not None and self.settings.tpot_slo_s is not None

    def _floor_pages(self) -> int:
        return -(-int(self._problem.min_bytes.sum()) // self.pool.page_bytes)

    def observe_step(self, duration_s: float, prefill_tokens: int = 0, decodes: int = 0) -> None:
        """A step's duration and shape (``StepStats``): each running request got one token from
        it, so the recent mean is the TPOT a decoding request sees; a prefill-heavy step also
        gives the seconds a computed token costs (what a cached block saves)."""
        self.steps.observe(duration_s, prefill_tokens, decodes)

    def prefer_swap(self, req: Request) -> bool:
        """KV offload (``kv_offload``; the scheduler asks for each victim of a preemption):
        whether swapping ``req`` costs less time than recomputing it (``KvOffload``)."""
        sched = self.scheduler
        caching = sched is not None and sched.prefix_caching
        return self.offload.prefer_swap(req, self.steps.prefill_token_s(), self.copy_time_s, caching)

    def observe_readmissions(self) -> None:
        """After a schedule: what the readmitted recomputed victims found in the cache."""
        self.offload.observe_readmissions()

    def _tpot_model(self):
        """Predicted TPOT for a precision map: the recent mean step, plus what the runtime's model
        says the last step would have gained or lost with that map. Added, not scaled: the bytes
        are read once a step whatever else the step computes (a prefill chunk's compute is not
        made faster by smaller weights)."""
        base_s = self.steps.step_ema_s - self.step_time_s(self.page_table.precision_ids)
        return lambda ids: base_s + self.step_time_s(ids)

    def _speed_capped(self, budget_pages: int, slo_fraction: float) -> int:
        """``budget_pages``, or less if its plan's TPOT would exceed ``slo_fraction`` of the SLO
        and a smaller budget's would not."""
        if not self._speed_on() or self.steps.step_ema_s <= 0:
            return budget_pages
        limit_s = self.settings.tpot_slo_s * slo_fraction
        ids_of = self._plan_ids(pinned=True)
        cap = largest_budget_within(limit_s, self._tpot_model(), ids_of, self._floor_pages(), budget_pages)
        return budget_pages if cap is None else cap

    def _speed_downgrades(self) -> list[Change]:
        """Downgrade when the current precisions make TPOT miss the SLO and a cheaper map would
        meet it."""
        slo_s = self.settings.tpot_slo_s
        if not self._speed_on() or self.steps.step_ema_s <= slo_s:
            return []
        weights = self.pool.num_weight_pages()
        floor = self._floor_pages()
        tpot = self._tpot_model()
        # Every expert at the ladder's bottom: if even that misses the SLO (long prefill chunks
        # are compute-bound), precision cannot meet it and memory alone decides.
        if floor >= weights or tpot(self._floor_ids) > slo_s:
            return []
        ids_of = self._plan_ids(pinned=False)
        cap = largest_budget_within(slo_s, tpot, ids_of, floor, weights - 1)
        if cap is None:
            return []
        # The mean lags the change: count the steps to come at their predicted time, or the
        # next plans would downgrade again for steps already made faster.
        self.steps.step_ema_s = tpot(ids_of(cap))
        return self._shrink_to(cap)

    # ---- serving under the SLOs (pagedweight): backlog, batch limits, late requests --------------
    def _backlog_on(self) -> bool:
        return (
            self.mode == "pagedweight"
            and self.queue is not None
            and self.scheduler is not None
            and self.step_time_s is not None
        )

    def queue_wait_s(self, now_s: float) -> float:
        """The queue's projected wait for a first token (``serving_order.projected_wait_s``)."""
        return projected_wait_s(self.scheduler.waiting, now_s, self.settings.ttft_slo_s, self.steps.prefill_token_s())

    def _update_backlog(self, now_s: float) -> bool:
        """Whether the queue is in backlog now (``QueueWatch``: on past ``backlog_fraction`` of
        the TTFT SLO, off after ``backlog_calm_s`` under half of it). When a backlog ends, its
        precision is dropped and upgrades may go above it again."""
        if not self._backlog_on():
            return False
        queue = self.queue
        if queue.update(now_s, self.queue_wait_s(now_s) if self.scheduler.waiting else 0.0):
            self._speed_level = None
            self._planned_for = None  # upgrades may go above the backlog's precision again
        return queue.backlog

    @property
    def backlog(self) -> bool:
        return self.queue is not None and self.queue.backlog

    @property
    def queue_pressure(self) -> float:
        """How hard the queue has pressed lately, in [0, 1] (``QueueWatch.pressure``)."""
        return 0.0 if self.queue is None else self.queue.pressure

    def _at_most_speed_level(self, target_ids: np.ndarray) -> np.ndarray | None:
        """A plan's precisions under backlog: none above the backlog's precision, and that
        precision where the plan chose another of the same pages (as fast to read, and it was
        chosen for computing faster). None before the backlog's precision is chosen."""
        lvl = self._speed_level
        if lvl is None:
            return None
        to_id = self.ladder_ids[lvl]
        pages = self.page_table.pages_by_id
        out = target_ids.copy()
        out[(self._level_of_id[out] < lvl) | (pages[out] == pages[to_id])] = to_id
        return out

    def _backlog_downgrades(self, now_s: float) -> list[Change]:
        """Under backlog: choose the ladder's fastest precision for the last step's shape (one
        with at least ``min_prefill_tokens`` of prefill: a queue waits for prefill), every expert
        at it, by the runtime's step-time model (a memory-bound decode step is fastest at the
        fewest bytes, a prefill-heavy one where the GPU computes fastest, e.g. FP8 MMAs); among
        precisions within 2% of the fastest, the least loss. The experts more precise than it go
        down to it; those below it come up to it only as upgrades do, when memory allows. The
        choice is made again at most once per ``min_dwell_s``, and kept unless another precision
        would make the step at least 10% faster (a mixed step may favour either)."""
        pt = self.page_table
        cur = pt.precision_ids
        if self._speed_level is None or now_s - self._speed_chosen_s >= self.settings.min_dwell_s:
            # Chosen again at most once per dwell time: each choice prices every ladder step.
            # The last step as it ran, plus what the model says each map changes: a model that
            # prices only the weights' bytes (the engine's) then compares whole steps too.
            self._speed_chosen_s = now_s
            base_s = max(0.0, self.steps.last_step_s - self.step_time_s(cur))
            options = []
            for lvl, pid in enumerate(self.ladder_ids.tolist()):
                ids = np.full_like(cur, pid)
                options.append((base_s + self.step_time_s(ids), float(self.table.dloss[:, lvl].sum()), lvl))
            fastest_s = min(o[0] for o in options)
            _, _, lvl = min((o for o in options if o[0] <= 1.02 * fastest_s), key=lambda o: o[1])
            held = self._speed_level
            if held is not None and options[lvl][0] > 0.9 * options[held][0]:
                lvl = held  # hysteresis: a new precision must make this step 10% faster
            if lvl != self._speed_level:
                self._speed_level = lvl
                self._planned_for = None  # the upgrade cap moved: plan again
        lvl = self._speed_level
        above = np.flatnonzero(self._level_of_id[cur] < lvl)
        if not len(above):
            return []
        to_id = int(self.ladder_ids[lvl])
        changes = [Change(ABORT, e, int(cur[e])) for e in pt.in_flight]
        return changes + [Change(DOWNGRADE, int(e), to_id) for e in above]

    def step_limits(self, now_s: float) -> tuple[int, int]:
        """The scheduler's limits for the step about to be batched (``Scheduler.step_limits``):
        tokens and running requests. Under a TPOT SLO, the prefill tokens and the running batch
        the learnt step model (``StepShapeFit``) predicts within (1 - latency_margin) of the SLO,
        never less than ``min_prefill_tokens`` of prefill beside the running requests' decodes,
        nor fewer requests than are running (at least one). Under a TTFT SLO, waiting requests
        that have already missed it go behind the others first (``serving_order.defer_late``)."""
        sched, s = self.scheduler, self.settings
        budget, max_seqs = sched.config.max_num_batched_tokens, sched.config.max_num_seqs
        if s.ttft_slo_s is not None and sched.waiting:
            self._deferring = defer_late(sched.waiting, now_s, s.ttft_slo_s, s.late_wait_max_s, self._deferring)
        fit = self.steps.fit
        if fit is None:
            return budget, max_seqs
        a, b, c = fit
        target_s = s.tpot_slo_s * (1.0 - s.latency_margin)
        n = len(sched.running)
        p_min = min(budget, s.min_prefill_tokens)
        if b > 0:
            prefill = (target_s - a - c * n) / b
            budget = min(budget, n + max(p_min, int(prefill)))
        if c > 0:
            seqs = (target_s - a - b * p_min) / c
            max_seqs = min(max_seqs, max(int(seqs), n, 1))
        return budget, max_seqs

    def _plan_ids(self, pinned: bool):
        plan = self._plan if pinned else self._plan_without_in_flight

        def ids_of(budget_pages: int):
            p = plan(budget_pages)
            return None if p is None else p.precision_ids

        return ids_of

    def _rebalanced(self, now_s: float) -> list[Change]:
        """Traffic moved (the losses were re-scaled): re-plan the weights' current pages, moving
        precision from experts no longer in use to those now in use. The downgrades free the
        pages the upgrades then take, so memory for KV does not shrink."""
        self._rebalance = False
        plan = self._plan_without_in_flight(self.pool.num_weight_pages())
        if plan is None:
            return []
        pages_by_id, current = self.page_table.pages_by_id, self.page_table.precision_ids
        downs = self._downgrades(plan)
        freed = sum(int(pages_by_id[current[c.expert]] - pages_by_id[c.to_id]) for c in downs)
        return downs + self._upgrades_to(plan, now_s, budgeted=True, extra_free_pages=freed)

    # ---- helpers ------------------------------------------------------------------------------
    def _all_at_top(self) -> bool:
        pt = self.page_table
        if self._at_top is None or self._at_top[0] != pt.version:
            self._at_top = (pt.version, bool((pt.pages_by_id[pt.precision_ids] >= self._top_pages).all()))
        return self._at_top[1]

    def _memory_moved(self, room: int) -> bool:
        if self._planned_for is None:
            return True
        last_room, last_weights = self._planned_for
        return abs(room - last_room) >= self._replan_pages or last_weights != self.pool.num_weight_pages()

    def _shrink_to(self, budget_pages: int, fallback_pages: int | None = None) -> list[Change]:
        """Abort upgrades in flight, then downgrade to the plan for ``budget_pages`` of weights
        (or ``fallback_pages``, or the lowest precisions, whichever first fits)."""
        pt = self.page_table
        in_flight = list(pt.in_flight)
        changes = changes_of(ABORT, in_flight, pt.precision_ids[in_flight].tolist()) if in_flight else []
        plan = self._plan_without_in_flight(budget_pages)
        if plan is None and fallback_pages is not None:
            plan = self._plan_without_in_flight(fallback_pages)
        if plan is None:
            plan = self._plan_without_in_flight(-(-int(self._problem.min_bytes.sum()) // self.pool.page_bytes))
        return changes + self._downgrades(plan)

    def _downgrades(self, plan: Plan) -> list[Change]:
        """The experts whose pages shrink under ``plan``, each moved to its planned precision."""
        pt = self.page_table
        rows = np.flatnonzero(pt.pages_by_id[plan.precision_ids] < pt.pages_by_id[pt.precision_ids])
        return changes_of(DOWNGRADE, rows.tolist(), plan.precision_ids[rows].tolist())

    def _plan_without_in_flight(self, budget_pages: int) -> Plan | None:
        budget_bytes = budget_pages * self.pool.page_bytes
        if budget_bytes < int(self._problem.min_bytes.sum()):
            return None
        if self.mode == "paper-greedy":
            return paper_greedy(self._problem, budget_bytes)
        return self._planner.plan(budget_bytes)

    def _upgrades_to(self, plan: Plan, now_s: float, budgeted: bool, extra_free_pages: int = 0) -> list[Change]:
        pt = self.page_table
        current, target = pt.precision_ids, plan.precision_ids
        grow = np.flatnonzero(pt.pages_by_id[target] > pt.pages_by_id[current])
        if not len(grow):
            return []
        if budgeted:
            rested = now_s - self.last_change_s[grow] >= self.settings.min_dwell_s
            self._upgrades_pending = not rested.all()
            grow = grow[rested]
            if not len(grow):
                return []
            # Most loss recovered per byte first: the copy budget buys the best upgrades.
            cur_lv, tgt_lv = self._level_of_id[current[grow]], self._level_of_id[target[grow]]
            gain = self.table.dloss[grow, cur_lv] - self.table.dloss[grow, tgt_lv]
            cost = np.maximum(1, self.table.bytes[grow, tgt_lv])
            grow = grow[np.argsort(-gain / cost, kind="stable")]
        # Cached prefix pages count as free, less protected ones: an upgrade's allocation evicts
        # them (PagePool.reclaim).
        free = self.pool.num_available - self.kv.reserve_pages - self.kv.num_protected_pages + extra_free_pages
        in_flight = pt.in_flight
        if in_flight:  # already on their way
            grow = grow[~np.isin(grow, np.fromiter(in_flight, dtype=np.int64, count=len(in_flight)))]
        # In order, as far as the free pages (and, budgeted, the copy credit and the bytes in
        # flight) reach: the prefix whose running sums stay within them. The sums are integers,
        # so they are the loop's own (the credit, a float, loses nothing by whole bytes: it only
        # shrinks, and its fraction keeps its place).
        to_ids = target[grow]
        num = np.searchsorted(np.cumsum(pt.pages_by_id[to_ids]), free, side="right")
        if budgeted:
            in_flight_bytes = sum(t.num_bytes for t in in_flight.values())
            cum_bytes = np.cumsum(pt.bytes_by_id[to_ids])
            limit = min(self._copy_credit_bytes, self.settings.max_in_flight_bytes - in_flight_bytes)
            num_budget = np.searchsorted(cum_bytes, limit, side="right")
            if num_budget < num:  # the copy budget stops it before the pages do
                self._upgrades_pending = True
                num = num_budget
            if num:
                self._copy_credit_bytes -= int(cum_bytes[num - 1])
        return changes_of(UPGRADE, grow[:num].tolist(), to_ids[:num].tolist())

    def _mark(self, changes: list[Change], now_s: float) -> None:
        if changes:
            self.last_change_s[[c.expert for c in changes if c.kind is not ABORT]] = now_s
