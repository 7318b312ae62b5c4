"""Runs without step tables (``pwsim bench`` by default): the summary and the request table are
those of a run with every table, on one GPU, expert-parallel, and in clusters routed statically
(replicas in worker processes) or by their state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_cluster_sim import _scenario as cluster_scenario
from test_cluster_sim import _trace
from test_ep_sim import _scenario as ep_scenario

from pagedweight.config.scenario import load_scenario
from pagedweight.results.writer import STEP_TABLES
from pwsim.run import run_scenario
from pwsim.sweep import run_cell

WALL_KEYS = {"wall_s", "sim_s_per_wall_s", "created", "date"}


def _without_wall(o):
    if isinstance(o, dict):
        return {k: _without_wall(v) for k, v in o.items() if k not in WALL_KEYS}
    if isinstance(o, list):
        return [_without_wall(v) for v in o]
    return o


def _case(tmp_path: Path, case: str):
    """The case's loaded scenario and its worker count."""
    if case == "ep8":
        return ep_scenario(tmp_path), 1
    trace = _trace(tmp_path, n=24)
    cluster = {"one-gpu": None, "round-robin": {"replicas": 3}, "least-kv": {"replicas": 2, "router": "least-kv"}}
    extra = {"cluster": cluster[case]} if cluster[case] else {}
    return load_scenario(cluster_scenario(tmp_path, trace, **extra)), 2 if case == "round-robin" else 1


@pytest.mark.parametrize("case", ["one-gpu", "round-robin", "least-kv", "ep8"])
def test_a_run_without_step_tables_has_the_same_summary_and_requests(tmp_path, case):
    loaded, jobs = _case(tmp_path, case)
    full = run_scenario(loaded, tmp_path / "full", report=False, jobs=jobs)
    lean = run_scenario(loaded, tmp_path / "lean", report=False, jobs=jobs, step_tables=False)
    assert _without_wall(lean) == _without_wall(full)
    assert (tmp_path / "lean" / "requests.csv").read_bytes() == (tmp_path / "full" / "requests.csv").read_bytes()
    written = {p.name for p in (tmp_path / "lean").iterdir()}
    assert written == {"summary.json", "requests.csv", "scenario.resolved.yaml"}, written
    full_tables = {p.stem for p in (tmp_path / "full").glob("*.csv")}
    assert full_tables - {"requests"} <= set(STEP_TABLES) and {"steps", "transitions"} <= full_tables
    assert json.loads((tmp_path / "lean" / "summary.json").read_text())["policies"].keys() == full["policies"].keys()


def test_a_report_asks_for_the_step_tables(tmp_path):
    loaded = load_scenario(cluster_scenario(tmp_path, _trace(tmp_path, n=4)))
    with pytest.raises(ValueError, match="step tables"):
        run_scenario(loaded, tmp_path / "out", report=True, step_tables=False)


def test_a_sweep_cell_without_step_tables(tmp_path):
    path = cluster_scenario(tmp_path, _trace(tmp_path, n=8))
    raw = yaml.safe_load(path.read_text()) | {"policies": ["static-int4"]}
    path.write_text(yaml.safe_dump(raw))
    run_cell(str(path), [], str(tmp_path / "cell"), {"x": 1}, False, False)
    assert {p.name for p in (tmp_path / "cell").iterdir()} == {
        "summary.json",
        "requests.csv",
        "scenario.resolved.yaml",
        "cell.json",
    }
