"""Scenario files: a good one loads; every malformed one is rejected with the expected message.

Each file under fixtures/scenarios/bad/ starts with ``# expect: <text>``; the error must name
the file and contain that text (which carries the key path and what is allowed)."""

import re
from pathlib import Path

import pytest

from pagedweight.config.scenario import load_scenario, parse_bytes
from pagedweight.errors import ScenarioError

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "scenarios"
BAD = sorted((FIXTURES / "bad").glob("*.yaml"))


def test_good_scenario_loads_with_defaults():
    loaded = load_scenario(FIXTURES / "good.yaml")
    s = loaded.scenario
    assert loaded.budget_bytes == 64 * 2**20
    assert s.memory.page_bytes == 64 * 2**10 and s.memory.precisions == ("bf16", "fp8", "int8", "int4")
    assert s.policies == ("static-fp16", "pagedweight") and s.slo.ttft_ms == 500
    assert loaded.max_model_len == loaded.model.max_context_tokens == 2048
    assert s.latency.kind == "analytic" and s.importance.kind == "measured-or-synthetic"


def test_there_are_many_malformed_examples():
    assert len(BAD) >= 12


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_malformed_scenario_is_rejected_with_a_clear_message(path):
    expect = re.match(r"# expect: (.*)", path.read_text()).group(1)
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    msg = str(err.value)
    assert str(path) in msg
    assert expect in msg, msg


def test_overrides_are_validated_like_the_file():
    loaded = load_scenario(FIXTURES / "good.yaml", ["memory.budget=128 MiB", "scheduler.max_num_seqs=8"])
    assert loaded.budget_bytes == 128 * 2**20 and loaded.scenario.scheduler.max_num_seqs == 8
    with pytest.raises(ScenarioError, match="scheduler.max_num_seq: unknown key"):
        load_scenario(FIXTURES / "good.yaml", ["scheduler.max_num_seq=8"])
    with pytest.raises(ScenarioError, match="expected key.path=value"):
        load_scenario(FIXTURES / "good.yaml", ["seed"])


def test_missing_scenario_file():
    with pytest.raises(ScenarioError, match="does not exist"):
        load_scenario(FIXTURES / "nope.yaml")


@pytest.mark.parametrize(
    "text, expected", [(2097152, 2097152), ("2 MiB", 2097152), ("80GB", 80 * 10**9), ("1.5e3", 1500), ("4kib", 4096)]
)
def test_sizes(text, expected):
    assert parse_bytes(text) == expected


def test_every_controller_setting_reaches_the_controller():
    """Scenario controller knobs are handed over by name: none is silently dropped."""
    from dataclasses import asdict

    from pagedweight.config.run import core_config

    sets = ["controller.horizon_steps=7", "controller.low_watermark=0.03", "controller.high_watermark=0.2",
            "controller.copy_budget_bytes_per_s=123", "controller.max_in_flight=4096", "controller.min_dwell_s=0.5",
            "controller.plan_interval_s=0.25", "controller.rescale_interval_s=3",
            "controller.recompute_weight=2.5", "controller.backlog_fraction=0.5", "controller.backlog_calm_s=4",
            "controller.slo_batching=false", "controller.min_prefill_tokens=128",
            "controller.kv_offload=true", "controller.late_wait_max_s=30"]  # fmt: skip
    settings = asdict(core_config(load_scenario(ROOT / "scenarios" / "longctx.yaml", sets)).controller)
    assert settings == {"horizon_steps": 7, "low_watermark": 0.03, "high_watermark": 0.2,
                        "copy_budget_bytes_per_s": 123, "max_in_flight_bytes": 4096, "min_dwell_s": 0.5,
                        "plan_interval_s": 0.25, "rescale_interval_s": 3.0,
                        "tpot_slo_s": 0.1, "latency_margin": 0.1, "recompute_weight": 2.5,
                        "ttft_slo_s": 10.0, "backlog_fraction": 0.5, "backlog_calm_s": 4.0, "slo_batching": False,
                        "min_prefill_tokens": 128, "late_wait_max_s": 30.0, "kv_offload": True}  # fmt: skip


def test_paper_greedy_precisions_reach_the_core_and_are_checked():
    from pagedweight.config.run import core_config

    path = ROOT / "scenarios" / "longctx.yaml"
    assert core_config(load_scenario(path)).paper_greedy_precisions is None  # the paper's ladder
    cfg = core_config(load_scenario(path, ["memory.paper_greedy_precisions=[int4, fp8, bf16]"]))
    assert cfg.paper_greedy_precisions == ("bf16", "fp8", "int4")  # most precise first
    with pytest.raises(
        ScenarioError, match=r"memory: paper_greedy_precisions: \[.int3.\] not in precisions; allowed: bf16"
    ):
        load_scenario(path, ["memory.paper_greedy_precisions=[bf16, int3]"])
