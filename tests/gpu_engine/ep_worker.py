"""Greedy generation on the engine, in one process or as the ranks of an expert-parallel group
(``pwgpu.ep``); writes every step's logits and the tokens to an .npz for
``test_ep_engine.py``. ``--downgrade``: after the third step, one expert of each MoE layer
(every rank's, so that each rank changes one of its own) goes to int4 through the core, as a
controller's change would.

    python ep_worker.py MODEL OUT.npz --policy static-fp16 [--ranks 2] [--downgrade] [--device cuda]

On CUDA each rank takes the GPU of its rank and the group talks over NCCL (gloo on the CPU).
``benchmarks/gpu_check.sh`` runs it on two GPUs when the machine has them.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from pagedweight.core.runtime import CoreConfig
from pagedweight.core.spec import PRECISION_ID
from pagedweight.policy.controller import DOWNGRADE, Change
from pwgpu.engine import Engine, EngineConfig
from pwgpu.sampling import SamplingParams

PROMPTS = [[5, 17, 42, 9, 33, 71, 2, 60], [7, 3, 88, 19, 64, 21, 50, 11, 45, 8, 30, 1, 2], [100, 200, 300]]
MAX_TOKENS = 10
BUDGET_BYTES = 48 << 20
PAGE_BYTES = 1 << 16
DOWNGRADED = (1, 6)  # experts of every MoE layer taken to int4 (one on each of two ranks)


def generate(model: str, policy: str, downgrade: bool, ep=None, device: str = "cpu") -> dict:
    cfg = EngineConfig(CoreConfig(budget_bytes=BUDGET_BYTES, page_bytes=PAGE_BYTES), policy=policy, device=device,
                       dtype="float32", moe_kernel="reference")  # fmt: skip
    eng = Engine(model, cfg, ep=ep)
    logits: list[np.ndarray] = []
    inner = eng.model.logits

    def record(hidden):
        out = inner(hidden)
        logits.append(out.cpu().numpy())
        return out

    eng.model.logits = record
    ers = [eng.add(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        if downgrade and steps == 3:
            core, num = eng.core, eng.spec.num_experts
            first = 0 if ep is None else ep.first_expert
            mine = [e - first for e in DOWNGRADED if first <= e < first + num]
            core.apply(
                [Change(DOWNGRADE, layer * num + e, PRECISION_ID["int4"]) for layer in range(eng.spec.num_moe_layers)
                 for e in mine]
            )  # fmt: skip
    return {
        "tokens": np.array([er.output_ids for er in ers]),
        "logits": np.concatenate(logits),
        "int4_experts": np.array([int((eng.core.page_table.precision_ids == PRECISION_ID["int4"]).sum())]),
    }


def _rank(rank: int, world: int, model: str, policy: str, downgrade: bool, out: str, device: str) -> None:
    from pwgpu.ep import EpGroup

    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    result = generate(model, policy, downgrade, EpGroup.current(), device)
    np.savez(f"{out}.rank{rank}.npz", **result)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--policy", default="static-fp16")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--downgrade", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = p.parse_args()
    torch.manual_seed(0)
    if a.ranks == 1:
        np.savez(a.out, **generate(a.model, a.policy, a.downgrade, device=a.device))
        return
    from pwgpu.ep import spawn_ranks

    backend = "nccl" if a.device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        args = (a.model, a.policy, a.downgrade, a.out, a.device)
        spawn_ranks(a.ranks, _rank, args, str(Path(tmp) / "init"), backend)


if __name__ == "__main__":
    main()
