"""The engine reuses cached prefix KV: a request whose prompt starts with a cached prefix
computes only the rest, reads the cached blocks through its block table, and gets the logits of
a cold run (the engine without caching, and transformers)."""

import pytest
import torch

from pagedweight.core.runtime import CoreConfig
from pwgpu.engine import Engine, EngineConfig
from pwgpu.sampling import SamplingParams

BLOCK = 8
SYSTEM = [(7 * i + 3) % 96 for i in range(5 * BLOCK)]  # a 40-token shared prefix: 5 full blocks


def engine(path, caching: bool, device="cpu") -> tuple[Engine, list]:
    """An fp32 engine whose every computed logits row is kept, with the step's prefill tokens."""
    cfg = CoreConfig(budget_bytes=8 << 20, page_bytes=1 << 14, kv_block_tokens=BLOCK, prefix_caching=caching)
    eng = Engine(path, EngineConfig(cfg, policy="static-fp16", device=device, dtype="float32"))
    seen: list = []
    logits = eng.model.logits

    def keep(hidden):
        out = logits(hidden)
        seen.append(out.detach().float().cpu().clone())
        return out

    eng.model.logits = keep
    return eng, seen


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run_one(eng, prompt, n=6):
    er = eng.add(prompt, greedy(n))
    prefill = []
    while eng.has_work():
        step = eng.core.steps.num_recorded
        eng.step()
        if eng.core.steps.num_recorded > step:
            prefill.append(int(eng.core.steps.columns()["num_prefill_tokens"][-1]))
    return er, prefill


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_cache_hit_gives_the_logits_of_a_cold_run(checkpoints, family, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path, hf = checkpoints[family]
    first = SYSTEM + [11, 12, 13]
    second = SYSTEM + [50, 51, 52, 53, 54]
    warm, warm_logits = engine(path, caching=True, device=device)
    run_one(warm, first)
    n_before = len(warm_logits)
    hit, prefill = run_one(warm, second)
    cold, cold_logits = engine(path, caching=False, device=device)
    miss, cold_prefill = run_one(cold, second)
    # The hit computed only its own 5 tokens; the cold run the whole prompt.
    assert hit.req.cached_tokens == len(SYSTEM) and prefill[0] == len(second) - len(SYSTEM)
    assert miss.req.cached_tokens == 0 and cold_prefill[0] == len(second)
    assert warm.core.scheduler.prefix_hit_tokens == len(SYSTEM)
    # The hit's blocks are the first request's cached blocks, read through its block table.
    got, want = torch.cat(warm_logits[n_before:]), torch.cat(cold_logits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert hit.output_ids == miss.output_ids
    with torch.no_grad():
        ref = hf(torch.tensor([second])).logits[0, -1].float()
    torch.testing.assert_close(got[0], ref, rtol=1e-4, atol=1e-4)


def test_without_caching_the_engine_recomputes_every_prompt(checkpoints):
    path, _ = checkpoints["mixtral"]
    eng, _ = engine(path, caching=False)
    run_one(eng, SYSTEM + [1])
    er, prefill = run_one(eng, SYSTEM + [2])
    assert prefill[0] == len(SYSTEM) + 1 and er.req.block_hashes is None
    assert eng.core.kv.num_cached_blocks == 0
