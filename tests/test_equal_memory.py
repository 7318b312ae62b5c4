"""pwgpu equal-memory: the best uniform mix, and the whole comparison at toy scale from the
command line (outputs, equal bytes, the paper's ladder for paper-greedy, generated tables)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import proc

pytest.importorskip("torch")

from pwgpu.equal_memory import best_layer_mix  # noqa: E402


def test_best_layer_mix_is_the_brute_force_optimum():
    rng = np.random.default_rng(3)
    cost = np.sort(rng.gamma(1.0, 1.0, (4, 5)), axis=1)
    cost[:, 0] = 0
    per_format = np.array([800, 400, 400, 200, 120])
    layer_bytes = np.tile(per_format, (4, 1))
    for budget in (480, 700, 1000, 1600, 3200):
        choice, used, total = best_layer_mix(cost, layer_bytes, budget)
        feasible = [
            (sum(cost[i, f] for i, f in enumerate(c)), c)
            for c in itertools.product(range(5), repeat=4)
            if sum(per_format[f] for f in c) <= budget
        ]
        best = min(c for c, _ in feasible)
        assert total == pytest.approx(best) and used <= budget
        assert used == sum(per_format[f] for f in choice)
    with pytest.raises(ValueError):
        best_layer_mix(cost, layer_bytes, 100)


@pytest.mark.e2e
def test_equal_memory_end_to_end_at_toy_scale(tmp_path):
    """Three seeds, both ladders, one budget, a few hundred tokens: every method is held to the
    uniform mix's bytes, paper-greedy runs on its own ladder, and a rerun comes from the cache."""
    import csv
    import json
    import sys
    from pathlib import Path

    from pwgpu.quality_tables import equal_memory_markdown

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "em"
    cmd = [sys.executable, "-m", "pwgpu.cli", "equal-memory", "--model", str(root / "models" / "tiny-moe"),
           "--eval", *(str(root / "data" / "eval" / f"{d}.txt") for d in ("code", "shakespeare")),
           "--calib", *(str(root / "data" / "calib" / f"{d}.txt") for d in ("code", "shakespeare")),
           "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--seeds", "3", "--calib-window", "64",
           "--calib-tokens", "64", "--selection-tokens", "64", "--max-eval-tokens", "128", "--window", "64",
           "--block-tokens", "16", "--bootstrap", "50", "--fractions", "0.35", "--equivalence-fractions", "0,1",
           "--threads", "1"]  # fmt: skip
    first = proc.run(cmd, cwd=root, quiet_s=20)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    rows = list(csv.DictReader((out / "equal_memory.csv").read_text().splitlines()))
    assert {r["ladder"] for r in rows} == {"ours", "paper"}
    assert {r["method"] for r in rows} == {"uniform-mix", "frequency", "paper-greedy", "marginal", "exact"}
    for r in rows:
        assert int(r["bytes_used_max"]) <= int(r["baseline_bytes"]), r  # never more bytes than the baseline
        assert r["method_ladder"] == ("paper" if r["method"] == "paper-greedy" else r["ladder"])
        assert int(r["seeds"]) == (1 if r["method"] == "uniform-mix" else 3)
        assert float(r["kl_lo"]) <= float(r["kl"]) <= float(r["kl_hi"])
    ratios = list(csv.DictReader((out / "equal_memory_ratios.csv").read_text().splitlines()))
    assert ratios and all(r["verdict"] == "resolved" or r["verdict"].startswith("not resolved") for r in ratios)
    summary = json.loads((out / "equal_memory.json").read_text())
    assert summary["settings"]["seeds"] == 3 and summary["noise_floor"]
    assert set(summary["equivalence"]["methods"]) == {"marginal", "uniform-mix"}
    assert (out / "equal_memory.md").read_text() == equal_memory_markdown(out)
    assert sorted(p.name for p in (out / "tables").iterdir()) == ["seed0.csv", "seed1.csv", "seed2.csv"]
    again = proc.run(cmd, cwd=root, quiet_s=10)
    assert again.returncode == 0 and "(0 plans evaluated" in again.stdout, again.stdout[-1500:]


def test_least_equivalent_budget_needs_every_larger_budget_to_meet_it():
    from pwgpu.equal_memory import _least_suffix

    ok = np.array(
        [
            [True, False, True],  # a lucky low budget (column 0) that a larger one fails
            [False, True, True],
            [True, True, False],
            [True, True, False],  # the assumption past the grid
        ]
    )
    assert _least_suffix(ok).tolist() == [2, 1, 3]
