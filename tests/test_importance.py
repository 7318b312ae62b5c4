"""Importance tables: file format, validation messages, synthetic skew, routing drift."""

from __future__ import annotations

import numpy as np
import pytest

from pagedweight.core.spec import load_model
from pagedweight.errors import ImportanceError
from pagedweight.policy.allocate import Problem, allocate
from pagedweight.policy.hull import MarginalPlanner
from pagedweight.policy.importance import QUANT_NOISE, RoutingTracker, read_table, synthetic_table, write_table

FIELDS = ("routing_freq", "routing_weight_mass", "importance", "dloss", "bytes")


@pytest.fixture
def tiny():
    return synthetic_table(load_model("tiny-moe"), ("bf16", "int8", "int4"), seed=7)


def test_round_trip_is_exact(tmp_path, tiny):
    path = tmp_path / "t.csv"
    write_table(tiny, path)
    back = read_table(path)
    for name in FIELDS:
        assert np.array_equal(getattr(back, name), getattr(tiny, name)), name
    assert (back.ladder, back.num_layers, back.num_experts) == (tiny.ladder, 4, 8)
    assert back.synthetic and back.source == tiny.source and back.model == "tiny-moe"
    assert "SYNTHETIC" in back.provenance


def test_rows_in_any_order_load_layer_major(tmp_path, tiny):
    path = tmp_path / "t.csv"
    write_table(tiny, path)
    lines = path.read_text().splitlines()
    head = [ln for ln in lines if ln.startswith("#")] + [lines[4]]
    body = lines[5:]
    path.write_text("\n".join(head + body[::-1]) + "\n")
    back = read_table(path)
    assert np.array_equal(back.dloss, tiny.dloss) and np.array_equal(back.importance, tiny.importance)


def test_arrays_are_read_only(tiny):
    with pytest.raises(ValueError):
        tiny.dloss[0, 0] = 1.0


def _edit(tmp_path, table, edit) -> str:
    """Write ``table``, let ``edit(lines)`` change the text lines, return the path."""
    path = tmp_path / "t.csv"
    write_table(table, path)
    lines = path.read_text().splitlines()
    edit(lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _set_cell(lines, line_no, column, value):
    cols = lines[4].split(",")
    cells = lines[line_no - 1].split(",")
    cells[cols.index(column)] = value
    lines[line_no - 1] = ",".join(cells)


# Data starts on line 6: four header comments, then the column line.
@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("importance", "-0.5", r"t.csv:9, column importance: -0.5 is negative; must be >= 0"),
        ("dloss_int8", "nan", r"t.csv:9, column dloss_int8: nan is not a finite number"),
        ("dloss_int4", "lots", r"t.csv:9, column dloss_int4: 'lots' is not a number"),
        ("routing_freq", "1.5", r"t.csv:9, column routing_freq: 1.5 is a fraction of tokens, must be in \[0, 1\]"),
        ("bytes_int4", "999999999", r"t.csv:9: bytes_int4=999999999 exceeds bytes_int8=\d+; bytes must not increase"),
        ("bytes_bf16", "12.5", r"t.csv:9, column bytes_bf16: '12.5' must be an integer"),
        ("expert", "-1", r"t.csv:9, column expert: -1 must be >= 0"),
    ],
)
def test_bad_cell_names_file_line_and_column(tmp_path, tiny, column, value, message):
    path = _edit(tmp_path, tiny, lambda lines: _set_cell(lines, 9, column, value))
    with pytest.raises(ImportanceError, match=message):
        read_table(path)


def test_missing_expert_is_named(tmp_path, tiny):
    path = _edit(tmp_path, tiny, lambda lines: lines.pop(5 + 2 * 8 + 3))  # layer 2, expert 3
    with pytest.raises(ImportanceError, match=r"1 expert\(s\) missing from a 4 x 8 table: \(layer 2, expert 3\)"):
        read_table(path)


def test_duplicate_expert_names_both_lines(tmp_path, tiny):
    def dup(lines):
        lines[6] = lines[5]

    with pytest.raises(ImportanceError, match=r"t.csv:7: layer 0 expert 0 already given on line 6"):
        read_table(_edit(tmp_path, tiny, dup))


def test_unknown_precision_column_lists_allowed(tmp_path, tiny):
    def rename(lines):
        lines[4] = lines[4].replace("dloss_int8", "dloss_int5")

    with pytest.raises(
        ImportanceError, match=r"t.csv:5: column 'dloss_int5' names unknown precision 'int5'; allowed: bf16"
    ):
        read_table(_edit(tmp_path, tiny, rename))


def test_unknown_column_and_unpaired_precision(tmp_path, tiny):
    def extra(lines):
        lines[4] = lines[4].replace("importance", "importanse")

    with pytest.raises(ImportanceError, match=r"unknown column 'importanse'; allowed: layer, expert"):
        read_table(_edit(tmp_path, tiny, extra))

    def unpaired(lines):
        lines[4] = lines[4].replace("bytes_int8", "bytes_fp8")

    with pytest.raises(ImportanceError, match=r"precision 'int8' has no bytes_int8 column"):
        read_table(_edit(tmp_path, tiny, unpaired))


def test_short_row_and_missing_file(tmp_path, tiny):
    def short(lines):
        lines[7] = ",".join(lines[7].split(",")[:-1])

    with pytest.raises(ImportanceError, match=r"t.csv:8: 10 fields, the header has 11"):
        read_table(_edit(tmp_path, tiny, short))
    with pytest.raises(ImportanceError, match="cannot read importance table"):
        read_table(tmp_path / "absent.csv")


def test_synthetic_table_shape_bytes_and_marking():
    model = load_model("deepseek-v3")
    t = synthetic_table(model, ("int4", "bf16", "fp8", "int8", "int3"), seed=0)
    assert t.ladder == ("bf16", "fp8", "int8", "int4", "int3")  # sorted most precise first
    assert t.dloss.shape == (58 * 256, 5) and t.synthetic and "synthetic_table(seed=0" in t.source
    assert (t.bytes[:, 3] == model.expert_bytes("int4")).all()
    assert np.allclose(t.grid(t.routing_freq).sum(axis=1), model.top_k, rtol=1e-9)
    assert np.allclose(t.grid(t.routing_weight_mass).sum(axis=1), 1.0)
    assert (t.dloss[:, 0] == 0).all()  # bf16 is the reference
    assert t.dloss[:, 3].sum() == pytest.approx(0.1, rel=0.05)  # int4_total_dloss, up to per-precision noise
    # The modelled noise ordering holds on average: int3 > int4 > fp8 > int8 > bf16.
    means = t.dloss.mean(axis=0)
    assert means[4] > means[3] > means[1] > means[2] > means[0]
    assert QUANT_NOISE["int3"] / QUANT_NOISE["int4"] == 4.0


def test_synthetic_losses_of_an_fp8_checkpoint_are_against_its_fp8_experts():
    model = load_model("deepseek-v3")
    t = synthetic_table(model, ("int4", "fp8-b128"), seed=0)
    assert t.ladder == ("fp8-b128", "int4")
    assert (t.dloss[:, 0] == 0).all() and (t.dloss[:, 1] > 0).all()  # the FP8 checkpoint is the reference
    assert (t.bytes[:, 0] == model.expert_bytes("fp8-b128")).all()


def test_an_fp8_block_ladder_round_trips_through_a_file(tmp_path):
    t = synthetic_table(load_model("tiny-moe"), ("fp8-b128", "int4"), seed=2)
    write_table(t, tmp_path / "fp8.csv")
    back = read_table(tmp_path / "fp8.csv")
    assert back.ladder == ("fp8-b128", "int4") and np.array_equal(back.dloss, t.dloss)
    assert "dloss_fp8-b128" in (tmp_path / "fp8.csv").read_text()


def test_zipf_exponent_controls_routing_skew():
    model = load_model("deepseek-v3")

    def top_decile_share(s):
        t = synthetic_table(model, seed=1, zipf_exponent=s)
        f = np.sort(t.grid(t.routing_freq), axis=1)[:, ::-1]
        return f[:, : model.num_experts // 10].sum() / f.sum()

    assert top_decile_share(0.0) < 0.2 < top_decile_share(0.8) < top_decile_share(1.2)


def test_same_seed_same_table_different_seed_different_table():
    model = load_model("olmoe-1b-7b")
    a, b, c = (synthetic_table(model, seed=s) for s in (5, 5, 6))
    assert np.array_equal(a.dloss, b.dloss) and not np.array_equal(a.dloss, c.dloss)


# --------------------------------------------------------------------------------------------
# RoutingTracker
# --------------------------------------------------------------------------------------------


def test_tracker_starts_neutral_and_halves_old_traffic_per_half_life(tiny):
    tracker = RoutingTracker(tiny, half_life_assignments=1000)
    assert np.allclose(tracker.scale(), 1.0)
    counts = np.zeros((4, 8))
    counts[:, 5] = 1000  # one half-life of assignments, all to expert 5
    tracker.observe(counts)
    f0 = tracker.offline_share
    assert np.allclose(tracker.share[:, 5], f0[:, 5] + 0.5 * (1 - f0[:, 5]))
    assert np.allclose(tracker.share[:, 0], 0.5 * f0[:, 0])
    assert np.allclose(tracker.share.sum(axis=1), 1.0)


def test_tracker_is_insensitive_to_step_sizes(tiny):
    """Ten steps of 100 assignments move the EMA as far as one step of 1,000."""
    one, many = RoutingTracker(tiny, 500), RoutingTracker(tiny, 500)
    counts = np.zeros((4, 8))
    counts[:, 2] = 1000
    one.observe(counts)
    for _ in range(10):
        many.observe(counts / 10)
    assert np.allclose(one.share, many.share)


def test_tracker_ignores_idle_layers_and_rejects_bad_counts(tiny):
    tracker = RoutingTracker(tiny, 100)
    before = tracker.share.copy()
    tracker.observe(np.zeros((4, 8)))
    assert np.array_equal(tracker.share, before)
    with pytest.raises(ImportanceError, match=r"tokens_per_expert has shape \(2, 8\), expected \(4, 8\)"):
        tracker.observe(np.zeros((2, 8)))
    with pytest.raises(ImportanceError, match="finite counts >= 0"):
        tracker.observe(-np.ones((4, 8)))


def test_drift_moves_precision_to_the_experts_now_in_use():
    """Calibrated on one mix, served another: the rescaled table upgrades the newly hot experts."""
    model = load_model("qwen3-30b-a3b")
    table = synthetic_table(model, ("bf16", "int8", "int4"), seed=2)
    freq = table.grid(table.routing_freq)
    cold = np.argsort(freq, axis=1)[:, :8]  # the 8 least used experts of each layer offline
    budget = int(table.bytes[:, 2].sum() + 0.1 * (table.bytes[:, 0] - table.bytes[:, 2]).sum())
    before = table.grid(allocate(table, budget, "marginal").levels)

    tracker = RoutingTracker(table, half_life_assignments=2048)
    counts = np.zeros(freq.shape)
    np.put_along_axis(counts, cold, 100.0, axis=1)  # traffic now goes only to the cold experts
    for _ in range(20):
        tracker.observe(counts)
    after = table.grid(allocate(tracker.rescaled(), budget, "marginal").levels)
    level_before = np.take_along_axis(before, cold, 1).mean()
    level_after = np.take_along_axis(after, cold, 1).mean()
    assert level_after < level_before - 1.0  # lower level index = more precise
    assert "rescaled by routing EMA over 768000 assignments" in tracker.rescaled().source


def test_tracker_rescaled_plan_is_what_the_planner_uses(tiny):
    tracker = RoutingTracker(tiny, 64)
    counts = np.ones((4, 8))
    tracker.observe(counts)
    rescaled = tracker.rescaled()
    r = tracker.scale().reshape(-1)
    assert np.allclose(rescaled.dloss, tiny.dloss * r[:, None])
    budget = int(tiny.bytes[:, 1].sum())
    assert MarginalPlanner(Problem.build(rescaled)).plan(budget).total_bytes <= budget


def test_on_ladder_keeps_exactly_the_named_precisions():
    from pagedweight.errors import ImportanceError
    from pagedweight.policy.importance import on_ladder

    table = synthetic_table(load_model("tiny-moe"), ("bf16", "int8", "int4", "int2"), seed=0)
    sub = on_ladder(table, ("bf16", "int4"))
    assert sub.ladder == ("bf16", "int4")
    assert (sub.dloss == table.dloss[:, [0, 2]]).all() and (sub.bytes == table.bytes[:, [0, 2]]).all()
    with pytest.raises(ImportanceError, match=r"imp.csv: no dloss/bytes columns for \['fp8'\]"):
        on_ladder(table, ("bf16", "fp8"), "imp.csv")
