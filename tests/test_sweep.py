"""Sweeps: the grid, deterministic cell names, strict sweep files, resuming after an
interruption, the local process pool, and Ray."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pwsim.run
from pagedweight.results.report_sweep import pareto_front
from pwsim.cli import main
from pwsim.sweep import SweepError, cell_for, load_sweep, run_sweep

import proc

SCENARIO = """\
name: small
model: tiny-moe
gpu: h200
memory: {budget: 34 MiB, page_bytes: 64 KiB, kv_block_tokens: 16}
workload:
  kind: synthetic
  arrival: {kind: poisson, rate_qps: 40.0}
  lengths: {kind: fixed, prompt_tokens: 1200, output_tokens: 30}
  num_requests: 40
"""
SWEEP = """\
name: tiny
scenario: small.yaml
set:
  policies: [static-fp16, pagedweight]
grid:
  memory.budget: [34 MiB, 40 MiB]
  workload.arrival.rate_qps: [20.0, 40.0]
"""


def _files(tmp_path: Path, sweep: str = SWEEP) -> Path:
    (tmp_path / "small.yaml").write_text(SCENARIO)
    path = tmp_path / "tiny.yaml"
    path.write_text(sweep)
    return path


def _summary_mtimes(out: Path, names) -> dict[str, int]:
    return {n: (out / n / "summary.json").stat().st_mtime_ns for n in names}


def test_grid_and_cell_names(tmp_path):
    sweep = load_sweep(_files(tmp_path))
    assert len(sweep.cells) == 4
    assert [c.params for c in sweep.cells] == [
        {"memory.budget": "34 MiB", "workload.arrival.rate_qps": 20.0},
        {"memory.budget": "34 MiB", "workload.arrival.rate_qps": 40.0},
        {"memory.budget": "40 MiB", "workload.arrival.rate_qps": 20.0},
        {"memory.budget": "40 MiB", "workload.arrival.rate_qps": 40.0},
    ]
    names = [c.name for c in sweep.cells]
    assert len(set(names)) == 4 and names[0].startswith("budget-34MiB_rate_qps-20.0_")
    assert names == [c.name for c in load_sweep(tmp_path / "tiny.yaml").cells]  # same file, same names
    # a change in the fixed keys is a different experiment: different names
    other = sweep.spec.model_copy(update={"set": {"policies": ["pagedweight"]}})
    assert cell_for(other, sweep.cells[0].params).name != names[0]
    # a single policy name in the grid is a one-policy run
    one = sweep.spec.model_copy(update={"grid": {"policies": ["static-int4"]}})
    assert cell_for(one, {"policies": "static-int4"}).overrides[-1] == 'policies=["static-int4"]'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (SWEEP + "colour: red\n", "tiny.yaml: colour: unknown key; allowed keys here: cell_reports, description, grid"),
        (SWEEP.replace("memory.budget", "memory.budgett"), "grid cell memory.budgett='34 MiB'"),
        (SWEEP.replace("[34 MiB, 40 MiB]", "[]"), "memory.budget: give at least one value"),
        (SWEEP.replace("[34 MiB, 40 MiB]", "[34 MiB, 34 MiB]"), "memory.budget: a value is listed twice"),
        (SWEEP.replace("[34 MiB, 40 MiB]", "[1 MiB]"), "memory.budget: 0.00 GiB cannot hold tiny-moe"),
        (SWEEP.replace("  policies:", "  memory.budget: 1 GiB\n  policies:"), "memory.budget both in set and in grid"),
        (SWEEP.replace("scenario: small.yaml", "scenario: none.yaml"), "scenario: file"),
        (SWEEP.replace("[static-fp16, pagedweight]", "[static-fp17]"), "set: " + "{tmp}/small.yaml: policies: unknown"),
        (SWEEP.replace("memory.budget:", "'memory..budget':"), "is not a dotted scenario key"),
    ],
)
def test_sweep_file_errors_name_file_and_key(tmp_path, text, message):
    with pytest.raises(SweepError) as e:
        load_sweep(_files(tmp_path, text))
    assert str(e.value).startswith(str(tmp_path / "tiny.yaml"))
    assert message.format(tmp=tmp_path) in str(e.value)


def test_resume_runs_only_missing_cells(tmp_path, monkeypatch):
    sweep = load_sweep(_files(tmp_path))
    names = [c.name for c in sweep.cells]
    out = tmp_path / "out"
    # Interrupt the sweep inside its second cell, after that cell wrote part of its results.
    real_run = pwsim.run.run_scenario
    calls = []

    def interrupted(loaded, out_dir, **kw):
        calls.append(Path(out_dir))
        if len(calls) == 2:
            Path(out_dir).mkdir(parents=True)
            (Path(out_dir) / "steps.csv").write_text("step\n0\n")
            raise KeyboardInterrupt
        return real_run(loaded, out_dir, **kw)

    monkeypatch.setattr(pwsim.run, "run_scenario", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep, out, workers=1, log=lambda _: None)
    assert (out / names[0] / "summary.json").is_file()
    assert not (out / names[1]).exists()  # the half-written cell never took the final name
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [calls[1].name]
    monkeypatch.setattr(pwsim.run, "run_scenario", real_run)

    result = run_sweep(sweep, out, workers=1, log=lambda _: None)
    assert result["skipped"] == names[:1] and sorted(result["ran"]) == sorted(names[1:])
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # the leftover was cleaned
    table = result["table"]
    assert len(table) == 8 and set(table["policy"]) == {"static-fp16", "pagedweight"}
    assert set(table["cell"]) == set(names)
    for name in names:
        cell = json.loads((out / name / "cell.json").read_text())
        assert cell["params"] == next(c.params for c in sweep.cells if c.name == name)

    # Delete one finished cell's summary: only that cell runs again.
    before = _summary_mtimes(out, names)
    (out / names[2] / "summary.json").unlink()
    result = run_sweep(sweep, out, workers=1, log=lambda _: None)
    assert result["ran"] == [names[2]] and sorted(result["skipped"]) == sorted(names[:2] + names[3:])
    after = _summary_mtimes(out, names)
    assert {n: after[n] == before[n] for n in names} == {n: n != names[2] for n in names}
    page = (out / "report.html").read_text()
    assert '<img alt="Pareto plots' in page and "data:image/png;base64," in page
    assert (out / "sweep.csv").is_file() and json.loads((out / "sweep.json").read_text())["name"] == "tiny"


def test_cli_local_process_pool(tmp_path, capsys):
    path = _files(tmp_path, SWEEP.replace("[34 MiB, 40 MiB]", "[34 MiB]"))
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--workers", "2"]) == 0
    assert "ran 2 cells, skipped 0" in capsys.readouterr().out
    assert len([p for p in out.iterdir() if (p / "summary.json").is_file()]) == 2
    assert main(["sweep", str(path), "--out", str(out)]) == 0
    assert "ran 0 cells, skipped 2" in capsys.readouterr().out
    assert main(["sweep", str(path), "--out", str(out), "--address", "x:1"]) == 2
    assert "--address is for --executor ray" in capsys.readouterr().err
    assert main(["sweep", str(path), "--out", str(out), "--jobs", "0"]) == 2  # --jobs as in pwsim run
    assert "--workers(=0) must be >= 1" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_ray_executor_against_local_cluster(tmp_path, capsys, monkeypatch):
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'pagedweight[ray]'")
    ray_bin = Path(sys.executable).with_name("ray")
    port = _free_port()
    # A throw-away cluster on this machine: no token authentication (Ray turns it on once a
    # token file exists), for the head and for this process, the driver.
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    env = dict(os.environ)
    temp_dir = Path("/tmp") / f"ray_{port}"  # Ray's socket paths must stay short
    cmd = [str(ray_bin if ray_bin.exists() else shutil.which("ray")), "start", "--head", "--block",
           f"--port={port}", "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp_dir}"]  # fmt: skip
    try:
        # The head and every Ray process it starts are in one process group, stopped at the end.
        with proc.spawn(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as head:
            address = f"127.0.0.1:{port}"
            deadline = time.monotonic() + proc.hang_guard_s(15)  # a hang guard: ~15 s to come up when quiet
            while not _listening(port):
                assert head.poll() is None, "ray start --head exited"
                assert time.monotonic() < deadline, "hang guard: ray start --head not listening"
                time.sleep(0.5)
            path = _files(tmp_path, SWEEP.replace("[34 MiB, 40 MiB]", "[34 MiB]"))
            out = tmp_path / "out"
            assert main(["sweep", str(path), "--out", str(out), "--executor", "ray", "--address", address]) == 0
            assert "ran 2 cells, skipped 0" in capsys.readouterr().out
            names = [c.name for c in load_sweep(path).cells]
            assert all((out / n / "summary.json").is_file() for n in names)
            (out / names[1] / "summary.json").unlink()
            assert main(["sweep", str(path), "--out", str(out), "--executor", "ray", "--address", address]) == 0
            assert "ran 1 cells, skipped 1" in capsys.readouterr().out
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_pareto_front():
    tput = np.array([100.0, 200.0, 150.0, 300.0, 300.0, 50.0])
    quality = np.array([0.0, 0.01, 0.02, 0.1, 0.05, 0.0])
    # (150, 0.02) is beaten by (200, 0.01); (300, 0.1) by (300, 0.05); (50, 0) by (100, 0)
    assert pareto_front(tput, quality).tolist() == [0, 1, 4]
