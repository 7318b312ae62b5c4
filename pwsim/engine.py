"""The SimPy runtime: one simulated engine running one policy over one request trace.

Processes (``env`` passed explicitly, one RNG per run):
- ``arrivals``: adds each trace request to the scheduler at its arrival time;
- ``engine``: the core's step loop (``RuntimeCore.step``), one SimPy timeout per step: the
  step's ``execute`` times it from the latency model and samples its routing;
- ``copy_engine``: host-to-device upgrades, one transfer at a time at the GPU's h2d bandwidth,
  overlapped with compute as on hardware; an upgrade flips when its copy completes.
- a CPU latency table (``pwsim.table_latency``) adds what the CPU engine does: each routed
  expert's fp32 copy made on its first use after a precision change (``dequantize``), and
  upgrades written inside the step that starts them (``upgrades: synchronous``: their quantise
  time is the step's, their copy lands at once and the expert flips for the next step).

Same-time ordering (tested): arrivals and copy completions at time t happen *before* an engine
step that starts at t, so a step sees every request that has arrived and every expert whose
copy has landed by its start. Both are scheduled URGENT; the engine's step timeouts are NORMAL,
and SimPy orders equal times by priority, then by scheduling order.

Pool, page table, scheduler and controller are ``pagedweight.core.runtime.RuntimeCore``, the same
object ``pwgpu`` drives; only the arithmetic is replaced by the latency model.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
from collections import deque

import numpy as np
import simpy
from simpy.core import URGENT
from simpy.events import Event

from pagedweight.core.pagetable import Transition
from pagedweight.core.prefix import TraceBlockKeys, own_block_keys
from pagedweight.core.runtime import CoreConfig, Executed, RuntimeCore, Step
from pagedweight.core.scheduler import Request
from pagedweight.policy.controller import DOWNGRADE, UPGRADE
from pagedweight.policy.importance import ImportanceTable
from pagedweight.workload.traces import RequestTrace
from pwsim.routing import RoutingSampler
from pwsim.routing_source import RoutingSource

# The simulator's pages move only between its own allocators, so the pool's per-call checks
# (``PagePool.validate``) are off unless this is "1" (the tests set it); every run still ends
# with the whole-state checks (``verify_memory``).
POOL_CHECKS_ENV = "PAGEDWEIGHT_POOL_CHECKS"


def pool_checks() -> bool:
    return os.environ.get(POOL_CHECKS_ENV) == "1"


def verify_memory(cores: list[RuntimeCore]) -> None:
    """The whole memory state of each core at the end of a run (``PagePool.check``,
    ``KvBlockAllocator.check``): a broken invariant fails the run even with the per-call checks
    off. O(pages + blocks) once per run."""
    for core in cores:
        core.pool.check()
        core.kv.check()


class UrgentTimeout(Event):
    """A timeout that fires before NORMAL events of the same time (see the module docstring)."""

    def __init__(self, env: simpy.Environment, delay_s: float):
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, URGENT, delay_s)


def replay_arrivals(env: simpy.Environment, trace, accept, close):
    """A SimPy process: each request of ``trace`` handed to ``accept`` at its arrival time (its
    id is its row), then ``close()`` (no more arrivals). One engine, an expert-parallel
    replica and a routed cluster all feed their requests this way."""
    for i in range(len(trace)):
        delay = float(trace.arrival_s[i]) - env.now
        if delay > 0:
            yield UrgentTimeout(env, delay)
        accept(Request(i, float(trace.arrival_s[i]), int(trace.prompt_tokens[i]), int(trace.output_tokens[i])))
    close()


class SimEngine:
    def __init__(
        self,
        cfg: CoreConfig,
        policy: str,
        trace: RequestTrace,
        table: ImportanceTable,
        latency,
        routing_kind: str,
        seed: int,
        routing_alpha: float = 1.0,
        env: simpy.Environment | None = None,
        routing: RoutingSource | None = None,
    ):
        """``routing``: where each step's tokens per expert come from; default: a
        ``RoutingSampler`` of ``routing_kind`` drawing from the run's RNG."""
        self.env = env or simpy.Environment()
        self.latency = latency
        self.trace = trace
        self.core = RuntimeCore(cfg, policy, table, self, clock=lambda: self.env.now)
        self.core.pool.validate = pool_checks()
        self.model = self.core.model
        if routing is None:
            rng = np.random.default_rng(seed)  # the run's one RNG
            freqs = table.grid(table.routing_freq) if routing_kind == "importance" else None
            routing = RoutingSampler(self.model, freqs, routing_kind, routing_alpha, rng)
        self.routing = routing
        self._last_step: tuple | None = None  # (shape, tokens per expert) of the last step
        self._predictors: dict[bytes, object] = {}  # latency-model copies by precision map
        self.core.set_step_time_model(self._predict_step_s)
        self.core.set_copy_time_model(latency.h2d_time_s)
        self.requests: list[Request] = []
        self.bytes_h2d = 0
        self._copy_queue: deque[Transition] = deque()
        self._copy_wake: Event | None = None
        self._engine_wake: Event | None = None
        self._arrivals_done = False
        self._trace_keys = None  # TraceBlockKeys of the trace, built on first use
        self._kv_bytes_per_token = self.model.kv_bytes_per_token()
        # A CPU latency table (pwsim.table_latency): the engine keeps a dense copy of each expert,
        # made for every expert when it is built and again on an expert's first use after each
        # precision change, and writes upgrades inside the step that starts them (no copy stream).
        self._dequantize = bool(getattr(latency, "has_dequantize", False))
        self._sync_upgrades = bool(getattr(latency, "synchronous_upgrades", False))
        self._copy_current = np.ones(self.model.num_moe_layers * self.model.num_experts, dtype=bool)
        self._expert_dequantize_s: dict[int, float] = {}

    # ---- TransitionBackend: what a precision change costs in simulated time -------------------
    def downgrade(self, t: Transition) -> None:
        self._copy_current[t.expert] = False  # its quantise time is charged to the step that made it

    def poll(self) -> None:
        pass  # the copy engine flips each upgrade when its copy lands (``copy_engine``)

    def start_upgrade(self, t: Transition) -> None:
        self._copy_queue.append(t)
        if self._copy_wake is not None and not self._copy_wake.triggered:
            self._copy_wake.succeed()

    def abort_upgrade(self, t: Transition) -> None:
        pass  # the copy engine sees the transition is no longer in flight and drops it

    # ---- processes --------------------------------------------------------------------------------
    @property
    def cores(self) -> list[RuntimeCore]:
        return [self.core]

    def accept(self, req: Request) -> None:
        """A request arrives now (from ``arrivals``, or from a cluster's router); its id is its
        row in ``self.trace``."""
        if self.core.scheduler.prefix_caching and req.block_hashes is None:
            req.block_hashes, req.private_from = self._block_keys(req)
        self.requests.append(req)
        self.core.add(req)
        self._wake_engine()

    def close_arrivals(self) -> None:
        """No request will arrive any more: the engine ends when the last one is done."""
        self._arrivals_done = True
        self._wake_engine()

    def _block_keys(self, req: Request):
        """(keys, the first key no other request has): prefix caching keys blocks by the trace's
        block ids; without them requests share nothing, but a preempted request finds its own
        blocks again (keys of its own; pagedweight.core.prefix)."""
        block_tokens = self.core.kv.block_tokens
        tr = self.trace
        if tr.hash_ids is not None and req.request_id < len(tr):
            if self._trace_keys is None:
                self._trace_keys = TraceBlockKeys(tr.hash_ids)
            keys = self._trace_keys
            return (
                keys.keys(req.request_id, req.prompt_tokens, block_tokens),
                keys.private_from(req.request_id, req.prompt_tokens, block_tokens),
            )
        return own_block_keys(req.request_id, req.prompt_tokens, block_tokens), 0

    def arrivals(self, env: simpy.Environment):
        return replay_arrivals(env, self.trace, self.accept, self.close_arrivals)

    def copy_engine(self, env: simpy.Environment):
        in_flight = self.core.page_table.in_flight
        while True:
            if not self._copy_queue:
                self._copy_wake = env.event()
                yield self._copy_wake
                continue
            t = self._copy_queue.popleft()
            if in_flight.get(t.expert) is not t:
                continue  # aborted before its copy started
            # A synchronous upgrade was written (and timed) in the step that started it.
            yield UrgentTimeout(env, 0.0 if self._sync_upgrades else self.latency.h2d_time_s(t.num_bytes))
            self.bytes_h2d += t.num_bytes
            if self.core.complete_upgrade(t):
                self._copy_current[t.expert] = False
                self._wake_engine()

    def _wake_engine(self) -> None:
        if self._engine_wake is not None and not self._engine_wake.triggered:
            self._engine_wake.succeed()

    def engine(self, env: simpy.Environment):
        core = self.core
        sched = core.scheduler
        while True:
            if not sched.has_work():
                if self._arrivals_done:
                    return
                self._engine_wake = env.event()
                yield self._engine_wake
                continue
            step = yield from core.step(self._execute)
            if step is None:  # nothing fits: wait for an arrival or a landed upgrade
                core.check_stall(requests_coming=not self._arrivals_done)
                self._engine_wake = env.event()
                yield self._engine_wake

    def _execute(self, step: Step) -> Executed:
        """The step's time from the latency model, its routing from the sampler."""
        shape, latency = step.shape, self.latency
        tokens = self.routing.sample(shape.num_tokens)
        step.observe_routing(tokens)
        # Downgrades are quantised on the device from the resident copy: HBM-bound, and the
        # step that needs the freed pages waits for them.
        quantize_s = 0.0
        for c in step.changes:
            if c.kind is DOWNGRADE or (c.kind is UPGRADE and self._sync_upgrades):
                quantize_s += sum(latency.quantize_time_s(n, k, c.to_id) for _, n, k in self.model.expert_matrices)
        if self._dequantize:
            quantize_s += self._dequantize_s(tokens)
        duration_s = latency.step_time_s(shape, tokens, self.core.precision_grid) + quantize_s
        self._last_step = (shape, tokens)
        batch = step.batch
        swapped_bytes = (batch.swapped_out_tokens + batch.swapped_in_tokens) * self._kv_bytes_per_token
        if swapped_bytes:  # kv-swap: KV copies over PCIe, before the step that needs the blocks
            duration_s += latency.h2d_time_s(swapped_bytes)
            self.bytes_h2d += batch.swapped_in_tokens * self._kv_bytes_per_token
        return Executed(duration_s, swapped_bytes, wait=self.env.timeout(duration_s))

    def _predict_step_s(self, precision_ids: np.ndarray) -> float:
        """The last step's time had the experts been at ``precision_ids``: the controller's view
        of what precision costs in speed. Copies of the latency model, one per map asked about
        (a few at most), keep the run's own cached per-precision times intact."""
        if self._last_step is None:
            return 0.0
        key = precision_ids.tobytes()
        model = self._predictors.get(key)
        if model is None:
            if len(self._predictors) >= 4:
                self._predictors.pop(next(iter(self._predictors)))
            model = self._predictors[key] = copy.copy(self.latency)
            if hasattr(model, "out_of_grid"):  # a table model: predictions are not steps that ran
                model.out_of_grid = type(model.out_of_grid)()
                model.fallback = copy.copy(model.fallback)
        shape, tokens = self._last_step
        return model.step_time_s(shape, tokens, precision_ids.reshape(self.core.precision_grid.shape))

    def _dequantize_s(self, tokens: np.ndarray) -> float:
        """The fp32 expert copies a CPU engine makes this step: every routed expert whose copy
        predates its last precision change (or that has none yet)."""
        used = tokens.ravel() > 0
        stale = used & ~self._copy_current
        if not stale.any():
            return 0.0
        self._copy_current |= used
        total_s = 0.0
        for pid in self.core.page_table.precision_ids[stale].tolist():
            s = self._expert_dequantize_s.get(pid)
            if s is None:
                s = self._expert_dequantize_s[pid] = sum(
                    self.latency.dequantize_time_s(n, k, pid) for _, n, k in self.model.expert_matrices
                )
            total_s += s
        return total_s

    def start(self, arrivals: bool = True):
        """Start the processes on the environment (``arrivals=False``: a cluster feeds
        ``accept``); returns the engine process."""
        env = self.env
        if arrivals:
            env.process(self.arrivals(env))
        env.process(self.copy_engine(env))
        return env.process(self.engine(env))

    def run(self, progress=None) -> None:
        """Run to the last request. ``progress(now_s)`` is called every 1/200 of the trace."""
        run_until(self.env, self.start(), self.trace, progress)
        verify_memory(self.cores)


# Young objects the cyclic garbage collector lets pile up before it looks (CPython's default is
# 700). A step makes and drops thousands of small objects (changes, transitions, tuples); with
# the default, those alive across a few steps (upgrades in flight) are promoted until full
# collections run every few seconds: 15% of paper-greedy's hour on a 6,144-expert model, ~1.5%
# of others. What is collected, and so every result, is the same; garbage in cycles waits
# longer (peak memory measured within 2% on DeepSeek-V3 EP8 and Qwen3-30B-A3B paper-greedy runs).
GC_YOUNG_THRESHOLD = 20_000


@contextlib.contextmanager
def _fewer_collections():
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], GC_YOUNG_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def run_until(env: simpy.Environment, done: Event, trace: RequestTrace, progress=None) -> None:
    """Run ``env`` until ``done``; ``progress(now_s)``, if given, is called every 1/200 of the
    trace's span (one engine, an expert-parallel replica or a cluster alike)."""
    with _fewer_collections():
        if progress is None:
            env.run(until=done)
            return
        horizon_s = float(trace.arrival_s[-1]) if len(trace) else 1.0
        slice_s = max(horizon_s / 200, 1e-3)
        while not done.triggered:
            env.run(until=env.now + slice_s)
            progress(env.now)
