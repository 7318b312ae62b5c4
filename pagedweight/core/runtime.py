"""What both runtimes hold and do for one policy: pool, page table, KV allocator, scheduler and
controller, built the same way, and the step loop that drives them, written once.

One step (``RuntimeCore.step``)::

    backend.poll()                      upgrades whose copy has landed flip
    controller.plan_step(now)           precision changes: downgrades now, upgrades under budget
    scheduler.schedule(now)             the batch; KV pressure first downgrades (controller.on_pressure),
                                        then preempts (``decide_batch``, which a runtime may replace)
    execute(step)                       the runtime: pwsim times the step from its latency model and
                                        samples routing; pwgpu runs the forward pass, counts the
                                        router's choices and samples tokens. Either reports the
    step.observe_routing(counts)        tokens per expert to the controller's drift tracker
    (the step's time passes)            pwsim: a SimPy timeout; pwgpu: it already has
    scheduler.finish_step(now)          tokens appended, finished requests released
    record_step                         one row of steps.csv

A runtime supplies only a clock, its ``execute`` and a ``TransitionBackend``, the physical part
of a precision change: ``pwsim``'s backend queues upgrades on its simulated copy engine (a
downgrade's quantise time is charged to the step that made it, in its ``execute``); ``pwgpu``'s
quantises on the device and copies from the host master on a side stream. Everything else, including the order of
operations within a change (reserve new pages, fill them, flip, free the old) and the stall
check, lives here once.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from pagedweight.core.kv_blocks import KvBlockAllocator
from pagedweight.core.pagetable import ExpertPageTable, Transition, expert_pages_by_id
from pagedweight.core.pool import OWNER_PINNED, PagePool
from pagedweight.core.scheduler import Batch, Request, Scheduler, SchedulerConfig
from pagedweight.core.spec import PRECISION_ID, PRECISION_NAMES, ModelSpec
from pagedweight.core.step import StepShape
from pagedweight.core.transition_log import TransitionLog
from pagedweight.errors import ConfigError, PagedWeightError, PoolExhausted
from pagedweight.policy.controller import (
    ABORT,
    DOWNGRADE,
    UPGRADE,
    Change,
    ChangeKind,
    Controller,
    ControllerSettings,
)
from pagedweight.policy.importance import ImportanceTable, on_ladder
from pagedweight.policy.latency_cap import WeightReadStepTime
from pagedweight.policy.policies import DYNAMIC_POLICIES, policy_ladder, setup_policy
from pagedweight.results.metrics import StepRecorder

# Pages of at least 32 KiB when a runtime derives the page size: small enough that a tiny
# model's expert matrices span several pages (so a downgrade frees some), large enough for a KV block.
MIN_DERIVED_PAGE_BYTES = 1 << 15


class TransitionBackend(Protocol):
    def downgrade(self, t: Transition) -> None:
        """Fill ``t.pages`` with expert ``t.expert`` at ``t.to_id`` before the flip (synchronous)."""

    def start_upgrade(self, t: Transition) -> None:
        """Start filling ``t.pages`` from the host master; ``RuntimeCore.complete_upgrade`` flips
        it once the bytes have landed (from ``poll``, or when the runtime's copy engine says so)."""

    def abort_upgrade(self, t: Transition) -> None:
        """Stop an upgrade; its pages are released right after."""

    def poll(self) -> None:
        """Complete every upgrade whose copy has landed; called at the start of each step."""


@dataclass(frozen=True, kw_only=True)
class CoreConfig:
    """Everything ``RuntimeCore`` needs besides the policy and the importance table, whoever
    says it: a scenario (``pagedweight.config.run.core_config``) or a command line. Each
    setting's default lives here (or in ``SchedulerConfig`` / ``ControllerSettings``) and
    nowhere else. ``None`` means derived from the model by ``for_model``."""

    budget_bytes: int  # the whole pool: pinned weights, routed experts and KV blocks
    model: ModelSpec | None = None  # None: the runtime's own (the engine: its checkpoint's)
    page_bytes: int | None = None  # None: the smallest power of two >= 32 KiB holding one KV block
    kv_block_tokens: int = 16
    # Keep the KV of full prompt blocks after their request ends and reuse it for requests with
    # the same prefix (vLLM's automatic prefix caching; on by default, as in production engines).
    prefix_caching: bool = True
    scheduler: SchedulerConfig = SchedulerConfig()  # max_model_len None: the model's context
    controller: ControllerSettings = ControllerSettings()
    # static-mixed: its fixed weight budget, as a fraction of every expert at the top precision.
    static_mixed_fraction: float = 0.5
    # paper-greedy's precisions; None: the paper's ladder (full, INT8, INT4) within the table's.
    paper_greedy_precisions: tuple[str, ...] | None = None
    # Keep only the newest this many steps and transitions (a server runs for days); None: all.
    history_window: int | None = None

    def for_model(self, model: ModelSpec) -> CoreConfig:
        """This configuration for ``model`` with every derived value filled in. If the
        configuration names a model (a scenario's), ``model`` must have its shape: both
        runtimes must count the same bytes."""
        if self.model is not None:
            _check_same_shape(self.model, model)
        page_bytes = self.page_bytes
        if page_bytes is None:
            block_bytes = self.kv_block_tokens * model.kv_bytes_per_token()
            page_bytes = max(MIN_DERIVED_PAGE_BYTES, 1 << (block_bytes - 1).bit_length())
        context = model.max_context_tokens
        max_len = min(self.scheduler.max_model_len or context, context)
        return replace(
            self, model=model, page_bytes=page_bytes, scheduler=replace(self.scheduler, max_model_len=max_len)
        )


def _check_same_shape(want: ModelSpec, got: ModelSpec) -> None:
    """What the pool, page table, scheduler and controller see of a model must agree."""
    facts = {
        "MoE layers": lambda m: m.num_moe_layers,
        "experts per layer": lambda m: m.num_experts,
        "top_k": lambda m: m.top_k,
        "expert matrices": lambda m: m.expert_matrices,
        "pinned bytes": lambda m: m.pinned_bytes(),
        "KV bytes per token": lambda m: m.kv_bytes_per_token(),
    }
    for what, fact in facts.items():
        if fact(want) != fact(got):
            hint = (
                f" ({want.name} counts {want.dtype_bytes}-byte weights and KV; this one {got.dtype_bytes})"
                if want.dtype_bytes != got.dtype_bytes
                else ""
            )
            raise ConfigError(
                f"model {got.name} ({got.source}) does not match the configured {want.name}: "
                f"{what} {fact(got)} vs {fact(want)}{hint}"
            )


@dataclass(slots=True, eq=False)
class Step:
    """One step as the core planned it. The runtime's ``execute`` reports the step's routing
    through ``observe_routing``; ``RuntimeCore.on_step`` sees the step once it is recorded."""

    core: RuntimeCore = field(repr=False)
    index: int  # its step_index in steps.csv (counted beyond a history window too)
    start_s: float
    batch: Batch
    shape: StepShape
    changes: list[Change]  # precision changes applied while planning and scheduling it
    routing: np.ndarray | None = None  # (MoE layers, experts) tokens routed to each expert

    def observe_routing(self, tokens_per_expert: np.ndarray) -> None:
        """Report the tokens each expert received in this step, (MoE layers, experts): the
        simulator's sampled counts, the engine's real ones. The controller's drift tracker sees
        them; every step must report them, once."""
        if self.routing is not None:
            raise PagedWeightError(f"step {self.index}: routing reported twice")
        self.routing = tokens_per_expert
        self.core.observe_routing(tokens_per_expert)


@dataclass(slots=True)
class Executed:
    """What a runtime's ``execute`` says about the step it ran, besides its routing."""

    duration_s: float | None = None  # None: measured on the runtime's clock, start to finish
    bytes_swapped: int = 0  # KV bytes moved between host and device (the kv-swap policy)
    # What the runtime waits on before the step finishes (pwsim: the SimPy timeout of its
    # duration); None when ``execute`` has already spent the step's time (pwgpu).
    wait: object = field(default=None)


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
        if cfg.model is None:
            raise ConfigError("RuntimeCore needs a CoreConfig with its model (CoreConfig.for_model)")
        self.config = cfg = cfg.for_model(cfg.model)
        model = cfg.model
        self.model, self.policy, self.backend, self.clock = model, policy, backend, clock
        self.pool = pool = PagePool(cfg.budget_bytes, cfg.page_bytes)
        pool.alloc(OWNER_PINNED, pool.pages_for_bytes(model.pinned_bytes()))
        pages_by_id = expert_pages_by_id(model, cfg.page_bytes)
        # The precisions this policy may use (paper-greedy: the paper's); the quality proxy
        # still reads the whole table, so every policy is scored on the same losses.
        self._quality = quality_matrix(table)
        own_ladder = policy_ladder(policy, table.ladder, cfg.paper_greedy_precisions)
        if own_ladder != table.ladder:
            table = on_ladder(table, own_ladder)
        self.ladder = table.ladder
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
        preemption = setup.preemption_mode
        if setup.controller_mode == "pagedweight" and cfg.controller.kv_offload:
            preemption = "cost"  # per victim: swap or recompute, whichever costs less (prefer_swap)
        sched_cfg = replace(cfg.scheduler, preemption_mode=preemption)
        self.scheduler = Scheduler(
            sched_cfg, self.kv, max_kv_pages * self.kv.blocks_per_page, prefix_caching=cfg.prefix_caching
        )
        self.controller: Controller | None = None
        self._weight_read: WeightReadStepTime | None = None  # the engine's step-time model, if used
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
            if preemption == "cost":
                self.scheduler.swap_preferred = self.controller.prefer_swap
            if setup.controller_mode == "pagedweight":
                # Serving under the SLOs: the controller reads the queue (backlog) and sets each
                # step's batch limits and the order of late requests (Controller.step_limits).
                self.controller.scheduler = self.scheduler
                ctl = cfg.controller
                if ctl.slo_batching and (ctl.tpot_slo_s is not None or ctl.ttft_slo_s is not None):
                    self.scheduler.step_limits = self.controller.step_limits
            # pagedweight weighs cached prefixes against downgrades by their observed reuse.
            if setup.controller_mode == "pagedweight" and cfg.prefix_caching and cfg.controller.recompute_weight > 0:
                self.kv.track_reuse()
        # What decides a step's batch at ``now_s``: this core's scheduler. A runtime whose cores
        # must agree on one batch (the engine's expert-parallel ranks, ``pwgpu.ep_agree``) puts
        # its own here: one core schedules, the others take its decision.
        self.decide_batch: Callable[[float], Batch] = self.scheduler.schedule
        self.quality_proxy = self.quality_recount()
        self.precision_grid = self.page_table.precision_ids.reshape(model.num_moe_layers, model.num_experts)
        # With a history window (a server runs for days) only the newest steps and transitions
        # are kept; the counts cover them all.
        window = cfg.history_window
        self.steps = StepRecorder(max_rows=window)
        self.transitions = TransitionLog(max_rows=window)
        self.num_transitions = dict.fromkeys(ChangeKind, 0)  # every change, beyond the window too
        # Called with every step once it is recorded (tests compare runtimes step by step).
        self.on_step: Callable[[Step], None] | None = None
        self._counters = [0, 0, 0, 0]  # downgrades, upgrades, bytes down, bytes up since the last step
        self._prefix_seen = (0, 0)  # prefix hit tokens and evicted blocks at the last step
        self._step_changes: list[Change] | None = None  # the changes of the step being planned

    # ---- requests -----------------------------------------------------------------------------
    def add(self, req: Request) -> bool:
        """Queue an arriving request. One that can never run is rejected and finishes now."""
        if self.scheduler.add(req):
            return True
        req.finish_s = self.clock()
        return False

    # ---- the step loop ----------------------------------------------------------------------
    def step(self, execute: Callable[[Step], Executed]) -> Generator[object, None, Step | None]:
        """One step (the sequence in the module docstring). Returns the step, or None when
        nothing could be computed (see ``check_stall``).

        A generator, so that a runtime on simulated time can let the step's time pass between
        ``execute`` and finishing: it yields ``Executed.wait`` when that is set (``pwsim``
        writes ``yield from core.step(...)`` in its SimPy process). A runtime whose ``execute``
        spends real time calls ``run_step`` instead."""
        self.backend.poll()
        start_s = self.clock()
        self._step_changes = changes = []
        self.plan_step()
        batch = self.decide_batch(start_s)
        self._step_changes = None
        if self.controller is not None:  # KV offload: what readmitted victims found in the cache
            self.controller.observe_readmissions()
        if not batch.requests:
            return None
        step = Step(self, self.steps.num_recorded, start_s, batch, batch.shape(), changes)
        executed = execute(step)
        if step.routing is None:
            raise PagedWeightError(f"{self.policy}: step {step.index} ran without reporting its routing")
        if executed.wait is not None:
            yield executed.wait
        end_s = self.clock()
        duration_s = end_s - start_s if executed.duration_s is None else executed.duration_s
        self.scheduler.finish_step(batch, end_s)
        self.record_step(start_s, duration_s, batch, step.shape, executed.bytes_swapped)
        if self.on_step is not None:
            self.on_step(step)
        return step

    def run_step(self, execute: Callable[[Step], Executed]) -> Step | None:
        """``step`` for a runtime whose ``execute`` has spent the step's time (nothing to wait on)."""
        gen = self.step(execute)
        try:
            waited = next(gen)
        except StopIteration as done:
            return done.value
        gen.close()
        raise PagedWeightError(f"run_step: execute asked to wait on {waited!r}; drive core.step instead")

    def check_stall(self, requests_coming: bool) -> None:
        """After a step that computed nothing: raise if no step can ever run again, i.e. requests
        wait, none runs (whose end would free KV), no upgrade is in flight (whose abort or flip
        changes memory) and no request is still to come."""
        sched = self.scheduler
        if requests_coming or sched.running or self.page_table.in_flight or not sched.waiting:
            return
        raise PagedWeightError(
            f"{self.policy}: stalled at t={self.clock():.3f}s with {len(sched.waiting)} requests waiting "
            "and no memory coming free"
        )

    def idle_tick(self) -> None:
        """What a runtime with nothing to compute may still do: flip landed upgrades and let the
        controller restore precision now that KV has room (no step is recorded)."""
        self.backend.poll()
        self.plan_step()

    def set_step_time_model(self, step_time_s) -> None:
        """Give the controller the runtime's prediction of a step's seconds for a precision map
        (flat ids per routed expert), which puts speed in its objective under a TPOT SLO."""
        if self.controller is not None:
            self.controller.step_time_s = step_time_s

    def set_copy_time_model(self, copy_time_s: Callable[[int], float]) -> None:
        """Give the controller the runtime's seconds to copy so many bytes between host and
        device (the simulator's latency model, the engine's PCIe bandwidth), which prices a
        swap against a recompute under ``kv_offload``."""
        if self.controller is not None:
            self.controller.copy_time_s = copy_time_s

    def use_weight_read_model(self, bandwidth_bytes_per_s: float) -> None:
        """For a runtime without a latency model (the engine): predict a map's step time from
        the bytes of the last step's active experts over ``bandwidth_bytes_per_s``
        (``latency_cap.WeightReadStepTime``), fed with every step's routing."""
        if self.controller is None:
            return
        self._weight_read = WeightReadStepTime(self.page_table.bytes_by_id, bandwidth_bytes_per_s)
        self.set_step_time_model(self._weight_read)

    # ---- precision changes --------------------------------------------------------------------
    def _on_pressure(self, blocks_short: int) -> None:
        kv = self.kv
        free_before = kv.num_free_blocks
        self.apply(self.controller.on_pressure(blocks_short, self.clock()))
        # Whatever the downgrades did not free (one found no room, or the floor is reached) comes
        # from the protected cached blocks: protection never makes the scheduler preempt.
        if kv.protected_blocks:
            still_short = blocks_short - (kv.num_free_blocks - free_before)
            if still_short > 0:
                kv.unprotect(still_short)

    def plan_step(self) -> None:
        if self.controller is not None:
            self.apply(self.controller.plan_step(self.clock()))

    def observe_routing(self, tokens_per_expert: np.ndarray) -> None:
        """Feed one step's routing counts (layers, experts) to the controller's drift tracker
        (and to the weight-read step-time model, where the runtime uses it)."""
        if self.controller is not None:
            self.controller.observe_routing(tokens_per_expert)
            if self._weight_read is not None:
                self._weight_read.observe(tokens_per_expert)

    def apply(self, changes: list[Change]) -> None:
        # A plan that aborts every upgrade in flight, or starts hundreds (paper-greedy re-plans
        # a 6,144-expert model at every change of KV), goes to the pool in one call per run of
        # aborts or upgrades; the result is what one change after another gives.
        i, n = 0, len(changes)
        while i < n:
            kind = changes[i].kind
            j = i + 1
            while j < n and changes[j].kind is kind:
                j += 1
            if j - i > 1 and kind is ABORT:
                self._abort_run(changes[i:j])
            elif j - i > 1 and kind is UPGRADE:
                self._apply_each(changes[i + self._upgrade_run(changes[i:j]) : j])
            else:
                self._apply_each(changes[i:j])
            i = j

    def _abort_run(self, changes: list[Change]) -> None:
        pt, applied = self.page_table, self._step_changes
        in_flight = pt.in_flight
        live, seen = [], set()
        for c in changes:  # each expert's first abort, in order (a repeat finds nothing in flight)
            if c.expert in in_flight and c.expert not in seen:
                seen.add(c.expert)
                live.append(c)
        backend = self.backend
        for c in live:
            backend.abort_upgrade(in_flight[c.expert])
        done = pt.abort_many([c.expert for c in live])
        per_layer = self.model.num_experts
        experts = [t.expert for t in done]
        self.num_transitions[ABORT] += len(done)
        self.transitions.extend(
            self.clock(), experts, [e // per_layer for e in experts], [t.from_id for t in done],
            [t.to_id for t in done], ABORT, [0] * len(done),
        )  # fmt: skip
        if applied is not None:
            applied.extend(live)

    def _upgrade_run(self, changes: list[Change]) -> int:
        """Begin the leading upgrades of a run that the pool's free pages cover, with one
        allocation (``ExpertPageTable.begin_many``); returns how many were begun."""
        started = self.page_table.begin_many([c.expert for c in changes], [c.to_id for c in changes])
        applied, backend = self._step_changes, self.backend
        for c, t in zip(changes, started, strict=False):
            backend.start_upgrade(t)
            if applied is not None:
                applied.append(c)
        return len(started)

    def _apply_each(self, changes: list[Change]) -> None:
        pt, applied = self.page_table, self._step_changes
        for c in changes:
            if c.kind is ABORT:
                t = pt.in_flight.get(c.expert)
                if t is not None:
                    self.backend.abort_upgrade(t)
                    pt.abort(c.expert)
                    self._log(t, ABORT, 0)
                    if applied is not None:
                        applied.append(c)
                continue
            try:
                t = pt.begin(c.expert, c.to_id)
            except PoolExhausted:
                continue  # no room this step; the controller plans again next step
            if c.kind is DOWNGRADE:
                self.backend.downgrade(t)
                pt.commit(c.expert)
                self._flipped(t)
                self._log(t, DOWNGRADE, t.num_bytes)
                self._counters[0] += 1
                self._counters[2] += t.num_bytes
            else:
                self.backend.start_upgrade(t)
            if applied is not None:
                applied.append(c)

    def complete_upgrade(self, t: Transition) -> bool:
        """The copy of ``t`` has landed: flip, unless it was aborted meanwhile."""
        if self.page_table.in_flight.get(t.expert) is not t:
            return False
        self.page_table.commit(t.expert)
        self._flipped(t)
        self._log(t, UPGRADE, t.num_bytes)
        self._counters[1] += 1
        self._counters[3] += t.num_bytes
        return True

    def _flipped(self, t: Transition) -> None:
        # One expert changed: update the quality proxy by its difference (a sum over every
        # expert after each upgrade cost 8% of a 6,144-expert run).
        self.quality_proxy += float(self._quality[t.expert, t.to_id] - self._quality[t.expert, t.from_id])

    def _log(self, t: Transition, kind: ChangeKind, num_bytes: int) -> None:
        e = t.expert
        self.num_transitions[kind] += 1
        self.transitions.append(self.clock(), e, e // self.model.num_experts, t.from_id, t.to_id, kind, num_bytes)

    def quality_recount(self) -> float:
        """The quality proxy summed afresh over every expert's current precision."""
        pt = self.page_table
        return float(self._quality[np.arange(pt.num_experts), pt.precision_ids].sum())

    # ---- steps ----------------------------------------------------------------------------------
    def record_step(
        self, start_s: float, duration_s: float, batch: Batch, shape: StepShape, bytes_swapped: int = 0
    ) -> None:
        """One row of steps.csv. ``bytes_swapped``: KV bytes the step moved between host and
        device (the kv-swap policy)."""
        sched, c, kv = self.scheduler, self._counters, self.kv
        # By position, in ``StepRecorder.record``'s order (keywords cost more than the row).
        self.steps.record(
            start_s,
            duration_s,
            len(sched.running),
            len(sched.waiting),
            shape.num_prefill_tokens,
            len(shape.decode_kv_lens),  # num_decodes
            len(batch.preempted),
            kv.num_used_blocks,
            kv.num_free_blocks,
            self.pool,
            c[0],  # num_downgrades
            c[1],  # num_upgrades
            c[2],  # bytes_downgraded
            c[3],  # bytes_upgraded
            bytes_swapped,
            self.quality_proxy,
            sched.prefix_hit_tokens - self._prefix_seen[0],  # prefix_hit_tokens
            kv.num_evicted_blocks - self._prefix_seen[1],  # kv_evicted_blocks
        )
        self._counters = [0, 0, 0, 0]
        if self.controller is not None:
            self.controller.observe_step(duration_s, shape.num_prefill_tokens, shape.num_decodes)
        self._prefix_seen = (sched.prefix_hit_tokens, kv.num_evicted_blocks)
