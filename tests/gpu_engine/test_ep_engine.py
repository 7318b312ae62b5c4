"""Expert parallelism in the engine (``pwgpu.ep``): two gloo ranks on the CPU, each holding half
of the trained tiny model's experts in its own page arena, give the single-process engine's
greedy tokens and logits, at the checkpoint's precision and after a precision change at run
time (one expert per rank and layer taken to int4 through each rank's core).

Each run is ``ep_worker.py`` in a process group of its own (``tests/proc.py``: killed on a hang
or a failure, nothing left behind); the two ranks are its children (``torch.multiprocessing``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import proc

HERE = Path(__file__).resolve().parent
MODEL = HERE.parents[1] / "models" / "tiny-moe"
WORKER = HERE / "ep_worker.py"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="needs models/tiny-moe"),
]


def _run(tmp_path, name, *args):
    out = tmp_path / name
    done = proc.run([sys.executable, WORKER, MODEL, out, *args], quiet_s=30)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("change", [[], ["--downgrade"]], ids=["static", "changed-at-run-time"])
def test_two_gloo_ranks_match_the_single_process_engine(tmp_path, change):
    single = np.load(_run(tmp_path, "single.npz", *change))
    base = _run(tmp_path, "ep", "--ranks", "2", *change)
    ranks = [np.load(f"{base}.rank{r}.npz") for r in range(2)]
    for r in ranks:
        assert (r["tokens"] == single["tokens"]).all()
        assert r["logits"].shape == single["logits"].shape
        np.testing.assert_allclose(r["logits"], single["logits"], atol=1e-4, rtol=0)
    if change:  # each rank changed its own experts: 4 MoE layers x one expert each
        assert [int(r["int4_experts"][0]) for r in ranks] == [4, 4] and int(single["int4_experts"][0]) == 8
        plain = np.load(_run(tmp_path, "plain.npz"))
        assert np.abs(plain["logits"] - single["logits"]).max() > 1e-3  # the change did change the model
