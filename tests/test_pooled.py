"""pwsim validate --repeats: real runs pooled into one results directory (pagedweight.results.pooled),
here with simulated runs of different seeds standing in for repeated real runs."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pagedweight.config.scenario import load_scenario
from pagedweight.errors import PagedWeightError
from pagedweight.results.pooled import pool_runs
from pagedweight.results.validation import compare, format_validation
from pwsim.cli import main
from pwsim.run import run_scenario

GOOD = Path(__file__).parent / "fixtures" / "scenarios" / "good.yaml"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pooled")
    dirs = [base / f"run-{i}" for i in (1, 2, 3)]
    for i, d in enumerate(dirs):
        run_scenario(load_scenario(GOOD, [f"seed={i}"]), d, report=False)
    return base, dirs


def test_pooled_figures_are_those_of_all_runs_together(runs):
    base, dirs = runs
    pooled = pool_runs(dirs, base / "pooled")
    summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
    requests = pd.read_csv(base / "pooled" / "requests.csv")
    assert sorted(requests["run"].unique()) == [1, 2, 3]
    for policy, p in pooled["policies"].items():
        runs_ = [s["policies"][policy] for s in summaries]
        assert len({r["output_throughput"] for r in runs_}) == 3  # the seeds make three different runs
        # Totals summed; every other figure the median of the runs' own (the typical run).
        assert p["duration_s"] == pytest.approx(sum(r["duration_s"] for r in runs_))
        assert p["completed"] == sum(r["completed"] for r in runs_)
        for key in ("output_throughput", "median_ttft_ms", "p99_tpot_ms", "num_downgrades", "mean_kv_cache_usage_perc"):
            assert p[key] == pytest.approx(float(np.median([r[key] for r in runs_]))), key
        assert p["real_runs"]["output_throughput"] == [r["output_throughput"] for r in runs_]
        # Each run starts where the same policy's previous run ended: the pooled clock runs on.
        mine = requests[requests["policy"] == policy]
        for run in (2, 3):
            assert mine[mine["run"] == run]["arrival_s"].min() >= mine[mine["run"] == run - 1]["finish_s"].max()
    steps = pd.read_csv(base / "pooled" / "steps.csv")
    assert len(steps) == sum(len(pd.read_csv(d / "steps.csv")) for d in dirs)


def test_a_pooled_run_compares_with_one_simulated_run(runs):
    base, dirs = runs
    pool_runs(dirs, base / "pooled-cmp")
    v = compare(base / "pooled-cmp", dirs[0], bounds={})
    for policy, e in v["policies"].items():
        assert len(e["real_runs"]["output_throughput"]) == 3
        # Transitions per run, as one simulated run makes them.
        assert e["transitions"]["real"] == pytest.approx(np.mean([len(_transitions(d, policy)) for d in dirs]))
    text = format_validation(v)
    assert "real runs (3), their medians above: output tok/s" in text and "fastest / slowest" in text


def test_four_pooled_runs_say_how_far_their_halves_differ(runs, tmp_path):
    from pagedweight.results.pooled import RUN_FIGURES
    from pagedweight.results.report import write_report

    base, dirs = runs
    fourth = tmp_path / "run-4"
    run_scenario(load_scenario(GOOD, ["seed=3"]), fourth, report=False)
    four = [*dirs, fourth]
    pool_runs(four, tmp_path / "pooled")
    v = compare(tmp_path / "pooled", dirs[0], bounds={})
    summaries = [json.loads((d / "summary.json").read_text()) for d in four]
    for policy, e in v["policies"].items():
        rates = [s["policies"][policy]["output_throughput"] for s in summaries]
        # Runs 1 and 4 against 2 and 3, in % of the median of all four.
        expected = abs(np.median([rates[0], rates[3]]) - np.median(rates[1:3])) / np.median(rates) * 100
        assert e["real_split_half_perc"]["output_throughput"] == pytest.approx(expected)
        assert set(e["real_split_half_perc"]) == set(RUN_FIGURES)
    assert "the real runs' two halves differ by output_throughput" in format_validation(v)
    page = write_report([dirs[0], tmp_path / "pooled"], tmp_path / "validation_report.html", validation=v)
    assert "real runs' halves differ by" in Path(page).read_text()


def _transitions(d: Path, policy: str) -> pd.DataFrame:
    tr = pd.read_csv(d / "transitions.csv") if (d / "transitions.csv").stat().st_size else pd.DataFrame()
    return tr[(tr["policy"] == policy) & (tr["kind"] != "abort")] if len(tr) else tr


def test_runs_of_different_scenarios_do_not_pool(runs, tmp_path):
    _, dirs = runs
    other = tmp_path / "other"
    other.mkdir()
    summary = json.loads((dirs[0] / "summary.json").read_text())
    summary["scenario"] = "chat"
    (other / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(PagedWeightError, match="same scenario and policies"):
        pool_runs([dirs[0], other], tmp_path / "out")


def test_repeats_alternate_the_policies_and_pool(tmp_path, monkeypatch, runs):
    """pwsim validate SCENARIO --repeats 3: three real runs, the policies' order reversed every
    other run, pooled into real/; here the 'engine' copies a simulated run into each."""
    import shutil

    _, dirs = runs
    calls = []

    def fake_run(cmd, env=None):
        calls.append(cmd)
        if "run" in cmd and "--out" in cmd:
            out = Path(cmd[cmd.index("--out") + 1])
            shutil.copytree(dirs[(len(calls) - 1) % 3], out)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr("pwsim.commands.validate.subprocess.run", fake_run)
    out = tmp_path / "v"
    assert main(["validate", str(GOOD), "--repeats", "3", "--no-bounds", "--out-dir", str(out)]) == 0
    orders = [c[c.index("--policies") + 1].split(",") for c in calls]
    assert len(orders) == 3 and orders[0] == orders[2] == orders[1][::-1] and len(orders[0]) > 1
    assert len(json.loads((out / "real" / "summary.json").read_text())["pooled_runs"]) == 3
    assert main(["validate", str(GOOD), "--repeats", "0", "--out-dir", str(tmp_path / "w")]) != 0
    assert not (tmp_path / "w").exists()
    real, sim = dirs[0], dirs[1]
    assert main(["validate", "--real", str(real), "--sim", str(sim), "--repeats", "2"]) != 0
