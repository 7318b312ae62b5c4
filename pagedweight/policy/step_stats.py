"""What the controller learns from the steps that ran, the same way in both runtimes (each
calls ``Controller.observe_step`` after every step):

- the recent mean step, an EMA over ~256 steps (about one output): the TPOT a decoding request
  sees, which speed in the objective (``latency_cap``) compares with the SLO;
- the seconds a computed token costs, an EMA over ~32 prefill-heavy steps: what a cached
  prefix block saves (the cache's value) and what a recomputed victim costs (KV offload);
- the last step's duration and prefill tokens: the shape a backlog's precision is chosen for;
- under a TPOT SLO with SLO batching, the step time by shape (``StepShapeFit``), refitted at
  each plan, for the batch limits.
"""

from __future__ import annotations

from pagedweight.policy.latency_cap import StepShapeFit

STEP_EMA_WEIGHT = 1 / 256
# Seconds per computed token: an EMA over ~32 prefill-heavy steps (at least PREFILL_SAMPLE_TOKENS
# prefill tokens, and no fewer than the step's decodes), where a token's cost is mostly compute,
# as a recomputed prefix's is.
TOKEN_EMA_WEIGHT = 1 / 32
PREFILL_SAMPLE_TOKENS = 64


class StepStats:
    """The controller's view of the steps that ran (see the module docstring)."""

    def __init__(self, shape_fit: StepShapeFit | None = None):
        self.step_ema_s = 0.0  # recent steps' mean duration (0: none seen)
        self.token_ema_s = 0.0  # recent seconds per computed token (0: none seen)
        self.last_prefill_tokens = 0
        self.last_step_s = 0.0
        self.shape_fit = shape_fit  # None: step time by shape not learnt
        self.fit: tuple[float, float, float] | None = None  # (s, s per prefill token, s per decode)

    def observe(self, duration_s: float, prefill_tokens: int = 0, decodes: int = 0) -> None:
        """A step's duration and shape."""
        if self.step_ema_s == 0.0:
            self.step_ema_s = duration_s
        else:
            self.step_ema_s += STEP_EMA_WEIGHT * (duration_s - self.step_ema_s)
        self.last_prefill_tokens = prefill_tokens
        self.last_step_s = duration_s
        if self.shape_fit is not None:
            self.shape_fit.observe(duration_s, prefill_tokens, decodes)
        if prefill_tokens >= PREFILL_SAMPLE_TOKENS and prefill_tokens >= decodes:
            per_token_s = duration_s / (prefill_tokens + decodes)
            if self.token_ema_s == 0.0:
                self.token_ema_s = per_token_s
            else:
                self.token_ema_s += TOKEN_EMA_WEIGHT * (per_token_s - self.token_ema_s)

    def refit(self) -> None:
        """Solve the step-shape fit again (once a plan, not once a step)."""
        if self.shape_fit is not None:
            self.fit = self.shape_fit.fit()

    def prefill_token_s(self) -> float:
        """Seconds a prefill token costs: the step-shape fit's, else the recent EMA."""
        fit = self.fit
        return fit[1] if fit is not None and fit[1] > 0 else self.token_ema_s
