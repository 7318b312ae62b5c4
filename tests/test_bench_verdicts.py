"""The scoreboard's target check (pwsim/bench_targets.py) on tables made by hand."""

import math

import pandas as pd

from pwsim.bench_targets import cell_verdicts, sustainable_verdicts, targets_markdown


def scoreboard(rows):
    return pd.DataFrame(rows, columns=["cell", "load", "policy", "request_goodput", "mean_quality_proxy"])


def test_goodput_within_two_percent_of_the_best_other_is_met_and_below_is_not():
    table = scoreboard(
        [
            ("a", 1.0, "static-int4", 10.0, 0.10),
            ("a", 1.0, "pagedweight", 9.81, 0.001),  # -1.9%
            ("b", 1.0, "static-int4", 10.0, 0.10),
            ("b", 1.0, "pagedweight", 9.79, 0.001),  # -2.1%
        ]
    )
    v = cell_verdicts(table).set_index("cell")
    assert v.at["a", "goodput_met"] and not v.at["b", "goodput_met"]
    assert v.at["a", "best_other"] == "static-int4"
    assert math.isclose(v.at["a", "goodput_margin"], -0.019)


def test_quality_is_compared_among_the_policies_that_reach_the_goodput():
    table = scoreboard(
        [
            # static-fp16 is far below pagedweight's goodput: its 0 proxy does not count.
            ("a", 1.0, "static-fp16", 5.0, 0.0),
            ("a", 1.0, "static-int8", 9.9, 0.0015),  # within 2% of pagedweight: it reaches it
            ("a", 1.0, "pagedweight", 10.0, 0.0016),  # within 10% of 0.0015
            ("b", 1.0, "static-fp16", 5.0, 0.0),
            ("b", 1.0, "static-int8", 9.9, 0.0010),
            ("b", 1.0, "pagedweight", 10.0, 0.0016),  # 60% above the best reaching
        ]
    )
    v = cell_verdicts(table).set_index("cell")
    assert v.at["a", "quality_met"] and v.at["a", "best_quality_reaching"] == "static-int8"
    assert not v.at["b", "quality_met"]


def test_a_best_quality_of_zero_asks_for_zero():
    table = scoreboard(
        [
            ("a", 1.0, "static-fp16", 3.863, 0.0),
            ("a", 1.0, "pagedweight", 3.867, 3e-6),
            ("b", 1.0, "static-fp16", 3.863, 0.0),
            ("b", 1.0, "pagedweight", 3.867, 0.0),
        ]
    )
    v = cell_verdicts(table).set_index("cell")
    assert not v.at["a", "quality_met"] and v.at["a", "best_quality_reaching"] == "static-fp16"
    assert v.at["b", "quality_met"]


def test_cells_without_the_policy_are_left_out_and_the_markdown_counts_them():
    table = scoreboard(
        [
            ("a", 1.0, "static-int4", 10.0, 0.1),
            ("a", 1.0, "pagedweight", 10.5, 0.001),
            ("a", 2.0, "static-int4", 10.0, 0.1),
            ("a", 2.0, "pagedweight", 8.0, 0.001),
            ("c", 1.0, "static-int4", 10.0, 0.1),
        ]
    )
    sustainable = pd.DataFrame(
        [("a", "static-int4", 1.0), ("a", "pagedweight", 2.0)], columns=["cell", "policy", "max_load"]
    )
    v = cell_verdicts(table)
    assert list(zip(v["cell"], v["load"], strict=True)) == [("a", 1.0), ("a", 2.0)]
    held = sustainable_verdicts(sustainable)
    assert held["met"].tolist() == [True]
    text = "\n".join(targets_markdown(table, sustainable))
    assert "goodput met in 1 of 2" in text and "quality met in 2 of 2" in text and "both in 1 of 2" in text
    assert "largest sustainable load met in 1 of 1 cells" in text
    assert "**no**" in text


def test_a_cell_where_the_policy_failed_is_not_met():
    """An infeasible run has no figures (NaN in the scoreboard): neither target is met."""
    table = scoreboard([("a", 1.0, "static-int4", 10.0, 0.1), ("a", 1.0, "pagedweight", math.nan, math.nan)])
    v = cell_verdicts(table).iloc[0]
    assert not v["goodput_met"] and not v["quality_met"]
