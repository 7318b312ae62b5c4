"""`pwsim allocate` and `pwsim importance` from the outside."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from pagedweight.policy.allocate import allocate
from pagedweight.policy.importance import read_table
from pwsim.cli import main

import proc


@pytest.fixture
def table_path(tmp_path):
    path = tmp_path / "olmoe.csv"
    assert main(["importance", "synth", "--model", "olmoe-1b-7b", "--out", str(path), "--seed", "4"]) == 0
    return path


def read_plan(path):
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]
    assert lines[0] == "layer,expert,precision,bytes,dloss"
    return [ln.split(",") for ln in lines[1:]]


@pytest.mark.parametrize("method", ["paper-greedy", "marginal", "exact", "uniform", "frequency"])
def test_allocate_prints_and_writes_the_plan(table_path, tmp_path, capsys, method):
    table = read_table(table_path)
    budget = int(table.bytes[:, 2].sum())  # everyone at int8, or a mix of the same size
    out = tmp_path / "plan.csv"
    rc = main(["allocate", "--importance", str(table_path), "--budget-bytes", str(budget), "--method", method,
               "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0
    expected = allocate(table, budget, method)
    assert "SYNTHETIC" in text and f"method {method}: 1024 experts (16 layers x 64)" in text
    assert f"used {expected.total_bytes} bytes" in text
    assert f"sum dloss {expected.sum_dloss:.6g}" in text
    assert "experts per precision: " + "  ".join(f"{k} {v}" for k, v in expected.counts().items()) in text
    rows = read_plan(out)
    assert len(rows) == 1024
    assert sum(int(r[3]) for r in rows) == expected.total_bytes <= budget
    assert [r[2] for r in rows] == np.array(table.ladder)[expected.levels].tolist()
    assert sum(float(r[4]) for r in rows) == pytest.approx(expected.sum_dloss)


def test_budget_fraction_and_lp_gap_line(table_path, capsys):
    assert main(["allocate", "--importance", str(table_path), "--budget-fraction", "0.4"]) == 0
    text = capsys.readouterr().out
    table = read_table(table_path)
    budget = int(0.4 * table.bytes[:, 0].sum())
    assert f"budget {budget} bytes" in text and "40.0% of all at bf16" in text
    assert "LP bound" in text and "gap" in text


def test_infeasible_budget_is_a_clear_error(table_path, capsys):
    assert main(["allocate", "--importance", str(table_path), "--budget-bytes", "1000"]) == 2
    err = capsys.readouterr().err
    assert "pwsim allocate: error: budget_bytes=1000" in err and "below the minimum" in err and "at int4" in err


def test_bad_table_is_a_clear_error(table_path, capsys):
    text = table_path.read_text().replace("bytes_int8", "bytes_int9")
    table_path.write_text(text)
    assert main(["allocate", "--importance", str(table_path), "--budget-fraction", "0.5"]) == 2
    assert "unknown precision 'int9'" in capsys.readouterr().err


def test_importance_check_summarises(table_path, capsys):
    assert main(["importance", "check", str(table_path)]) == 0
    text = capsys.readouterr().out
    assert "ok, 16 layers x 64 experts, ladder bf16, fp8, int8, int4" in text
    assert "routing_freq per layer sums to 8.000..8.000" in text


def test_synthetic_model_through_a_subprocess(tmp_path):
    out = tmp_path / "plan.csv"
    done = proc.run(
        [sys.executable, "-m", "pwsim.cli", "allocate", "--synthetic-model", "mixtral-8x7b", "--budget-fraction",
         "0.3", "--method", "marginal", "--out", str(out)],
        quiet_s=3,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("importance table: mixtral-8x7b, SYNTHETIC")
    assert "method marginal: 256 experts (32 layers x 8)" in done.stdout
    assert out.read_text().startswith("# importance table: mixtral-8x7b, SYNTHETIC")
    assert len(read_plan(out)) == 256
