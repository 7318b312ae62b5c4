"""reports/claims.md: regenerated from its committed inputs it is unchanged, and the figures it
states follow the definitions it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedweight.errors import PagedWeightError
from pwgpu.claims import claim_overhead, claim_throughput, compute, figures_json, read_scoreboard, render

ROOT = Path(__file__).resolve().parents[1]


def test_claims_file_matches_its_inputs(monkeypatch):
    monkeypatch.chdir(ROOT)  # the file names its inputs by their paths in the repository
    figures = compute(Path("reports/quality"), [Path("reports/claims/sim_scoreboard.csv")])
    assert (ROOT / "reports" / "claims.md").read_text() == render(figures)
    assert (ROOT / "reports" / "claims" / "claims.json").read_text() == figures_json(figures)


def test_a_drifted_input_changes_the_claims(tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(ROOT)
    board = [Path("reports/claims/sim_scoreboard.csv")]
    before = render(compute(Path("reports/quality"), board))
    quality = tmp_path / "quality"
    shutil.copytree(ROOT / "reports" / "quality", quality)
    ratios = quality / "equal_memory_ratios.csv"
    lines = ratios.read_text().splitlines()
    head = lines[0].split(",")
    i = next(n for n, line in enumerate(lines) if ",marginal," in line and ",ours," in f",{line}")
    cells = lines[i].split(",")
    cells[head.index("ratio")] = repr(float(cells[head.index("ratio")]) * 1.5)  # one gain edited
    lines[i] = ",".join(cells)
    ratios.write_text("\n".join(lines) + "\n")
    assert render(compute(quality, board)) != before


def _rows(table):
    return [
        {"scenario": sc, "seed": seed, "policy": p, "output_throughput": tp}
        for sc, seed, per in table
        for p, tp in per.items()
    ]


def test_throughput_and_overhead_follow_their_definitions():
    rows = _rows(
        [
            ("a", 0, {"static-fp16": 100.0, "static-mixed": 200.0, "pagedweight": 196.0, "static-int8": 200.0}),
            ("a", 1, {"static-fp16": 100.0, "static-mixed": 200.0, "pagedweight": 190.0, "static-int8": 200.0}),
            ("b", 0, {"static-fp16": 100.0, "static-mixed": 120.0, "pagedweight": 119.0, "static-int8": 120.0}),
        ]
    )
    tp = claim_throughput(rows, [])
    assert tp["best"]["scenario"] == "a" and tp["best"]["mean"] == pytest.approx(1.93)
    assert tp["best"]["min"] == pytest.approx(1.9) and tp["verdict"] == "does not hold"
    ov = claim_overhead(rows, [])
    assert ov["worst"] == pytest.approx(0.05) and ov["verdict"] == "does not hold"  # seed 1 of a: 5% > 4.1%
    better = _rows(
        [
            ("a", 0, {"static-fp16": 100.0, "static-mixed": 200.0, "pagedweight": 196.0}),
            ("a", 1, {"static-fp16": 100.0, "static-mixed": 200.0, "pagedweight": 197.0}),
        ]
    )
    assert claim_overhead(better, [])["verdict"] == "holds"  # 2% and 1.5%
    assert claim_throughput(better, [])["verdict"] == "holds"  # 1.96x and 1.97x


def test_scoreboards_from_csv_and_from_pwsim_results(tmp_path):
    csv_path = tmp_path / "board.csv"
    csv_path.write_text("# run_time_s: 12.5\nscenario,seed,policy,output_throughput\nx,0,pagedweight,3.5\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "scenario": "y",
                "model": "m",
                "gpu": "g",
                "seed": 2,
                "policies": {"static-fp16": {"output_throughput": 1.0}, "kv-swap": {"error": "x"}},
            }
        )
    )
    rows, seconds = read_scoreboard([csv_path, run_dir])
    assert seconds == 12.5
    assert rows == [
        {"scenario": "x", "seed": 0, "policy": "pagedweight", "output_throughput": 3.5},
        {"scenario": "y", "seed": 2, "policy": "static-fp16", "output_throughput": 1.0, "model": "m", "gpu": "g"},
    ]
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(PagedWeightError, match="needs columns scenario, policy, output_throughput"):
        read_scoreboard([tmp_path / "bad.csv"])
    with pytest.raises(PagedWeightError, match="does not exist"):
        read_scoreboard([tmp_path / "missing.csv"])
