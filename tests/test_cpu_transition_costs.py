"""What a precision change costs a CPU engine, as the simulator charges it from a CPU latency
table: the dense copy of an expert made again on its first use after each change
(``dequantize`` rows; every expert's first copy is made when the engine is built), and upgrades
written inside the step that starts them (meta ``upgrades: synchronous``). A table without
either (a GPU's) charges nothing of the kind."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pagedweight.config.kernel_table import write_kernel_table
from pagedweight.config.latency import ConstantLatencyConfig, TableLatencyConfig
from pagedweight.config.run import scenario_run
from pagedweight.config.scenario import load_scenario
from pagedweight.core.spec import PRECISION_ID, load_gpu, load_model
from pagedweight.policy.controller import DOWNGRADE, UPGRADE
from pwsim.engine import SimEngine
from pwsim.latency import ConstantLatencyModel, build_latency_model

from golden import FIXTURES, PRESSURE

STEP_S, QUANTIZE_S, DEQUANTIZE_S = 0.01, 1e-3, 1e-4  # per step, per matrix, per matrix


class CpuConstantLatency(ConstantLatencyModel):
    """The constant model with a CPU table's extras: every matrix dequantises in DEQUANTIZE_S."""

    has_dequantize = True

    def __init__(self, cfg, gpu, synchronous_upgrades: bool):
        super().__init__(cfg, gpu)
        self.synchronous_upgrades = synchronous_upgrades

    def dequantize_time_s(self, n: int, k: int, precision_id: int) -> float:
        return DEQUANTIZE_S


def _run(latency_for) -> tuple[SimEngine, list]:
    loaded = load_scenario(FIXTURES / "scenarios" / "good.yaml", [*PRESSURE, "workload.lengths.output_tokens=60"])
    cfg = ConstantLatencyConfig(kind="constant", step_time_s=STEP_S, quantize_s=QUANTIZE_S)
    run = scenario_run(loaded)
    eng = SimEngine(run.core, "pagedweight", run.trace, run.table, latency_for(cfg, loaded.gpu), "uniform", seed=0)
    seen = []
    eng.core.on_step = lambda step: seen.append((step.routing.copy(), list(step.changes)))
    eng.run()
    return eng, seen


def test_each_step_pays_for_the_copies_it_makes_and_the_upgrades_it_writes():
    eng, seen = _run(lambda cfg, gpu: CpuConstantLatency(cfg, gpu, synchronous_upgrades=True))
    durations = eng.core.steps.columns()["duration_s"]
    assert len(durations) == len(seen)
    matrices = len(eng.model.expert_matrices)
    # The engine made every expert's copy when it was built: only precision changes make more.
    current = np.ones(eng.model.num_moe_layers * eng.model.num_experts, dtype=bool)
    copies, kinds = 0, set()
    for i, ((routing, changes), duration_s) in enumerate(zip(seen, durations, strict=True)):
        # A downgrade flips before the step computes: its expert's copy is stale in this step.
        # An upgrade is written in this step and flips after it: stale from the next step on.
        for c in changes:
            if c.kind is DOWNGRADE:
                current[c.expert] = False
        used = routing.ravel() > 0
        stale = used & ~current
        current |= used
        for c in changes:
            if c.kind is UPGRADE:
                current[c.expert] = False
        writes = sum(c.kind in (DOWNGRADE, UPGRADE) for c in changes)
        kinds |= {c.kind for c in changes}
        copies += int(stale.sum())
        expected = STEP_S + writes * matrices * QUANTIZE_S + int(stale.sum()) * matrices * DEQUANTIZE_S
        assert duration_s == pytest.approx(expected, rel=1e-12, abs=1e-15), i
    assert durations[0] == pytest.approx(STEP_S) and not seen[0][1]  # no copy, no change in the first step
    assert {DOWNGRADE, UPGRADE} <= kinds and copies > 0


def test_without_cpu_extras_a_step_pays_only_its_downgrades():
    eng, seen = _run(lambda cfg, gpu: ConstantLatencyModel(cfg, gpu))
    durations = eng.core.steps.columns()["duration_s"]
    matrices = len(eng.model.expert_matrices)
    for (_, changes), duration_s in zip(seen, durations, strict=True):
        downgrades = sum(c.kind is DOWNGRADE for c in changes)
        assert duration_s == pytest.approx(STEP_S + downgrades * matrices * QUANTIZE_S, rel=1e-12)
    assert any(c.kind is UPGRADE for _, changes in seen for c in changes)


def _cpu_table(tmp_path, with_extras: bool) -> TableLatencyConfig:
    rows = [dict(op="dense", precision="-", m=m, latency_us_p50=us) for m, us in ((1, 50.0), (64, 90.0))]
    rows.append(dict(op="quantize", precision="int4", n=256, k=256, latency_us_p50=40.0))
    if with_extras:
        for prec, us in (("bf16", 10.0), ("int4", 30.0)):
            for n in (256, 512):
                for k in (256, 512):
                    rows.append(dict(op="dequantize", precision=prec, n=n, k=k, latency_us_p50=us * n * k / 65536))
    df = pd.DataFrame(rows).fillna(0)
    df["model"] = "tiny-moe"
    df["latency_us_p20"], df["latency_us_p80"], df["samples"] = df["latency_us_p50"], df["latency_us_p50"], 5
    meta = {"device": "cpu (x86_64)", "date": "2026-12-01", "torch": "2.13", "triton": "none", "cuda": "none",
            "models": ["tiny-moe"], "grid": "test"}  # fmt: skip
    if with_extras:
        meta["upgrades"] = "synchronous"
    name = "cpu.csv" if with_extras else "gpu.csv"
    write_kernel_table(df, tmp_path / name, meta)
    return TableLatencyConfig(kind="table", path=name, scale=2.0)


def test_a_cpu_table_times_dequantisation_and_says_upgrades_are_synchronous(tmp_path):
    model, gpu = load_model("tiny-moe"), load_gpu("cpu")
    cpu = build_latency_model(_cpu_table(tmp_path, True), model, gpu, tmp_path)
    assert cpu.has_dequantize and cpu.synchronous_upgrades
    int4, bf16 = PRECISION_ID["int4"], PRECISION_ID["bf16"]
    # Exact at grid points, times the table's scale, per precision.
    assert cpu.dequantize_time_s(512, 256, int4) == pytest.approx(2 * 60e-6)
    assert cpu.dequantize_time_s(256, 256, bf16) == pytest.approx(2 * 10e-6)
    gpu_table = build_latency_model(_cpu_table(tmp_path, False), model, gpu, tmp_path)
    assert not gpu_table.has_dequantize and not gpu_table.synchronous_upgrades
    assert gpu_table.dequantize_time_s(512, 256, int4) == 0.0
