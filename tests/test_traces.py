"""Trace loaders, synthetic arrivals, workload building, `pwsim trace stats|synth`."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedweight.config.workload import RateSegment, parse_workload
from pagedweight.errors import TraceError
from pagedweight.workload.arrivals import gamma_arrivals, generate_arrivals, piecewise_arrivals, poisson_arrivals
from pagedweight.workload.build import build_workload, scale_rate, spread_buckets, truncate_to_context, window
from pagedweight.workload.stats import arrival_stats, trace_stats
from pagedweight.workload.synth import SYNTH_PRESETS, synthesize
from pagedweight.workload.traces import (
    RequestTrace,
    detect_format,
    load_azure,
    load_burstgpt,
    load_generic,
    load_lengths,
    load_mooncake,
    write_jsonl,
)
from pwsim.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "traces"
# The real traces live outside the repository (never copied in): beside the checkout, or where
# PAGEDWEIGHT_SHARED_TRACES points. Tests that read them skip when they are absent.
SHARED = Path(os.environ.get("PAGEDWEIGHT_SHARED_TRACES", ROOT.parent / "shared" / "traces"))


def shared_trace(name: str) -> Path:
    path = SHARED / name
    if not path.is_file():
        pytest.skip(f"shared trace {path} not found (set PAGEDWEIGHT_SHARED_TRACES to the traces folder)")
    return path


def _trace(arrival_s, prompt=None, output=None) -> RequestTrace:
    n = len(arrival_s)
    return RequestTrace(
        np.asarray(arrival_s, dtype=float),
        np.full(n, 10) if prompt is None else np.asarray(prompt),
        np.full(n, 5) if output is None else np.asarray(output),
        source="test",
    )


# --- loaders on hand-written fixtures ------------------------------------------------------------


def test_azure_seven_fractional_digits_and_zero_output():
    t = load_azure(FIX / "azure.csv")
    np.testing.assert_allclose(t.arrival_s, [0.0, 0.25, 1.1234567, 3.0, 3.5], atol=1e-9)
    assert t.prompt_tokens.tolist() == [100, 200, 300, 4000, 50]
    assert t.output_tokens.tolist() == [10, 20, 30, 40, 1]  # the 0 is counted as 1, and said so
    assert t.notes == ["1 requests had 0 output tokens; counted as 1"]
    assert t.arrival_s.dtype == np.float64 and t.prompt_tokens.dtype == np.int64
    assert len(t) == 5


def test_mooncake_ms_timestamps_blank_line_and_hash_ids_ignored():
    t = load_mooncake(FIX / "mooncake.jsonl")
    np.testing.assert_allclose(t.arrival_s, [0, 0, 0, 3.001, 6.002, 6.002])
    assert t.prompt_tokens.tolist() == [1000, 600, 513, 40, 2048, 1]
    assert t.output_tokens.tolist() == [5, 7, 9, 11, 13, 1]


def test_burstgpt_drops_failed_rows_and_says_so():
    t = load_burstgpt(FIX / "burstgpt.csv")
    assert t.arrival_s.tolist() == [0.0, 1.0, 7.0]  # relative to the first kept row (Timestamp 5)
    assert t.prompt_tokens.tolist() == [472, 230, 2201]
    assert t.notes == ["dropped 2 failed rows (zero response tokens)"]


def test_burstgpt_keep_failed_and_model_filter():
    kept = load_burstgpt(FIX / "burstgpt.csv", drop_failed=False)
    assert len(kept) == 5 and kept.output_tokens.tolist() == [18, 1, 311, 1, 405]
    assert "kept 2 failed rows" in kept.notes[0]
    gpt4 = load_burstgpt(FIX / "burstgpt.csv", model="GPT-4")
    assert gpt4.prompt_tokens.tolist() == [2201]
    assert gpt4.notes == ["kept 3 of 5 rows with Model 'GPT-4'", "dropped 2 failed rows (zero response tokens)"]
    with pytest.raises(TraceError, match="no rows with Model 'Llama'; models present: ChatGPT, GPT-4"):
        load_burstgpt(FIX / "burstgpt.csv", model="Llama")


def test_sharegpt_lengths():
    prompt, output = load_lengths(FIX / "sharegpt.csv")
    assert prompt.tolist() == [74, 290, 1, 5000] and output.tolist() == [918, 905, 2, 100]


def test_generic_csv_unsorted_in_ms_and_jsonl():
    with pytest.raises(TraceError, match=r"generic.csv:3: column 't_ms': earlier than the row before it; .*sort: true"):
        load_generic(FIX / "generic.csv", "t_ms", "in", "out", time_unit="ms")
    t = load_generic(FIX / "generic.csv", "t_ms", "in", "out", time_unit="ms", sort=True)  # opted in
    assert t.arrival_s.tolist() == [0.0, 1.0, 2.5]
    assert t.prompt_tokens.tolist() == [20, 30, 10]  # sorted by time, lengths follow their rows
    assert t.notes == ["sorted by time (1 rows were out of order)"]
    j = load_generic(FIX / "generic.jsonl", "arrival", "prompt", "completion")
    assert j.arrival_s.tolist() == [0.0, 0.5] and j.output_tokens.tolist() == [3, 9]


def test_jsonl_epoch_times_under_date_like_keys_stay_numbers():
    for key in ("arrival_time", "timestamp"):
        t = load_generic(FIX / "generic_epoch_ms.jsonl", key, "in", "out", time_unit="ms")
        assert t.arrival_s.tolist() == [0.0, 1.5]


@pytest.mark.parametrize(
    "name, load, message",
    [
        (
            "azure_bad_timestamp.csv",
            load_azure,
            r"azure_bad_timestamp.csv:3: column 'TIMESTAMP': expected a time .* \(got '2024-01-02 25:61:00.0000000'\)",
        ),
        (
            "azure_missing_column.csv",
            load_azure,
            r"missing column\(s\) GeneratedTokens; found: TIMESTAMP, ContextTokens",
        ),
        ("mooncake_negative.jsonl", load_mooncake, r"mooncake_negative.jsonl:3: column 'output_length': .* \(got -3\)"),
        ("mooncake_bad_json.jsonl", load_mooncake, r"mooncake_bad_json.jsonl:2: not valid JSON"),
        (
            "generic_non_numeric.csv",
            None,
            r"generic_non_numeric.csv:4: column 'prompt': expected a number \(got 'twelve'\)",
        ),
        ("generic_missing_value.csv", None, r"generic_missing_value.csv:4: column 'output': .*got an empty value"),
        ("generic_fractional.csv", None, r"generic_fractional.csv:2: column 'prompt': expected a whole number"),
        ("generic_extra_field.csv", None, r"generic_extra_field.csv:3: expected 3 comma-separated fields, found 4"),
    ],
)
def test_malformed_rows_name_file_line_and_column(name, load, message):
    load = load or (lambda p: load_generic(p, "arrival", "prompt", "output"))
    with pytest.raises(TraceError, match=message):
        load(FIX / name)


BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens"


def _generic(path, **kw):
    return load_generic(path, "at", "in", "out", **kw)


MOONCAKE_ROW = '{{"timestamp": {t}, "input_length": {p}, "output_length": 5}}\n'


@pytest.mark.parametrize(
    "t, p, message",
    [
        ("0", "1e30", r"line 3: column 'input_length': expected a whole number from 0 to 2,147,483,647 \(got 1e\+30\)"),
        ("0", "true", r"line 3: column 'input_length': expected a number, not a boolean \(got True\)"),
        ("0", "12.5", r"line 3: column 'input_length': expected a whole number"),
        ("-5", "10", r"line 3: column 'timestamp': expected a time >= 0 \(got -5\)"),
        ("NaN", "10", r"line 3: column 'timestamp': expected a number"),
        ("Infinity", "10", r"line 3: column 'timestamp': expected a finite number"),
        ("false", "10", r"line 3: column 'timestamp': expected a number, not a boolean"),
        ("500", "10", r"line 3: column 'timestamp': earlier than the row before it; .* \(got 500\)"),
    ],
)
def test_mooncake_values_that_are_refused(tmp_path, t, p, message):
    path = tmp_path / "bad.jsonl"
    rows = [MOONCAKE_ROW.format(t=0, p=10), MOONCAKE_ROW.format(t=1000, p=10), MOONCAKE_ROW.format(t=t, p=p)]
    path.write_text("".join(rows) + MOONCAKE_ROW.format(t=1000, p=10))
    with pytest.raises(TraceError, match=f"{path}:" + message.replace("line ", "")):
        load_mooncake(path)


@pytest.mark.parametrize(
    "loader, header, rows, column",
    [
        (load_azure, "TIMESTAMP,ContextTokens,GeneratedTokens",
         ["2023-11-16 18:15:46.0000000,10,5", "2023-11-16 18:15:45.0000000,10,5"], "TIMESTAMP"),
        (load_burstgpt, BURST_HEADER, ["5,GPT-4,10,0", "7,GPT-4,10,5", "6,GPT-4,3,4"], "Timestamp"),
        (lambda p, **kw: load_generic(p, "at", "in", "out", **kw), "at,in,out", ["1,10,5", "0.5,10,5"], "at"),
    ],
)  # fmt: skip
def test_every_timed_loader_refuses_time_going_backwards_unless_asked_to_sort(tmp_path, loader, header, rows, column):
    path = tmp_path / "t.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    with pytest.raises(TraceError, match=rf"t.csv:{len(rows) + 1}: column '{column}': earlier than the row before"):
        loader(path)
    t = loader(path, sort=True)
    assert t.notes[-1] == "sorted by time (1 rows were out of order)" and np.all(np.diff(t.arrival_s) >= 0)


@pytest.mark.parametrize(
    "loader, text, message",
    [
        (load_azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,1e30,5\n",
         r":2: column 'ContextTokens': expected a whole number from 0"),
        (load_burstgpt, f"{BURST_HEADER}\n-1,GPT-4,10,5\n", r":2: column 'Timestamp': expected a time >= 0"),
        (lambda p: load_lengths(p), "num_prefill_tokens,num_decode_tokens\n10,5\n99999999999999999999,5\n",
         r":3: column 'num_prefill_tokens': expected a whole number from 0"),
        (_generic, "at,in,out\n0,10,True\n", r":2: column 'out': expected a number, not a boolean"),
        (_generic, "at,in,out\ninf,10,5\n", r":2: column 'at': expected a finite number"),
    ],
)  # fmt: skip
def test_csv_values_that_are_refused(tmp_path, loader, text, message):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=f"t.csv{message}"):
        loader(path)


def test_missing_file_is_a_trace_error():
    with pytest.raises(TraceError, match="no such trace file"):
        load_azure(FIX / "does_not_exist.csv")


def test_detect_format():
    assert detect_format(FIX / "azure.csv") == "azure"
    assert detect_format(FIX / "mooncake.jsonl") == "mooncake"
    assert detect_format(FIX / "burstgpt.csv") == "burstgpt"
    assert detect_format(FIX / "sharegpt.csv") == "sharegpt"
    assert detect_format(FIX / "generic.csv") == "generic"


def test_request_trace_checks_and_is_read_only():
    with pytest.raises(ValueError, match="sorted"):
        _trace([1.0, 0.0])
    with pytest.raises(ValueError, match=">= 1"):
        _trace([0.0], prompt=[0])
    with pytest.raises(ValueError, match="equal length"):
        RequestTrace(np.zeros(2), np.ones(3, dtype=int), np.ones(2, dtype=int), source="x")
    source = np.array([0.0, 1.0])
    t = _trace(source)
    with pytest.raises(ValueError):
        t.arrival_s[0] = 5.0
    source[0] = -1.0  # the caller's array stays the caller's
    assert t.arrival_s[0] == 0.0


def test_write_jsonl_round_trip(tmp_path):
    t = _trace([0.0, 0.0014, 2.5], prompt=[1, 2, 3], output=[4, 5, 6])
    write_jsonl(t, tmp_path / "t.jsonl")
    back = load_mooncake(tmp_path / "t.jsonl")
    np.testing.assert_allclose(back.arrival_s, [0.0, 0.001, 2.5])
    assert back.prompt_tokens.tolist() == [1, 2, 3] and back.output_tokens.tolist() == [4, 5, 6]


# --- arrival processes ---------------------------------------------------------------------------


def test_arrivals_are_deterministic_with_a_seed():
    a = gamma_arrivals(3.0, 2.0, np.random.default_rng(7), num_requests=500)
    b = gamma_arrivals(3.0, 2.0, np.random.default_rng(7), num_requests=500)
    c = gamma_arrivals(3.0, 2.0, np.random.default_rng(8), num_requests=500)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_poisson_rate_and_cv():
    a = poisson_arrivals(5.0, np.random.default_rng(0), duration_s=20_000)
    assert a[0] == 0.0 and a[-1] < 20_000 and np.all(np.diff(a) >= 0)
    # 100k arrivals: the rate's standard error is ~0.3 %.
    assert len(a) / 20_000 == pytest.approx(5.0, rel=0.02)
    assert arrival_stats(a)["iat_cv"] == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_cv_measured_on_a_long_sample(cv):
    a = gamma_arrivals(10.0, cv, np.random.default_rng(1), num_requests=400_000)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_num_requests_and_duration_whichever_first():
    rng = np.random.default_rng(2)
    assert len(poisson_arrivals(100.0, rng, num_requests=50, duration_s=1000)) == 50
    short = poisson_arrivals(100.0, rng, num_requests=10**6, duration_s=2.0)
    assert 150 < len(short) < 250 and short[-1] < 2.0


def test_piecewise_segment_rates_and_idle_gap():
    segs = [RateSegment(duration_s=200, rate_qps=20), RateSegment(duration_s=100, rate_qps=0)]
    segs.append(RateSegment(duration_s=200, rate_qps=2))
    a = piecewise_arrivals(segs, np.random.default_rng(3))
    first, idle, last = (a < 200).sum(), ((a >= 200) & (a < 300)).sum(), (a >= 300).sum()
    assert idle == 0
    assert first == pytest.approx(4000, rel=0.06) and last == pytest.approx(400, rel=0.2)
    assert a[-1] < 500


def test_piecewise_cv_applies_within_segments():
    a = piecewise_arrivals([RateSegment(duration_s=20_000, rate_qps=10)], np.random.default_rng(4), cv=3.0)
    assert arrival_stats(a)["iat_cv"] == pytest.approx(3.0, rel=0.08)


def test_piecewise_stops_at_duration_s():
    a = piecewise_arrivals([RateSegment(duration_s=100, rate_qps=10)], np.random.default_rng(5), duration_s=30)
    assert a[-1] < 30 and len(a) == pytest.approx(300, rel=0.25)


# --- workload building ---------------------------------------------------------------------------


def test_rate_scale_two_halves_the_span():
    cfg = parse_workload({"kind": "trace", "path": "azure.csv", "format": "azure"})
    base = build_workload(cfg, FIX, 32768, np.random.default_rng(0))
    fast = build_workload(cfg.model_copy(update={"rate_scale": 2.0}), FIX, 32768, np.random.default_rng(0))
    assert fast.span_s() == pytest.approx(base.span_s() / 2)
    assert fast.notes[-1] == "rate x2"
    assert np.array_equal(fast.prompt_tokens, base.prompt_tokens)


def test_window_and_max_requests():
    cfg = parse_workload(
        {"kind": "trace", "path": "azure.csv", "format": "azure", "start_s": 0.2, "duration_s": 3.0, "max_requests": 2}
    )
    t = build_workload(cfg, FIX, 32768, np.random.default_rng(0))
    np.testing.assert_allclose(t.arrival_s, [0.05, 0.9234567])  # 0.25 and 1.1234567, shifted by 0.2
    assert t.notes == [
        "1 requests had 0 output tokens; counted as 1",
        "window [0.2, 3.2) s: 3 of 5 requests",
        "first 2 of 3 requests",
    ]
    with pytest.raises(TraceError, match="no requests in the window"):
        window(t, 100.0, 1.0)


def test_truncation_prompt_first_and_keeps_one_output_token():
    t = truncate_to_context(_trace([0, 1, 2, 3], prompt=[100, 100, 10, 50], output=[10, 50, 200, 500]), 120)
    assert t.prompt_tokens.tolist() == [100, 70, 1, 1]
    assert t.output_tokens.tolist() == [10, 50, 119, 119]
    assert t.notes == ["truncated 3 requests to the 120-token context (3 prompts, 2 outputs shortened)"]
    assert np.all(t.prompt_tokens + t.output_tokens <= 120)


@given(
    st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 10**5)), min_size=1, max_size=30),
    st.integers(2, 40_000),
)
def test_truncation_invariants(lengths, max_context_tokens):
    prompt, output = (np.array(x) for x in zip(*lengths, strict=True))
    t = truncate_to_context(_trace(np.zeros(len(prompt)), prompt, output), max_context_tokens)
    p, o = t.prompt_tokens, t.output_tokens
    assert np.all(p + o <= max_context_tokens) and np.all(p >= 1) and np.all(o >= 1)
    assert np.all(p <= prompt) and np.all(o <= output)
    fits = prompt + output <= max_context_tokens
    assert np.array_equal(p[fits], prompt[fits]) and np.array_equal(o[fits], output[fits])
    # Prompt first: an output that fits beside a 1-token prompt is never shortened.
    assert np.array_equal(o[output < max_context_tokens], output[output < max_context_tokens])


def test_build_workload_truncates_to_context():
    cfg = parse_workload({"kind": "trace", "path": "azure.csv", "format": "azure"})
    t = build_workload(cfg, FIX, 1000, np.random.default_rng(0))
    assert t.prompt_tokens.tolist() == [100, 200, 300, 960, 50]
    assert "truncated 1 requests to the 1000-token context" in t.notes[-1]


def test_spread_even_and_random_keep_order_and_bounds():
    t = load_mooncake(FIX / "mooncake.jsonl")
    even = spread_buckets(t, 3.0, "even", np.random.default_rng(0))
    np.testing.assert_allclose(even.arrival_s, [0.0, 1.0, 2.0, 3.001, 6.002, 7.502])
    assert even.notes == ["spread 5 requests sharing 2 timestamps over 3 s (even)"]
    rnd = spread_buckets(t, 3.0, "random", np.random.default_rng(0))
    assert np.all(np.diff(rnd.arrival_s) >= 0) and rnd.arrival_s[0] >= 0 and rnd.arrival_s[2] < 3.001
    assert rnd.prompt_tokens.tolist() == t.prompt_tokens.tolist()  # file order within a bucket
    # Never past the next timestamp: a 10 s bucket is cut at 3.001 s.
    wide = spread_buckets(t, 10.0, "even", np.random.default_rng(0))
    assert wide.arrival_s[2] < 3.001


def test_mooncake_config_spreads():
    cfg = parse_workload(
        {"kind": "trace", "path": "mooncake.jsonl", "format": "mooncake", "spread_bucket_s": 3.0, "rate_scale": 0.5}
    )
    t = build_workload(cfg, FIX, 32768, np.random.default_rng(0))
    np.testing.assert_allclose(t.arrival_s, np.array([0.0, 1.0, 2.0, 3.001, 6.002, 7.502]) * 2)


def test_sharegpt_with_poisson_arrivals_is_deterministic():
    cfg = parse_workload(
        {"kind": "trace", "path": "sharegpt.csv", "format": "sharegpt", "arrival": {"kind": "poisson", "rate_qps": 2}}
    )
    a = build_workload(cfg, FIX, 32768, np.random.default_rng(9))
    b = build_workload(cfg, FIX, 32768, np.random.default_rng(9))
    assert np.array_equal(a.arrival_s, b.arrival_s) and len(a) == 4
    assert a.prompt_tokens.tolist() == [74, 290, 1, 5000]


def test_synthetic_lognormal_and_file_lengths(tmp_path):
    cfg = parse_workload(
        {
            "kind": "synthetic",
            "arrival": {"kind": "poisson", "rate_qps": 50},
            "lengths": {
                "kind": "lognormal",
                "prompt": {"median": 1000, "p90": 3000, "min": 10, "max": 8000},
                "output": {"mean": 200, "sigma": 0.5},
            },
            "num_requests": 50_000,
        }
    )
    t = build_workload(cfg, tmp_path, 32768, np.random.default_rng(0))
    assert len(t) == 50_000
    assert np.median(t.prompt_tokens) == pytest.approx(1000, rel=0.03)
    assert np.percentile(t.prompt_tokens, 90) == pytest.approx(3000, rel=0.04)
    assert t.prompt_tokens.min() >= 10 and t.prompt_tokens.max() <= 8000
    assert t.output_tokens.mean() == pytest.approx(200, rel=0.02)
    files = parse_workload(
        {
            "kind": "synthetic",
            "arrival": {"kind": "gamma", "rate_qps": 1, "cv": 2},
            "lengths": {"kind": "file", "path": str(FIX / "sharegpt.csv"), "order": "sequential"},
            "num_requests": 6,
        }
    )
    s = build_workload(files, tmp_path, 32768, np.random.default_rng(0))
    assert s.prompt_tokens.tolist() == [74, 290, 1, 5000, 74, 290]


def test_synthetic_same_seed_same_trace():
    cfg = SYNTH_PRESETS["chat"].workload
    a = build_workload(cfg, ".", 32768, np.random.default_rng(11))
    b = build_workload(cfg, ".", 32768, np.random.default_rng(11))
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)


def test_scale_rate_rejects_nonpositive():
    with pytest.raises(ValueError, match="rate_scale"):
        scale_rate(_trace([0.0, 1.0]), 0.0)


def test_generate_arrivals_dispatch():
    cfg = parse_workload(
        {
            "kind": "synthetic",
            "arrival": {"kind": "piecewise", "segments": [{"duration_s": 10, "rate_qps": 5}]},
            "lengths": {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 2},
        }
    )
    a = generate_arrivals(cfg.arrival, np.random.default_rng(0))
    assert a[-1] < 10 and 20 < len(a) < 90


# --- the shared real traces: stats reproduce PROVENANCE.md ---------------------------------------


def test_azure_conv_stats_match_provenance():
    s = trace_stats(load_azure(shared_trace("azure_conv_2023.csv")))  # load speed: benchmarks/trace_load.py
    assert s["rows"] == 19_366
    assert s["span_s"] == pytest.approx(3501.7, abs=0.05)
    assert round(s["rate_qps"], 3) == 5.530
    assert round(s["iat_cv"], 2) == 1.09
    assert round(s["max_gap_s"], 1) == 4.3
    assert (round(s["count_1s_cv"], 2), s["count_1s_max"]) == (0.50, 16)
    assert (round(s["count_60s_cv"], 2), s["count_60s_max"]) == (0.25, 507)
    p = s["prompt_tokens"]
    assert (round(p["mean"], 1), p["median"], p["p90"], p["p99"], p["max"]) == (1154.7, 1020, 2734.5, 4142, 14050)
    o = s["output_tokens"]
    assert (round(o["mean"], 1), o["median"], o["p90"], o["p99"], o["max"]) == (211.1, 129, 424, 601, 1000)


def test_mooncake_synthetic_stats_match_provenance():
    s = trace_stats(load_mooncake(shared_trace("mooncake_synthetic.jsonl")))
    assert s["rows"] == 3993 and round(s["rate_qps"], 3) == 3.906 and round(s["iat_cv"], 2) == 1.01
    assert (round(s["count_60s_cv"], 3), s["count_60s_max"]) == (0.242, 273)
    p = s["prompt_tokens"]
    assert (round(p["mean"], 1), p["median"], round(p["p90"], 1), p["max"]) == (15325.5, 11587, 38611.2, 191378)


def test_sharegpt_lengths_match_provenance(capsys):
    assert main(["trace", "stats", str(shared_trace("sharegpt_lengths_llama2tok.csv"))]) == 0
    out = capsys.readouterr().out
    assert "rows                      30,731" in out
    assert "mean 2,340.0  median 1,730.0  p90 5,696.0  p99 7,433.7  max 8,141  min 1" in out
    assert "mean 438.7  median 415.0  p90 834.0  p99 998.0  max 1,024  min 2" in out


# --- the command line ----------------------------------------------------------------------------


def test_cli_stats_on_fixture(capsys):
    assert main(["trace", "stats", str(FIX / "mooncake.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "(mooncake)" in out and "rows                      6" in out
    assert "span                      6.0 s" in out


def test_cli_stats_error_exit_code(capsys):
    assert main(["trace", "stats", str(FIX / "generic_non_numeric.csv"), "--columns", "arrival,prompt,output"]) == 2
    assert re.search(r"generic_non_numeric.csv:4: column 'prompt'", capsys.readouterr().err)
    assert main(["trace", "stats", str(FIX / "generic.csv")]) == 2
    assert "needs --columns" in capsys.readouterr().err


def test_cli_synth_is_deterministic_and_readable(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (a, b):
        assert main(["trace", "synth", "--kind", "burst", "--seed", "3", "--duration-s", "60", "--out", str(out)]) == 0
    assert a.read_bytes() == b.read_bytes()
    t = load_mooncake(a)
    assert t.arrival_s[-1] < 60 and 100 < len(t) < 800
    assert "wrote" in capsys.readouterr().out


def test_synth_overrides_rate_and_cv():
    t = synthesize("chat", seed=0, num_requests=40_000, rate_qps=10.0, cv=2.0)
    s = trace_stats(t)
    assert len(t) == 40_000 and t.source == "synth:chat:seed=0"
    assert s["rate_qps"] == pytest.approx(10.0, rel=0.05) and s["iat_cv"] == pytest.approx(2.0, rel=0.06)
    with pytest.raises(ValueError, match="kind"):
        synthesize("nope", seed=0)
    with pytest.raises(ValueError, match=r"arrival.rate_qps: Input should be greater than 0 \(got 0.0\)"):
        synthesize("chat", seed=0, rate_qps=0.0)  # one line naming the field, not pydantic's dump


@pytest.mark.parametrize("kind", sorted(SYNTH_PRESETS))
def test_shipped_traces_regenerate_exactly(kind, tmp_path):
    """traces/README.md documents `pwsim trace synth --kind KIND --seed 1`; the files must match it."""
    shipped = ROOT / "traces" / f"{kind}.jsonl"
    assert shipped.stat().st_size < 300_000
    write_jsonl(synthesize(kind, seed=1), tmp_path / "t.jsonl")
    assert (tmp_path / "t.jsonl").read_bytes() == shipped.read_bytes()


@pytest.mark.parametrize("kind", [*sorted(SYNTH_PRESETS), "multiturn"])
def test_hour_long_bench_traces_regenerate_exactly(kind, tmp_path):
    """traces/bench/KIND_1h.jsonl (the default scoreboard suite's hour of each shipped trace) is
    `pwsim trace synth --kind KIND --seed 1 --duration-s 3600`, as traces/README.md says."""
    shipped = ROOT / "traces" / "bench" / f"{kind}_1h.jsonl"
    write_jsonl(synthesize(kind, seed=1, duration_s=3600), tmp_path / "t.jsonl")
    assert (tmp_path / "t.jsonl").read_bytes() == shipped.read_bytes()
    assert trace_stats(load_mooncake(shipped))["span_s"] == pytest.approx(3600, abs=2)


def test_shipped_traces_have_the_advertised_shape():
    longctx = trace_stats(load_mooncake(ROOT / "traces" / "longctx.jsonl"))
    assert 8000 <= longctx["prompt_tokens"]["mean"] <= 12000 and 1.0 <= longctx["rate_qps"] <= 2.0
    assert longctx["prompt_tokens"]["max"] + longctx["output_tokens"]["max"] <= 32768
    chat = trace_stats(load_mooncake(ROOT / "traces" / "chat.jsonl"))
    assert chat["iat_cv"] == pytest.approx(1.09, abs=0.1) and chat["rate_qps"] == pytest.approx(5.53, rel=0.05)
    burst = trace_stats(load_mooncake(ROOT / "traces" / "burst.jsonl"))
    assert burst["iat_cv"] >= 4.0


def test_pwsim_run_refuses_a_bad_trace_in_one_line_and_records_an_opted_in_sort(tmp_path, capsys):
    from pwsim.cli import main

    trace = tmp_path / "t.jsonl"
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "name: s\nmodel: tiny-moe\ngpu: h200\nmemory: {budget: 40 MiB, page_bytes: 64 KiB, kv_block_tokens: 16}\n"
        f"workload: {{kind: trace, path: {trace}, format: mooncake}}\npolicies: [static-fp16]\n"
    )
    trace.write_text(MOONCAKE_ROW.format(t=0, p=10) + MOONCAKE_ROW.format(t=5, p="1e30"))
    assert main(["run", str(scenario), "--out", str(tmp_path / "a"), "--no-report", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{trace}:2: column 'input_length': expected a whole number" in err[0]

    trace.write_text(MOONCAKE_ROW.format(t=900, p=10) + MOONCAKE_ROW.format(t=5, p=20))
    assert main(["run", str(scenario), "--out", str(tmp_path / "b"), "--no-report", "--no-progress"]) == 2
    assert f"{trace}:2: column 'timestamp': earlier than the row before it" in capsys.readouterr().err
    sets = ["--set", "workload.sort=true"]
    assert main(["run", str(scenario), "--out", str(tmp_path / "c"), "--no-report", "--no-progress", *sets]) == 0
    assert "trace: sorted by time (1 rows were out of order)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert "sorted by time (1 rows were out of order)" in summary["trace"]["notes"]
