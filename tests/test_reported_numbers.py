"""Every table the reports print is rendered from the committed outputs it reports: a number
edited by hand, or an output regenerated without its table, fails here."""

from __future__ import annotations

import shutil
from pathlib import Path

from pwgpu.quality_tables import BLOCK, RENDERERS, WHOLE_FILES, sync, sync_files

ROOT = Path(__file__).resolve().parents[1]
QUALITY = ROOT / "reports" / "quality"


def test_quality_readme_tables_match_their_outputs():
    text = (QUALITY / "README.md").read_text()
    names = [m.group("name") for m in BLOCK.finditer(text)]
    assert {"exp1", "exp2-thresholds", "exp2-gains", "exp3", "exp4"} <= set(names)
    assert set(names) <= set(RENDERERS)
    assert sync(QUALITY / "README.md", QUALITY) == []


def test_the_reports_beside_the_outputs_match_them(tmp_path):
    assert all((QUALITY / name).is_file() for name in WHOLE_FILES)
    assert sync_files(QUALITY) == []
    d = tmp_path / "quality"
    shutil.copytree(QUALITY, d)
    report = d / "served_quality.md"
    report.write_text(report.read_text().replace("|", "!", 1))
    assert sync_files(d) == ["served_quality.md"]
    assert sync_files(d, write=True) == ["served_quality.md"] and sync_files(d) == []


def test_a_drifted_number_is_caught(tmp_path):
    d = tmp_path / "quality"
    shutil.copytree(QUALITY, d)
    csv_path = d / "exp1_quality_vs_memory.csv"
    lines = csv_path.read_text().splitlines()
    cells = lines[1].split(",")
    cells[7] = repr(float(cells[7]) * 2)  # one KL doubled
    csv_path.write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    assert sync(d / "README.md", d) == ["exp1"]
    assert sync(d / "README.md", d, write=True) == ["exp1"]
    assert sync(d / "README.md", d) == []


def test_run_times_and_the_oracle_text_come_from_the_outputs(tmp_path):
    from pwgpu.quality_tables import exp3_oracle, run_times

    d = tmp_path / "quality"
    d.mkdir()
    (d / "estimators.csv").write_text(
        "# calibration_tokens: 16384; oracle_tokens: 2048; oracle_text: fold 3 of 4, disjoint from calibration "
        "folds 0,1,2; run_time_s: 321.4; load_start: 2.50; load_end: 3.00; cpus: 2\nlayer,expert\n"
    )
    assert "oracle measured on 2,048 tokens of calibration fold 3 of 4, disjoint" in exp3_oracle(d)
    assert "| importance table and `estimators.csv` | 321 s | 2.5, 3.0 on 2 CPUs |" in run_times(d)
    (d / "estimators.csv").write_text("# calibration_tokens: 16384; oracle_tokens: 2048\nlayer,expert\n")
    assert "not disjoint" in exp3_oracle(d) and "| not recorded | not recorded |" in run_times(d)
