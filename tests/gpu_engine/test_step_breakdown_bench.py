"""``benchmarks/step_breakdown.py --replay-moe``: every MoE call of a real run replayed warm, cold
and in the profiler's form, on a few requests of the CPU validation scenario."""

import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def bench():
    spec = importlib.util.spec_from_file_location("step_breakdown", ROOT / "benchmarks" / "step_breakdown.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replay_moe_times_every_call_four_ways(tmp_path, capsys):
    src = yaml.safe_load((ROOT / "scenarios" / "cpu_validate.yaml").read_text())
    src["workload"]["num_requests"] = 3
    src["workload"]["lengths"] = {"kind": "fixed", "prompt_tokens": 40, "output_tokens": 3}
    src["latency"]["path"] = str(ROOT / "traces" / "kernels" / "cpu.csv")
    scenario = tmp_path / "small.yaml"
    scenario.write_text(yaml.safe_dump(src))
    assert bench().main(["--scenario", str(scenario), "--policy", "static-fp16", "--replay-moe",
                         "--out", str(tmp_path / "out")]) == 0  # fmt: skip
    import pandas as pd

    calls = pd.read_csv(tmp_path / "out" / "moe_replays.csv")
    # Every MoE layer of every step: prefills of 40 tokens (one or more prompts), then decodes.
    assert len(calls) % 4 == 0 and len(calls) >= 4 * 3  # the default model's four MoE layers
    assert (calls[["ran_s", "warm_s", "cold_s", "table_form_s"]] > 0).all().all()
    assert calls["tokens"].max() >= 40 and calls["tokens"].min() <= 3
    assert "the profiler's form cold" in capsys.readouterr().out
