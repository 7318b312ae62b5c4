"""Latency models: how long an engine step, a downgrade and a host-to-device copy take.

``build_latency_model(cfg, model, gpu, base_dir)`` turns the scenario's ``latency:`` section
(``pagedweight.config.latency``) into one of three models, chosen through ``LATENCY_BUILDERS``:

- ``analytic`` (``pwsim.roofline``): roofline from the ``GpuSpec``; the default.
- ``table`` (``pwsim.table_latency``): measured kernel tables, linear interpolation, analytic
  fallback outside the grid.
- ``constant`` (below): ``step_time_s + per_token_s * tokens``, for tests and teaching.

Arrays passed to ``step_time_s`` (L = MoE layers, E = experts per layer):
``tokens_per_expert`` (L, E) int64 tokens routed to each expert this step (``pwsim.routing``),
``precision_ids`` (L, E) int8 codes into ``PRECISION_NAMES``. A step without tokens takes 0 s.
Every output names the model that timed the run with ``describe()``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from pagedweight.config.latency import (
    AnalyticLatencyConfig,
    ConstantLatencyConfig,
    LatencyConfig,
    TableLatencyConfig,
)
from pagedweight.core.spec import GpuSpec, ModelSpec
from pagedweight.core.step import StepShape
from pwsim.roofline import AnalyticLatencyModel
from pwsim.table_latency import TableLatencyModel


class LatencyModel(Protocol):
    name: str

    def step_time_s(self, shape: StepShape, tokens_per_expert: np.ndarray, precision_ids: np.ndarray) -> float: ...

    def quantize_time_s(self, n: int, k: int, precision_id: int) -> float: ...

    def h2d_time_s(self, num_bytes: int) -> float: ...

    def describe(self) -> str: ...


class ConstantLatencyModel:
    """Fixed step time plus a per-token term; copies at the GPU's host-to-device bandwidth, so a
    run's throughput and transition costs can be checked by hand."""

    name = "constant"

    def __init__(self, cfg: ConstantLatencyConfig, gpu: GpuSpec):
        self.cfg, self.gpu = cfg, gpu

    def step_time_s(self, shape: StepShape, tokens_per_expert: np.ndarray, precision_ids: np.ndarray) -> float:
        num_tokens = shape.num_tokens
        if num_tokens == 0:
            return 0.0
        return self.cfg.step_time_s + self.cfg.per_token_s * num_tokens

    def quantize_time_s(self, n: int, k: int, precision_id: int) -> float:
        return self.cfg.quantize_s

    def h2d_time_s(self, num_bytes: int) -> float:
        return max(num_bytes, 0) / self.gpu.h2d_bandwidth_bytes_per_s

    def describe(self) -> str:
        text = f"constant {self.cfg.step_time_s * 1e3:g} ms"
        if self.cfg.per_token_s:
            text += f" + {self.cfg.per_token_s * 1e3:g} ms/token"
        return text


LATENCY_BUILDERS: dict[str, Callable[..., LatencyModel]] = {
    "analytic": lambda cfg, model, gpu, base_dir: AnalyticLatencyModel(cfg, model, gpu),
    "table": lambda cfg, model, gpu, base_dir: TableLatencyModel(cfg, model, gpu, base_dir),
    "constant": lambda cfg, model, gpu, base_dir: ConstantLatencyModel(cfg, gpu),
}


def build_latency_model(
    cfg: LatencyConfig | None, model: ModelSpec, gpu: GpuSpec, base_dir: str | Path = ".", like: ModelSpec | None = None
) -> LatencyModel:
    """The latency model of a scenario; ``base_dir`` (the scenario's folder) anchors table paths.
    ``like``: the model whose rows a latency table is read for, when ``model`` is a share of it
    (an expert-parallel rank's)."""
    if cfg is None:
        cfg = AnalyticLatencyConfig()
    if like is not None and cfg.kind == "table" and cfg.model is None:
        cfg = cfg.model_copy(update={"model": like.name})
    return LATENCY_BUILDERS[cfg.kind](cfg, model, gpu, base_dir)


__all__ = [
    "LATENCY_BUILDERS",
    "AnalyticLatencyConfig",
    "AnalyticLatencyModel",
    "ConstantLatencyConfig",
    "ConstantLatencyModel",
    "LatencyModel",
    "TableLatencyConfig",
    "TableLatencyModel",
    "build_latency_model",
]
