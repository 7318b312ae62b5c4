"""Latency models: roofline sanity against hand-computed bounds, the constant model exactly,
the table model's interpolation, out-of-grid fallback and configuration errors."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from pydantic import BaseModel, Field, ValidationError

from pagedweight.config.kernel_table import decode_step_routing, write_kernel_table
from pagedweight.config.latency import (
    AnalyticLatencyConfig,
    ConstantLatencyConfig,
    LatencyConfig,
    RoutingConfig,
    TableLatencyConfig,
)
from pagedweight.core.spec import PRECISION_ID, load_gpu, load_model
from pagedweight.core.step import StepShape
from pagedweight.errors import SpecError
from pwsim.latency import build_latency_model

MIXTRAL = load_model("mixtral-8x7b")
H200 = load_gpu("h200")
BF16, FP8, INT4 = PRECISION_ID["bf16"], PRECISION_ID["fp8"], PRECISION_ID["int4"]


def _ids(model, pid: int) -> np.ndarray:
    return np.full((model.num_moe_layers, model.num_experts), pid, dtype=np.int8)


def _decode(kv_lens) -> StepShape:
    z = np.zeros(0, dtype=np.int64)
    return StepShape(z, z, np.asarray(kv_lens, dtype=np.int64))


def _prefill(tokens: int, kv_len: int | None = None) -> StepShape:
    z = np.zeros(0, dtype=np.int64)
    return StepShape(np.array([tokens]), np.array([kv_len or tokens]), z)


def _spread(model, num_tokens: int) -> np.ndarray:
    """Tokens per expert with every layer's num_tokens * top_k picks spread evenly."""
    picks = num_tokens * model.top_k
    tpe = np.full((model.num_moe_layers, model.num_experts), picks // model.num_experts, dtype=np.int64)
    tpe[:, : picks % model.num_experts] += 1
    return tpe


def _two_active(model) -> np.ndarray:
    tpe = np.zeros((model.num_moe_layers, model.num_experts), dtype=np.int64)
    tpe[:, :2] = 1
    return tpe


# ---- analytic -------------------------------------------------------------------------------


def test_mixtral_decode_batch_1_is_weight_bytes_over_bandwidth():
    """Batch-1 decode reads 2 active experts x 32 layers + the pinned weights. The model may
    exceed that ideal by 1 / hbm_efficiency (1.25) plus the fixed overheads (1 ms + 32 x 10 us
    + 64 launches x 5 us = 1.64 ms on 5.4 ms): at most 1.6x, and never less than the ideal."""
    lm = build_latency_model(AnalyticLatencyConfig(), MIXTRAL, H200)
    t = lm.step_time_s(_decode([512]), _two_active(MIXTRAL), _ids(MIXTRAL, BF16))
    ideal_bytes = MIXTRAL.pinned_bytes() + 2 * MIXTRAL.num_moe_layers * MIXTRAL.expert_bytes("bf16")
    ideal_s = ideal_bytes / H200.hbm_bandwidth_bytes_per_s
    assert ideal_s == pytest.approx(5.37e-3, rel=0.01)
    assert ideal_s < t < 1.6 * ideal_s


def test_int4_experts_make_decode_faster():
    lm = build_latency_model(AnalyticLatencyConfig(), MIXTRAL, H200)
    shape, tpe = _decode([1000] * 8), _spread(MIXTRAL, 8)
    bf16 = lm.step_time_s(shape, tpe, _ids(MIXTRAL, BF16))
    half = _ids(MIXTRAL, BF16)
    half[:, ::2] = INT4
    mixed = lm.step_time_s(shape, tpe, half)
    int4 = lm.step_time_s(shape, tpe, _ids(MIXTRAL, INT4))
    assert int4 < mixed < bf16
    # Memory-bound: expert bytes shrink 3.5x (4.25 bits/weight vs 16), so the expert part does too.
    expert_bf16 = lm.moe_s(tpe, _ids(MIXTRAL, BF16))
    expert_int4 = lm.moe_s(tpe, _ids(MIXTRAL, INT4))
    ratio = MIXTRAL.expert_bytes("bf16") / MIXTRAL.expert_bytes("int4")
    assert expert_bf16 / expert_int4 == pytest.approx(ratio, rel=0.05)


def test_prefill_2048_is_compute_bound():
    """512 tokens per expert is past the ridge (~290 for bf16 at these efficiencies), so the
    expert time is the flops over the achieved peak and the weight format barely matters."""
    lm = build_latency_model(AnalyticLatencyConfig(), MIXTRAL, H200)
    tpe = _spread(MIXTRAL, 2048)
    assert (tpe > lm.expert_ridge_tokens[BF16]).all()
    flops = 2 * 3 * MIXTRAL.hidden_size * MIXTRAL.expert_ffn_size * 2048 * 2 * MIXTRAL.num_moe_layers
    compute_s = flops / (H200.peak_bf16_flops * 0.70)
    launches_s = MIXTRAL.num_moe_layers * 5e-6
    assert lm.moe_s(tpe, _ids(MIXTRAL, BF16)) == pytest.approx(compute_s + launches_s, rel=1e-9)
    assert lm.moe_s(tpe, _ids(MIXTRAL, INT4)) == pytest.approx(compute_s + launches_s, rel=1e-9)
    # FP8 runs FP8 MMAs on an H200: twice the peak (1,979 vs 989 TFLOP/s).
    fp8 = lm.moe_s(tpe, _ids(MIXTRAL, FP8))
    assert fp8 == pytest.approx(compute_s * H200.peak_bf16_flops / H200.peak_fp8_flops + launches_s, rel=1e-9)
    # The whole step is compute-bound too: more than the flops of its weights at the achieved peak.
    step = lm.step_time_s(_prefill(2048), tpe, _ids(MIXTRAL, BF16))
    dense_flops = 2 * 2048 * (MIXTRAL.num_moe_layers * MIXTRAL.attention_params_per_layer())
    assert step > compute_s + dense_flops / (H200.peak_bf16_flops * 0.70)


def test_time_grows_with_batch_and_context():
    lm = build_latency_model(AnalyticLatencyConfig(), MIXTRAL, H200)
    ids = _ids(MIXTRAL, BF16)
    by_batch = [lm.step_time_s(_decode([2000] * b), _spread(MIXTRAL, b), ids) for b in (1, 4, 16, 64, 256, 1024)]
    assert all(a < b for a, b in zip(by_batch, by_batch[1:], strict=False))
    tpe = _spread(MIXTRAL, 32)
    by_kv = [lm.step_time_s(_decode([kv] * 32), tpe, ids) for kv in (16, 256, 4096, 32768)]
    assert all(a < b for a, b in zip(by_kv, by_kv[1:], strict=False))
    by_prefill_kv = [lm.step_time_s(_prefill(512, kv), _spread(MIXTRAL, 512), ids) for kv in (512, 4096, 32768)]
    assert all(a < b for a, b in zip(by_prefill_kv, by_prefill_kv[1:], strict=False))
    # Decode KV traffic: 32 x 32768 tokens x 128 KiB = 137 GB/s-worth at ~3.84 TB/s achieved.
    extra = by_kv[-1] - by_kv[0]
    kv_bytes = 32 * (32768 - 16) * MIXTRAL.kv_bytes_per_token()
    assert extra == pytest.approx(kv_bytes / (H200.hbm_bandwidth_bytes_per_s * 0.80), rel=0.01)


def test_mla_and_dense_layers_are_timed():
    ds = load_model("deepseek-v3")
    lm = build_latency_model(None, ds, H200)
    tpe = _spread(ds, 64)
    ids = _ids(ds, BF16)
    short = lm.step_time_s(_decode([1000] * 64), tpe, ids)
    long = lm.step_time_s(_decode([100000] * 64), tpe, ids)
    assert long > short
    # The 3 dense layers' FFNs (3 x 18432 x 7168 bf16 each) are read every step.
    assert lm.dense_layer_s(64) > 3 * ds.hidden_size * ds.dense_ffn_size * 2 / (H200.hbm_bandwidth_bytes_per_s * 0.8)


def test_precision_mix_costs_one_launch_per_class():
    lm = build_latency_model(AnalyticLatencyConfig(step_overhead_s=0.0), MIXTRAL, H200)
    tpe = _spread(MIXTRAL, 2048)  # compute-bound: the weight format does not change the flops
    one = lm.moe_s(tpe, _ids(MIXTRAL, BF16))
    ids = _ids(MIXTRAL, BF16)
    ids[:, 0] = INT4
    two = lm.moe_s(tpe, ids)
    assert two - one == pytest.approx(MIXTRAL.num_moe_layers * 5e-6, rel=1e-6)


def test_moe_time_follows_precision_changes_in_place():
    """The per-precision grid is cached; changing the experts' precisions in place (as a
    flip does) must re-time them, exactly as a fresh model would."""
    lat = build_latency_model(AnalyticLatencyConfig(), MIXTRAL, H200)
    ids = _ids(MIXTRAL, BF16)
    tpe, sparse = _spread(MIXTRAL, 64), _two_active(MIXTRAL)
    before = lat.moe_s(tpe, ids), lat.moe_s(sparse, ids)
    ids[3, :4] = INT4
    fresh = build_latency_model(AnalyticLatencyConfig(), MIXTRAL, H200)
    for t in (tpe, sparse):
        assert lat.moe_s(t, ids) == fresh.moe_s(t, ids)
    assert lat.moe_s(tpe, ids) < before[0] and lat.moe_s(sparse, ids) < before[1]


@pytest.mark.parametrize("seed", range(4))
def test_every_ranks_moe_time_at_once_is_each_ranks_to_the_bit(seed):
    """``moe_s_ranks`` (an expert-parallel replica's step) gives each rank exactly its own
    ``moe_s``: ranks with every expert active, some, or none; mixed precisions per rank; its
    stacked grids follow precision changes in place."""
    rng = np.random.default_rng(seed)
    share = MIXTRAL.model_copy(update={"num_experts": 4})  # a rank's share of 8 experts on 2 GPUs
    ranks = 3
    models = [build_latency_model(AnalyticLatencyConfig(), share, H200) for _ in range(ranks)]
    refs = [build_latency_model(AnalyticLatencyConfig(), share, H200) for _ in range(ranks)]
    ids = [rng.choice([BF16, FP8, INT4], size=(share.num_moe_layers, 4)).astype(np.int8) for _ in range(ranks)]
    for step in range(6):
        tokens = rng.integers(0, 5, size=(ranks, share.num_moe_layers, 4)) * (rng.random((ranks, 1, 1)) < 0.8)
        tokens[0] += 1  # every expert of rank 0 active
        got = models[0].moe_s_ranks(models, tokens, ids)
        want = [float(refs[r].moe_s(tokens[r], ids[r])) for r in range(ranks)]
        assert got == want  # exact: the same floats
        if step == 2:
            ids[1][5, :2] = INT4 if ids[1][5, 0] != INT4 else BF16  # a flip in place
    assert models[0].moe_s_ranks(models, np.zeros_like(tokens), ids) == [0.0] * ranks


def _moe_s_by_numpy_passes(lat, tokens, ids) -> float:
    """The roofline's MoE time as whole-array numpy passes, as ``moe_s`` computed it before its
    per-expert pass was compiled: the times' dot with the activity mask (BLAS's order)."""
    active = tokens > 0
    expert_s = np.maximum(tokens * lat.expert_s_per_token.take(ids), lat.expert_read_s.take(ids))
    total_s = float(np.dot(expert_s.ravel(), active.ravel().astype(np.float64)))
    keys = (np.arange(ids.shape[0]) * lat._num_precisions)[:, None] + ids
    return total_s + np.count_nonzero(np.bincount(keys[active], minlength=1)) * lat.cfg.kernel_launch_s


@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v3"])
def test_moe_time_is_the_numpy_passes_to_the_bit(model):
    """The compiled per-expert pass gives the floats of the numpy passes it replaced, with every
    expert active, some or none, and the pass's numpy form (used without numba) the same."""
    from pwsim import roofline_kernels

    spec = load_model(model)
    lat = build_latency_model(AnalyticLatencyConfig(), spec, H200)
    rng = np.random.default_rng(1)
    shape = (spec.num_moe_layers, spec.num_experts)
    for step in range(40):
        if step % 10 == 0:
            ids = rng.choice([BF16, FP8, INT4], size=shape).astype(np.int8)
        density = (0.0, 0.05, 0.5, 1.0)[step % 4]
        tokens = (rng.random(shape) < density) * rng.integers(1, 600, size=shape)
        assert lat.moe_s(tokens, ids) == _moe_s_by_numpy_passes(lat, tokens, ids)
        grid = lat._grid_for(ids)
        args = (tokens.reshape(1, -1), grid.s_per_token, grid.read_s, grid.layer_class, grid.num_keys)
        for a, b in zip(
            roofline_kernels.expert_times(*args),
            roofline_kernels.expert_times(*args, compiled=False),
            strict=True,
        ):
            assert np.array_equal(a, b)


def test_quantize_and_h2d():
    lm = build_latency_model(None, MIXTRAL, H200)
    n, k = MIXTRAL.expert_ffn_size, MIXTRAL.hidden_size
    # Read bf16 once (117 MB), write INT4 (31 MB) at 3.84 TB/s: ~39 us.
    q4 = lm.quantize_time_s(n, k, INT4)
    assert q4 == pytest.approx(5e-6 + (n * k * 2 + n * k * 0.5 + n * (k // 128) * 3) / (4.8e12 * 0.8), rel=1e-6)
    assert q4 < lm.quantize_time_s(n, k, PRECISION_ID["int8"])
    # One bf16 expert (352 MB) over PCIe at 55 GB/s: ~6.4 ms (ANCHORS: ~7 ms at 50 GB/s).
    assert lm.h2d_time_s(MIXTRAL.expert_bytes("bf16")) == pytest.approx(6.4e-3, rel=0.01)
    assert lm.h2d_time_s(0) == 0.0


def test_precision_efficiency_override_slows_only_that_precision():
    slow = build_latency_model(AnalyticLatencyConfig(precision_hbm_efficiency={"int4": 0.4}), MIXTRAL, H200)
    base = build_latency_model(None, MIXTRAL, H200)
    tpe = _two_active(MIXTRAL)
    assert slow.moe_s(tpe, _ids(MIXTRAL, INT4)) > 1.9 * base.moe_s(tpe, _ids(MIXTRAL, INT4)) - 1e-3
    assert slow.moe_s(tpe, _ids(MIXTRAL, BF16)) == base.moe_s(tpe, _ids(MIXTRAL, BF16))
    assert "analytic roofline (efficiency: HBM 0.80, FLOPs 0.70" in base.describe()


def test_empty_step_takes_no_time():
    for cfg in (None, ConstantLatencyConfig(kind="constant", step_time_s=0.02)):
        lm = build_latency_model(cfg, MIXTRAL, H200)
        assert lm.step_time_s(StepShape.empty(), _spread(MIXTRAL, 0), _ids(MIXTRAL, BF16)) == 0.0


# ---- constant -------------------------------------------------------------------------------


def test_constant_model_is_exact():
    cfg = ConstantLatencyConfig(kind="constant", step_time_s=0.02, per_token_s=0.001, quantize_s=3e-5)
    lm = build_latency_model(cfg, MIXTRAL, H200)
    shape = StepShape(np.array([100, 20]), np.array([100, 500]), np.array([7, 8, 9]))
    assert lm.step_time_s(shape, _spread(MIXTRAL, 123), _ids(MIXTRAL, INT4)) == 0.02 + 0.001 * 123
    assert lm.quantize_time_s(10, 10, INT4) == 3e-5
    assert lm.h2d_time_s(55_000_000_000) == 1.0
    assert lm.describe() == "constant 20 ms + 1 ms/token"
    assert build_latency_model(ConstantLatencyConfig(kind="constant", step_time_s=0.02), MIXTRAL, H200).describe() == (
        "constant 20 ms"
    )


# ---- table ----------------------------------------------------------------------------------

META = {"device": "NVIDIA H200", "date": "2026-11-29", "torch": "2.11", "triton": "3.5", "cuda": "12.8"}
M_GRID, E_GRID = (1, 4, 16), (1, 2, 8)


def _moe_us(prec: str, m: float, e: float) -> float:
    """Deliberately non-linear, so interpolation is visible between grid points."""
    return (2.0 if prec == "int4" else 5.0) * e * (10 + m**1.5) + 3 * m * e


def _table(tmp_path, name="h200.csv", meta: dict | None = None) -> str:
    rows = []
    for prec in ("bf16", "int4"):
        for m in M_GRID:
            for e in E_GRID:
                rows.append(dict(op="moe_ffn", precision=prec, m=m, e=e, latency_us_p50=_moe_us(prec, m, e)))
    for m, us in ((1, 50.0), (256, 90.0), (4096, 700.0)):
        rows.append(dict(op="dense", precision="bf16", m=m, latency_us_p50=us))
        rows.append(dict(op="lm_head", precision="bf16", m=m, latency_us_p50=us / 2))
    for b in (1, 64):
        for kv in (128, 8192):
            rows.append(dict(op="attn_decode", precision="-", batch=b, kv_len=kv, latency_us_p50=5 + b * kv / 1000))
    for m in (128, 1024):
        for kv in (1024, 8192):
            rows.append(dict(op="attn_prefill", precision="-", m=m, kv_len=kv, latency_us_p50=m * kv / 1e4))
    rows.append(dict(op="quantize", precision="int4", n=14336, k=4096, latency_us_p50=40.0))
    for nbytes, us in ((1 << 20, 30.0), (1 << 30, 20000.0)):
        rows.append(dict(op="h2d_copy", precision="-", bytes=nbytes, latency_us_p50=us))
    df = pd.DataFrame(rows).fillna(0)
    df["model"] = "mixtral-8x7b"
    df["latency_us_p20"] = df["latency_us_p50"] * 0.95
    df["latency_us_p80"] = df["latency_us_p50"] * 1.05
    df["samples"] = 20
    write_kernel_table(
        df, tmp_path / "kernels" / name, {**META, "models": ["mixtral-8x7b"], "grid": "test", **(meta or {})}
    )
    return f"kernels/{name}"


def _table_model(tmp_path):
    cfg = TableLatencyConfig(kind="table", path=_table(tmp_path))
    return build_latency_model(cfg, MIXTRAL, H200, base_dir=tmp_path)


def _layer0(counts: dict[int, tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Only layer 0 routes: expert -> (tokens, precision id)."""
    tpe = np.zeros((MIXTRAL.num_moe_layers, MIXTRAL.num_experts), dtype=np.int64)
    ids = _ids(MIXTRAL, BF16)
    for e, (tokens, pid) in counts.items():
        tpe[0, e], ids[0, e] = tokens, pid
    return tpe, ids


def test_table_is_exact_at_grid_points(tmp_path):
    lm = _table_model(tmp_path)
    for prec, pid in (("bf16", BF16), ("int4", INT4)):
        for m in M_GRID:
            tpe, ids = _layer0({0: (m, pid), 1: (m, pid)})  # e = 2, mean m
            assert lm.moe_s(tpe, ids) == pytest.approx(_moe_us(prec, m, 2) * 1e-6, rel=1e-12)
            tpe, ids = _layer0({e: (m, pid) for e in range(8)})
            assert lm.moe_s(tpe, ids) == pytest.approx(_moe_us(prec, m, 8) * 1e-6, rel=1e-12)
    assert not lm.out_of_grid


def test_table_interpolates_linearly_between_grid_points(tmp_path):
    lm = _table_model(tmp_path)
    # m = 2.5 (tokens 2 and 3), e = 2: a third of the way from m = 1 to m = 4.
    tpe, ids = _layer0({0: (2, BF16), 1: (3, BF16)})
    expected = _moe_us("bf16", 1, 2) + (2.5 - 1) / 3 * (_moe_us("bf16", 4, 2) - _moe_us("bf16", 1, 2))
    assert lm.moe_s(tpe, ids) == pytest.approx(expected * 1e-6, rel=1e-12)
    # e = 5 (between 2 and 8) at m = 4, plus one INT4 class in the same layer at a grid point.
    tpe, ids = _layer0({**{e: (4, BF16) for e in range(5)}, 6: (16, INT4)})
    bf16 = _moe_us("bf16", 4, 2) + (5 - 2) / 6 * (_moe_us("bf16", 4, 8) - _moe_us("bf16", 4, 2))
    assert lm.moe_s(tpe, ids) == pytest.approx((bf16 + _moe_us("int4", 16, 1)) * 1e-6, rel=1e-12)
    # Log-space interpolation would give sqrt(30 * 20000) = 775 us here, linear gives 10015.
    assert lm.h2d_time_s(((1 << 20) + (1 << 30)) // 2) == pytest.approx(10015e-6, rel=1e-3)
    assert lm.quantize_time_s(14336, 4096, INT4) == pytest.approx(40e-6)


def test_cpu_table_times_one_moe_call_per_layer(tmp_path):
    """``moe_calls: per layer`` (the CPU engine's one call for a layer's experts, whatever their
    precisions): a layer of two classes is one call of all its experts at their mean tokens, each
    class's share timed by its own rows; per class (the GPU's launches) it is two calls."""
    cfg = TableLatencyConfig(kind="table", path=_table(tmp_path, "cpu.csv", {"moe_calls": "per layer"}))
    lm = build_latency_model(cfg, MIXTRAL, H200, base_dir=tmp_path)
    per_class = _table_model(tmp_path)
    # Layer 0: 4 bf16 experts of 1 token, 4 int4 experts of 4 tokens: one call of e = 8, m = 2.5.
    tpe, ids = _layer0({**{e: (1, BF16) for e in range(4)}, **{e: (4, INT4) for e in range(4, 8)}})

    def at(prec, m, e):  # the table's bilinear value (grids m 1, 4, 16 and e 1, 2, 8)
        return _moe_us(prec, 1, e) + (m - 1) / 3 * (_moe_us(prec, 4, e) - _moe_us(prec, 1, e))

    one_call = 0.5 * at("bf16", 2.5, 8) + 0.5 * at("int4", 2.5, 8)
    assert lm.moe_s(tpe, ids) == pytest.approx(one_call * 1e-6, rel=1e-12)
    two_calls = (_moe_us("bf16", 1, 2) + 2 / 6 * (_moe_us("bf16", 1, 8) - _moe_us("bf16", 1, 2))) + (
        _moe_us("int4", 4, 2) + 2 / 6 * (_moe_us("int4", 4, 8) - _moe_us("int4", 4, 2))
    )
    assert per_class.moe_s(tpe, ids) == pytest.approx(two_calls * 1e-6, rel=1e-12)
    # One class per layer: the same call either way, to the bit.
    tpe, ids = _layer0({e: (4, INT4) for e in range(3)})
    assert lm.moe_s(tpe, ids) == per_class.moe_s(tpe, ids)
    with pytest.raises(SpecError, match="moe_calls: 'per rank'; allowed: 'per layer', 'per precision class'"):
        bad = TableLatencyConfig(kind="table", path=_table(tmp_path, "bad.csv", {"moe_calls": "per rank"}))
        build_latency_model(bad, MIXTRAL, H200, base_dir=tmp_path)


def test_table_step_adds_up_its_ops(tmp_path):
    lm = _table_model(tmp_path)
    shape = StepShape(np.array([512]), np.array([4096]), np.array([1000, 3000]))
    tpe, ids = _layer0({0: (256, BF16), 1: (259, BF16), 2: (514, BF16)})  # 514 tokens x 2 picks
    # Attention latencies in the table are bilinear in their keys, so interpolation is exact.
    prefill_us = 512 * 4096 / 1e4
    decode_us = 5 + 2 * 2000 / 1000  # batch 2, mean kv 2000
    dense_us = 90 + (514 - 256) / (4096 - 256) * (700 - 90)
    head_us = (50 + (3 - 1) / 255 * (90 - 50)) / 2  # 3 sequences
    m = (256 + 259 + 514) / 3  # past the grid's m = 16: the analytic fallback times it
    with pytest.warns(UserWarning, match="moe_ffn/bf16 at m=343, e=3 is outside the measured grid"):
        t = lm.step_time_s(shape, tpe, ids)
    moe_s = lm.fallback.moe_class_s(BF16, m, 3)
    step_overhead_s = 1e-3
    expected = 32 * (prefill_us + decode_us + dense_us) * 1e-6 + head_us * 1e-6 + moe_s + step_overhead_s
    assert t == pytest.approx(expected, rel=1e-9)
    assert lm.out_of_grid == {"moe_ffn/bf16": 1}


def test_out_of_grid_warns_once_and_counts(tmp_path):
    lm = _table_model(tmp_path)
    tpe, ids = _layer0({0: (40, BF16), 1: (3, FP8)})  # m past the grid; FP8 not in the table
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = lm.moe_s(tpe, ids)
        for _ in range(4):
            assert lm.moe_s(tpe, ids) == first
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages  # once per op and precision, not once per look-up
    assert lm.out_of_grid == {"moe_ffn/bf16": 5, "moe_ffn/fp8": 5}
    expected = lm.fallback.moe_class_s(BF16, 40, 1) + lm.fallback.moe_class_s(FP8, 3, 1)
    assert first == pytest.approx(expected, rel=1e-12)
    # Past the h2d grid: the analytic PCIe time.
    with pytest.warns(UserWarning, match="h2d_copy"):
        assert lm.h2d_time_s(4 << 30) == lm.fallback.h2d_time_s(4 << 30)
    assert lm.out_of_grid["h2d_copy"] == 1


def test_median_of_tables_takes_each_rows_median(tmp_path):
    from pagedweight.config.kernel_table import median_of_tables, read_kernel_table

    paths = []
    for i, factor in enumerate((1.0, 3.0, 2.0)):
        path = tmp_path / _table(tmp_path, f"p{i}.csv", {"date": f"2026-12-0{i + 1}"})
        df, meta = read_kernel_table(path)
        df[["latency_us_p50", "latency_us_p20", "latency_us_p80"]] *= factor
        write_kernel_table(df.iloc[::-1] if i == 1 else df, path, meta)  # row order does not matter
        paths.append(path)
    base, _ = read_kernel_table(paths[0])
    out, meta = median_of_tables(paths)
    for col in ("latency_us_p50", "latency_us_p20", "latency_us_p80"):
        assert np.allclose(out[col], base[col] * 2.0)
    assert (out["samples"] == 60).all() and list(out["op"]) == list(base["op"])
    assert meta["profiles"] == 3 and meta["dates"] == ["2026-12-01", "2026-12-03"]
    df, other = read_kernel_table(paths[2])
    write_kernel_table(df.iloc[1:], paths[2], other)  # a table of another grid
    with pytest.raises(SpecError, match=r"p2.csv: not the grid of .*p0.csv"):
        median_of_tables(paths)


def test_table_describe_and_errors(tmp_path):
    lm = _table_model(tmp_path)
    assert lm.describe().startswith(
        "table kernels/h200.csv (NVIDIA H200, 2026-11-29, fitted non-decreasing); outside the grid: analytic"
    )
    path = _table(tmp_path)
    with pytest.raises(SpecError, match="no rows for model 'qwen3-30b-a3b'; the table has: mixtral-8x7b"):
        build_latency_model(TableLatencyConfig(kind="table", path=path), load_model("qwen3-30b-a3b"), H200, tmp_path)
    # The table's model can be named explicitly (e.g. shapes measured on a sibling model).
    named = TableLatencyConfig(kind="table", path=path, model="mixtral-8x7b")
    assert build_latency_model(named, load_model("qwen3-30b-a3b"), H200, tmp_path).moe_grid is not None
    with pytest.raises(SpecError, match="does not exist"):
        build_latency_model(TableLatencyConfig(kind="table", path="nope.csv"), MIXTRAL, H200, tmp_path)


# ---- configuration --------------------------------------------------------------------------


class _Scenario(BaseModel):
    latency: LatencyConfig = Field(default_factory=AnalyticLatencyConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)


def test_latency_config_kinds(tmp_path):
    assert isinstance(_Scenario().latency, AnalyticLatencyConfig)
    assert isinstance(_Scenario.model_validate({"latency": {}}).latency, AnalyticLatencyConfig)
    t = _Scenario.model_validate({"latency": {"kind": "table", "path": "k/h200.csv", "fallback": "analytic"}}).latency
    assert isinstance(t, TableLatencyConfig) and t.fallback == AnalyticLatencyConfig()
    assert t.resolved_path(tmp_path) == tmp_path / "k/h200.csv"
    assert TableLatencyConfig(kind="table", path="/abs/h200.csv").resolved_path(tmp_path).as_posix() == "/abs/h200.csv"
    t = _Scenario.model_validate({"latency": {"kind": "table", "path": "x.csv", "fallback": {"hbm_efficiency": 0.5}}})
    assert t.latency.fallback.hbm_efficiency == 0.5
    c = _Scenario.model_validate({"latency": {"kind": "constant", "step_time_s": 0.02}}).latency
    assert isinstance(c, ConstantLatencyConfig) and c.per_token_s == 0.0


@pytest.mark.parametrize(
    "latency, match",
    [
        ({"kind": "roofline"}, "kind must be one of: analytic, table, constant"),
        ({"kind": "constant"}, "step_time_s"),
        ({"kind": "constant", "step_time_s": 0.02, "per_token": 1}, "per_token"),
        ({"kind": "analytic", "hbm_efficiency": 1.5}, "hbm_efficiency"),
        ({"precision_hbm_efficiency": {"int5": 0.5}}, "unknown precision 'int5'"),
        ({"kind": "table", "path": "x.csv", "fallback": "table"}, "fallback must be 'analytic'"),
    ],
)
def test_latency_config_errors(latency, match):
    with pytest.raises(ValidationError, match=match):
        _Scenario.model_validate({"latency": latency})


def test_routing_config():
    assert RoutingConfig().resolved_kind(has_importance_table=True) == "importance"
    assert RoutingConfig().resolved_kind(has_importance_table=False) == "uniform"
    z = RoutingConfig(kind="zipf")
    assert z.zipf_alpha == 1.0 and RoutingConfig(kind="zipf", alpha=1.5).zipf_alpha == 1.5
    with pytest.raises(ValidationError, match="alpha"):
        RoutingConfig(kind="uniform", alpha=1.2)
    with pytest.raises(ValidationError):
        RoutingConfig(kind="zipf", alpha=0)


def test_table_fills_skipped_cells_and_reports_missing_ops(tmp_path):
    path = _table(tmp_path)
    csv = tmp_path / path
    df = pd.read_csv(csv)
    hole = (df["op"] == "moe_ffn") & (df["precision"] == "bf16") & (df["m"] == 4) & (df["e"] == 2)
    df = df[~hole & (df["op"] != "lm_head")]
    write_kernel_table(df, csv, {**META, "models": ["mixtral-8x7b"], "grid": "test"})
    lm = build_latency_model(TableLatencyConfig(kind="table", path=path), MIXTRAL, H200, tmp_path)
    # The skipped cell is linear between its neighbours along m (m = 1 and m = 16) at e = 2.
    tpe, ids = _layer0({0: (4, BF16), 1: (4, BF16)})
    lo, hi = _moe_us("bf16", 1, 2), _moe_us("bf16", 16, 2)
    assert lm.moe_s(tpe, ids) == pytest.approx((lo + (4 - 1) / 15 * (hi - lo)) * 1e-6, rel=1e-12)
    with pytest.warns(UserWarning, match=r"lm_head \(not in table\)"):
        lm.step_time_s(_decode([1000]), tpe, ids)
    assert lm.out_of_grid == {"lm_head (not in table)": 1}


def test_monotone_fit_removes_dips_and_keeps_ordered_grids():
    from pwsim.table_latency import monotone_grid

    ordered = np.array([[1.0, 2.0, 4.0], [2.0, 3.0, 5.0]])
    np.testing.assert_array_equal(monotone_grid(ordered), ordered)  # nothing to fit
    noisy = np.array([[1.0, 3.0, 2.0], [0.5, 4.0, 6.0], [2.0, 5.0, 7.0]])
    fit = monotone_grid(noisy)
    assert (np.diff(fit, axis=0) >= -1e-12).all() and (np.diff(fit, axis=1) >= -1e-12).all()
    # A dip is pooled with its neighbour: 3, 2 -> 2.5, 2.5 (least squares), not clipped up.
    assert fit[0, 1] == pytest.approx(fit[0, 2]) and fit[0, 1] < 3.0


def test_table_monotone_switch(tmp_path):
    """A table whose moe_ffn dips at one point: fitted by default, raw with monotone: false."""
    from pagedweight.config.kernel_table import read_kernel_table

    df, meta = read_kernel_table(tmp_path / _table(tmp_path))
    row = (df["op"] == "moe_ffn") & (df["precision"] == "bf16") & (df["e"] == 8) & (df["m"] == M_GRID[1])
    assert row.sum() == 1
    df.loc[row, ["latency_us_p20", "latency_us_p50", "latency_us_p80"]] = 1.0  # far below its neighbours
    write_kernel_table(df, tmp_path / "kernels" / "dip.csv", meta)
    tpe, ids = _layer0({e: (M_GRID[1], BF16) for e in range(8)})
    times = {}
    for monotone in (True, False):
        cfg = TableLatencyConfig(kind="table", path="kernels/dip.csv", monotone=monotone)
        times[monotone] = build_latency_model(cfg, MIXTRAL, H200, base_dir=tmp_path).moe_s(tpe, ids)
    assert times[False] == pytest.approx(1e-6)
    assert times[True] > 10 * times[False]


def _profiler_step(model, b: int, kv: int) -> tuple[StepShape, np.ndarray, np.ndarray]:
    """The step ``pwgpu.profile.Profiler.decode_step`` times: b requests of kv tokens, token i
    routed to experts i*k .. i*k+k-1 (mod E) on every layer, every expert bf16."""
    slots = decode_step_routing(b, model.top_k, model.num_experts)
    counts = np.bincount(slots.ravel(), minlength=model.num_experts)
    return _decode([kv] * b), np.repeat(counts[None, :], model.num_moe_layers, axis=0), _ids(model, BF16)


def test_whole_decode_steps_scale_pure_decode_steps_by_their_ratio_to_the_ops(tmp_path):
    """A table with ``decode_step`` rows times a pure decode step by its ops scaled by the
    measured step over the ops' sum for the profiler's step at the same (batch, context),
    bilinear between the rows' points: here half at one request, the ops' own time at 64.
    Steps with a prefill chunk, and decode steps outside the rows' grid (counted), are not scaled."""
    assert decode_step_routing(5, 2, 8).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]]
    plain = _table_model(tmp_path)
    rows = []
    for b, factor in ((1, 0.5), (64, 1.0)):
        for kv in (128, 8192):
            ops_s = plain._kernels_s(*_profiler_step(MIXTRAL, b, kv))
            us = factor * ops_s * 1e6
            rows.append(dict(op="decode_step", precision="bf16", batch=b, kv_len=kv, latency_us_p50=us))
    extra = pd.DataFrame(rows).assign(model="mixtral-8x7b", latency_us_p20=1.0, latency_us_p80=1.0, samples=7)
    base = pd.read_csv(tmp_path / "kernels" / "h200.csv")
    cfg = TableLatencyConfig(kind="table", path="kernels/cpu.csv")

    def with_rows(extra: pd.DataFrame):
        table = pd.concat([base, extra]).fillna(0)
        write_kernel_table(table, tmp_path / "kernels" / "cpu.csv", {**META, "models": ["mixtral-8x7b"], "grid": "t"})
        return build_latency_model(cfg, MIXTRAL, H200, base_dir=tmp_path)

    lm = with_rows(extra)
    overhead_s = 1e-3
    for kv_lens, factor in (([128], 0.5), ([8192], 0.5), ([1000, 3000], 0.5 + 0.5 / 63), ([128] * 64, 1.0)):
        shape, tpe, ids = _decode(kv_lens), _spread(MIXTRAL, len(kv_lens)), _ids(MIXTRAL, BF16)
        ops_s = plain.step_time_s(shape, tpe, ids) - overhead_s
        assert lm.step_time_s(shape, tpe, ids) == pytest.approx(factor * ops_s + overhead_s, rel=1e-9)
    mixed = StepShape(np.array([128]), np.array([1024]), np.array([1000]))
    tpe = _spread(MIXTRAL, 16)
    assert lm.step_time_s(mixed, tpe, ids) == plain.step_time_s(mixed, tpe, ids)
    long = _decode([9000])  # past the grid's context (attention too: timed by the fallback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lm.step_time_s(long, _spread(MIXTRAL, 1), ids) == plain.step_time_s(long, _spread(MIXTRAL, 1), ids)
    assert any("decode_step at batch=1, kv_len=9000 is outside the measured grid" in str(w.message) for w in caught)
    assert lm.out_of_grid["decode_step"] == 1
    extra.loc[0, "precision"] = "int4"
    with pytest.raises(SpecError, match="op decode_step needs rows of one precision"):
        with_rows(extra)
