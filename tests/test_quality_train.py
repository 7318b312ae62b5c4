"""The training pipeline's pieces that need no download: tokenizer, batches, schedule, texts."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from pwgpu.train import TrainConfig, lr_at, sample_row, train_tokenizer  # noqa: E402


def test_tokenizer_is_byte_level_and_round_trips():
    tok = train_tokenizer(["def f(x):\n    return x\n" * 50, "To be, or not to be\n" * 50], vocab_size=300)
    for text in ("def g(y): return y  # é ✓\n", "Whether 'tis nobler\n"):
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    assert tok.token_to_id("<s>") == 0 and tok.token_to_id("</s>") == 1


def test_rows_mix_both_domains():
    streams = {"code": np.full(1000, 7), "shakespeare": np.full(1000, 9)}
    rng = np.random.default_rng(0)
    for _ in range(5):
        row = sample_row(rng, streams, 64)
        assert len(row) == 64 and (row == 7).sum() == 32 and (row == 9).sum() == 32


def test_schedule_warms_up_then_ends_at_floor():
    cfg = TrainConfig(out_dir="x", lr=1e-3, min_lr_frac=0.1, warmup_steps=10)
    assert lr_at(cfg, 0, 0.0) == pytest.approx(1e-4)
    assert lr_at(cfg, 50, 0.0) == pytest.approx(1e-3)
    assert lr_at(cfg, 500, 1.0) == pytest.approx(1e-4)
    assert lr_at(cfg, 500, 0.5) == pytest.approx(0.55e-3)
