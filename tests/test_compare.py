"""``pwsim compare``: one row per run and policy, the numbers of each summary.json."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from pagedweight.results.report_data import KEY_METRICS
from pwsim.cli import main

SCENARIO = """\
name: cmp
model: tiny-moe
gpu: h200
memory: {budget: 40 MiB, page_bytes: 64 KiB, kv_block_tokens: 16}
workload:
  kind: synthetic
  arrival: {kind: poisson, rate_qps: 20.0}
  lengths: {kind: fixed, prompt_tokens: 800, output_tokens: 30}
  num_requests: 40
policies: [static-fp16, pagedweight]
"""


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("compare")
    scenario = base / "cmp.yaml"
    scenario.write_text(SCENARIO)
    a = base / "run_a"
    assert main(["run", str(scenario), "--out", str(a), "--no-progress", "--no-report"]) == 0
    # A second run where static-fp16 could not run: compare shows the reason, not numbers.
    b = base / "run_b"
    shutil.copytree(a, b)
    summary = json.loads((b / "summary.json").read_text())
    summary["policies"]["static-fp16"] = {"error": "static-fp16: experts need more than the budget"}
    (b / "summary.json").write_text(json.dumps(summary))
    return a, b


def test_csv_has_every_run_policy_and_exact_metrics(two_runs, capsys):
    a, b = two_runs
    assert main(["compare", str(a), str(b), "--csv"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)
    assert list(zip(table["run"], table["policy"], strict=True)) == [
        ("run_a", "static-fp16"),
        ("run_a", "pagedweight"),
        ("run_b", "static-fp16"),
        ("run_b", "pagedweight"),
    ]
    summary = json.loads((a / "summary.json").read_text())
    for i, policy in enumerate(("static-fp16", "pagedweight")):
        for key in KEY_METRICS:
            assert float(table.loc[i, key]) == pytest.approx(summary["policies"][policy][key]), key
    assert table.loc[2, "error"].startswith("static-fp16: experts need")
    assert (table["budget_gib"].astype(float) == 40 / 1024).all()


def test_text_table_names_runs_and_reasons(two_runs, capsys):
    a, b = two_runs
    assert main(["compare", str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["run", "runtime", "scenario", "budget", "GiB"]
    assert len(lines) == 5
    tput = json.loads((a / "summary.json").read_text())["policies"]["pagedweight"]["output_throughput"]
    assert lines[2].startswith("run_a") and "pagedweight" in lines[2] and f"{tput:.1f}" in lines[2]
    assert lines[3].startswith("run_b") and "infeasible: static-fp16: experts need" in lines[3]


def test_not_a_results_directory(tmp_path, capsys):
    assert main(["compare", str(tmp_path)]) == 2
    assert f"{tmp_path}: not a results directory" in capsys.readouterr().err


def test_huge_values_keep_columns_apart(two_runs, tmp_path, capsys):
    """A TTFT past 1e6 ms (an overloaded run) must not run into its neighbours, in pwsim run's
    table or in compare's."""
    from pwsim.commands.run import format_table

    a, _ = two_runs
    big = tmp_path / "big"
    shutil.copytree(a, big)
    summary = json.loads((big / "summary.json").read_text())
    huge = {"mean_ttft_ms": 154912200686.5, "p99_ttft_ms": 831287.1, "mean_tpot_ms": 2.5e7}
    summary["policies"]["static-fp16"] |= huge
    (big / "summary.json").write_text(json.dumps(summary))
    lines = format_table(summary).splitlines()
    head, row = lines[0].split(), lines[1].split()
    assert head[:3] == ["policy", "out", "tok/s"] and len(row) == 12  # every value its own field
    assert row[2:5] == ["154912200686.5", "831287.1", "25000000.00"]
    assert main(["compare", str(big)]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert "154912200686.5" in row and "831287.1" in row
