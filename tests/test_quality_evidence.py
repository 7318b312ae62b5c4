"""The pieces behind honest quality numbers: KL in float64, token-block statistics, the
incremental forward that replays a KV history, calibration folds, the disk cache and the paired
bootstrap."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pwgpu.bootstrap import Resampler, interval, ratio_of_sums  # noqa: E402
from pwgpu.evaluate import (  # noqa: E402
    MoeForward,
    ReferenceCache,
    ScoredReference,
    evaluate_blocks,
    evaluate_plan,
    kl_per_position,
    load_tokens,
    nll_per_position,
    truncate_past,
    uniform_plan,
)
from pwgpu.importance import fold_tokens  # noqa: E402
from pwgpu.qcache import DiskCache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-moe"


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return MoeForward(MODEL)


@pytest.fixture(scope="module")
def ids():
    return load_tokens(MODEL, ROOT / "data" / "eval" / "code.txt", 300)


def test_kl_in_float64_is_never_negative_and_zero_on_itself():
    torch.manual_seed(0)
    a = torch.randn(50, 4096) * 5
    b = a + torch.randn(50, 4096) * 1e-6  # a perturbation whose fp32 KL is pure rounding noise
    assert (kl_per_position(a, b) >= -1e-15).all()
    assert float(kl_per_position(a, a).abs().max()) < 1e-15


def test_a_scored_reference_gives_the_same_kl_and_nll():
    torch.manual_seed(1)
    ref = torch.randn(40, 4096) * 4
    targets = torch.randint(0, 4096, (40,))
    scored = ScoredReference(ref, targets)
    for other in (ref + torch.randn(40, 4096), ref + torch.randn(40, 4096) * 1e-5, ref):
        kl, lp = scored.kl(other)
        direct = kl_per_position(ref, other)
        assert float((kl - direct).abs().max()) < 1e-13 * max(1.0, float(direct.abs().max()))
        assert torch.equal(-lp.gather(-1, targets[:, None])[:, 0], nll_per_position(other, targets))
    assert torch.allclose(scored.nll, nll_per_position(ref, targets), rtol=0, atol=1e-12)


def test_block_statistics_add_up_to_the_plan_result(model, ids):
    ref = ReferenceCache(model, {"code": ids}, 128)
    plan = uniform_plan(model, "int4")
    stats = evaluate_blocks(model, ref, plan, block_tokens=32)["code"]
    (whole,) = evaluate_plan(model, ref, plan)
    # 300 tokens in windows of 128, 128, 44: 127 + 127 + 43 scored positions, blocks of <= 32
    assert stats.tokens.sum() == whole.tokens == 297 and stats.tokens.max() == 32
    assert len(stats.tokens) == 4 + 4 + 2
    assert stats.kl.sum() / stats.tokens.sum() == pytest.approx(whole.kl_nats_per_token, rel=1e-12)
    assert (stats.kl > 0).all()


def test_reference_logits_come_back_from_the_disk_cache(model, ids, tmp_path):
    cache = DiskCache(tmp_path)
    first = ReferenceCache(model, {"code": ids[:200]}, 64, cache)
    assert len(list(tmp_path.rglob("*.npz"))) == 1
    again = ReferenceCache(model, {"code": ids[:200]}, 64, cache)
    for a, b in zip(first.ref["code"], again.ref["code"], strict=True):
        assert torch.equal(a, b)


def test_extend_replays_a_kv_history_chunk_by_chunk(model, ids):
    seq = torch.as_tensor(ids[:40])[None]
    model.reset()
    with torch.no_grad():
        full = model.logits(seq)[0]
    past, parts = None, []
    for start, end in ((0, 17), (17, 18), (18, 30), (30, 40)):
        out, past = model.extend(seq[:, start:end], past)
        parts.append(out[0])
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-4, atol=1e-4)
    # A chunk recomputed after truncation gives the same logits.
    again, _ = model.extend(seq[:, 30:40], truncate_past(past, 30))
    torch.testing.assert_close(again[0], parts[-1], rtol=1e-5, atol=1e-5)
    # Keys and values of earlier chunks keep the map that computed them: quantising the experts
    # only for the last chunk differs from quantising them for the whole sequence.
    model.set_plan(uniform_plan(model, "int2"))
    last_only, _ = model.extend(seq[:, 30:40], truncate_past(past, 30))
    with torch.no_grad():
        everywhere = model.logits(seq)[0, 30:40]
    model.reset()
    assert not torch.allclose(last_only[0], everywhere, atol=1e-5)
    assert not torch.allclose(last_only[0], parts[-1], atol=1e-5)


def test_folds_are_disjoint_whole_windows_in_order():
    ids = np.arange(1000)
    parts = [fold_tokens(ids, 100, 3, [k]) for k in range(3)]
    assert [len(p) for p in parts] == [400, 300, 300]  # windows 0..9 dealt round-robin
    assert set(parts[0]).isdisjoint(parts[1]) and set(parts[1]).isdisjoint(parts[2])
    assert parts[1][:100].tolist() == list(range(100, 200)) and parts[1][100:200].tolist() == list(range(400, 500))
    both = fold_tokens(ids, 100, 3, [0, 2])
    assert sorted(both.tolist()) == sorted(parts[0].tolist() + parts[2].tolist())


def test_cache_keys_follow_their_parts(tmp_path):
    cache = DiskCache(tmp_path)
    a = cache.key("x", 1, np.arange(3))
    assert a == cache.key("x", 1, np.arange(3))
    assert a != cache.key("x", 1, np.arange(4)) and a != cache.key("x", 2, np.arange(3))
    cache.save(a, v=np.ones(2))
    assert cache.load(a)["v"].tolist() == [1.0, 1.0] and cache.load(cache.key("x", 3)) is None
    cache.path(a).write_bytes(b"truncated")  # a run killed mid-write: recomputed, not a crash
    assert cache.load(a) is None


def test_cache_counts_what_each_entry_cost_once(tmp_path):
    cache = DiskCache(tmp_path)
    cache.save("x/a", 2.5, v=np.ones(1))
    cache.save("x/b", None, v=np.ones(1))  # no time recorded: costs nothing
    assert cache.load("x/a")["v"].tolist() == [1.0]  # the stored time is not returned as data
    assert cache.spent_s == 2.5  # a read of what this run computed is not counted again
    rerun = DiskCache(tmp_path)  # a rerun served from the cache reports what its results cost
    rerun.load("x/a"), rerun.load("x/a"), rerun.load("x/b")
    assert rerun.spent_s == 2.5


def test_paired_bootstrap_of_a_ratio():
    rng = np.random.default_rng(0)
    base = rng.gamma(2.0, 1.0, 200)
    rs = Resampler({"d": 200}, 1000)
    point, lo, hi = ratio_of_sums(rs, "d", 0.5 * base, base)
    assert point == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    noisy = 0.5 * base * rng.lognormal(0, 0.3, 200)
    point, lo, hi = ratio_of_sums(rs, "d", noisy, base)
    assert lo < point < hi and lo > 0.4 and hi < 0.7
    assert interval(np.array([np.nan, 1.0, 2.0, 3.0])) == pytest.approx((1.05, 2.95))
