"""The CPU validation scenario end to end: the real engine (`pwgpu run --scenario`) and the
simulator on the same scenario, compared by `pwsim validate`, with the side-by-side report.

The table is profiled in the same run (--profile) and the step overhead fitted on static-fp16
(--calibrate). A shared CPU's speed drifts by up to 2x from minute to minute
(benchmarks/RESULTS.md has the measured errors), so timing is held only to generous bounds here.
What both runtimes share is checked: both complete every request, and both come under memory
pressure (the controller downgrades experts in both)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

import proc

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the engine needs torch (the gpu extra)")
def test_cpu_validation_scenario(tmp_path):
    out = tmp_path / "val"
    cmd = [sys.executable, "-m", "pwsim.cli", "validate", str(ROOT / "scenarios" / "cpu_validate.yaml"),
           "--out-dir", str(out), "--no-bounds", "--calibrate", "static-fp16", "--profile"]  # fmt: skip
    run = proc.run(cmd, quiet_s=120)  # two profiles (before and after the run), 96 requests twice
    assert run.returncode == 0, run.stderr[-3000:]
    v = json.loads((out / "sim-calibrated" / "validation.json").read_text())
    assert v["real"]["runtime"] == "pwgpu" and v["sim"]["runtime"] == "pwsim"
    # The table was measured just now on a grid fitted to this scenario: nothing falls outside.
    assert "out_of_grid" not in v and (out / "kernels.csv").is_file()
    assert str(out / "kernels.csv") in json.loads((out / "sim" / "summary.json").read_text())["latency_model"]
    # Calibration closed the mean step-time gap on the policy it was fitted on, and kept the
    # uncalibrated errors beside the calibrated ones.
    cal = v["calibration"]
    assert cal["fitted_on"] == ["static-fp16"] and cal["key"] == "latency.fallback.step_overhead_s"
    # Converged, unless even no overhead left the simulated steps slower than the real ones.
    assert cal["converged"] or (cal["step_overhead_s"] == 0 and cal["remaining_gap_s"] < 0), cal
    assert cal["scale"] > 0
    assert set(cal["uncalibrated_errors_perc"]) == {"static-fp16", "pagedweight"}
    assert "pagedweight  (out of sample)" in run.stdout
    page = (out / "sim-calibrated" / "validation_report.html").read_text()
    assert "data:image/png;base64," in page
    assert "Calibrated on <b>static-fp16</b>" in page and "Median step time by step shape" in page
    for policy in ("static-fp16", "pagedweight"):
        m = v["policies"][policy]["metrics"]
        for key in ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms"):
            assert math.isfinite(m[key]["error_perc"]), (policy, key, m[key])
        # Generous bounds (five runs on an idle 2-core machine: pagedweight's throughput -15% to
        # +24% out of sample, mean E2E -29% to +14%); a table measured under heavy load was off
        # by 5-9x and fails these.
        ratio = m["output_throughput"]["sim"] / m["output_throughput"]["real"]
        assert 1 / 3 < ratio < 3, (policy, ratio)
        ratio = m["mean_e2el_ms"]["sim"] / m["mean_e2el_ms"]["real"]
        assert 1 / 5 < ratio < 5, (policy, ratio)
    for side in ("real", "sim", "sim-calibrated"):
        summary = json.loads((out / side / "summary.json").read_text())
        for policy in ("static-fp16", "pagedweight"):
            assert summary["policies"][policy]["completed"] == 96, (side, policy)
        # The budget is meant to put both runtimes under memory pressure.
        assert summary["policies"]["pagedweight"]["num_downgrades"] > 0, side


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the engine needs torch (the gpu extra)")
def test_engine_gets_the_simulators_synthetic_table(tmp_path):
    """`pwgpu run --scenario` with any synthetic importance: the engine plans from the very table
    the simulator builds (same provenance, same initial precision of every expert)."""
    import yaml

    from pagedweight.config.scenario import load_scenario
    from pwsim.run import run_scenario

    src = yaml.safe_load((ROOT / "scenarios" / "cpu_validate.yaml").read_text())
    src["importance"] = {"kind": "synthetic", "seed": 3, "zipf_exponent": 1.3}
    src["workload"]["num_requests"] = 3
    src["policies"] = ["pagedweight"]
    src["memory"]["budget"] = "30 MiB"  # below BF16 for every expert: the plan picks which to lower
    src["latency"]["path"] = str(ROOT / "traces" / "kernels" / "cpu.csv")
    scenario = tmp_path / "synthetic.yaml"
    scenario.write_text(yaml.safe_dump(src))
    cmd = [sys.executable, "-m", "pwgpu.cli", "run", "--scenario", str(scenario), "--out", str(tmp_path / "real")]
    run = proc.run(cmd, quiet_s=30)
    assert run.returncode == 0, run.stderr[-3000:]
    run_scenario(load_scenario(scenario), tmp_path / "sim", report=False)
    real, sim = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("real", "sim"))
    assert "seed=3" in real["importance"] and real["importance"] == sim["importance"]
    plans = [(tmp_path / d / "initial_precisions.csv").read_text() for d in ("real", "sim")]
    assert plans[0] == plans[1] and "int" in plans[0]
