"""Cells of the policy scoreboards (``scenarios/bench_small.yaml``, ``bench_default.yaml``) where
``pagedweight`` still misses its target: best or within 2% of the best policy on goodput and on the largest
sustainable load, and within 10% of the best quality proxy among the policies that reach its
goodput (``benchmarks/RESULTS.md`` has the whole table). Each miss is a test of its reason,
and an ``xfail(strict=True)`` of the target itself, which fails the day the cell is won, so
that this file is brought up to date.

chat-100g at 1x: every request of both policies meets the SLOs; goodput's span (vLLM's: first
arrival to last completion) ends with two 1,000-token answers that arrived 3.6 s before the
last arrival. static-int4 decodes them at INT4 speed; pagedweight, with no SLO at risk and no
queue, decodes them at the precision the backlog left (FP8, as fast to read as INT8) or the
one it restores once the queue has been calm for ``backlog_calm_s``. Matching it would take
INT4 precision with nothing at risk, i.e. static-int4's quality proxy (0.10, 10-25x
pagedweight's here).

multiturn-100g at 1x (``scenarios/bench_default.yaml``, an hour): static-fp16 already meets
both SLOs for every request, at a quality proxy of 0. Under a TTFT SLO pagedweight weighs the
cache against downgrades by how hard the queue has pressed lately; at this load it presses only
in a few short spells (several long returning prompts waiting at once, the projected wait past
half the backlog threshold). Even the little weight those spells leave keeps the cache against
the coldest experts, whose downgrade costs almost nothing: a few of them go down (24 in the
first five minutes, none back). The rest of the time the cache gives way first, so its hit rate
is about static-fp16's. The same goodput at a quality proxy of a few 1e-6 in five minutes (a few
1e-5 over the hour, 1/11 of the unscaled weighing's) still misses "within 10% of the best" when
the best is exactly 0. The shipped 10-minute ``scenarios/multiturn.yaml`` shows the same; the
test runs its first five minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedweight.config.scenario import load_scenario
from pwsim.bench import good_fraction

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def chat_1x(tmp_path_factory):
    """The bench's chat-100g cell at load 1 (its suite's overrides), for the two policies."""
    from pwsim.run import run_scenario

    sets = ["workload.duration_s=120", "policies=[static-int4, pagedweight]"]
    loaded = load_scenario(ROOT / "scenarios" / "chat.yaml", sets)
    out = tmp_path_factory.mktemp("chat_1x")
    summary = run_scenario(loaded, out, report=False)
    import pandas as pd

    return summary["policies"], pd.read_csv(out / "requests.csv")


def test_chat_1x_misses_goodput_only_by_the_span_of_its_last_long_answers(chat_1x):
    s, requests = chat_1x
    int4, pw = s["static-int4"], s["pagedweight"]
    # The same requests meet the SLOs (all but none or one): goodput differs by its span only.
    assert good_fraction(pw) >= 0.998 and good_fraction(int4) >= 0.998
    good = {p: s[p]["request_goodput"] * s[p]["duration_s"] for p in s}
    assert good["pagedweight"] >= good["static-int4"] - 1
    # The span ends with the same long answers, decoded after the last arrival.
    last_arrival = requests["arrival_s"].max()
    for policy in ("static-int4", "pagedweight"):
        r = requests[requests["policy"] == policy].sort_values("finish_s")
        tail = r.tail(2)
        assert (tail["output_tokens"] >= 1000).all(), policy
        assert (tail["finish_s"] > last_arrival).all(), policy
    # ... at a quality proxy far below static-int4's.
    assert pw["mean_quality_proxy"] < int4["mean_quality_proxy"] / 10


@pytest.mark.xfail(strict=True, reason="chat-100g 1x: goodput's span is set by the last long answers (module doc)")
def test_chat_1x_goodput_within_2_percent_of_static_int4(chat_1x):
    s, _ = chat_1x
    assert s["pagedweight"]["request_goodput"] >= 0.98 * s["static-int4"]["request_goodput"]


@pytest.fixture(scope="module")
def multiturn_1x(tmp_path_factory):
    """The first five minutes of the multi-turn cell, static-fp16 and pagedweight."""
    from pwsim.run import run_scenario

    sets = ["workload.duration_s=300", "policies=[static-fp16, pagedweight]"]
    loaded = load_scenario(ROOT / "scenarios" / "multiturn.yaml", sets)
    summary = run_scenario(loaded, tmp_path_factory.mktemp("multiturn_1x"), report=False)
    return summary["policies"]


def test_multiturn_1x_spends_quality_only_in_short_spells_when_the_queue_presses(multiturn_1x):
    fp16, pw = multiturn_1x["static-fp16"], multiturn_1x["pagedweight"]
    # Every request meets the SLOs under both: the same goodput (within 2%).
    assert good_fraction(fp16) >= 0.99 and good_fraction(pw) >= 0.99
    assert pw["request_goodput"] >= 0.98 * fp16["request_goodput"]
    # The queue stays calm: the cache gives way first, as static-fp16's does (the same hits).
    assert abs(pw["prefix_cache_hit_rate"] - fp16["prefix_cache_hit_rate"]) < 0.01
    # A few downgrades all the same: a quality proxy above static-fp16's zero, but tiny.
    assert pw["num_downgrades"] > 0 and 0 < pw["mean_quality_proxy"] < 1e-5


@pytest.mark.xfail(strict=True, reason="multiturn-100g 1x: downgrades while the queue presses (module doc)")
def test_multiturn_1x_quality_within_10_percent_of_static_fp16(multiturn_1x):
    fp16, pw = multiturn_1x["static-fp16"], multiturn_1x["pagedweight"]
    assert pw["mean_quality_proxy"] <= 1.1 * fp16["mean_quality_proxy"]
