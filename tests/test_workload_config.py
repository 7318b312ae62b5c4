"""The ``workload:`` schema: kinds, defaults, and the errors a user sees for bad input."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from pagedweight.config.workload import (
    Z90,
    FileLengths,
    GammaArrival,
    LognormalTokens,
    PiecewiseArrival,
    PoissonArrival,
    SyntheticWorkload,
    TraceWorkload,
    WorkloadConfig,
    parse_workload,
)
from pagedweight.errors import format_validation_error

_FIXED = {"kind": "fixed", "prompt_tokens": 100, "output_tokens": 10}


class _Scenario(BaseModel):
    """Stand-in for the scenario loader: a model with a ``workload`` field."""

    workload: WorkloadConfig


def _errors(data: dict) -> str:
    with pytest.raises(ValidationError) as e:
        _Scenario.model_validate({"workload": data})
    return format_validation_error(e.value, "s.yaml", _Scenario, raw={"workload": data})


def test_trace_from_yaml_with_defaults():
    cfg = parse_workload(
        yaml.safe_load(
            """
            kind: trace
            path: ../traces/longctx.jsonl
            format: mooncake
            rate_scale: 1.5
            duration_s: 300
            """
        )
    )
    assert isinstance(cfg, TraceWorkload)
    assert cfg.effective_time_unit() == "ms" and cfg.start_s == 0 and cfg.drop_failed is True
    assert cfg.spread_bucket_s is None and cfg.max_requests is None
    assert cfg.resolved_path("/x/scenarios") == Path("/x/scenarios/../traces/longctx.jsonl")
    assert cfg.resolved_path("/elsewhere") == Path("/elsewhere/../traces/longctx.jsonl")
    absolute = cfg.model_copy(update={"path": "/data/t.jsonl"})
    assert absolute.resolved_path("/x") == Path("/data/t.jsonl")


def test_time_unit_defaults_per_format():
    azure = parse_workload({"kind": "trace", "path": "a.csv", "format": "azure"})
    generic = parse_workload(
        {
            "kind": "trace",
            "path": "g.csv",
            "format": "generic",
            "columns": {"arrival": "t", "prompt_tokens": "p", "output_tokens": "o"},
        }
    )
    assert azure.effective_time_unit() == "s" and generic.effective_time_unit() == "s"
    ms = generic.model_copy(update={"time_unit": "ms"})
    assert ms.effective_time_unit() == "ms"


def test_synthetic_with_each_arrival_and_lengths_kind():
    for arrival, cls in (
        ({"kind": "poisson", "rate_qps": 2}, PoissonArrival),
        ({"kind": "gamma", "rate_qps": 2, "cv": 4}, GammaArrival),
        (
            {"kind": "piecewise", "segments": [{"duration_s": 60, "rate_qps": 1}, {"duration_s": 60, "rate_qps": 0}]},
            None,
        ),
    ):
        cfg = parse_workload(
            {
                "kind": "synthetic",
                "arrival": arrival,
                "lengths": {"kind": "file", "path": "lengths.csv"},
                "duration_s": 100,
            }
        )
        assert isinstance(cfg, SyntheticWorkload)
        assert isinstance(cfg.arrival, cls or PiecewiseArrival)
        assert isinstance(cfg.lengths, FileLengths) and cfg.lengths.order == "random"
    piecewise = cfg.arrival
    assert piecewise.cv == 1.0 and piecewise.total_duration_s() == 120


def test_models_are_frozen():
    cfg = parse_workload({"kind": "trace", "path": "a.csv", "format": "azure"})
    with pytest.raises(ValidationError):
        cfg.rate_scale = 2.0


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"kind": "trace", "path": "a.csv", "format": "azure", "rate": 2},
            "s.yaml: workload.rate: unknown key; allowed keys here: arrival, burstgpt_model, columns",
        ),
        (
            {"kind": "replay", "path": "a.csv"},
            "s.yaml: workload.kind: 'replay' is not allowed; allowed: 'trace', 'synthetic'",
        ),
        ({"kind": "trace", "path": "a.csv", "format": "parquet"}, "s.yaml: workload.format: must be one of"),
        (
            {"kind": "trace", "path": "a.csv", "format": "azure", "rate_scale": 0},
            "s.yaml: workload.rate_scale: Input should be greater than 0 (got 0)",
        ),
        ({"kind": "trace", "path": "a.csv", "format": "azure", "rate_scale": -1}, "greater than 0 (got -1)"),
        ({"kind": "trace", "format": "azure"}, "s.yaml: workload.path: required key is missing"),
        ({"kind": "trace", "path": "g.csv", "format": "generic"}, "s.yaml: workload: format generic needs columns"),
        (
            {
                "kind": "trace",
                "path": "a.csv",
                "format": "azure",
                "columns": {"arrival": "a", "prompt_tokens": "b", "output_tokens": "c"},
            },
            "columns only applies to format generic",
        ),
        ({"kind": "trace", "path": "s.csv", "format": "sharegpt"}, "format sharegpt has no timestamps"),
        (
            {"kind": "trace", "path": "a.csv", "format": "azure", "arrival": {"kind": "poisson", "rate_qps": 1}},
            "arrival only applies to format sharegpt",
        ),
        ({"kind": "trace", "path": "a.csv", "format": "azure", "time_unit": "ms"}, "time_unit does not apply"),
        ({"kind": "trace", "path": "a.csv", "format": "azure", "burstgpt_model": "GPT-4"}, "burstgpt_model only"),
        (
            {"kind": "trace", "path": "a.csv", "format": "azure", "sort": "yes"},
            "s.yaml: workload.sort: Input should be a valid boolean",
        ),
        (
            {
                "kind": "trace",
                "path": "s.csv",
                "format": "sharegpt",
                "sort": True,
                "arrival": {"kind": "poisson", "rate_qps": 1},
            },
            "sort does not apply to format sharegpt",
        ),
        (
            {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_qps": 0}, "lengths": _FIXED, "num_requests": 5},
            "s.yaml: workload.arrival.rate_qps: Input should be greater than 0 (got 0)",
        ),
        (
            {
                "kind": "synthetic",
                "arrival": {"kind": "gamma", "rate_qps": 1, "cv": 0},
                "lengths": _FIXED,
                "num_requests": 5,
            },
            "s.yaml: workload.arrival.cv: Input should be greater than 0",
        ),
        (
            {"kind": "synthetic", "arrival": {"kind": "gamma", "rate_qps": 1}, "lengths": _FIXED, "num_requests": 5},
            "s.yaml: workload.arrival.cv: required key is missing",
        ),
        (
            {"kind": "synthetic", "arrival": {"kind": "piecewise", "segments": []}, "lengths": _FIXED},
            "s.yaml: workload.arrival.segments: List should have at least 1 item",
        ),
        (
            {
                "kind": "synthetic",
                "arrival": {"kind": "piecewise", "segments": [{"duration_s": 5, "rate_qps": 0}]},
                "lengths": _FIXED,
            },
            "s.yaml: workload.arrival: every segment has rate_qps 0",
        ),
        (
            {
                "kind": "synthetic",
                "arrival": {"kind": "piecewise", "segments": [{"duration_s": 5, "rate_qps": -1}]},
                "lengths": _FIXED,
            },
            "s.yaml: workload.arrival.segments.0.rate_qps: Input should be greater than or equal to 0",
        ),
        (
            {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_qps": 1}, "lengths": _FIXED},
            "give num_requests or duration_s",
        ),
        (
            {
                "kind": "synthetic",
                "arrival": {"kind": "poisson", "rate_qps": 1},
                "num_requests": 3,
                "lengths": {"kind": "fixed", "prompt_tokens": 0, "output_tokens": 1},
            },
            "s.yaml: workload.lengths.prompt_tokens: Input should be greater than or equal to 1",
        ),
        (
            {
                "kind": "synthetic",
                "arrival": {"kind": "poisson", "rate_qps": 1},
                "num_requests": 3,
                "lengths": {
                    "kind": "lognormal",
                    "prompt": {"median": 100, "mean": 120, "sigma": 1},
                    "output": {"median": 10, "sigma": 1},
                },
            },
            "s.yaml: workload.lengths.prompt: give exactly one of mean or median",
        ),
    ],
)
def test_errors_name_the_key_and_the_problem(data, message):
    assert message in _errors(data)


def test_unknown_nested_key_lists_allowed_keys():
    text = _errors(
        {
            "kind": "synthetic",
            "arrival": {"kind": "poisson", "rate_qps": 1, "burst": 3},
            "lengths": _FIXED,
            "num_requests": 5,
        }
    )
    assert "s.yaml: workload.arrival.burst: unknown key; allowed keys here: kind, rate_qps" in text


def test_lognormal_from_median_and_p90():
    mu, sigma = LognormalTokens(median=1020, p90=2734.5).mu_sigma()
    assert math.exp(mu) == pytest.approx(1020)
    assert math.exp(mu + Z90 * sigma) == pytest.approx(2734.5)


def test_lognormal_from_mean_and_sigma_or_p90():
    mu, sigma = LognormalTokens(mean=200, sigma=0.5).mu_sigma()
    assert math.exp(mu + sigma**2 / 2) == pytest.approx(200) and sigma == 0.5
    mu, sigma = LognormalTokens(mean=1000, p90=1800).mu_sigma()
    assert math.exp(mu + sigma**2 / 2) == pytest.approx(1000)
    assert math.exp(mu + Z90 * sigma) == pytest.approx(1800)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"median": 100}, "give exactly one of sigma or p90"),
        ({"median": 100, "p90": 50}, "p90 (=50.0) must be > median (=100.0)"),
        ({"mean": 1154.7, "p90": 2734.5}, "no lognormal has mean 1154.7 and p90 2734.5"),
        ({"median": 100, "sigma": 1, "min": 10, "max": 5}, "max (=5) must be >= min (=10)"),
        ({"median": 100, "sigma": 0}, "greater than 0"),
    ],
)
def test_lognormal_rejects_impossible_parameters(kwargs, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LognormalTokens(**kwargs)
