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
