"""Short versions of the quality commands on a subset, from the command line as users run them:
pwgpu importance -> pwsim allocate -> pwgpu eval, and the experiments script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import proc

pytest.importorskip("torch")

from pagedweight.policy.importance import read_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "models" / "tiny-moe")
CALIB = [str(ROOT / "data" / "calib" / f"{d}.txt") for d in ("code", "shakespeare")]
EVAL = [str(ROOT / "data" / "eval" / f"{d}.txt") for d in ("code", "shakespeare")]


def _run(*args: str, quiet_s: float) -> str:
    done = proc.run([sys.executable, *args], cwd=ROOT, quiet_s=quiet_s)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def table_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("q")
    small = [
        "--tokens",
        "128",
        "--window",
        "64",
        "--oracle",
        "--oracle-tokens",
        "64",
        "--oracle-experts",
        "0:0,0:1,0:2",
        "--folds",
        "2",  # calibrate on fold 0, the oracle on fold 1: never the same text
    ]
    out = _run("-m", "pwgpu.cli", "importance", "--model", MODEL, "--data", *CALIB, "--out", str(d / "t.csv"),
               *small, "--details", str(d / "details.csv"), quiet_s=30)  # fmt: skip
    assert "wrote" in out
    return d / "t.csv"


def test_cli_modules_do_not_import_torch():
    code = (
        "import sys; import pwgpu.commands.importance as c, pwgpu.commands.eval, pwgpu.commands.train; "
        "assert 'torch' not in sys.modules; import pwgpu.importance as i; "
        "assert (c.TABLE_LADDER, c.DLOSS_SOURCES) == (i.TABLE_LADDER, i.DLOSS_SOURCES)"
    )
    _run("-c", code, quiet_s=3)


@pytest.mark.e2e
def test_importance_writes_a_table_pwsim_reads(table_path):
    table = read_table(table_path)
    assert (table.num_layers, table.num_experts) == (4, 8)
    assert table.ladder == ("bf16", "fp8", "int8", "int4", "int3", "int2")
    assert not table.synthetic and "calibration" in table.source
    assert (table.dloss[:, 0] == 0).all() and (table.dloss[:, -1] > 0).all()
    details = (table_path.parent / "details.csv").read_text().splitlines()
    assert "oracle_text: fold 1 of 2, disjoint from calibration folds 0" in details[0]
    assert "--folds 2 --fold 0" in table.source
    oracle = [ln.split(",")[-1] for ln in details[2:]]  # oracle_int2 of each expert
    assert sum(v != "nan" for v in oracle) == 3  # only the three requested experts were measured


@pytest.mark.e2e
def test_allocate_then_eval(table_path, tmp_path):
    plan = tmp_path / "plan.csv"
    _run("-m", "pwsim.cli", "allocate", "--importance", str(table_path), "--budget-fraction", "0.4",
         "--method", "marginal", "--out", str(plan), quiet_s=3)  # fmt: skip
    small = ["--max-tokens", "128", "--window", "64"]
    out = _run("-m", "pwgpu.cli", "eval", "--model", MODEL, "--plan", str(plan), "--data", *EVAL, *small,
               "--out", str(tmp_path / "r.csv"), quiet_s=10)  # fmt: skip
    rows = (tmp_path / "r.csv").read_text().splitlines()
    assert rows[0] == "plan,domain,tokens,kl_nats_per_token,ppl_full,ppl_plan" and len(rows) == 3
    assert all(float(r.split(",")[3]) > 0 for r in rows[1:]), out
    _run("-m", "pwgpu.cli", "eval", "--model", MODEL, "--uniform", "bf16", "--data", EVAL[0], *small,
         "--out", str(tmp_path / "full.csv"), quiet_s=10)  # fmt: skip
    (row,) = (tmp_path / "full.csv").read_text().splitlines()[1:]
    assert float(row.split(",")[3]) == 0.0  # the full-precision plan is the reference itself


@pytest.mark.e2e
def test_experiments_script_quick(table_path, tmp_path):
    out = tmp_path / "rep"
    small = ["--max-eval-tokens", "128", "--fractions", "0.3,0.6", "--calib-tokens", "128"]
    _run("-m", "pwgpu.cli", "experiments", "--model", MODEL, "--table", str(table_path),
         "--details", str(table_path.parent / "details.csv"), "--eval", *EVAL, "--calib", *CALIB,
         "--out", str(out), *small, quiet_s=40)  # fmt: skip
    names = ("exp1_quality_vs_memory.csv", "exp3_rank_correlation.csv", "exp4_drift.csv", "summary.json",
             "exp1_quality_vs_memory.png")  # fmt: skip
    for name in names:
        assert (out / name).is_file(), name


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--dloss", "oracle"], "--dloss oracle needs --oracle"),
        (["--oracle", "--oracle-experts", "a:b"], "LAYER:EXPERT"),
        (["--oracle", "--folds", "3", "--fold", "1,2"], "--oracle-fold 2 is also a calibration fold"),
        (["--folds", "0"], "--folds 0: must be >= 1"),
        (["--fold", "1"], "--fold/--oracle-fold need --folds >= 2"),
    ],
)
def test_conflicting_flags_are_refused_before_calibration(flags, words, tmp_path):
    cmd = [sys.executable, "-m", "pwgpu.cli", "importance", "--model", str(ROOT / "models" / "tiny-moe"),
           "--data", str(ROOT / "data" / "calib" / "code.txt"), "--out", str(tmp_path / "t.csv"), *flags]  # fmt: skip
    done = proc.run(cmd, quiet_s=5)
    assert done.returncode == 2 and words in done.stderr and "calibrated" not in done.stdout, done.stderr


def test_a_plan_with_a_non_integer_layer_is_one_clear_error(tmp_path):
    from pwgpu.evaluate import QualityError, read_plan

    plan = tmp_path / "plan.csv"
    plan.write_text("layer,expert,precision\n0,0,bf16\nx,1,int4\n")
    with pytest.raises(QualityError, match=r"plan.csv: row 3: layer and expert must be integers"):
        read_plan(plan, 1, 2)
