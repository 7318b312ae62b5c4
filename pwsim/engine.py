"""The SimPy runtime: one simulated engine running one policy over one request trace.

Processes (``env`` passed explicitly, one RNG per run):
- ``arrivals``: adds each trace request to the scheduler at its arrival time;
- ``engine``: one SimPy event per engine step: plan precision, schedule, time the step from
  the latency model, finish the step;
- ``copy_engine``: host-to-device upgrades, one transfer at a time at the GPU's h2d bandwidth,
  overlapped with compute as on hardware; an upgrade flips when its copy completes.

Same-time ordering (tested): arrivals and copy completions at time t happen *before* an engine
step that starts at t, so a step sees every request that has arrived and every expert whose
copy has landed by its start. Both are scheduled URGENT; the engine's step timeouts are NORMAL,
and SimPy orders equal times by priority, then by scheduling order.

Pool, page table, scheduler and controller are ``pagedweight.core.runtime.RuntimeCore``, the same
object ``pwgpu`` drives; only the arithmetic is replaced by the latency model.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import simpy
from simpy.core import URGENT
from simpy.events import Event

from pagedweight.core.pagetable import Transition
from pagedweight.core.runtime import CoreConfig, RuntimeCore
from pagedweight.core.scheduler import Request
from pagedweight.errors import PagedWeightError
from pagedweight.policy.importance import ImportanceTable
from pagedweight.workload.traces import RequestTrace
from pwsim.routing import RoutingSampler


class UrgentTimeout(Event):
    """A timeout that fires before NORMAL events of the same time (see the module docstring)."""

    def __init__(self, env: simpy.Environment, delay_s: float):
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, URGENT, delay_s)


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
    ):
        self.env = env or simpy.Environment()
        self.model = cfg.model
        self.latency = latency
        self.trace = trace
        self.core = RuntimeCore(cfg, policy, table, self, clock=lambda: self.env.now)
        rng = np.random.default_rng(seed)  # the run's one RNG
        freqs = table.grid(table.routing_freq) if routing_kind == "importance" else None
        self.routing = RoutingSampler(cfg.model, freqs, routing_kind, routing_alpha, rng)
        self.requests: list[Request] = []
        self.bytes_h2d = 0
        self._copy_queue: deque[Transition] = deque()
        self._copy_wake: Event | None = None
        self._engine_wake: Event | None = None
        self._arrivals_done = False
        self._step_extra_s = 0.0

    # ---- TransitionBackend: what a precision change costs in simulated time -------------------
    def downgrade(self, t: Transition) -> None:
        # Quantised on the device from the resident copy: HBM-bound, and the step that needs
        # the freed pages waits for it.
        self._step_extra_s += sum(self.latency.quantize_time_s(n, k, t.to_id) for _, n, k in self.model.expert_matrices)

    def start_upgrade(self, t: Transition) -> None:
        self._copy_queue.append(t)
        if self._copy_wake is not None and not self._copy_wake.triggered:
            self._copy_wake.succeed()

    def abort_upgrade(self, t: Transition) -> None:
        pass  # the copy engine sees the transition is no longer in flight and drops it

    # ---- processes --------------------------------------------------------------------------------
    def arrivals(self, env: simpy.Environment):
        tr, sched = self.trace, self.core.scheduler
        for i in range(len(tr)):
            delay = float(tr.arrival_s[i]) - env.now
            if delay > 0:
                yield UrgentTimeout(env, delay)
            req = Request(i, float(tr.arrival_s[i]), int(tr.prompt_tokens[i]), int(tr.output_tokens[i]))
            self.requests.append(req)
            if not sched.add(req):
                req.finish_s = env.now
            self._wake_engine()
        self._arrivals_done = True
        self._wake_engine()

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
            yield UrgentTimeout(env, self.latency.h2d_time_s(t.num_bytes))
            self.bytes_h2d += t.num_bytes
            if self.core.complete_upgrade(t):
                self._wake_engine()

    def _wake_engine(self) -> None:
        if self._engine_wake is not None and not self._engine_wake.triggered:
            self._engine_wake.succeed()

    def engine(self, env: simpy.Environment):
        core = self.core
        sched, latency, routing = core.scheduler, self.latency, self.routing
        kv_bytes_per_token = self.model.kv_bytes_per_token()
        while True:
            if not sched.has_work():
                if self._arrivals_done:
                    return
                self._engine_wake = env.event()
                yield self._engine_wake
                continue
            start_s = env.now
            self._step_extra_s = 0.0
            core.plan_step()
            batch = sched.schedule(start_s)
            if not batch.requests:
                if self._arrivals_done and not core.page_table.in_flight and not sched.running:
                    raise PagedWeightError(
                        f"{core.policy}: stalled at t={start_s:.3f}s with {len(sched.waiting)} requests waiting "
                        "and no memory coming free"
                    )
                self._engine_wake = env.event()
                yield self._engine_wake
                continue
            shape = batch.shape()
            tokens = routing.sample(shape.num_tokens)
            core.observe_routing(tokens)
            duration_s = latency.step_time_s(shape, tokens, core.precision_grid) + self._step_extra_s
            swapped_bytes = (batch.swapped_out_tokens + batch.swapped_in_tokens) * kv_bytes_per_token
            if swapped_bytes:  # kv-swap: KV copies over PCIe, before the step that needs the blocks
                duration_s += latency.h2d_time_s(swapped_bytes)
                self.bytes_h2d += batch.swapped_in_tokens * kv_bytes_per_token
            yield env.timeout(duration_s)
            sched.finish_step(batch, env.now)
            core.record_step(start_s, duration_s, batch, shape, swapped_bytes)

    def run(self, progress=None) -> None:
        """Run to the last request. ``progress(now_s)`` is called every 1/200 of the trace."""
        env = self.env
        env.process(self.arrivals(env))
        env.process(self.copy_engine(env))
        done = env.process(self.engine(env))
        if progress is None:
            env.run(until=done)
            return
        horizon_s = float(self.trace.arrival_s[-1]) if len(self.trace) else 1.0
        slice_s = max(horizon_s / 200, 1e-3)
        while not done.triggered:
            env.run(until=env.now + slice_s)
            progress(env.now)
