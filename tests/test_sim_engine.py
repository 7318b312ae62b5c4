"""The SimPy runtime: determinism, same-time event ordering, a hand-checked run, a golden run
(tests/golden.py says how the golden file is written; no test writes it)."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import simpy
import yaml

from pagedweight.config.scenario import load_scenario
from pagedweight.policy.controller import DOWNGRADE, UPGRADE
from pwsim.engine import UrgentTimeout
from pwsim.run import run_scenario

from golden import FIXTURES, PRESSURE, golden_scenario, golden_view, read_golden


def scenario(tmp_path, **overrides):
    base = yaml.safe_load((FIXTURES / "scenarios" / "good.yaml").read_text())
    for key, value in overrides.items():
        node = base
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(base))
    return load_scenario(path)


def test_urgent_events_fire_before_normal_ones_at_the_same_time():
    env, order = simpy.Environment(), []

    def step(env):
        yield env.timeout(1.0)
        order.append("step")

    def arrival(env):
        yield UrgentTimeout(env, 1.0)
        order.append("arrival")

    env.process(step(env))  # scheduled first, yet must fire second
    env.process(arrival(env))
    env.run()
    assert order == ["arrival", "step"]


def test_a_request_arriving_as_a_step_ends_joins_the_next_step(tmp_path):
    loaded = scenario(
        tmp_path,
        latency={"kind": "constant", "step_time_s": 0.5},
        workload={"kind": "synthetic", "arrival": {"kind": "poisson", "rate_qps": 1.0},
                  "lengths": {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 3}, "num_requests": 2},
    )  # fmt: skip
    from pagedweight.config.run import core_config
    from pagedweight.config.scenario import importance_table
    from pagedweight.workload.traces import RequestTrace
    from pwsim.engine import SimEngine
    from pwsim.latency import build_latency_model

    # Second arrival at exactly t = 1.0, when the second step (0.5 -> 1.0) ends.
    trace = RequestTrace(np.array([0.0, 1.0]), np.array([10, 10]), np.array([3, 3]), source="test")
    lat = build_latency_model(loaded.scenario.latency, loaded.model, loaded.gpu)
    eng = SimEngine(core_config(loaded), "static-fp16", trace, importance_table(loaded), lat, "uniform", seed=0)
    eng.run()
    a, b = eng.requests
    assert a.first_scheduled_s == 0.0 and a.finish_s == 1.5  # 3 steps: prefill + 2 decodes
    assert b.first_scheduled_s == 1.0  # not 1.5: the arrival at 1.0 comes before the step at 1.0


def test_constant_latency_throughput_by_hand(tmp_path):
    # 8 requests at t=0, prompt 100 (all 800 prompt tokens fit one 8192-token step), 20 outputs
    # each: one prefill step, then 19 decode steps, each 10 ms: the run lasts 200 ms.
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join('{"timestamp": 0, "input_length": 100, "output_length": 20}\n' for _ in range(8)))
    loaded = scenario(
        tmp_path,
        latency={"kind": "constant", "step_time_s": 0.01},
        workload={"kind": "trace", "path": str(trace), "format": "mooncake"},
        policies=["static-fp16"],
    )
    s = run_scenario(loaded, tmp_path / "out", report=False)["policies"]["static-fp16"]
    assert s["completed"] == 8 and s["num_steps"] == 20
    assert s["duration_s"] == pytest.approx(0.2, abs=1e-6)
    assert s["output_throughput"] == pytest.approx(8 * 20 / 0.2, rel=1e-6)
    assert s["mean_ttft_ms"] == pytest.approx(10.0, abs=1e-3) and s["mean_tpot_ms"] == pytest.approx(10.0, abs=1e-3)


def test_same_seed_same_results_and_golden_summary(tmp_path):
    loaded = golden_scenario()
    first = run_scenario(loaded, tmp_path / "a", report=False)
    second = run_scenario(loaded, tmp_path / "b", report=False)
    assert golden_view(first) == golden_view(second)
    assert (tmp_path / "a" / "steps.csv").read_text() == (tmp_path / "b" / "steps.csv").read_text()
    assert golden_view(first) == read_golden()


def test_kv_swap_moves_kv_over_pcie_and_records_it(tmp_path):
    # A promise of 16 outputs where each request writes 400: growth beyond it must preempt.
    overrides = [
        *PRESSURE,
        "workload.lengths.output_tokens=400",
        "policies=[kv-swap]",
        "scheduler.admission_reserve_tokens=16",
    ]
    loaded = load_scenario(FIXTURES / "scenarios" / "good.yaml", overrides)  # fmt: skip
    s = run_scenario(loaded, tmp_path / "swap", report=False)["policies"]["kv-swap"]
    steps = pd.read_csv(tmp_path / "swap" / "steps.csv")
    assert s["num_preemptions"] > 0 and s["completed"] == 150
    kv_bytes_per_token = loaded.model.kv_bytes_per_token()
    assert steps["bytes_swapped"].sum() > 0 and steps["bytes_swapped"].sum() % kv_bytes_per_token == 0
    assert s["h2d_bytes"] == steps["bytes_swapped"].sum() // 2  # every swapped-out token comes back in


def test_quality_proxy_kept_incrementally_equals_a_full_recount():
    """The quality proxy is updated per flipped expert; after a run full of downgrades and
    upgrades it still equals the sum over every expert's current precision."""
    from pagedweight.config.run import core_config
    from pagedweight.config.scenario import importance_table
    from pagedweight.workload.build import build_workload
    from pwsim.engine import SimEngine
    from pwsim.latency import build_latency_model

    sets = [*PRESSURE, "policies=[pagedweight]", "controller.min_dwell_s=0", "controller.backlog_calm_s=0"]
    sets.append("workload.lengths.output_tokens=200")
    loaded = load_scenario(FIXTURES / "scenarios" / "good.yaml", sets)
    sc = loaded.scenario
    trace = build_workload(sc.workload, loaded.base_dir, loaded.max_model_len, np.random.default_rng(0))
    lat = build_latency_model(sc.latency, loaded.model, loaded.gpu)
    eng = SimEngine(core_config(loaded), "pagedweight", trace, importance_table(loaded), lat, "uniform", seed=0)
    eng.run()
    kinds = {t.kind for t in eng.core.transitions}
    assert {DOWNGRADE, UPGRADE} <= kinds, kinds
    assert eng.core.quality_proxy == pytest.approx(eng.core.quality_recount(), rel=1e-9, abs=1e-12)


def test_deepseek_v3_fp8_scenario_walks_an_fp8_ladder(tmp_path):
    """The shipped DeepSeek-V3 FP8 scenario (MLA KV, 256 experts) on its first 40 s: static-fp16
    keeps every expert at the checkpoint's fp8-b128; pagedweight moves some to INT4 under KV
    pressure and never to a format outside its ladder."""
    root = Path(__file__).resolve().parent.parent
    loaded = load_scenario(root / "scenarios" / "deepseek_v3_fp8.yaml", ["workload.duration_s=40"])
    assert loaded.model.attention == "mla" and loaded.model.kv_bytes_per_token() == 12 * (512 + 64) * 2
    run_scenario(loaded, tmp_path, policies=["static-fp16", "pagedweight"], report=False)
    steps = pd.read_csv(tmp_path / "steps.csv")
    fixed, dynamic = steps[steps["policy"] == "static-fp16"], steps[steps["policy"] == "pagedweight"]
    assert (fixed["weight_pages_fp8-b128"] > 0).all() and (fixed["weight_pages_int4"] == 0).all()
    assert dynamic["weight_pages_int4"].max() > 0
    others = [
        c for c in steps if c.startswith("weight_pages_") and c not in ("weight_pages_fp8-b128", "weight_pages_int4")
    ]
    assert (steps[others] == 0).all().all()


def test_a_run_lets_young_objects_pile_up_and_restores_the_collector():
    """``run_until`` raises the collector's young-generation threshold for the run (never
    lowers one set higher) and puts the caller's thresholds back, also when the run fails."""
    import gc

    from pwsim.engine import GC_YOUNG_THRESHOLD, run_until

    seen = []
    before = gc.get_threshold()
    try:
        for young in (700, 10 * GC_YOUNG_THRESHOLD):
            gc.set_threshold(young, 10, 10)
            env = simpy.Environment()

            def proc(env):
                seen.append(gc.get_threshold())
                yield env.timeout(1.0)

            run_until(env, env.process(proc(env)), None)  # no progress: the trace is not read
            assert gc.get_threshold() == (young, 10, 10)
        assert seen == [(GC_YOUNG_THRESHOLD, 10, 10), (10 * GC_YOUNG_THRESHOLD, 10, 10)]
        env = simpy.Environment()

        def fails(env):
            yield env.timeout(1.0)
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            run_until(env, env.process(fails(env)), None)
        assert gc.get_threshold() == (10 * GC_YOUNG_THRESHOLD, 10, 10)
    finally:
        gc.set_threshold(*before)
