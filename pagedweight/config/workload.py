"""The ``workload:`` section of a scenario: which requests arrive, when, and how long they are.

Pure schema (pydantic v2, frozen, unknown keys rejected). Every pluggable part is chosen by
``kind:``; the simulator turns a validated ``WorkloadConfig`` into a request trace
(``pagedweight.workload.build.build_workload``). Relative paths are resolved by the caller against the
directory of the scenario file (``resolved_path(base_dir)``), never against the working directory.

    workload:
      kind: trace
      path: ../traces/longctx.jsonl
      format: mooncake
      rate_scale: 1.5          # 1.5x the load: inter-arrival times divided by 1.5
      duration_s: 300          # first 5 minutes of the trace (before scaling)

    workload:
      kind: synthetic
      arrival: {kind: gamma, rate_qps: 4.0, cv: 4.0}
      lengths:
        kind: lognormal
        prompt: {median: 1020, p90: 2734.5, min: 2, max: 14050}
        output: {median: 129, p90: 424, min: 7, max: 1000}
      duration_s: 600
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictBool, TypeAdapter, model_validator

from pagedweight.errors import ConfigError

# Standard normal quantile at 0.9: a lognormal's p90 is exp(mu + Z90 * sigma).
Z90 = 1.2815515655446004

TraceFormat = Literal["azure", "mooncake", "burstgpt", "sharegpt", "generic"]
TRACE_FORMATS: tuple[str, ...] = get_args(TraceFormat)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------------------------------
# Arrival processes
# ---------------------------------------------------------------------------------------------


class PoissonArrival(_Frozen):
    """Exponential inter-arrival times: the memoryless baseline (IAT CV = 1)."""

    kind: Literal["poisson"]
    rate_qps: float = Field(gt=0)


class GammaArrival(_Frozen):
    """Gamma inter-arrival times with mean 1/rate_qps and coefficient of variation ``cv``.

    cv > 1 is burstier than Poisson (shape = 1/cv^2 < 1), cv < 1 more regular."""

    kind: Literal["gamma"]
    rate_qps: float = Field(gt=0)
    cv: float = Field(gt=0)


class RateSegment(_Frozen):
    duration_s: float = Field(gt=0)
    # Zero is allowed: an idle stretch between two busy ones is a legitimate schedule.
    rate_qps: float = Field(ge=0)


class PiecewiseArrival(_Frozen):
    """A rate schedule: each segment holds its rate for its duration; arrivals stop after the last.

    Inter-arrival times are Gamma with coefficient of variation ``cv`` in operational time
    (time-rescaling of a unit-rate renewal process), so ``cv: 1.0`` is a piecewise Poisson process."""

    kind: Literal["piecewise"]
    segments: list[RateSegment] = Field(min_length=1)
    cv: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _some_load(self) -> PiecewiseArrival:
        if not any(s.rate_qps > 0 for s in self.segments):
            raise ConfigError("every segment has rate_qps 0; at least one must be > 0")
        return self

    def total_duration_s(self) -> float:
        return sum(s.duration_s for s in self.segments)


ArrivalConfig = Annotated[PoissonArrival | GammaArrival | PiecewiseArrival, Field(discriminator="kind")]


# ---------------------------------------------------------------------------------------------
# Length distributions (synthetic workloads)
# ---------------------------------------------------------------------------------------------


class LognormalTokens(_Frozen):
    """A lognormal token count, given by its mean or median and by sigma or its p90, then
    rounded and clipped to [min, max]. Clipping moves the realised mean; ``pwsim trace stats``
    shows what a sample really looks like."""

    mean: float | None = Field(default=None, gt=0)
    median: float | None = Field(default=None, gt=0)
    sigma: float | None = Field(default=None, gt=0)
    p90: float | None = Field(default=None, gt=0)
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_of_each(self) -> LognormalTokens:
        if (self.mean is None) == (self.median is None):
            raise ConfigError("give exactly one of mean or median")
        if (self.sigma is None) == (self.p90 is None):
            raise ConfigError("give exactly one of sigma or p90")
        if self.max is not None and self.max < self.min:
            raise ConfigError(f"max (={self.max}) must be >= min (={self.min})")
        if self.p90 is not None:
            centre = self.median if self.median is not None else self.mean
            if self.p90 <= centre:
                which = "median" if self.median is not None else "mean"
                raise ConfigError(f"p90 (={self.p90}) must be > {which} (={centre})")
            if self.mean is not None and math.log(self.p90 / self.mean) > Z90**2 / 2:
                # mean = exp(mu + s^2/2) and p90 = exp(mu + Z90 s) have no solution s > 0 here.
                bound = self.mean * math.exp(Z90**2 / 2)
                raise ConfigError(
                    f"no lognormal has mean {self.mean} and p90 {self.p90} (p90 must be <= {bound:.1f}); "
                    "give median instead of mean"
                )
        return self

    def mu_sigma(self) -> tuple[float, float]:
        """Parameters of the underlying normal: ln(X) ~ N(mu, sigma^2)."""
        if self.median is not None:
            mu = math.log(self.median)
            sigma = self.sigma if self.sigma is not None else (math.log(self.p90) - mu) / Z90
            return mu, sigma
        if self.sigma is not None:
            return math.log(self.mean) - self.sigma**2 / 2, self.sigma
        # ln p90 = ln mean - s^2/2 + Z90 s: the smaller root keeps the distribution's body.
        sigma = Z90 - math.sqrt(Z90**2 - 2 * math.log(self.p90 / self.mean))
        return math.log(self.mean) - sigma**2 / 2, sigma


class FixedLengths(_Frozen):
    kind: Literal["fixed"]
    prompt_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)


class LognormalLengths(_Frozen):
    kind: Literal["lognormal"]
    prompt: LognormalTokens
    output: LognormalTokens


class FileLengths(_Frozen):
    """Lengths drawn from a ShareGPT-style file (``num_prefill_tokens, num_decode_tokens``)."""

    kind: Literal["file"]
    path: str = Field(min_length=1)
    # random: draw rows with replacement; sequential: take rows in file order, wrapping around.
    order: Literal["random", "sequential"] = "random"

    def resolved_path(self, base_dir: str | Path) -> Path:
        return _resolve(self.path, base_dir)


LengthsConfig = Annotated[FixedLengths | LognormalLengths | FileLengths, Field(discriminator="kind")]


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------


class TraceColumns(_Frozen):
    """Column (CSV) or key (JSONL) names of a generic trace."""

    arrival: str = Field(min_length=1)
    prompt_tokens: str = Field(min_length=1)
    output_tokens: str = Field(min_length=1)


class TraceWorkload(_Frozen):
    """Replay a trace file. Order of operations: load, spread buckets, window (``start_s``,
    ``duration_s`` on the file's own timeline, relative to its first request), ``max_requests``,
    then ``copies`` (that many copies laid over each other on the same timeline), then
    ``rate_scale`` (divides every inter-arrival time), then truncation to the model's context."""

    kind: Literal["trace"]
    path: str = Field(min_length=1)
    format: TraceFormat
    columns: TraceColumns | None = None
    # Unit of numeric timestamps; default ms for mooncake, s for burstgpt and generic.
    time_unit: Literal["s", "ms"] | None = None
    # Only for sharegpt, whose files carry lengths but no timestamps.
    arrival: ArrivalConfig | None = None
    rate_scale: float = Field(default=1.0, gt=0)
    start_s: float = Field(default=0.0, ge=0)
    duration_s: float | None = Field(default=None, gt=0)
    max_requests: int | None = Field(default=None, ge=1)
    # Many times the load over the same span (a cluster's traffic from one service's trace): copy
    # j is shifted by j/copies of the span, wrapping around, so the copies' bursts do not line up.
    copies: int = Field(default=1, ge=1)
    # Requests sharing one timestamp are spread over the next spread_bucket_s seconds (Mooncake's
    # timestamps come in ~3 s buckets); null leaves them as simultaneous batches.
    spread_bucket_s: float | None = Field(default=None, gt=0)
    spread: Literal["even", "random"] = "even"
    burstgpt_model: str | None = None
    drop_failed: bool = True
    # A file whose timestamps go backwards is an error unless this opts in to replaying it
    # sorted by time (the run's trace notes then say how many rows were out of order).
    sort: StrictBool = False

    @model_validator(mode="after")
    def _format_options(self) -> TraceWorkload:
        fmt = self.format
        if self.sort and fmt == "sharegpt":
            raise ConfigError("sort does not apply to format sharegpt (its arrivals are generated in order)")
        if fmt == "generic" and self.columns is None:
            raise ConfigError("format generic needs columns: {arrival: NAME, prompt_tokens: NAME, output_tokens: NAME}")
        if fmt != "generic" and self.columns is not None:
            raise ConfigError(f"columns only applies to format generic (format is {fmt})")
        if fmt == "sharegpt" and self.arrival is None:
            raise ConfigError(
                "format sharegpt has no timestamps; give an arrival process (arrival: {kind: poisson, ...})"
            )
        if fmt != "sharegpt" and self.arrival is not None:
            raise ConfigError(f"arrival only applies to format sharegpt; a {fmt} trace has its own timestamps")
        if self.time_unit is not None and fmt not in ("mooncake", "burstgpt", "generic"):
            raise ConfigError(f"time_unit does not apply to format {fmt}")
        if self.burstgpt_model is not None and fmt != "burstgpt":
            raise ConfigError(f"burstgpt_model only applies to format burstgpt (format is {fmt})")
        if self.spread_bucket_s is not None and fmt == "sharegpt":
            raise ConfigError("spread_bucket_s does not apply to format sharegpt (its arrivals are generated)")
        return self

    def effective_time_unit(self) -> Literal["s", "ms"]:
        if self.time_unit is not None:
            return self.time_unit
        return "ms" if self.format == "mooncake" else "s"

    def resolved_path(self, base_dir: str | Path) -> Path:
        return _resolve(self.path, base_dir)


class SyntheticWorkload(_Frozen):
    """Generate requests: arrivals from a process, lengths from a distribution. Stops at
    ``num_requests`` or ``duration_s``, whichever comes first (at least one is required)."""

    kind: Literal["synthetic"]
    arrival: ArrivalConfig
    lengths: LengthsConfig
    num_requests: int | None = Field(default=None, ge=1)
    duration_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _bounded(self) -> SyntheticWorkload:
        if self.num_requests is None and self.duration_s is None and not isinstance(self.arrival, PiecewiseArrival):
            raise ConfigError("give num_requests or duration_s (or a piecewise arrival, whose segments end)")
        return self


WorkloadConfig = Annotated[TraceWorkload | SyntheticWorkload, Field(discriminator="kind")]


def _resolve(path: str, base_dir: str | Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


_WORKLOAD_ADAPTER: TypeAdapter = TypeAdapter(WorkloadConfig)


def parse_workload(data: object) -> TraceWorkload | SyntheticWorkload:
    """Validate a ``workload:`` mapping; raises pydantic's ``ValidationError`` (format it with
    ``pagedweight.errors.format_validation_error``)."""
    return _WORKLOAD_ADAPTER.validate_python(data)
