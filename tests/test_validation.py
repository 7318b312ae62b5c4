"""pwsim validate: signed errors between two results directories, bounds, exit codes."""

import json
from pathlib import Path

import pytest

from pagedweight.config.scenario import load_scenario
from pagedweight.errors import PagedWeightError
from pagedweight.results.validation import compare, signed_error_perc
from pwsim.cli import main
from pwsim.run import run_scenario

GOOD = Path(__file__).parent / "fixtures" / "scenarios" / "good.yaml"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("validate")
    run_scenario(load_scenario(GOOD), base / "real", report=False)
    # A different scheduler limit stands in for a simulator that gets the batch size wrong.
    run_scenario(load_scenario(GOOD, ["scheduler.max_num_seqs=1"]), base / "sim", report=False)
    return base / "real", base / "sim"


def test_signed_error():
    assert signed_error_perc(110.0, 100.0) == pytest.approx(10.0)
    assert signed_error_perc(90.0, 100.0) == pytest.approx(-10.0)
    assert signed_error_perc(0.0, 0.0) == 0.0


def test_identical_runs_have_zero_error(two_runs):
    real, _ = two_runs
    v = compare(real, real)
    assert v["all_within_bounds"]
    for e in v["policies"].values():
        assert all(row["error_perc"] == 0 for row in e["metrics"].values())
        assert e["suggested_extra_step_overhead_s"] == 0
        assert all(err == 0 for err in e["weight_bytes_mean_abs_error_perc"].values())
        assert e["step_time_by_shape"] and all(row["error_perc"] == 0 for row in e["step_time_by_shape"])


def test_step_time_by_shape_buckets_and_errors():
    import pandas as pd

    from pagedweight.results.validation import step_time_by_shape

    def steps(rows):
        return pd.DataFrame(
            [dict(num_prefill_tokens=p, num_decodes=d, duration_s=t, num_downgrades=x, num_upgrades=0)
             for p, d, t, x in rows]
        )  # fmt: skip

    # The last step changed an expert's precision: it is left out.
    real = steps(
        [(0, 1, 0.010, 0), (0, 3, 0.020, 0), (0, 4, 0.030, 0), (0, 16, 0.050, 0), (300, 2, 0.100, 0), (0, 16, 9.0, 1)]
    )
    sim = steps([(0, 1, 0.011, 0), (0, 4, 0.025, 0), (0, 12, 0.040, 0), (500, 0, 0.090, 0)])
    rows = {r["shape"]: r for r in step_time_by_shape(real, sim)}
    assert list(rows) == ["decode 1", "decode 3-4", "decode 9-16", "prefill 257-512"]
    assert rows["decode 3-4"]["real_median_ms"] == pytest.approx(25.0) and rows["decode 3-4"]["real_steps"] == 2
    assert rows["decode 9-16"]["error_perc"] == pytest.approx(-20.0)
    assert rows["prefill 257-512"]["error_perc"] == pytest.approx(-10.0)


def test_matched_step_times_compare_like_shapes():
    """Two runs whose steps take the same time shape for shape, but in different mixes: no gap,
    though their plain means differ by 2x."""
    import pandas as pd

    from pagedweight.results.validation import matched_step_times

    def steps(rows):
        return pd.DataFrame(
            [dict(num_prefill_tokens=p, num_decodes=d, duration_s=t, num_downgrades=0, num_upgrades=0)
             for p, d, t in rows]
        )  # fmt: skip

    decode, prefill = (0, 8, 0.010), (300, 4, 0.080)
    real = steps([decode] * 6 + [prefill] * 2)
    sim = steps([decode] * 2 + [prefill] * 2 + [(2000, 0, 1.0)])  # a class the real run lacks: left out
    assert sim["duration_s"].mean() > 2 * real["duration_s"].mean()
    assert matched_step_times(real, sim) == pytest.approx((0.0275, 0.0275))
    # Shape for shape 10% slower: the gap is 10% of the real run's matched step.
    slower = sim.assign(duration_s=sim["duration_s"] * 1.1)
    real_s, sim_s = matched_step_times(real, slower)
    assert sim_s == pytest.approx(1.1 * real_s)
    # No class in common: the plain means.
    assert matched_step_times(real, steps([(2000, 0, 1.0)])) == pytest.approx((real["duration_s"].mean(), 1.0))


def test_matched_step_times_count_the_slow_steps_and_take_the_typical_run():
    """A class's slow steps are time the run spent: the matched step is the class's mean, not
    its median. Pooled repeats give the median of the runs' own matched steps, so one run
    slowed throughout (as the headline figures, the runs' medians, ignore it) moves nothing."""
    import pandas as pd

    from pagedweight.results.validation import matched_step_times

    def steps(rows, run=None):
        df = pd.DataFrame(
            [dict(num_prefill_tokens=p, num_decodes=d, duration_s=t, num_downgrades=0, num_upgrades=0)
             for p, d, t in rows]
        )  # fmt: skip
        return df if run is None else df.assign(run=run)

    decode = [(0, 8, 0.010)] * 4 + [(0, 8, 0.050)]  # median 10 ms, mean 18 ms
    prefill = [(300, 4, 0.080)] * 5
    real = steps(decode + prefill)
    sim = steps([(0, 8, 0.018)] * 3 + [(300, 4, 0.080)] * 3)
    real_s, sim_s = matched_step_times(real, sim)
    assert real_s == pytest.approx(0.049) and sim_s == pytest.approx(0.049)
    # Three pooled runs; the third ran 3x slow. Each run's own matched step: 49, 54, 147 ms.
    slow = [(p, d, 3 * t) for p, d, t in decode + prefill]
    slower_decode = [(0, 8, 0.016)] * 4 + [(0, 8, 0.080)]  # mean 28.8 ms
    pooled = pd.concat([steps(decode + prefill, 1), steps(slower_decode + prefill, 2), steps(slow, 3)])
    real_s, _ = matched_step_times(pooled, sim)
    assert real_s == pytest.approx((0.0288 + 0.080) / 2)
    # A run without one of the classes is averaged over the classes it has.
    pooled = pd.concat([steps(prefill, 1), steps(prefill, 2), steps(decode + prefill, 3)])
    assert matched_step_times(pooled, sim)[0] == pytest.approx(0.080)


def test_split_half_compares_balanced_halves_of_the_real_runs():
    from pagedweight.results.validation import split_half_perc

    # Runs 1, 4, 5, 8 (one of each pair, each policy order twice) against 2, 3, 6, 7.
    rates = [110.0, 90.0, 90.0, 110.0, 110.0, 90.0, 90.0, 110.0]
    assert split_half_perc({"output_throughput": rates}) == pytest.approx({"output_throughput": 20.0})
    # A drift over time or a policy order that is slower falls on both halves alike.
    assert split_half_perc({"m": [100.0, 100.0, 120.0, 120.0, 140.0, 140.0, 160.0, 160.0]}) == {"m": 0.0}
    assert split_half_perc({"m": [100.0, 120.0] * 4}) == {"m": 0.0}
    # Below four runs, or a run without the figure: nothing to say.
    assert split_half_perc({"m": [1.0, 2.0, 3.0], "n": [1.0, None, 2.0, 3.0]}) == {}


def test_a_wrong_simulation_is_caught(two_runs, tmp_path):
    real, sim = two_runs
    v = compare(real, sim)
    ttft = v["policies"]["static-fp16"]["metrics"]["p99_ttft_ms"]
    assert ttft["error_perc"] > 10 and ttft["ok"] is False and not v["all_within_bounds"]
    out = tmp_path / "v.json"
    assert main(["validate", "--real", str(real), "--sim", str(sim), "--out", str(out), "--check"]) == 1
    assert json.loads(out.read_text())["scenario"] == "good"
    assert main(["validate", "--real", str(real), "--sim", str(sim), "--out", str(out), "--no-bounds", "--check"]) == 0
    assert main(["validate", "--real", str(real), "--sim", str(real), "--out", str(out), "--check"]) == 0
    deeper = tmp_path / "new" / "dir" / "v.json"  # --out into a directory that does not exist yet
    assert main(["validate", "--real", str(real), "--sim", str(sim), "--out", str(deeper), "--no-bounds"]) == 0
    page = (deeper.parent / "validation_report.html").read_text()
    assert "Median step time by step shape" in page and "Simulated vs real" in page
    # --out DIR: the files (and the report's images) inside DIR, new or existing; nothing beside it.
    base = tmp_path / "base"
    (base / "existing").mkdir(parents=True)
    for folder in (base / "report_dir", base / "existing"):
        assert main(["validate", "--real", str(real), "--sim", str(sim), "--out", str(folder), "--no-bounds"]) == 0
        assert (folder / "validation.json").is_file() and (folder / "validation_report.html").is_file()
    assert sorted(p.name for p in base.iterdir()) == ["existing", "report_dir"]


def test_different_scenarios_are_refused(two_runs, tmp_path):
    real, _ = two_runs
    other = tmp_path / "other"
    other.mkdir()
    summary = json.loads((real / "summary.json").read_text())
    summary["scenario"] = "chat"
    (other / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(PagedWeightError, match="same scenario"):
        compare(real, other)


def _sim(scenario: Path, out: Path, sets: list[str]) -> Path:
    run_scenario(load_scenario(scenario, sets), out, report=False)
    return out


def _calibrate_against(scenario: Path, real: Path, base: Path, sets: list[str]) -> dict:
    """pwsim validate's calibration, with a simulated run standing in for the real one."""
    import argparse

    from pwsim.commands.validate import _calibrate

    args = argparse.Namespace(scenario=str(scenario), overrides=sets, calibrate="all", policy=None)
    cal, cal_dir = _calibrate(args, real, _sim(scenario, base / "sim", sets))
    assert cal_dir == base / "sim-calibrated"
    return cal


def test_calibration_recovers_a_known_overhead(tmp_path):
    real = _sim(GOOD, tmp_path / "real", ["latency.step_overhead_s=0.004"])
    cal = _calibrate_against(GOOD, real, tmp_path, [])
    assert cal["converged"] and cal["key"] == "latency.step_overhead_s" and cal["scale"] == 1.0
    assert cal["step_overhead_s"] == pytest.approx(0.004, rel=0.05)


def test_calibration_scales_a_table_that_is_too_slow(tmp_path):
    """A machine running twice as fast as when it was profiled: no overhead can absorb that,
    so the table's times are scaled down."""
    scenario = Path(__file__).parent.parent / "scenarios" / "cpu_validate.yaml"
    real = _sim(scenario, tmp_path / "real", ["latency.scale=0.5", "latency.fallback.step_overhead_s=0.001"])
    cal = _calibrate_against(scenario, real, tmp_path, [])
    assert cal["converged"], cal
    assert cal["step_overhead_s"] < 0.002 and 0.4 < cal["scale"] < 0.65


def test_unknown_calibration_policy_is_refused_before_any_run(tmp_path, capsys):
    scenario = Path(__file__).parent.parent / "scenarios" / "cpu_validate.yaml"
    out = tmp_path / "v"
    assert main(["validate", str(scenario), "--calibrate", "static-fp8", "--out-dir", str(out)]) != 0
    err = capsys.readouterr().err
    assert "static-fp8" in err and "allowed: static-fp16, pagedweight" in err
    assert not out.exists()  # nothing ran


def test_threads_reach_the_profiler_and_the_engine(tmp_path, monkeypatch, capsys):
    import subprocess

    scenario = Path(__file__).parent.parent / "scenarios" / "cpu_validate.yaml"
    envs = []

    def fake_run(cmd, env=None):
        envs.append(env)
        return subprocess.CompletedProcess(cmd, 1)  # stop after the first subprocess

    monkeypatch.setattr("pwsim.commands.validate.subprocess.run", fake_run)
    out = tmp_path / "v"
    assert main(["validate", str(scenario), "--profile", "--threads", "1", "--out-dir", str(out)]) != 0
    assert envs and envs[0]["OMP_NUM_THREADS"] == "1" and "profiling failed" in capsys.readouterr().err
    assert main(["validate", str(scenario), "--threads", "0", "--out-dir", str(out)]) != 0
    assert "--threads 0: must be at least 1" in capsys.readouterr().err


def test_profiles_interleave_with_the_real_runs(tmp_path, monkeypatch):
    """--profile --repeats 2: a table before each real run and one after the last; the simulation
    is timed by each row's median of the three."""
    import argparse
    import subprocess

    import pagedweight.results.pooled
    from pagedweight.config.kernel_table import read_kernel_table, write_kernel_table
    from pwsim.commands.validate import _run_both, add_arguments

    root = Path(__file__).parent.parent
    scenario = root / "scenarios" / "cpu_validate.yaml"
    src, src_meta = read_kernel_table(root / "traces" / "kernels" / "cpu.csv")
    calls = []

    def fake_run(cmd, env=None):
        calls.append(cmd[3])  # python -m pwgpu.cli {profile,run} ...
        if cmd[3] == "profile":
            df = src.copy()
            df["latency_us_p50"] *= (3.0, 1.0, 2.0)[calls.count("profile") - 1]
            write_kernel_table(df, cmd[cmd.index("--out") + 1], {**src_meta, "date": f"d{len(calls)}"})
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr("pwsim.commands.validate.subprocess.run", fake_run)
    monkeypatch.setattr(pagedweight.results.pooled, "pool_runs", lambda runs, out: None)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "v"
    args = parser.parse_args([str(scenario), "--profile", "--repeats", "2", "--out-dir", str(out)])
    _run_both(args)
    assert calls == ["profile", "run", "profile", "run", "profile"]
    table, meta = read_kernel_table(out / "kernels.csv")
    assert (table["latency_us_p50"] == src["latency_us_p50"] * 2.0).all()
    assert meta["profiles"] == 3 and meta["dates"] == ["d1", "d5"]
    assert sorted(p.name for p in (out / "tables").glob("*.csv")) == [f"kernels-{i}.csv" for i in (1, 2, 3)]
    assert str(out / "kernels.csv") in json.loads((out / "sim" / "summary.json").read_text())["latency_model"]


def test_steps_of_one_shape_are_compared_across_policies():
    import pandas as pd

    from pagedweight.results.validation import _add_cross_policy_ratios

    def steps(policy, rows):
        return [dict(policy=policy, num_prefill_tokens=p, num_decodes=d, duration_s=t, num_downgrades=x,
                     num_upgrades=0) for p, d, t, x in rows]  # fmt: skip

    # Real: pagedweight's decodes of 9-16 ran 1.5x, its 257-512 prefills 2x as long as
    # static-fp16's; its step with a precision change and its decode 2 (no counterpart) are
    # left out. Simulated: 1.2x and 1x.
    real = pd.DataFrame(
        steps("static-fp16", [(0, 10, 0.040, 0), (0, 12, 0.040, 0), (300, 0, 0.100, 0)])
        + steps("pagedweight", [(0, 16, 0.060, 0), (300, 1, 0.200, 0), (0, 16, 5.0, 1), (0, 2, 0.01, 0)])
    )
    sim = pd.DataFrame(
        steps("static-fp16", [(0, 10, 0.050, 0), (300, 0, 0.100, 0)])
        + steps("pagedweight", [(0, 16, 0.060, 0), (300, 1, 0.100, 0)])
    )
    out = {"policies": {"static-fp16": {}, "pagedweight": {}}}
    _add_cross_policy_ratios(out, real, sim)
    d = out["policies"]["pagedweight"]["step_ratio_vs"]
    assert d["vs"] == "static-fp16" and "step_ratio_vs" not in out["policies"]["static-fp16"]
    assert list(d["by_shape"]) == ["decode 9-16", "prefill 257-512"]
    assert d["by_shape"]["decode 9-16"] == pytest.approx({"real": 1.5, "sim": 1.2})
    assert d["by_shape"]["prefill 257-512"] == pytest.approx({"real": 2.0, "sim": 1.0})
