"""The policy scoreboard: strict suite files, the grid and the bisection of the largest
sustainable load, resuming, and the margins its tables and heat maps show."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from pwsim.bench import BenchError, load_suite, margins, run_bench

SCENARIO = """\
name: tiny-trace
model: tiny-moe
gpu: cpu
memory: {budget: 40 MiB, page_bytes: 16 KiB, kv_block_tokens: 8}
workload: {kind: trace, path: trace.jsonl, format: mooncake}
slo: {ttft_ms: 200, tpot_ms: 50}
"""
SUITE = """\
name: tiny-bench
description: the tiny model on a synthetic trace
policies: [static-int4, pagedweight]
cells:
  - {name: tiny, scenario: tiny.yaml}
loads: [1.0, 2.0]
sustainable: {min_good_fraction: 0.9, low: 0.5, high: 64.0, rounds: 2}
"""


@pytest.fixture
def suite_dir(tmp_path):
    rng = np.random.default_rng(0)
    t_ms = np.cumsum(rng.exponential(100.0, 60))  # ~10 requests/s for 6 s
    rows = [
        {"timestamp": int(t), "input_length": int(rng.integers(50, 400)), "output_length": int(rng.integers(5, 40))}
        for t in t_ms
    ]
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tiny.yaml").write_text(SCENARIO)
    (tmp_path / "suite.yaml").write_text(SUITE)
    return tmp_path


def test_a_suite_runs_its_grid_and_bisection_and_resumes(suite_dir):
    suite = load_suite(suite_dir / "suite.yaml")
    out = suite_dir / "out"
    logs = []
    result = run_bench(suite, out, workers=1, log=logs.append)
    table = pd.read_csv(out / "bench.csv")
    assert len(table) == 4 and set(table["policy"]) == {"static-int4", "pagedweight"}
    assert set(table["load"]) == {1.0, 2.0}
    for key in ("request_goodput", "prefill_recompute_ratio", "transitions_per_request", "mean_quality_proxy"):
        assert table[key].notna().all(), key
    sust = pd.read_csv(out / "sustainable.csv")
    assert len(sust) == 2
    # Sustainable at the bottom of the search, not at 64x the trace's rate: the bisection ran
    # and its answer lies in its bracket, with the arrival rate it stands for.
    assert ((sust["max_load"] >= 0.5) & (sust["max_load"] < 64.0)).all(), sust
    assert (sust["max_request_rate"] > 0).all()
    assert any("round 1/2" in line for line in logs)
    assert (out / "report.html").stat().st_size > 1000 and "Goodput margin" in (out / "report.html").read_text()
    assert "## Largest sustainable load" in (out / "bench.md").read_text()
    ran = len(result["ran"])
    assert ran >= 2 + 4  # the grid (one run per load) and both ends of the search per policy
    for name in result["ran"]:  # the figures' sources, without the step tables (--tables keeps them)
        assert {p.name for p in (out / name).glob("*.csv")} == {"requests.csv"}, name
    again = run_bench(suite, out, workers=1, log=logs.append)
    assert again["ran"] == [] and len(again["skipped"]) == ran
    pd.testing.assert_frame_equal(pd.read_csv(out / "sustainable.csv"), sust)


def test_margins_are_over_the_best_other_policy():
    m = margins(pd.Series({"a": 10.0, "b": 8.0, "c": 5.0}))
    assert m["a"] == pytest.approx(0.25) and m["b"] == pytest.approx(-0.2) and m["c"] == pytest.approx(-0.5)


HEAD = "name: x\npolicies: [pagedweight]\n"
ONE = HEAD + "cells: [{name: a, scenario: tiny.yaml}]\n"


@pytest.mark.parametrize(
    "suite, message",
    [
        (HEAD + "cells: []\n", "cells"),
        (ONE + "loads: [0]\n", "loads must be > 0"),
        (
            HEAD + "cells: [{name: a, scenario: tiny.yaml}, {name: a, scenario: tiny.yaml}]\n",
            "cell names must be unique",
        ),
        (HEAD + "cells: [{name: a, scenario: nope.yaml}]\n", "cell a"),
        (HEAD + "cells: [{name: a, scenario: synth.yaml}]\n", "has no rate_scale"),
        (ONE + "sustainable: {low: 2, high: 1}\n", "low"),
        (ONE + "extra: 1\n", "extra"),
    ],
)
def test_bad_suites_are_one_clear_error(suite_dir, suite, message):
    (suite_dir / "synth.yaml").write_text(
        "name: s\nmodel: tiny-moe\ngpu: h200\nmemory: {budget: 40 MiB, page_bytes: 16 KiB, kv_block_tokens: 8}\n"
        "workload: {kind: synthetic, arrival: {kind: poisson, rate_qps: 1.0}, "
        "lengths: {kind: fixed, prompt_tokens: 10, output_tokens: 2}, num_requests: 2}\n"
    )
    (suite_dir / "bad.yaml").write_text(suite)
    with pytest.raises(BenchError, match=message):
        load_suite(suite_dir / "bad.yaml")


def test_an_optional_cell_with_an_absent_file_is_skipped_by_name(suite_dir):
    (suite_dir / "far.yaml").write_text(SCENARIO.replace("path: trace.jsonl", "path: ../nowhere/trace.jsonl"))
    cells = "  - {name: tiny, scenario: tiny.yaml}\n  - {name: far, scenario: far.yaml, optional: true}\n"
    (suite_dir / "opt.yaml").write_text(HEAD + "cells:\n" + cells + "loads: [1.0]\n")
    suite = load_suite(suite_dir / "opt.yaml")
    assert [c.name for c in suite.cells] == ["tiny"]
    assert set(suite.absent) == {"far"} and "nowhere/trace.jsonl does not exist" in suite.absent["far"]
    logs = []
    run_bench(suite, suite_dir / "out", workers=1, log=logs.append)
    assert any("cell far skipped" in line and "nowhere/trace.jsonl" in line for line in logs)
    assert set(pd.read_csv(suite_dir / "out" / "bench.csv")["cell"]) == {"tiny"}
    assert "- far: " in (suite_dir / "out" / "bench.md").read_text()
    # Not optional: the suite does not load, and the error names the cell and the file.
    (suite_dir / "req.yaml").write_text(HEAD + "cells:\n" + cells.replace(", optional: true", ""))
    with pytest.raises(BenchError, match=r"cell far: .*nowhere/trace.jsonl does not exist"):
        load_suite(suite_dir / "req.yaml")
    (suite_dir / "none.yaml").write_text(HEAD + "cells: [{name: far, scenario: far.yaml, optional: true}]\n")
    with pytest.raises(BenchError, match="every cell is optional and absent"):
        load_suite(suite_dir / "none.yaml")


def test_the_default_suite_resolves_every_cell_at_every_load():
    """scenarios/bench_default.yaml: every cell's scenario exists and takes its overrides at every
    load the grid and the bisection can ask for (nothing runs). Cells reading the shared traces
    beside the checkout are optional: absent, they are skipped, naming the file; where
    $PAGEDWEIGHT_SHARED_TRACES (or ../shared/traces) has them, they are checked against it."""
    from pagedweight.config.scenario import load_scenario

    root = Path(__file__).resolve().parents[1]
    suite = load_suite(root / "scenarios" / "bench_default.yaml")
    spec = suite.spec
    assert spec.set["workload.duration_s"] == 3600  # an hour of traffic per cell by default
    optional = {c.name for c in spec.cells if c.optional}
    assert set(suite.absent) <= optional
    for cell, why in suite.absent.items():
        assert "shared/traces" in why and "does not exist" in why, (cell, why)
    s = spec.sustainable
    loads = set(spec.loads) | ({s.low, s.high, math.sqrt(s.low * s.high)} if s else set())
    for c in suite.cells:
        for load in sorted(loads):
            loaded = load_scenario(suite.scenarios[c.name], list(suite.probe(c.name, load, ("pagedweight",)).overrides))
            assert loaded.scenario.workload.rate_scale == pytest.approx(suite.base_rate_scale[c.name] * load)
    assert {"chat-100g", "multiturn-100g", "qwen3-chat-64g"} <= {c.name for c in suite.cells}
    # The skipped cells, against the shared traces where $PAGEDWEIGHT_SHARED_TRACES points.
    shared = Path(os.environ.get("PAGEDWEIGHT_SHARED_TRACES", root.parent / "shared" / "traces"))
    for c in spec.cells:
        scenario = root / "scenarios" / c.scenario
        trace = shared / Path(yaml.safe_load(scenario.read_text())["workload"]["path"]).name
        if c.name in suite.absent and trace.is_file():
            sets = [f"{k}={json.dumps(v)}" for k, v in (*spec.set.items(), *c.set.items())]
            for load in sorted(loads):
                rate = yaml.safe_load(scenario.read_text())["workload"].get("rate_scale", 1.0) * load
                extra = [f"workload.path={json.dumps(str(trace))}", f"workload.rate_scale={rate}"]
                assert load_scenario(scenario, sets + extra).scenario.workload.kind == "trace"


def test_a_cell_can_run_a_subset_of_the_policies(suite_dir):
    cells = "  - {name: tiny, scenario: tiny.yaml}\n  - {name: few, scenario: tiny.yaml, policies: [pagedweight]}\n"
    sust = "sustainable: {min_good_fraction: 0.9, low: 0.5, high: 64.0, rounds: 1}\n"
    (suite_dir / "sub.yaml").write_text(SUITE.split("cells:")[0] + "cells:\n" + cells + "loads: [1.0]\n" + sust)
    run_bench(load_suite(suite_dir / "sub.yaml"), suite_dir / "out", workers=1, log=lambda _: None)
    table = pd.read_csv(suite_dir / "out" / "bench.csv")
    assert sorted(table[table["cell"] == "few"]["policy"]) == ["pagedweight"]
    assert sorted(table[table["cell"] == "tiny"]["policy"]) == ["pagedweight", "static-int4"]
    sust = pd.read_csv(suite_dir / "out" / "sustainable.csv")
    assert sorted(zip(sust["cell"], sust["policy"], strict=True)) == [
        ("few", "pagedweight"),
        ("tiny", "pagedweight"),
        ("tiny", "static-int4"),
    ]
    (suite_dir / "bad.yaml").write_text(HEAD + "cells: [{name: a, scenario: tiny.yaml, policies: [static-int4]}]\n")
    with pytest.raises(BenchError, match=r"cell a: policies \['static-int4'\] are not among the suite's"):
        load_suite(suite_dir / "bad.yaml")


def test_the_bisection_reads_the_grid_where_the_grid_has_the_load(suite_dir):
    """low 0.5 and high 2 bracket the grid's load 1, the first midpoint: the bisection reads the
    grid's run there instead of running each policy again, which is exact because a policy's
    figures do not depend on the policies run beside it."""
    from pagedweight.results.report_data import read_summary
    from pwsim.sweep import run_cell

    sust = "sustainable: {min_good_fraction: 0.9, low: 0.5, high: 2.0, rounds: 1}\n"
    (suite_dir / "reuse.yaml").write_text(SUITE.split("loads:")[0] + "loads: [1.0]\n" + sust)
    suite = load_suite(suite_dir / "reuse.yaml")
    out = suite_dir / "out"
    run_bench(suite, out, workers=1, log=lambda _: None)
    runs = sorted(d.name for d in out.iterdir() if d.is_dir())
    assert not [r for r in runs if r.startswith("tiny_load-1_") and "_all_" not in r], runs
    assert [r for r in runs if r.startswith("tiny_load-1_all_")]
    sust = pd.read_csv(out / "sustainable.csv")
    assert set(sust["policy"]) == {"static-int4", "pagedweight"} and (sust["max_request_rate"] >= 0).all()
    # The grid's entry of each policy is what that policy's own run gives.
    grid = read_summary(out / suite.probe("tiny", 1.0, ("static-int4", "pagedweight")).dirname)["policies"]
    for policy in ("static-int4", "pagedweight"):
        alone = suite.probe("tiny", 1.0, (policy,))
        run_cell(alone.scenario_path, list(alone.overrides), str(out / alone.dirname), {}, False)
        entry = read_summary(out / alone.dirname)["policies"][policy]
        same = {k: v for k, v in entry.items() if "wall" not in k}
        assert same == {k: v for k, v in grid[policy].items() if "wall" not in k}, policy
