"""The overload check: TTFT's trend late in a run, and the note `pwsim run` prints for it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedweight.results.backlog import MIN_REQUESTS, overload_note, queue_growth

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _fifo(arrival_s: np.ndarray, service_s: float) -> np.ndarray:
    """First-token times of one FIFO server taking ``service_s`` a request."""
    first = np.empty_like(arrival_s)
    free_s = 0.0
    for i, t in enumerate(arrival_s):
        free_s = max(free_s, t) + service_s
        first[i] = free_s
    return first


def test_a_queue_that_keeps_up_has_no_growth_however_high_its_ttft():
    arrival = np.arange(400) * 0.5  # 2 req/s
    first = arrival + 30.0  # a constant 30 s wait: high, but not growing
    g = queue_growth(arrival, first, np.zeros(400, dtype=bool), float(first[-1]))
    assert g["queue_growth_s_per_s"] == pytest.approx(0.0, abs=1e-12)
    assert g["late_median_ttft_ms"] == pytest.approx(30_000.0)
    assert overload_note("p", g) is None


@pytest.mark.parametrize("rho", [1.25, 2.0, 4.0])
def test_an_overloaded_fifo_queue_reads_its_load(rho):
    """Served at mu = 1 req/s, fed at rho req/s: TTFT grows at rho - 1 seconds per second."""
    arrival = np.arange(2000) / rho
    first = _fifo(arrival, 1.0)
    g = queue_growth(arrival, first, np.zeros(2000, dtype=bool), float(first[-1]))
    assert g["queue_growth_s_per_s"] == pytest.approx(rho - 1, rel=0.01)
    note = overload_note("static-fp16", g)
    assert note.startswith("static-fp16: the queue kept growing") and f"~{rho:.2f}x" in note


def test_a_light_load_on_the_same_server_reads_none():
    arrival = np.arange(2000) / 0.8
    first = _fifo(arrival, 1.0)
    g = queue_growth(arrival, first, np.zeros(2000, dtype=bool), float(first[-1]))
    assert g["queue_growth_s_per_s"] == pytest.approx(0.0, abs=1e-9)
    assert overload_note("p", g) is None


def test_a_trend_of_milliseconds_is_no_backlog():
    arrival = np.arange(1000) * 0.001  # an overload, but the run is 1 s long: TTFTs stay under 1 s
    first = _fifo(arrival, 0.0015)
    g = queue_growth(arrival, first, np.zeros(1000, dtype=bool), float(first[-1]))
    assert g["queue_growth_s_per_s"] > 0.4 and g["late_median_ttft_ms"] < 1000
    assert overload_note("p", g) is None


def test_unserved_requests_wait_until_the_end_and_rejected_ones_do_not_count():
    n = 40
    arrival = np.arange(n, dtype=float)
    first = arrival + 1.0
    first[3 * n // 4 :] = np.nan  # the last quarter never got a token by the end, t = 100 s
    rejected = np.zeros(n, dtype=bool)
    g = queue_growth(arrival, first, rejected, 100.0)
    late = 100.0 - arrival[3 * n // 4 :]
    assert g["late_median_ttft_ms"] == pytest.approx(np.median(late) * 1e3)
    assert g["queue_growth_s_per_s"] > 1.0
    # The same requests with the unserved ones rejected instead: none of them is counted.
    g2 = queue_growth(arrival, np.where(np.isnan(first), 0.0, first), np.isnan(first), 100.0)
    assert g2["queue_growth_s_per_s"] == pytest.approx(0.0) and g2["late_median_ttft_ms"] == pytest.approx(1000.0)


def test_too_few_requests_or_one_instant_give_no_trend():
    few = np.arange(MIN_REQUESTS - 1, dtype=float)
    assert queue_growth(few, few + 5, np.zeros(len(few), dtype=bool), 99.0)["queue_growth_s_per_s"] == 0.0
    burst = np.zeros(40)  # every request at t = 0
    g = queue_growth(burst, np.arange(40.0), np.zeros(40, dtype=bool), 40.0)
    assert g["queue_growth_s_per_s"] == 0.0 and g["late_median_ttft_ms"] > 0


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
    assert figures["queue_growth_s_per_s"] > 0.5 and figures["late_median_ttft_ms"] > 1000
    assert "note: static-fp16: the queue kept growing" in out
    assert "Note: static-fp16: the queue kept growing" in (tmp_path / "run" / "report.html").read_text()
    # The same scenario as shipped keeps up: no note.
    args = ["run", str(FIXTURES / "scenarios" / "good.yaml"), "--out", str(tmp_path / "ok"), "--no-progress"]
    assert main([*args, "--no-report", "--jobs", "1"]) == 0
    assert "queue kept growing" not in capsys.readouterr().out
