"""The overload check: the backlog's growth late in a run, and the note `pwsim run` prints for it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedweight.results.backlog import MAX_LOAD_RATIO, MIN_REQUESTS, overload_note, queue_growth

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _fifo(arrival_s: np.ndarray, service_s: float) -> np.ndarray:
    """Finish times of one FIFO server taking ``service_s`` a request."""
    finish = np.empty_like(arrival_s)
    free_s = 0.0
    for i, t in enumerate(arrival_s):
        free_s = max(free_s, t) + service_s
        finish[i] = free_s
    return finish


def _none_rejected(n: int) -> np.ndarray:
    return np.zeros(n, dtype=bool)


def test_a_policy_that_keeps_up_has_no_growth_however_long_its_requests():
    arrival = np.arange(400) * 0.5  # 2 req/s, each in the system for 30 s: ~60 at a time, steady
    g = queue_growth(arrival, arrival + 30.0, _none_rejected(400))
    assert g["backlog_growth_per_s"] == pytest.approx(0.0, abs=0.05)
    assert g["load_ratio"] == pytest.approx(1.0, abs=0.03)
    assert g["drain_s"] == pytest.approx(30.0) and g["backlog_at_last_arrival"] == 60
    assert overload_note("p", g) is None


@pytest.mark.parametrize("rho", [1.25, 2.0, 4.0])
def test_an_overloaded_fifo_queue_reads_its_load(rho):
    """Served at mu = 1 req/s, fed at rho req/s: the backlog grows by rho - 1 a second."""
    arrival = np.arange(2000) / rho
    g = queue_growth(arrival, _fifo(arrival, 1.0), _none_rejected(2000))
    assert g["backlog_growth_per_s"] == pytest.approx(rho - 1, rel=0.02)
    assert g["load_ratio"] == pytest.approx(rho, rel=0.02)
    note = overload_note("static-fp16", g)
    assert note.startswith("static-fp16: the queue kept growing") and f"~{g['load_ratio']:.2f}x" in note


def test_the_order_of_service_does_not_hide_a_backlog():
    """The same server serving the newest arrival first (LIFO): late arrivals see short waits,
    early ones wait to the end; the count in the system grows all the same."""
    arrival = np.arange(2000) / 2.0
    done, finish, queue, now = 0, np.full(2000, np.nan), [], 0.0
    i = 0
    while done < 2000:  # one server, 1 s a request, the newest waiting request next
        while i < 2000 and arrival[i] <= now:
            queue.append(i)
            i += 1
        if not queue:
            now = arrival[i]
            continue
        j = queue.pop()
        now += 1.0
        finish[j] = now
        done += 1
    g = queue_growth(arrival, finish, _none_rejected(2000))
    assert g["load_ratio"] == pytest.approx(2.0, rel=0.02)
    assert overload_note("pagedweight", g) is not None


def test_a_light_load_on_the_same_server_reads_none():
    arrival = np.arange(2000) / 0.8
    g = queue_growth(arrival, _fifo(arrival, 1.0), _none_rejected(2000))
    assert g["backlog_growth_per_s"] == pytest.approx(0.0, abs=1e-9)
    assert g["load_ratio"] == pytest.approx(1.0)
    assert overload_note("p", g) is None


def test_a_backlog_of_milliseconds_is_none_to_note():
    arrival = np.arange(1000) * 0.001  # overloaded, but it all clears 0.5 s after the last arrival
    g = queue_growth(arrival, _fifo(arrival, 0.0015), _none_rejected(1000))
    assert g["load_ratio"] > 1.4 and g["drain_s"] < 1.0
    assert overload_note("p", g) is None


def test_unfinished_requests_stay_in_the_system_and_rejected_ones_do_not_count():
    n = 40
    arrival = np.arange(n, dtype=float)
    finish = arrival + 1.0
    finish[n // 2 :] = np.nan  # nothing finished in the second half: nothing served late
    g = queue_growth(arrival, finish, _none_rejected(n))
    assert g["load_ratio"] == MAX_LOAD_RATIO and g["backlog_at_last_arrival"] == n // 2
    assert "100x or more" in overload_note("p", {**g, "drain_s": 5.0})
    # The same requests with the unfinished ones rejected instead: none of them is counted.
    g = queue_growth(arrival, np.where(np.isnan(finish), 0.0, finish), np.isnan(finish))
    assert g["backlog_growth_per_s"] == 0.0 and g["load_ratio"] == pytest.approx(1.0)


def test_too_few_requests_or_one_instant_tell_nothing():
    few = np.arange(MIN_REQUESTS - 1, dtype=float)
    assert queue_growth(few, few + 5, _none_rejected(len(few)))["load_ratio"] == 0.0
    burst = np.zeros(40)  # every request at t = 0
    g = queue_growth(burst, np.arange(1.0, 41.0), _none_rejected(40))
    assert g["load_ratio"] == 0.0 and g["drain_s"] == 40.0 and g["backlog_at_last_arrival"] == 40


def test_pwsim_run_notes_the_policy_whose_queue_kept_growing(tmp_path, capsys):
    """One request at a time (max_num_seqs 1), each ~200 steps long, fed faster than that: the
    summary carries the trend, and the table and the report carry a note naming the policy."""
    import json

    from pwsim.cli import main

    overrides = ["scheduler.max_num_seqs=1", "workload.num_requests=40", "workload.arrival.rate_qps=10",
                 "workload.lengths.output_tokens=200", "policies=[static-fp16]"]  # fmt: skip
    args = ["run", str(FIXTURES / "scenarios" / "good.yaml"), "--out", str(tmp_path / "run"), "--no-progress"]
    args += ["--jobs", "1"] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 0
    out = capsys.readouterr().out
    figures = json.loads((tmp_path / "run" / "summary.json").read_text())["policies"]["static-fp16"]
    assert figures["load_ratio"] > 1.5 and figures["drain_s"] > 1
    assert "note: static-fp16: the queue kept growing" in out
    assert "Note: static-fp16: the queue kept growing" in (tmp_path / "run" / "report.html").read_text()
    # The same scenario as shipped keeps up: no note.
    args = ["run", str(FIXTURES / "scenarios" / "good.yaml"), "--out", str(tmp_path / "ok"), "--no-progress"]
    assert main([*args, "--no-report", "--jobs", "1"]) == 0
    assert "queue kept growing" not in capsys.readouterr().out
