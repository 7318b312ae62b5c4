"""Policies and sweep cells in worker processes: the same files as one process, one line per
job when not on a terminal, and Ctrl-C stops every worker, keeps finished cells, exits 130."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedweight.config.scenario import load_scenario
from pagedweight.errors import PagedWeightError
from pwsim.executor import Job, LineDisplay, dispatch_order, run_jobs
from pwsim.run import run_scenario

FIXTURES = Path(__file__).parent / "fixtures"
PRESSURE = (
    "memory.budget=40 MiB",
    "memory.page_bytes=16 KiB",
    "memory.kv_block_tokens=8",
    "workload.num_requests=150",
    "workload.arrival.rate_qps=400",
    "workload.lengths.prompt_tokens=600",
    "workload.lengths.output_tokens=60",
    "policies=[static-fp16, static-int4, kv-swap, paper-greedy, pagedweight]",
)
WALL_KEYS = ("wall_s", "sim_s_per_wall_s")


def _without_wall(summary: dict) -> dict:
    return {p: {k: v for k, v in s.items() if k not in WALL_KEYS} for p, s in summary["policies"].items()}


def test_workers_write_exactly_what_one_process_writes(tmp_path):
    loaded = load_scenario(FIXTURES / "scenarios" / "good.yaml", list(PRESSURE))
    one = run_scenario(loaded, tmp_path / "one", report=False, jobs=1)
    two = run_scenario(loaded, tmp_path / "two", report=False, jobs=2)
    assert list(two["policies"]) == list(one["policies"])  # the scenario's order, not finishing order
    assert _without_wall(two) == _without_wall(one)
    for name in ("requests.csv", "steps.csv", "transitions.csv", "initial_precisions.csv"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    left = sorted(p.name for p in (tmp_path / "two").iterdir())
    assert left == sorted(p.name for p in (tmp_path / "one").iterdir())  # no parts folder left behind


def _square(x, progress):
    progress(0.5)
    return x * x


def _fail(x, progress):
    raise PagedWeightError(f"job {x} cannot run")


def test_executor_order_lines_and_errors():
    lines: list[str] = []
    jobs = [Job(f"j{i}", _square, (i,)) for i in range(5)]
    assert run_jobs(jobs, 2, LineDisplay(lines.append), on_result=lambda i, r: f"j{i} -> {r}") == [0, 1, 4, 9, 16]
    assert sorted(lines) == sorted(f"j{i} -> {i * i}" for i in range(5))
    with pytest.raises(PagedWeightError, match="job 1 cannot run"):  # a worker's error, same message
        run_jobs([Job("a", _square, (1,)), Job("b", _fail, (1,))], 2)


def _started_at(x, progress):
    start_s = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
    time.sleep(0.05)
    return (x, os.getpid(), start_s)


class _Cycle:
    """An object in a reference cycle (only the cyclic collector frees it)."""

    def __init__(self):
        self.me = self


_LEFT_BEHIND: list = []  # weak references to the cycles jobs left, in the worker process


def _leave_a_cycle(x, progress):
    import gc
    import weakref

    alive = sum(r() is not None for r in _LEFT_BEHIND)  # before this job collects anything
    cycle = _Cycle()
    _LEFT_BEHIND.append(weakref.ref(cycle))
    gc.collect()  # aged into the oldest generation while alive, as a finished simulation is
    return alive


def test_a_worker_collects_what_a_finished_job_left_before_the_next():
    # One worker, jobs one after another: each finds the cycles of the jobs before it freed
    # (a worker grew by a cluster replica's memory with every job before).
    assert run_jobs([Job(f"j{i}", _leave_a_cycle, (i,)) for i in range(3)], 2) == [0, 0, 0]


def test_workers_take_the_costliest_jobs_first_and_results_keep_job_order():
    costs = [1.0, 1.0, 3.0, 2.0, 1.0]
    jobs = [Job(f"j{i}", _started_at, (i,), cost=c) for i, c in enumerate(costs)]
    order = dispatch_order(jobs)
    assert order == [2, 3, 0, 1, 4]  # costliest first; equal costs in job order
    results = run_jobs(jobs, 2)
    assert [x for x, _, _ in results] == [0, 1, 2, 3, 4]
    # Each worker ran its jobs in dispatch order, and the first two went out first, one to each
    # worker (start times across workers depend on when each worker process got going).
    by_worker: dict[int, list[tuple[float, int]]] = {}
    for x, pid, start_s in results:
        by_worker.setdefault(pid, []).append((start_s, x))
    ran = [[x for _, x in sorted(v)] for v in by_worker.values()]
    assert len(ran) == 2 and {r[0] for r in ran} == {2, 3}
    for r in ran:
        assert r == sorted(r, key=order.index)


def test_run_prints_a_line_per_policy_when_not_on_a_terminal(tmp_path):
    args = [sys.executable, "-m", "pwsim.cli", "run", str(FIXTURES / "scenarios" / "good.yaml"), "--jobs", "2"]
    args += ["--out", str(tmp_path / "out"), "--no-report", "--policy", "static-fp16", "--policy", "static-int4"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr  # no bar updates in a log
    policy_lines = [line for line in done.stderr.splitlines() if line.startswith("static-")]
    assert len(policy_lines) == 2 and all("simulated s in" in line for line in policy_lines)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal for stderr")
def test_run_draws_a_bar_only_on_a_terminal(tmp_path):
    """With stderr a terminal (here a pseudo-terminal that reports no size, the hardest case)
    the progress is one bar counting jobs, and each policy's line is printed above it."""
    import pty

    primary, secondary = pty.openpty()
    args = [sys.executable, "-m", "pwsim.cli", "run", str(FIXTURES / "scenarios" / "good.yaml"), "--jobs", "2"]
    args += ["--out", str(tmp_path / "out"), "--no-report", "--policy", "static-fp16", "--policy", "static-int4"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=secondary, stdin=subprocess.DEVNULL)
    os.close(secondary)
    chunks = []
    while True:  # read while it runs: a full pty buffer would block the writer
        try:
            data = os.read(primary, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    assert p.wait(timeout=300) == 0
    err = b"".join(chunks).decode(errors="replace")
    assert re.search(r"\d+%\|.*\| [0-2]/2 .*job", err), err  # the bar, counting jobs
    lines = [line.rstrip("\r").rpartition("\r")[2] for line in err.split("\n")]  # what a terminal shows
    assert sum(line.startswith("static-") and "simulated s in" in line for line in lines) == 2, err


# ---- Ctrl-C -----------------------------------------------------------------------------------

SLOW_SCENARIO = """\
name: slow
model: tiny-moe
gpu: h200
memory: {budget: 34 MiB, page_bytes: 64 KiB, kv_block_tokens: 16}
workload:
  kind: synthetic
  arrival: {kind: poisson, rate_qps: 40.0}
  lengths: {kind: fixed, prompt_tokens: 300, output_tokens: 30}
  num_requests: 20
policies: [static-fp16]
"""


def _group(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
            except ProcessLookupError:
                pass
    return pids


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def group():
    """Start a command in its own process group; the whole group is killed in teardown."""
    started: list[subprocess.Popen] = []

    def start(args, **kw) -> subprocess.Popen:
        p = subprocess.Popen(args, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)


# `pwsim` as a terminal starts it: SIGINT raising KeyboardInterrupt. A test run launched in the
# background by a non-interactive shell (`cmd &`) inherits SIGINT ignored, and Python keeps an
# ignored SIGINT ignored, so the CLI would (rightly) not react to the simulated Ctrl-C.
_CLI_WITH_CTRL_C = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('pwsim.cli', run_name='__main__', alter_sys=True)"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process groups from /proc")
@pytest.mark.parametrize("command", ["sweep", "run"])
def test_ctrl_c_stops_every_worker_and_exits_130(tmp_path, group, command):
    (tmp_path / "slow.yaml").write_text(SLOW_SCENARIO)
    out = tmp_path / "out"
    if command == "sweep":
        # One quick cell, then two that would run for many minutes.
        (tmp_path / "sweep.yaml").write_text(
            "name: s\nscenario: slow.yaml\ngrid:\n  workload.num_requests: [20, 300000, 300001]\n"
        )
        args = ["sweep", str(tmp_path / "sweep.yaml"), "--workers", "2", "--out", str(out)]
    else:
        args = ["run", str(tmp_path / "slow.yaml"), "--jobs", "2", "--out", str(out), "--no-report"]
        args += ["--set", "workload.num_requests=300000", "--set", "policies=[static-fp16, static-int4]"]
    p = group([sys.executable, "-c", _CLI_WITH_CTRL_C, *args])
    pgid = p.pid
    if command == "sweep":
        _wait_for(lambda: len(list(out.glob("*/summary.json"))) == 1, 300, "the quick cell")
    else:
        _wait_for(lambda: len(list(out.glob(".parts-*"))) == 1, 300, "the run to start")
    _wait_for(lambda: len(_group(pgid)) >= 3, 300, "two workers")  # the CLI and its workers
    time.sleep(1.0)  # the workers are inside their jobs now
    os.killpg(pgid, signal.SIGINT)  # what a terminal's Ctrl-C does
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 130, stderr
    err = stderr.decode().strip().splitlines()
    assert err[-1] == f"pwsim {command}: interrupted" and "Traceback" not in stderr.decode(), stderr
    _wait_for(lambda: not _group(pgid), 30, "every process of the run to end")
    if command == "sweep":
        finished = [d for d in out.iterdir() if (d / "summary.json").is_file()]
        assert len(finished) == 1 and json.loads((finished[0] / "cell.json").read_text())["params"] == {
            "workload.num_requests": 20
        }
    else:
        assert not (out / "summary.json").exists() and not list(out.glob(".parts-*"))


def _tenfold(x, progress):
    return 10 * x


@pytest.mark.parametrize("workers", [1, 2])
def test_jobs_added_as_others_finish_run_in_the_same_workers(workers):
    """``then`` adds jobs while the run goes on (the bench's bisection follows each cell's grid
    runs this way): every added job runs, once, and its result follows in the list."""
    added: list[int] = []

    def then(index, result):
        if result < 30 and result % 10 == 0:  # the first generation each add one more job
            added.append(index)
            return [Job(f"after-{index}", _tenfold, (result // 10 + 10,))]
        return []

    jobs = [Job(f"j{i}", _tenfold, (i,)) for i in range(3)]
    results = run_jobs(jobs, workers, then=then)
    assert results[:3] == [0, 10, 20]
    assert sorted(results[3:]) == [100, 110, 120] and len(results) == 6
    assert sorted(added) == [0, 1, 2]


def test_added_jobs_go_ahead_of_those_not_started():
    order: list[int] = []

    def then(index, result):
        order.append(result)
        return [Job("follow", _tenfold, (7,))] if result == 0 else []

    run_jobs([Job(f"j{i}", _tenfold, (i,)) for i in range(3)], 1, then=then)
    assert order == [0, 70, 10, 20]
