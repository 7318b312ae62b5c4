"""The scenario's ``latency:`` and ``routing:`` sections: which model times a step, and how
tokens are spread over experts. Pure configuration; ``pwsim.latency`` builds the models.

``latency:`` picks one of three kinds by ``kind:`` (``analytic`` when the key is absent):

- ``analytic``: a roofline from the ``GpuSpec`` (bytes / bandwidth vs flops / peak) with the
  efficiency factors below. The default until a measured table exists.
- ``table``: the latency table ``pwgpu profile`` writes (``traces/kernels/<gpu>.csv``),
  fitted non-decreasing along each key and interpolated linearly; points outside the measured
  grid are timed by ``fallback``.
- ``constant``: a fixed step time (plus an optional per-token term), for tests and teaching.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from pagedweight.core.spec import PRECISIONS
from pagedweight.errors import ConfigError


class AnalyticLatencyConfig(BaseModel):
    """Roofline efficiency factors. Defaults are set from public H100/H200 measurements:

    - ``hbm_efficiency`` 0.80: a device copy reaches ~4.3 of the H200's 4.8 TB/s (0.90); weight
      streaming GEMV-like MoE kernels (Marlin, vLLM fused MoE) reach ~75-85% of peak at batch 1.
    - ``flops_efficiency`` 0.70: ~790 of 989 TFLOP/s bf16 measured on large dense GEMMs (0.80);
      grouped expert GEMMs and FlashAttention run lower (FA3 fwd: 600-740 TFLOP/s).
    - ``step_overhead_s`` 1 ms: scheduling, input preparation and sampling synchronisation of a
      Python engine per step (vLLM V1 with CUDA graphs: ~0.5-2 ms).
    - ``layer_overhead_s`` 10 us: the small kernels of a layer (norms, RoPE, router softmax/top-k,
      token sort) that do no significant work but each cost a few microseconds.
    - ``kernel_launch_s`` 5 us: one launch per expert-FFN call (one per precision class present
      in a layer, since a fused MoE kernel holds one weight dtype), per quantize kernel and per
      host-to-device copy.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["analytic"] = "analytic"
    hbm_efficiency: float = Field(default=0.80, gt=0, le=1)
    flops_efficiency: float = Field(default=0.70, gt=0, le=1)
    # Override of ``hbm_efficiency`` for the expert-FFN kernel of one weight precision, e.g.
    # ``{int4: 0.4}`` for a Triton W4A16 kernel at 16-46% of Marlin's speed (ANCHORS.md).
    precision_hbm_efficiency: dict[str, float] = Field(default_factory=dict)
    step_overhead_s: float = Field(default=1.0e-3, ge=0)
    layer_overhead_s: float = Field(default=1.0e-5, ge=0)
    kernel_launch_s: float = Field(default=5.0e-6, ge=0)

    @field_validator("precision_hbm_efficiency")
    @classmethod
    def _check_precisions(cls, v: dict[str, float]) -> dict[str, float]:
        for name, eff in v.items():
            if name not in PRECISIONS:
                raise ConfigError(f"unknown precision {name!r}; allowed: {', '.join(PRECISIONS)}")
            if not 0 < eff <= 1:
                raise ConfigError(f"precision_hbm_efficiency[{name}](={eff}) must be in (0, 1]")
        return v

    def describe(self) -> str:
        return (
            f"analytic roofline (efficiency: HBM {self.hbm_efficiency:.2f}, FLOPs {self.flops_efficiency:.2f}; "
            f"overhead {self.step_overhead_s * 1e3:g} ms/step, {self.layer_overhead_s * 1e6:g} us/layer)"
        )


class TableLatencyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["table"]
    path: str  # traces/kernels/<gpu>.csv, relative to the scenario file
    model: str | None = None  # model name in the table's ``model`` column; None: the scenario's model
    # Fit each op's grid to be non-decreasing along every key (isotonic regression): more tokens,
    # experts, context or bytes never take less time, so a dip between neighbours is noise.
    monotone: bool = True
    # Multiplies every time the table gives (not the step overhead): the second per-deployment
    # term `pwsim validate --calibrate` fits, for a machine running slower or faster than when
    # it was profiled (a shared CPU drifts by 2x).
    scale: float = Field(default=1.0, gt=0)
    # Times what the table does not cover (points outside the grid, missing ops or precisions,
    # the per-step overhead, dense FFN layers). YAML may say just ``fallback: analytic``.
    fallback: AnalyticLatencyConfig = Field(default_factory=AnalyticLatencyConfig)

    @field_validator("fallback", mode="before")
    @classmethod
    def _fallback_shorthand(cls, v: Any) -> Any:
        if v == "analytic":
            return {}
        if isinstance(v, str):
            raise ConfigError(f"fallback must be 'analytic' or a mapping of analytic settings (got {v!r})")
        return v

    def resolved_path(self, base_dir: str | Path) -> Path:
        p = Path(self.path)
        return p if p.is_absolute() else Path(base_dir) / p


class ConstantLatencyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["constant"]
    step_time_s: float = Field(gt=0)
    per_token_s: float = Field(default=0.0, ge=0)  # added per token through the MoE layers
    quantize_s: float = Field(default=0.0, ge=0)  # per matrix downgrade; upgrades use the GPU's h2d bandwidth


def _latency_kind(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("kind", "analytic")
    return getattr(v, "kind", None)


LatencyConfig = Annotated[
    Annotated[AnalyticLatencyConfig, Tag("analytic")]
    | Annotated[TableLatencyConfig, Tag("table")]
    | Annotated[ConstantLatencyConfig, Tag("constant")],
    Discriminator(
        _latency_kind,
        custom_error_type="latency_kind",
        custom_error_message="kind must be one of: analytic, table, constant",
    ),
]


RoutingKind = Literal["importance", "uniform", "zipf"]


class RoutingConfig(BaseModel):
    """How each step's tokens are spread over experts (see ``pwsim.routing``).

    ``kind`` None picks ``importance`` (the importance table's routing frequencies) when the
    scenario has an importance table, else ``uniform``. ``zipf`` ranks experts in a random order
    per layer and gives rank r a frequency proportional to ``1 / r**alpha`` (default alpha 1.0).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: RoutingKind | None = None
    alpha: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _alpha_only_for_zipf(self) -> RoutingConfig:
        if self.alpha is not None and self.kind != "zipf":
            raise ConfigError(f"alpha(={self.alpha}) applies only to kind 'zipf' (kind is {self.kind!r})")
        return self

    def resolved_kind(self, has_importance_table: bool) -> RoutingKind:
        if self.kind is not None:
            return self.kind
        return "importance" if has_importance_table else "uniform"

    @property
    def zipf_alpha(self) -> float:
        return 1.0 if self.alpha is None else self.alpha
