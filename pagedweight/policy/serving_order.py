"""The waiting queue under a TTFT SLO: how long it will make its head wait, and the order that
serves the requests that can still meet the SLO first (``pagedweight``; docs/DESIGN.md,
"Serving under the SLOs"). Functions of the queue alone, and ``QueueWatch``: the backlog's
hysteresis and the queue's recent pressure, kept by the controller from the projected wait.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedweight.core.scheduler import Request


def projected_wait_s(waiting: deque[Request], now_s: float, ttft_slo_s: float, prefill_token_s: float) -> float:
    """The queue's projected wait for a first token: the oldest on-time waiting request's wait
    so far plus the prefill of every queued prompt (and preempted request's tokens) at
    ``prefill_token_s``. Infinite when a request has already missed the TTFT SLO while waiting:
    demand has outrun the current precision map."""
    cutoff = now_s - ttft_slo_s
    oldest, tokens = now_s, 0
    for r in waiting:
        if r.first_token_s is None:
            if r.arrival_s < cutoff:
                return math.inf
            if r.arrival_s < oldest:
                oldest = r.arrival_s
        tokens += r.num_tokens - r.swapped_tokens
    return now_s - oldest + tokens * prefill_token_s


def defer_late(
    waiting: deque[Request], now_s: float, ttft_slo_s: float, late_wait_max_s: float | None, deferring: bool
) -> bool:
    """Put requests that waited past the TTFT SLO without a first token (they can no longer
    meet it) behind those that still can, in place: FCFS within each group; requests already
    started (preempted ones) stay in front. None is dropped: they are admitted as soon as no
    on-time request waits, or, with ``late_wait_max_s``, once they have waited that long since
    their arrival (then in arrival order ahead of the on-time ones). Returns whether requests
    are deferred now (pass it back as ``deferring``): arrivals join the queue in arrival order,
    so while nothing is deferred only the first request not yet started needs a look."""
    cutoff = now_s - ttft_slo_s
    if not deferring:
        for r in waiting:
            if r.first_token_s is None:
                if r.arrival_s >= cutoff:
                    return False  # the oldest is on time: so is everyone behind it
                break
        else:
            return False
    last = waiting[-1]
    if late_wait_max_s is None and last.first_token_s is None and last.arrival_s < cutoff:
        return False  # the newest has missed it too: every request not started has; order kept
    overdue_before = -math.inf if late_wait_max_s is None else now_s - late_wait_max_s
    started, overdue, on_time, late = [], [], [], []
    for r in waiting:
        if r.first_token_s is not None:
            started.append(r)
        elif r.arrival_s < cutoff:
            (overdue if r.arrival_s <= overdue_before else late).append(r)
        else:
            on_time.append(r)
    if late or overdue:
        waiting.clear()
        waiting.extend(started)
        waiting.extend(overdue)
        waiting.extend(on_time)
        waiting.extend(late)
    return bool(late)


class QueueWatch:
    """Whether the queue is in backlog, and how hard it has pressed lately, from its projected
    wait (``projected_wait_s``) at each plan.

    Backlog: on when the projected wait passes ``enter_s`` (``backlog_fraction`` of the TTFT
    SLO); off once it has stayed under half of that for ``calm_s`` (hysteresis: bursts a few
    seconds apart do not flip every expert back and forth).

    Pressure: whether the queue presses now (a backlog, or a wait past the calm line) folded
    into an EMA with time constant ``calm_s``, in [0, 1]. A cached page lives tens of seconds
    before its reuse, so what its recompute time is worth follows the pressure of that span,
    not of the instant: a wait that crosses the line for a moment adds little, and one that
    comes and goes does not switch the cache's protection (and with it downgrades and
    upgrades) on and off."""

    def __init__(self, enter_s: float, calm_s: float):
        self.enter_s = enter_s
        self.calm_s = calm_s
        self.backlog = False
        self.pressure = 0.0
        self._pressure_at_s: float | None = None
        self._calm_since: float | None = None

    def update(self, now_s: float, wait_s: float) -> bool:
        """The queue's projected wait now; returns whether a backlog ended with it."""
        enter_s = self.enter_s
        ended = False
        if wait_s > enter_s:
            self.backlog, self._calm_since = True, None
        elif self.backlog:
            if wait_s > enter_s / 2:
                self._calm_since = None
            elif self._calm_since is None:
                self._calm_since = now_s
            elif now_s - self._calm_since >= self.calm_s:
                self.backlog, self._calm_since, ended = False, None, True
        self._update_pressure(now_s, self.backlog or wait_s > enter_s / 2)
        return ended

    def _update_pressure(self, now_s: float, pressed: bool) -> None:
        last, self._pressure_at_s = self._pressure_at_s, now_s
        target = 1.0 if pressed else 0.0
        calm_s = self.calm_s
        if last is None or calm_s <= 0:
            self.pressure = target
            return
        self.pressure -= math.expm1(-(now_s - last) / calm_s) * (target - self.pressure)
